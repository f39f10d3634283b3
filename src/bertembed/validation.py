"""Checks on what enters the layer, so bad input fails here with a message that names the value, the limit and the fix.

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

import torch

from bertembed.config import EmbeddingConfig

_INT_DTYPES = (torch.int64, torch.int32)  # what torch's embedding lookup takes, so every backend takes the same


def _check_int(name: str, ids: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of integer ids, got {type(ids).__name__}; "
                         f"wrap it with torch.tensor(...)")
    if ids.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} has dtype {ids.dtype}, but ids index a table and must be integers of 64 or 32 "
                         f"bits; convert with {name}.long()")


def _check_ranges(checks: list[tuple[str, torch.Tensor, int, str, str]]) -> None:
    """Each (name, ids, limit, table, fix): every id in [0, limit), or a ValueError naming the first bad one. The
    minima and maxima of all the tensors come back in one transfer: on a GPU, one wait for the device per call."""
    checks = [c for c in checks if c[1].numel()]
    if not checks:
        return
    bounds = torch.stack([v.long() for c in checks for v in torch.aminmax(c[1])]).tolist()
    for i, (name, ids, limit, table, fix) in enumerate(checks):
        low, high = bounds[2 * i], bounds[2 * i + 1]
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            where = tuple(int(k) for k in (ids == bad).nonzero()[0])
            raise ValueError(f"{name} holds {bad} at index {where}, outside the {table} table's rows [0, {limit}): "
                             f"{fix}")


def skipped_ids_error(count: int, where: str) -> RuntimeError:
    """The error of a kernel that found `count` ids outside their tables and skipped those tokens."""
    return RuntimeError(f"{where}: {count} tokens had ids outside their tables (skipped: nothing was read for them). "
                        f"The layer checks ids before its kernels and names the bad one (check_inputs), except "
                        f"inside a torch.compile or torch.export graph; reaching here otherwise is a bug")


def table_rows(tables) -> tuple[int, int, int | None]:
    """(word, segment, position) rows of (word, segment, position or None, ...) tables, for `check_inputs`."""
    word, segment, position = tables[:3]
    return word.shape[0], segment.shape[0], None if position is None else position.shape[0]


def _input_shape(config: EmbeddingConfig, input_ids, inputs_embeds) -> tuple[int, int]:
    """(B, L) from whichever of input_ids [B, L] and inputs_embeds [B, L, H] was given (exactly one must be)."""
    if (input_ids is None) == (inputs_embeds is None):
        given = "both" if input_ids is not None else "neither"
        raise ValueError(f"pass exactly one of input_ids [B, L] and inputs_embeds [B, L, H]; got {given}")
    if input_ids is not None:
        _check_int("input_ids", input_ids)
        if input_ids.dim() != 2:
            fix = ("add a batch dimension with input_ids.reshape(1, -1)" if input_ids.dim() < 2 else
                   "flatten the leading dimensions with input_ids.reshape(-1, input_ids.shape[-1])")
            raise ValueError(f"input_ids must have shape [B, L], got {tuple(input_ids.shape)}; {fix}")
        return tuple(input_ids.shape)
    if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
        raise ValueError("inputs_embeds must be a floating-point tensor [B, L, H]")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
        raise ValueError(f"inputs_embeds must have shape [B, L, {config.hidden_size}], "
                         f"got {tuple(inputs_embeds.shape)}")
    return tuple(inputs_embeds.shape[:2])


def check_inputs(
    config: EmbeddingConfig,
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    past_key_values_length: int,
    check_ranges: bool = True,
    rows: tuple[int, int, int | None] | None = None,
) -> tuple[int, int]:
    """Validate the arguments of `BertEmbeddings.forward` and return (B, L). Nothing is launched on bad input.

    `check_ranges=False` leaves the ids' values unchecked (shapes and dtypes still are): for the GPU kernels with
    `id_checks="device"`, which check each id themselves and so need no wait for the device. Under `torch.compile`
    and `torch.export` the values are not checked either: a check that reads them would break the graph. There, as in
    transformers' layer, a bad id fails in the lookup (torch's IndexError; the fused kernels skip it and raise),
    never reading outside a table. `rows`: the rows of the
    word, segment and position tables the ids will index (`table_rows`), which differ from the config's sizes where a
    table was replaced through `.data`; the config's sizes when not given. (Positions stay within the config's
    `max_position_embeddings` too: the default position ids are a buffer of that length.)"""
    shape = batch, length = _input_shape(config, input_ids, inputs_embeds)
    if isinstance(past_key_values_length, bool) or not isinstance(past_key_values_length, int) \
            or past_key_values_length < 0:
        raise ValueError(f"past_key_values_length must be a non-negative int, got {past_key_values_length!r}")
    vocab, segments, positions = rows or (config.vocab_size, config.type_vocab_size, None)
    limit = config.max_position_embeddings if positions is None else min(positions, config.max_position_embeddings)
    if position_ids is None and past_key_values_length + length > limit:
        raise ValueError(
            f"a sequence of {length} tokens at offset past_key_values_length={past_key_values_length} needs "
            f"positions up to {past_key_values_length + length - 1}, but the position table has {limit} rows: "
            f"truncate to {max(limit - past_key_values_length, 0)} tokens (the tokenizer's truncation does this)")
    ranges = []
    if input_ids is not None:
        ranges.append(("input_ids", input_ids, vocab, "word",
                       "use ids from this checkpoint's tokenizer, or a config with a larger vocab_size"))
    if token_type_ids is not None:
        _check_int("token_type_ids", token_type_ids)
        if tuple(token_type_ids.shape) != shape:
            raise ValueError(f"token_type_ids has shape {tuple(token_type_ids.shape)} but the input has {shape}; "
                             f"give one segment id per token")
        ranges.append(("token_type_ids", token_type_ids, segments, "segment",
                       "use 0 for the first segment and 1 for the second"))
    if position_ids is not None:
        _check_int("position_ids", position_ids)
        if tuple(position_ids.shape) not in (shape, (1, length)):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)} but the input has {shape}; "
                             f"pass [B, L] or [1, L] (shared by the batch)")
        ranges.append(("position_ids", position_ids, limit, "position",
                       f"positions count from 0 and stop at {limit - 1}; truncate the sequence"))
    if check_ranges and not torch.compiler.is_compiling():
        _check_ranges(ranges)
    return batch, length
