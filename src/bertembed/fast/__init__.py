"""The fast path of BERT's embedding layer: fused kernels, one pass per token, tested against the reference layer.

    out = fused_embeddings(input_ids, word, segment, position, ln_weight, ln_bias, eps=1e-12)  # [B, L, H]

`BertEmbeddings(config, backend=...)` calls `run`. Backends: "cpu" (numba, `cpu.py`), "triton" (`triton.py`),
"reference" (plain PyTorch) and "auto" (the kernel for the tensors' device, else the reference with a logged reason).
Design: docs/fused-layer.md. Dimension letters: B batch, L length, H hidden, V vocabulary, P positions, T segments.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import torch
from torch import Tensor, nn
from torch.compiler import is_compiling
from torch.nn.modules import module as _torch_module

from bertembed import validation
from bertembed.fast.function import embeddings_op, kernel_forward
from bertembed.functional import default_positions, embed

log = logging.getLogger(__name__)

BACKENDS = ("auto", "reference", "cpu", "triton")
_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "triton": (torch.float32, torch.float16, torch.bfloat16)}
_INSTALL = {"cpu": "numba is not installed: pip install 'bertembed[fast]' (numba)",
            "triton": "triton is not installed: pip install 'bertembed[gpu]' (triton)"}
_told: set[str] = set()
_found: dict[str, bool] = {}
_GLOBAL_HOOKS = (_torch_module._global_forward_hooks, _torch_module._global_forward_pre_hooks,
                 _torch_module._global_backward_hooks, _torch_module._global_backward_pre_hooks)
# What each submodule must be for the kernel to compute what it would (a subclass or a wrapper runs its own forward)
_PLAIN = {"word_embeddings": nn.Embedding, "token_type_embeddings": nn.Embedding, "position_embeddings": nn.Embedding,
          "LayerNorm": nn.LayerNorm, "dropout": nn.Dropout}
_COMPUTED_TABLE = "bertembed.embeddings.SinusoidalPositions"  # a position table that is a buffer: also a lookup
_OVERFLOWED = "a token's rows hold a NaN, an inf or values whose variance overflows float32, where torch's own " \
              "arithmetic decides the output (a NaN row, or LayerNorm's bias)"


def _missing(backend: str) -> str | None:
    """Why `backend` cannot run in this environment, or None when it can (looked up once per backend)."""
    if backend not in _found:
        _found[backend] = importlib.util.find_spec("numba" if backend == "cpu" else "triton") is not None
    return None if _found[backend] else _INSTALL[backend]


def check_backend(backend: str) -> str:
    """Validate a backend name at construction; an explicit fused backend must be installed. Returns the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend in ("cpu", "triton") and (reason := _missing(backend)):
        raise ImportError(f"backend={backend!r} is unavailable: {reason}")
    return backend


def _transform_reason() -> str | None:
    """Why the kernels cannot run under a torch.func transform, forward-mode AD, `torch.jit.trace` or ONNX export, or
    None (under torch.compile the custom op is traced instead)."""
    if not is_compiling():
        if validation.in_torch_func():
            return "a torch.func transform is running, and the fused kernels have no rules for its wrapped tensors"
        if torch.autograd.forward_ad._current_level >= 0:  # (inside `dual_level()`, as `jvp` runs)
            return "forward-mode AD (a dual level) is on, and the fused kernels have no jvp rule"
        if torch._C._is_tracing():
            return "torch.jit.trace (or torch.onnx.export's tracer) is recording, and it cannot record compiled kernels"
        return None
    onnx = sys.modules.get("torch.onnx")  # (not imported: no export is running, and asking would import it)
    if onnx is not None and onnx.is_in_onnx_export():
        return "torch.onnx.export is running, and ONNX has no operator for the fused kernels"
    return None


