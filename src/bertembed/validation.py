"""Checks on what enters the layer, so bad input fails here with a message that names the value, the limit and the fix.

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

import functools
import operator

import numpy as np
import torch
from torch.autograd import forward_ad as _forward_ad

from bertembed.config import EmbeddingConfig

_INT_DTYPES = (torch.int64, torch.int32)  # what torch's embedding lookup takes, so every backend takes the same


def _check_int(name: str, ids: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of integer ids, got {type(ids).__name__}; "
                         f"wrap it with torch.tensor(...)")
    if ids.layout is not torch.strided or ids.is_nested:  # (torch's errors for these name no cause and no fix)
        if ids.is_nested:
            kind, fix = "nested", f"pad its rows to one length with torch.nested.to_padded_tensor({name}, pad_id)"
        else:
            kind, fix = str(ids.layout).removeprefix("torch."), f"convert with {name}.to_dense()"
        raise ValueError(f"{name} is a {kind} tensor, but ids must be a dense [B, L] tensor; {fix}")
    if ids.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} has dtype {ids.dtype}, but ids index a table and must be integers of 64 or 32 "
                         f"bits; convert with {name}.long()")


def check_dropout(p: float, name: str) -> float:
    """`p` as a float, or the ValueError `F.dropout` raises for a probability outside [0, 1] (NaN included; torch's
    C++ check raises a RuntimeError for it), in training and in eval mode alike. `nn.Dropout` checks p when built,
    and a `dropout.p` set afterwards as it runs: the fused layer, which never runs it, asks this instead."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {name}={p}; set it in [0, 1] "
                         f"(0: no dropout)")
    return float(p)


def forward_ad_on() -> bool:
    """Whether forward-mode AD is on (inside `torch.autograd.forward_ad.dual_level()`, as `jacobian(...,
    strategy="forward-mode")` and `jvp` run): the kernels have no jvp rule, so a tangent would be dropped."""
    return _forward_ad._current_level >= 0


