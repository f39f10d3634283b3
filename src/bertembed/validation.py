"""Checks on what enters the layer, so bad input fails here with a message that names the value, the limit and the fix.

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import operator

import numpy as np
import torch


def _check_ids(name: str, ids: torch.Tensor, shape: tuple[int, int] | None = None, fix: str = "") -> None:
    """A ValueError unless `ids` is a dense integer tensor, and one that broadcasts to `shape` where given."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of integer ids, got {type(ids).__name__}; "
                         f"wrap it with torch.tensor(...)")
    if ids.layout is not torch.strided or ids.is_nested:  # (torch's errors for these name no cause and no fix)
        if ids.is_nested:
            kind, how = "nested", f"pad its rows to one length with torch.nested.to_padded_tensor({name}, pad_id)"
        else:
            kind, how = str(ids.layout).removeprefix("torch."), f"convert with {name}.to_dense()"
        raise ValueError(f"{name} is a {kind} tensor, but ids must be a dense [B, L] tensor; {how}")
    if ids.dtype not in (torch.int64, torch.int32):  # (what torch's embedding lookup takes: every backend alike)
        raise ValueError(f"{name} has dtype {ids.dtype}, but ids index a table and must be integers of 64 or 32 "
                         f"bits; convert with {name}.long()")
    if shape and (ids.dim() > 2 or any(d not in (1, s) for d, s in zip(ids.shape[::-1], shape[::-1], strict=False))):
        raise ValueError(f"{name} has shape {tuple(ids.shape)} but the input has {shape}; {fix}")


def check_dropout(p: float, name: str) -> float:
    """`p` as a float, or the ValueError `F.dropout` raises for a probability outside [0, 1] (NaN included), in
    training and in eval mode alike: the fused layer never runs `nn.Dropout`, which checks p as it runs."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {name}={p}; set it in [0, 1] "
                         f"(0: no dropout)")
    return float(p)


ID_CHECKS = ("host", "device")  # where the Triton kernels' ids are checked (docs/fused-layer.md)


def check_option(name: str, value, choices: tuple):
    """`value` if it is one of `choices` (of their type: True is not 1), or a ValueError naming them."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ValueError(f"{name}={value!r} is not one of {choices}")
    return value


def check_padding_idx(padding_idx, rows: int) -> int | None:
    """`padding_idx` as a row of a table of `rows` rows, in [0, rows) (a negative one counts from the end, as
    `F.embedding` takes it), or None; a ValueError for anything else on every backend (F.embedding asserts)."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not hasattr(type(padding_idx), "__index__") \
            or not -rows <= operator.index(padding_idx) < rows:
        raise ValueError(f"padding_idx={padding_idx!r} is outside the table's rows [{-rows}, {rows}) (negative: from "
                         f"the end): pass one of them, or None for no padding row")
    return operator.index(padding_idx) % rows


def in_torch_func() -> bool:
    """Whether a torch.func transform (`grad`, `vmap`, ...) is running: its wrapped tensors cannot be read directly."""
    return torch._C._functorch.peek_interpreter_stack() is not None


# (name, table, fix) of the ids that index the word, segment and position tables
_RANGES = (("input_ids", "word", "use ids from this checkpoint's tokenizer, or a config with a larger vocab_size"),
           ("token_type_ids", "segment", "use 0 for the first segment and 1 for the second"),
           ("position_ids", "position", "positions count from 0 and stop at {last}; truncate the sequence"))


def summed_dtype(*addends: torch.Tensor | None) -> torch.dtype:
    """The dtype of the sum of the tensors given (None skipped), by torch's type promotion: LayerNorm's input."""
    return functools.reduce(torch.promote_types, {t.dtype for t in addends if t is not None})


_HALF = (torch.float16, torch.bfloat16)


def check_norm_dtypes(summed: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A ValueError, before any table is read, for a LayerNorm weight and bias that torch's LayerNorm refuses beside
    an input of dtype `summed`: it takes them in the input's dtype, and float32 ones beside a float16 or bfloat16
    input on the CPU (elsewhere a two-element LayerNorm asks the installed torch). Every backend raises it alike."""
    dtypes = {weight.dtype, summed if bias is None else bias.dtype}
    if dtypes == {summed} or torch.compiler.is_compiling():
        return
    if summed in _HALF and dtypes == {torch.float32}:
        if weight.device.type == "cpu":
            return
        with contextlib.suppress(RuntimeError), torch.no_grad():
            torch.nn.functional.layer_norm(torch.ones(1, 2, dtype=summed, device=weight.device), (2,),
                                           torch.ones(2, device=weight.device), torch.zeros(2, device=weight.device))
            return
    shown = str(weight.dtype) if bias is None or bias.dtype == weight.dtype else f"{weight.dtype}/{bias.dtype}"
    fix = f"layer.LayerNorm.to({summed})" + (" or .float()" if summed in _HALF else "")
    raise ValueError(f"the LayerNorm weight and bias are {shown} but the embeddings they normalise are {summed}, "
                     f"a mix torch's LayerNorm on {weight.device.type} refuses; cast them with {fix}")