def select_backend(requested: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """(backend that will run, reason it is the reference when a fused one was asked for or None)."""
    if requested == "reference":
        return "reference", None
    backend = requested if requested != "auto" else ("cpu" if device.type == "cpu" else "triton")
    reason = _missing(backend)
    if reason is None and backend == "cpu" and device.type != "cpu":
        reason = f"the 'cpu' backend runs on CPU tensors, these are on {device}"
    elif reason is None and backend == "triton" and device.type != "cuda" \
            and (device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1"):
        reason = f"the 'triton' backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), these are on {device}"
    reason = reason or _transform_reason()
    if reason is None and dtype not in _DTYPES[backend]:
        reason = f"the {backend!r} kernels take {[str(d) for d in _DTYPES[backend]]} tables, not {dtype}"
    return ("reference", reason) if reason else (backend, None)


def can_fuse(layer: nn.Module, modules: dict | None = None, *, gathered: bool = False) -> str | None:
    """Why the fused kernel cannot stand in for `layer`'s submodules (`layer.submodules()`, given or read), or None when
    it computes what they would. `gathered`: the word rows come already looked up, so the word module is not asked."""
    if any(_GLOBAL_HOOKS):
        return "module hooks are registered globally (register_module_forward_hook and the like), and they run only " \
               "where a submodule's own forward does"
    modules = modules or layer.submodules()
    if layer.config.projection == "before_norm":
        return "the layer projects its sum E -> H before the LayerNorm (DeBERTa), which the kernels do not"
    for name in _PLAIN:
        module = modules[name]
        if module is None and name in ("position_embeddings", "token_type_embeddings"):  # a member without one
            continue
        if not (gathered and name == "word_embeddings") and (reason := _module_reason(name, module)):
            return reason
    return "LayerNorm has no weight (elementwise_affine=False)" if modules["LayerNorm"].weight is None else None


def _module_reason(name: str, module: nn.Module) -> str | None:
    """Why the kernel cannot compute what submodule `name` would, or None."""
    if type(module) is not _PLAIN[name]:
        shown = f"{type(module).__module__}.{type(module).__qualname__}"
        if not (name == "position_embeddings" and shown == _COMPUTED_TABLE):
            return f"{name} is a {shown}, whose own forward the fused kernel does not compute"
    if "forward" in module.__dict__:
        return f"{name} has a forward of its own set on it (as accelerate's hooks set one), which must run"
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return f"{name} has hooks, which run only when its own forward does"
    if type(module) is nn.Embedding:
        if module.max_norm is not None:
            return f"{name} has max_norm={module.max_norm} (rows renormalised as they are read)"
        if torch.is_grad_enabled() and (module.sparse or module.scale_grad_by_freq):
            option = "sparse=True" if module.sparse else "scale_grad_by_freq=True"
            return f"{name} has {option} (the kernels write dense, unscaled gradients)"
    return None


def _mixed(tables, ids, device: torch.device) -> str | None:
    """Why the kernels cannot read these tables (on `device`) and (input, segment, position) ids together (mixed dtypes
    or devices, where the reference gives torch's answer), or None."""
    dtype = tables[0].dtype
    if any(t is not None and t.dtype != dtype for t in tables[1:3]):
        return f"the tables have different dtypes {sorted({str(t.dtype) for t in tables[:3] if t is not None})}"
    for name, given in zip(("input_ids", "token_type_ids", "position_ids"), ids, strict=True):
        if given is not None and given.device != device:
            return f"{name} is on {given.device}, the tables on {device}"
    return None


def _fall_back(reason: str) -> None:
    if reason not in _told:  # once per reason, not once per call
        _told.add(reason)
        log.info("bertembed: running the reference layer instead of the fused kernel: %s", reason)


def run(layer: nn.Module, modules: dict, tables: tuple, padding: tuple, input_ids: Tensor, token_type_ids: Tensor,
        position_ids: Tensor, inputs_embeds: Tensor | None) -> Tensor | None:
    """`layer`'s output [B, L, H] from the fused kernel, or None (the reason logged once) where the reference must
    run, on the layer's `modules`, `tables`, `padding` rows and checked, explicit ids (`BertEmbeddings._checked_ids`).
    Id values are checked by the CPU kernel as it reads them, before the Triton one (unless `layer.id_checks` is
    "device"). Word rows the kernel cannot read from the table itself come `gathered_rows`."""
    word = modules["word_embeddings"]
    gathered = inputs_embeds is not None or _module_reason("word_embeddings", word) is not None
    reason = can_fuse(layer, modules, gathered=True)  # (the word module was asked just above)
    if reason is None:
        if inputs_embeds is not None:  # (what sets the kernels' dtype and device)
            tables = (inputs_embeds, *tables[1:])
        device = tables[0].device
        backend, reason = select_backend(layer.backend, device, tables[0].dtype)
        reason = reason or _mixed(tables, (input_ids, token_type_ids, position_ids), device)
    if reason:
        _fall_back(reason)
        return None
    if gathered:
        padding = (None, padding[1])
        rows, input_ids = gathered_rows(word, input_ids, token_type_ids, position_ids, inputs_embeds, tables)
        if rows.dtype != tables[0].dtype or rows.device != tables[0].device:  # a wrapper that cast them: no kernel
            _fall_back(f"word_embeddings gave {rows.dtype} rows on {rows.device} from a {tables[0].dtype} table")
            rows = rows.view(*input_ids.shape, -1)
            rows = layer._rows(validation.table_rows(tables), None, token_type_ids, position_ids, rows)
            return modules["dropout"](layer._normalised(*rows)[1])
        tables = (rows, *tables[1:])  # (the word module's own backward keeps its padding row's gradient zero)
    if backend != "cpu" and layer.id_checks != "device":
        validation.check_id_ranges(input_ids, token_type_ids, position_ids, validation.table_rows(tables))
    dropout = modules["dropout"]
    try:
        return _fused(backend, input_ids, token_type_ids, position_ids, tables, modules["LayerNorm"].eps,
                      float(dropout.p) if dropout.training else 0.0, padding, layer.deterministic)
    except validation.IdsOutsideTables:  # (the kernel counts the bad ids; the check names one)
        validation.check_id_ranges(input_ids, token_type_ids, position_ids, validation.table_rows(tables))
        raise
    except validation.RowsOverflowed:
        _fall_back(_OVERFLOWED)
        return None


def gathered_rows(word: nn.Module, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor,
                  inputs_embeds: Tensor | None, tables: tuple) -> tuple[Tensor, Tensor]:
    """(rows [B*L, E], ids [B, L]: 0 .. B*L - 1): the word rows as a table read in token order, their gradient flowing
    back to `inputs_embeds` or `word(input_ids)` (on ids checked first: a sharded lookup zeroes a bad id's row)."""
    if inputs_embeds is None:
        validation.check_id_ranges(input_ids, token_type_ids, position_ids, validation.table_rows(tables))
        inputs_embeds = word(input_ids)
    rows = inputs_embeds.reshape(-1, inputs_embeds.shape[-1])
    if type(rows) is not Tensor:  # a tensor subclass (a collective's pending result): its values, in plain memory
        rows = rows.clone()
    return rows, torch.arange(rows.shape[0], device=rows.device).view(inputs_embeds.shape[:2])


def _needs_autograd(tables) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tables)


def _fused(backend: str, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor, tables: tuple, eps: float,
           p: float, padding: tuple[int | None, int | None], deterministic: bool, out: Tensor | None = None) -> Tensor:
    """The kernels on checked inputs with explicit ids: the forward kernel alone for inference, the custom op for
    training and under torch.compile. `padding`: the word and position tables' padding rows or None."""
    word, segment, position, weight, bias = tables
    # no segment table (DistilBERT, MPNet, ModernBERT), position table (ModernBERT, DeBERTa) or LayerNorm bias
    # (ModernBERT): a zero row, which adds nothing
    if segment is None:
        segment, token_type_ids = word.new_zeros((1, word.shape[1])), input_ids.new_zeros((1, 1))
    if position is None:
        position, position_ids = word.new_zeros((1, word.shape[1])), input_ids.new_zeros((1, 1))
    if bias is None:
        bias = weight.new_zeros(weight.shape)
    seed = int(torch.randint(0, 2**62, (1,))) if p > 0 else 0  # torch's generator: torch.manual_seed governs it
    compiling = is_compiling()
    if out is not None or not compiling and not _needs_autograd(tables):
        return kernel_forward(backend, input_ids, token_type_ids, position_ids, word, segment, position, weight, bias,
                              eps, p, seed, out, False)[0]
    pad, position_pad = (-1 if i is None else int(i) for i in padding)
    return embeddings_op(input_ids, token_type_ids, position_ids, word, segment, position, weight, bias, eps, p, seed,
                         pad, position_pad, backend, deterministic or torch.are_deterministic_algorithms_enabled(),
                         not compiling)[0]  # (strict in eager mode: the reference runs instead)


def fused_embeddings(
    input_ids: Tensor,
    word_embeddings: Tensor,
    token_type_embeddings: Tensor | None,
    position_embeddings: Tensor | None,
    layer_norm_weight: Tensor,
    layer_norm_bias: Tensor | None,
    *,
    token_type_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values_length: int | None = None,
    cache_length: int | None = None,
    eps: float = 1e-12,
    dropout_p: float = 0.0,
    training: bool = False,
    padding_idx: int | None = 0,
    backend: str = "auto",
    deterministic: bool = False,
    id_checks: str = "host",
    out: Tensor | None = None,
) -> Tensor:
    """dropout(LayerNorm((word[input_ids] + segment[token_type_ids]) + position[position_ids])): [B, L, H].

    Args:
        input_ids: [B, L] integer ids; token_type_ids [B, L] (zeros when None); position_ids [B, L] (`arange(L) +
            past_key_values_length` when None); segment and position ids may be of any shape that broadcasts to
            [B, L] ([1, L]: shared by the batch).
        past_key_values_length, cache_length: the offset of the first default position, under transformers 4's
            name and 5's (one number; both given and different: ValueError). 0 by default.
        word_embeddings [V, H], token_type_embeddings [T, H] or None, position_embeddings [P, H] or None (no such
            table: nothing added), layer_norm_weight [H], layer_norm_bias [H] or None (no bias, as ModernBERT's):
            the tables, differentiable (autograd-aware custom op).
        eps: LayerNorm's epsilon (BERT's 1e-12). dropout_p, training: dropout after LayerNorm when training (p in
            [0, 1], checked even when not training, as F.dropout checks it; p == 1 gives zeros).
        padding_idx: the word row whose gradient stays zero, as nn.Embedding's (negative: from the end; None: none).
        backend: "auto", "cpu", "triton" or "reference" (the plain PyTorch ops, for comparison).
        deterministic: bitwise-reproducible gradients on GPU (the CPU backward always is).
        id_checks: "host" (ids checked before any kernel) or "device" (GPU only: no wait for the device; a token with
            a bad id gets a row of NaN instead of an error).
        out: a [B, L, H] buffer to write into; inference only.
    Raises the reference layer's ValueErrors on bad input, before any kernel runs.
    """
    validation.check_option("id_checks", id_checks, validation.ID_CHECKS)
    validation.check_option("deterministic", deterministic, (False, True))
    tables = (word_embeddings, token_type_embeddings, position_embeddings, layer_norm_weight, layer_norm_bias)
    past = validation.offset_given(past_key_values_length, cache_length)
    device = word_embeddings.device
    chosen, reason = select_backend(check_backend(backend), device, word_embeddings.dtype)
    p = validation.check_dropout(dropout_p, "dropout_p")  # (in eval mode too, as F.dropout checks it)
    p = p if training else 0.0
    eps = validation.check_eps(eps)
    device_checks = id_checks == "device" and chosen == "triton" and device.type == "cuda"
    rows = validation.check_table_shapes(tables)
    padding_idx = validation.check_padding_idx(padding_idx, word_embeddings.shape[0])
    batch, length, past = validation.check_inputs(input_ids, token_type_ids, position_ids, None, past, rows,
                                                  word_embeddings.shape[1], check_ranges=not device_checks)
    validation.check_norm_dtypes(validation.summed_dtype(*tables[:3]), layer_norm_weight, layer_norm_bias)
    if out is not None:
        if _needs_autograd(tables):
            raise ValueError("out= is for inference: call under torch.no_grad() (or torch.inference_mode()), "
                             "or drop out= to get a tensor autograd can differentiate")
        shape, dtype = [batch, length, word_embeddings.shape[1]], word_embeddings.dtype
        if list(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() or out.device != device:
            raise ValueError(f"out= must be a contiguous {dtype} tensor of shape {shape} on {device}, "
                             f"got {out.dtype} {list(out.shape)} on {out.device}")
    if token_type_ids is None:
        token_type_ids = torch.zeros((1, length), dtype=torch.int64, device=device)
    if position_ids is None:
        position_ids = default_positions(length, past, device=device)
    if chosen != "reference" and (mixed := _mixed(tables, (input_ids, token_type_ids, position_ids), device)):
        chosen, reason = "reference", mixed
    if chosen != "reference":
        try:
            return _fused(chosen, input_ids, token_type_ids, position_ids, tables, eps, p, (padding_idx, None),
                          deterministic, out)
        except validation.RowsOverflowed:
            reason = _OVERFLOWED
    if reason:
        _fall_back(reason)
    result = embed(input_ids, *tables, token_type_ids, position_ids, eps=eps, p=p, padding_idx=padding_idx)
    return result if out is None else out.copy_(result)