def in_torch_func() -> bool:
    """Whether a torch.func transform (`grad`, `vmap`, `jacrev`, ...) is running: its tensors wrap others, and neither
    the host nor a kernel can read their memory."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _check_ranges(checks: list[tuple[str, torch.Tensor, int, str, str]]) -> None:
    """Each (name, ids, limit, table, fix): every id in [0, limit), or a ValueError naming the first bad one. The
    minima and maxima of all the tensors come back in one transfer: on a GPU, one wait for the device per call. Ids on
    the meta device have no values to check (a model run there for its shapes, as transformers' runs)."""
    checks = [c for c in checks if c[1].numel() and c[1].device.type != "meta"]
    if not checks:
        return
    if all(c[1].device.type == "cpu" for c in checks):
        bounds = [int(v) for c in checks for v in torch.aminmax(c[1])]
    else:  # one transfer, one wait for the device
        bounds = torch.stack([v.long() for c in checks for v in torch.aminmax(c[1])]).tolist()
    for i, (name, ids, limit, table, fix) in enumerate(checks):
        low, high = bounds[2 * i], bounds[2 * i + 1]
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            where = tuple(int(k) for k in (ids == bad).nonzero()[0])
            raise ValueError(f"{name} holds {bad} at index {where}, outside the {table} table's rows [0, {limit}): "
                             f"{fix}")


def summed_dtype(*addends: torch.Tensor | None) -> torch.dtype:
    """The dtype of the sum of the tensors given (None skipped), by torch's type promotion: LayerNorm's input."""
    dtypes = {t.dtype for t in addends if t is not None}
    return dtypes.pop() if len(dtypes) == 1 else functools.reduce(torch.promote_types, dtypes)


_HALF = (torch.float16, torch.bfloat16)


def check_norm_dtypes(summed: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A ValueError, before any table is read, for a LayerNorm weight and bias that torch's LayerNorm refuses beside
    an input of dtype `summed`. It takes them in the input's dtype; float32 ones beside a float16 or bfloat16 input
    it takes on the CPU (its mixed-precision kernel), and on other devices as the installed torch does (CUDA's kernel
    refused them in torch 2.11): that rare mix alone is asked of torch, with a two-element LayerNorm. The fused kernels
    could compute other mixes, but then one layer would run on one backend and fail on another; so every backend
    raises this. The tests hold the rule to torch's own answer for every mix, on the CPU and the GPU."""
    dtypes = {weight.dtype, summed if bias is None else bias.dtype}
    if dtypes == {summed} or torch.compiler.is_compiling():
        return
    if summed in _HALF and dtypes == {torch.float32} and (weight.device.type == "cpu" or _mix_runs(summed, weight)):
        return
    shown = str(weight.dtype) if bias is None or bias.dtype == weight.dtype else f"{weight.dtype}/{bias.dtype}"
    fix = f"layer.LayerNorm.to({summed})" + (" or .float()" if summed in _HALF else "")
    raise ValueError(f"the LayerNorm weight and bias are {shown} but the embeddings they normalise are {summed}, "
                     f"a mix torch's LayerNorm on {weight.device.type} refuses; cast them with {fix}")


def _mix_runs(summed: torch.dtype, weight: torch.Tensor) -> bool:
    try:
        with torch.no_grad():
            torch.nn.functional.layer_norm(torch.ones(1, 2, dtype=summed, device=weight.device), (2,),
                                           torch.ones(2, device=weight.device), torch.zeros(2, device=weight.device))
    except RuntimeError:
        return False
    return True


class IdsOutsideTables(RuntimeError):
    """A kernel found ids outside their tables and skipped those tokens, reading nothing for them."""


def skipped_ids_error(count: int, where: str) -> IdsOutsideTables:
    """The error of a kernel that found `count` ids outside their tables and skipped those tokens."""
    return IdsOutsideTables(f"{where}: {count} tokens had ids outside their tables (skipped: nothing was read for "
                            f"them). The layer names the bad one (check_id_ranges), except inside a torch.compile or "
                            f"torch.export graph; reaching here otherwise is a bug")


def table_shape_problem(tables, norm_width: int | None = None) -> str | None:
    """What is wrong with the shapes of (word [V, E], segment [T, E] or None, position [P, E] or None, LayerNorm
    weight [N], bias [N] or None), or None. N is E unless `norm_width` says otherwise (a projection before the norm).
    The fused kernels read E columns of every row and E entries of the weight and bias, so any other shape would have
    them read outside a table."""
    word, segment, position, weight, bias = tables[:5]
    if word.dim() != 2:
        return f"the word table has shape {tuple(word.shape)}, not [V, E]"
    width = word.shape[1]
    norm = (norm_width or width,)
    for name, table, want in zip(("segment table", "position table", "LayerNorm weight", "LayerNorm bias"),
                                 tables[1:5], ("[T, E]", "[P, E]", "[N]", "[N]"), strict=True):
        if table is None:
            continue
        if want == "[N]" and tuple(table.shape) != norm:
            return f"the {name} has shape {tuple(table.shape)}, not [{norm[0]}]"
        if want != "[N]" and tuple(table.shape[1:]) != (width,):
            return f"the {name} has shape {tuple(table.shape)}, not {want} with E={width} as the word table's"
    return None


def check_table_shapes(tables, norm_width: int | None = None) -> None:
    """A ValueError, before any table is read, for tables whose shapes do not fit together (`table_shape_problem`):
    every backend raises it, where torch's ops would raise their own errors and the kernels would read too far."""
    if problem := table_shape_problem(tables, norm_width):
        raise ValueError(f"{problem}; the tables and the LayerNorm must share one hidden size (was a table's .data "
                         f"replaced?)")


def table_rows(tables) -> tuple[int, int | None, int | None]:
    """(word, segment, position) rows of (word, segment or None, position or None, ...) tables, for `check_inputs`
    (None: no such table)."""
    return tuple(None if t is None else t.shape[0] for t in tables[:3])


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
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.table_width:
        raise ValueError(f"inputs_embeds must have shape [B, L, {config.table_width}], "
                         f"got {tuple(inputs_embeds.shape)}")
    return tuple(inputs_embeds.shape[:2])


def _check_broadcasts(name: str, ids: torch.Tensor, shape: tuple[int, int], fix: str) -> None:
    """A ValueError unless `ids` broadcasts to `shape` (transformers' layer adds the rows they pick, so any shape that
    broadcasts to the input's gives the same result as the full [B, L])."""
    dims = tuple(ids.shape)
    if len(dims) > len(shape) or any(d not in (1, s) for d, s in zip(reversed(dims), reversed(shape), strict=False)):
        raise ValueError(f"{name} has shape {dims} but the input has {shape}; {fix}")


def offset(past_key_values_length) -> int:
    """`past_key_values_length` as a non-negative Python int, or ValueError. Whatever stands for an integer exactly is
    taken, as transformers' layer takes it (its slicing asks `__index__`): a numpy integer, a 0-d integer tensor
    (`torch.onnx.export`'s TorchScript tracer passes the default that way); not a bool or a float."""
    value = past_key_values_length
    if type(value) is not int and not isinstance(value, (bool, np.bool_)):
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 and not value.is_floating_point() and not value.is_complex() \
                    and value.dtype is not torch.bool:
                value = int(value)
        elif hasattr(type(value), "__index__"):
            value = operator.index(value)
    if type(value) is not int or value < 0:
        raise ValueError(f"past_key_values_length must be a non-negative int, got {past_key_values_length!r}")
    return value


def offset_given(past_key_values_length=None, cache_length=None):
    """The offset of the first position after a cache, under either of transformers' names for it: `cache_length`
    (transformers 5) or `past_key_values_length` (transformers 4), the same number. 0 when neither is given; a
    ValueError when both are given and differ. The value is returned as given (`offset` checks it)."""
    if cache_length is None:
        return 0 if past_key_values_length is None else past_key_values_length
    if past_key_values_length is not None and offset(past_key_values_length) != offset(cache_length):
        raise ValueError(f"cache_length={cache_length!r} and past_key_values_length={past_key_values_length!r} name "
                         f"the same offset (transformers 5 calls it cache_length, 4 past_key_values_length) but "
                         f"differ; pass one of them")
    return cache_length


def check_id_ranges(input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
                    position_ids: torch.Tensor | None, rows: tuple[int, int, int | None]) -> None:
    """A ValueError naming the first id outside its table: `rows`, the (word, segment, position) tables' rows
    (`table_rows`; position None: no position table, nothing read). Ids given as None are not checked. Not checked
    under `torch.compile` and `torch.export` (a check that reads the ids would break the graph) nor inside a
    torch.func transform, whose wrapped tensors cannot be read on the host: there, as in transformers' layer, a bad
    id fails in the lookup (torch's IndexError; the fused kernels skip it and raise), never reading outside a table."""
    if torch.compiler.is_compiling() or in_torch_func():
        return
    vocab, segments, positions = rows
    ranges = []
    if input_ids is not None:
        ranges.append(("input_ids", input_ids, vocab, "word",
                       "use ids from this checkpoint's tokenizer, or a config with a larger vocab_size"))
    if token_type_ids is not None and segments is not None:
        ranges.append(("token_type_ids", token_type_ids, segments, "segment",
                       "use 0 for the first segment and 1 for the second"))
    if position_ids is not None and positions is not None:
        ranges.append(("position_ids", position_ids, positions, "position",
                       f"positions count from 0 and stop at {positions - 1}; truncate the sequence"))
    _check_ranges(ranges)


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

    `check_ranges=False` leaves the ids' values unchecked (shapes and dtypes still are), for a caller that checks
    them where it reads them (`check_id_ranges`). `rows`: the rows of the word, segment and position tables the ids
    will index (`table_rows`), which differ from the config's sizes where a table was replaced (a position table
    extended for longer inputs, a table replaced through `.data`); the config's sizes when not given. Segment and
    position ids may be of any shape that broadcasts to [B, L] ([1, L] or [L]: shared by the batch), as in
    transformers."""
    shape = batch, length = _input_shape(config, input_ids, inputs_embeds)
    past_key_values_length = offset(past_key_values_length)
    vocab, segments, positions = rows or (config.vocab_size, config.type_vocab_size or None, None)
    limit = config.max_position_embeddings if positions is None else positions
    has_table = positions is not None if rows else config.position_embedding_type != "none"
    first = config.first_position + past_key_values_length
    counted = config.positions_from_padding and input_ids is not None  # (from the ids: pads take no position)
    if position_ids is None and has_table and not counted and first + length > limit:
        raise ValueError(
            f"a sequence of {length} tokens at offset past_key_values_length={past_key_values_length} needs "
            f"positions up to {first + length - 1}, but the position table has {limit} rows: "
            f"truncate to {max(limit - first, 0)} tokens (the tokenizer's truncation does this)")
    if token_type_ids is not None:  # (checked even where there is no segment table, which ignores them as DeBERTa's)
        _check_int("token_type_ids", token_type_ids)
        _check_broadcasts("token_type_ids", token_type_ids, shape, "give one segment id per token")
    if position_ids is not None:
        _check_int("position_ids", position_ids)
        _check_broadcasts("position_ids", position_ids, shape, "pass [B, L], or [1, L] shared by the batch")
    if check_ranges:
        check_id_ranges(input_ids, token_type_ids, position_ids, (vocab, segments, limit))
    return batch, length