class IdsOutsideTables(RuntimeError):
    """A kernel found ids outside their tables and skipped those tokens, reading nothing for them."""


class RowsOverflowed(ArithmeticError):
    """A kernel met tokens (how many: the argument) whose float32 moments are not finite: a NaN or inf in their rows, or
    a variance past float32's range. torch's own arithmetic decides their output there (a NaN row, or LayerNorm's bias,
    by the column), so the caller computes the reference instead."""


def skipped_ids_error(count: int, where: str) -> IdsOutsideTables:
    return IdsOutsideTables(f"{where}: {count} tokens had ids outside their tables (skipped: nothing was read for "
                            f"them). The layer names the bad one (check_id_ranges), except inside a torch.compile or "
                            f"torch.export graph; reaching here otherwise is a bug")


_SHARED_WIDTH = "; the tables and the LayerNorm must share one hidden size (was a table's .data replaced?)"


def check_table_shapes(tables, norm_width: int | None = None) -> tuple[int, int | None, int | None]:
    """The tables' rows (`table_rows`), after a ValueError, before any table is read, unless the shapes of (word
    [V, E], segment [T, E] or None, position [P, E] or None, LayerNorm weight [N], bias [N] or None) fit together; N is
    E unless `norm_width` says otherwise (a projection before the norm). Every backend raises it; the fused kernels
    would read outside a table."""
    word, *shapes = (None if t is None else t.shape for t in tables)  # (each read once: a torch call apiece)
    if len(word) != 2:
        raise ValueError(f"the word table has shape {tuple(word)}, not [V, E]{_SHARED_WIDTH}")
    width = word[1]
    for name, shape, want in (("segment table", shapes[0], "[T, E]"), ("position table", shapes[1], "[P, E]")):
        if shape is not None and (len(shape) != 2 or shape[1] != width):
            raise ValueError(f"the {name} has shape {tuple(shape)}, not {want} with E={width} as the word "
                             f"table's{_SHARED_WIDTH}")
    norm = (norm_width or width,)
    for name, shape in (("LayerNorm weight", shapes[2]), ("LayerNorm bias", shapes[3])):
        if shape is not None and shape != norm:
            raise ValueError(f"the {name} has shape {tuple(shape)}, not [{norm[0]}]{_SHARED_WIDTH}")
    return word[0], None if shapes[0] is None else shapes[0][0], None if shapes[1] is None else shapes[1][0]


def check_eps(eps) -> float:
    """LayerNorm's eps as a float, or a ValueError unless it is a positive finite number."""
    value = float(eps) if isinstance(eps, numbers.Real) and not isinstance(eps, bool) and abs(eps) < 1e300 else None
    if value is None or not 0 < value < math.inf:
        raise ValueError(f"eps must be a positive finite number (LayerNorm's epsilon, BERT's 1e-12), got {eps!r}")
    return value


def table_rows(tables) -> tuple[int, int | None, int | None]:
    """(word, segment, position) rows of (word, segment, position, ...) tables (None: no such table)."""
    word, segment, position = tables[:3]
    return word.shape[0], None if segment is None else segment.shape[0], None if position is None else position.shape[0]


def offset(past_key_values_length) -> int:
    """`past_key_values_length` as a non-negative Python int, or ValueError. Whatever stands for an integer exactly is
    taken, as transformers' slicing takes it (`__index__`; a 0-d integer tensor, as ONNX export's tracer passes it);
    not a bool or a float."""
    value = past_key_values_length
    if type(value) is not int and not isinstance(value, (bool, np.bool_)):
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 and not (value.is_floating_point() or value.is_complex() or value.dtype is torch.bool):
                value = int(value)
        elif hasattr(type(value), "__index__"):
            value = operator.index(value)
    if type(value) is not int or value < 0:
        raise ValueError(f"past_key_values_length must be a non-negative int, got {past_key_values_length!r}")
    return value


def offset_given(past_key_values_length=None, cache_length=None):
    """The offset of the first position after a cache, as given under transformers 5's name (`cache_length`) or 4's
    (`past_key_values_length`): 0 when neither is given; a ValueError when both are given and differ."""
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
    (`table_rows`; None: no such table, nothing read). Ids given as None or on the meta device are not checked; nor
    under `torch.compile`, `torch.export` or a torch.func transform (a bad id then fails in the lookup: torch's
    IndexError, or the fused kernels skip it and raise). The minima and maxima come back in one transfer."""
    if torch.compiler.is_compiling() or in_torch_func():
        return
    checks = [(about, ids, limit) for about, ids, limit in zip(_RANGES, (input_ids, token_type_ids, position_ids), rows,
                                                               strict=True)
              if ids is not None and limit is not None and ids.numel() and ids.device.type != "meta"]
    if not checks:
        return
    if all(c[1].device.type == "cpu" for c in checks):
        bounds = [int(v) for c in checks for v in torch.aminmax(c[1])]
    else:  # one transfer, one wait for the device
        bounds = torch.stack([v.long() for c in checks for v in torch.aminmax(c[1])]).tolist()
    for ((name, table, fix), ids, limit), low, high in zip(checks, bounds[::2], bounds[1::2], strict=True):
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            where = tuple(int(k) for k in (ids == bad).nonzero()[0])
            if table == "segment" and limit == 1:  # (RoBERTa, XLM-R, CamemBERT)
                fix = "the table has one row: use 0 throughout, or leave token_type_ids out"
            raise ValueError(f"{name} holds {bad} at index {where}, outside the {table} table's rows [0, {limit}): "
                             f"{fix.format(last=limit - 1)}")


def _check_position_room(input_ids: torch.Tensor | None, length: int, past: int, limit: int, first_position: int,
                         positions_from_padding: bool) -> None:
    """A ValueError naming the token limit where default positions would pass the table's `limit` rows. Where
    positions count from the padding: from the ids (pads take no position), or without ids from pad + 1 whatever the
    offset, as transformers' create_position_ids_from_inputs_embeds gives them."""
    counted = positions_from_padding and input_ids is not None
    used = 0 if positions_from_padding and not counted else past
    first, tokens = first_position + used, length
    if counted and first + length > limit:
        # pads take no position: a batch longer than the table may fit, so count (not inside a graph or a transform)
        readable = input_ids.numel() and input_ids.device.type != "meta" and not torch.compiler.is_compiling() \
            and not in_torch_func()
        tokens = int(input_ids.ne(first_position - 1).sum(1).max()) if readable else 0
    if first + tokens > limit:
        raise ValueError(
            f"a sequence of {tokens} tokens{' (pads not counted)' * counted}"
            f"{f' at offset past_key_values_length={used}' * bool(used)} needs positions up to {first + tokens - 1}, "
            f"but the position table has {limit} rows: truncate to {max(limit - first, 0)} tokens (the tokenizer's "
            f"truncation does this)")


def check_inputs(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    past_key_values_length: int,
    rows: tuple[int, int | None, int | None],
    width: int,
    first_position: int = 0,
    positions_from_padding: bool = False,
    check_ranges: bool = True,
) -> tuple[int, int, int]:
    """Validate the arguments of `BertEmbeddings.forward` and return (B, L, offset): the offset as an int
    (`validation.offset`). Nothing is launched on bad input.

    `rows`: the (word, segment, position) tables' rows (`table_rows`; None: no such table); `width`: the tables' E.
    `first_position`: the first default position (pad + 1 where positions count from the padding,
    `positions_from_padding`: then, given input_ids, pads take no position). `check_ranges=False` leaves the ids'
    values unchecked (shapes and dtypes still are), for a caller that checks them where it reads them. Segment and
    position ids may be of any shape that broadcasts to [B, L], as in transformers."""
    if (input_ids is None) == (inputs_embeds is None):
        given = "both" if input_ids is not None else "neither"
        raise ValueError(f"pass exactly one of input_ids [B, L] and inputs_embeds [B, L, H]; got {given}")
    if input_ids is not None:
        _check_ids("input_ids", input_ids)
        if input_ids.dim() != 2:
            fix = ("add a batch dimension with input_ids.reshape(1, -1)" if input_ids.dim() < 2 else
                   "flatten the leading dimensions with input_ids.reshape(-1, input_ids.shape[-1])")
            raise ValueError(f"input_ids must have shape [B, L], got {tuple(input_ids.shape)}; {fix}")
        shape = batch, length = tuple(input_ids.shape)
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
            raise ValueError("inputs_embeds must be a floating-point tensor [B, L, H]")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != width:
            raise ValueError(f"inputs_embeds must have shape [B, L, {width}], got {tuple(inputs_embeds.shape)}")
        shape = batch, length = tuple(inputs_embeds.shape[:2])
    past_key_values_length = offset(past_key_values_length)
    if position_ids is None and (limit := rows[2]) is not None:
        _check_position_room(input_ids, length, past_key_values_length, limit, first_position, positions_from_padding)
    if token_type_ids is not None:  # (checked even where there is no segment table, which ignores them as DeBERTa's)
        _check_ids("token_type_ids", token_type_ids, shape, "give one segment id per token")
    if position_ids is not None:
        _check_ids("position_ids", position_ids, shape, "pass [B, L], or [1, L] shared by the batch")
    if check_ranges:
        check_id_ranges(input_ids, token_type_ids, position_ids, rows)
    return batch, length, past_key_values_length
