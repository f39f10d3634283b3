"""Fused kernels for BERT's embedding layer: one pass per token instead of three gathers, two adds and a LayerNorm.

    from bertembed.kernels import fused_embeddings
    out = fused_embeddings(input_ids, word, segment, position, ln_weight, ln_bias, eps=1e-12)  # [B, L, H]

Backends: "cpu" (numba, `cpu.py`, its torch glue in `cpu_run.py`), "triton" (`triton.py`: CUDA, or CPU tensors under
TRITON_INTERPRET=1), "reference" (the plain PyTorch layer in `bertembed/embeddings.py`, which every kernel is tested
against), and "auto", which picks the fused kernel for the tensors' device and falls back to the reference with a
logged reason. Inference in eval mode takes a short path with less Python around the kernel: `lean.py` on the CPU,
`lean_gpu.py` on a GPU.

Dimension letters: B batch, L length, H hidden, V vocabulary, P positions, T segments.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.compiler import is_compiling

from bertembed.config import EmbeddingConfig
from bertembed.embeddings import default_ids_untouched
from bertembed.kernels.submodules import submodule_reason
from bertembed.validation import (
    cache_offset,
    check_dropout,
    check_inputs,
    check_norm_dtypes,
    check_table_shapes,
    forward_ad_on,
    in_torch_func,
    offset,
    summed_dtype,
    table_rows,
)

log = logging.getLogger(__name__)

BACKENDS = ("auto", "reference", "cpu", "triton")
_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "triton": (torch.float32, torch.float16, torch.bfloat16)}
_INSTALL = {"cpu": "pip install 'bertembed[fast]' (numba)", "triton": "pip install 'bertembed[gpu]' (triton)"}
_told: set[str] = set()
_found: dict[str, bool] = {}
# Set in a process forked from one whose numba pool ran on GNU OpenMP (`cpu_run`): a parallel kernel there would end
# the process ("Terminating: fork() called from a process already using GNU OpenMP").
_FORKED_POOL = "this process was forked from one whose numba thread pool runs on GNU OpenMP, which cannot run in a " \
    "forked child; start worker processes with multiprocessing's 'spawn' or 'forkserver' method to keep the kernels"
_cpu_pool: dict[str, str | None] = {"lost": None}


def lose_cpu_pool() -> None:
    """`os.register_at_fork`'s child hook (`cpu_run`): from now on the cpu backend's parallel kernels cannot run."""
    _cpu_pool["lost"] = _FORKED_POOL


ID_CHECKS = ("host", "device")


@dataclass(frozen=True)
class KernelOptions:
    """How the fused kernels run. `deterministic`: bitwise-repeatable GPU gradients (a fixed summation order instead
    of atomics), also whenever `torch.use_deterministic_algorithms(True)` is on. `id_checks`: "host" checks every id
    before any kernel runs, raising the reference layer's errors (on a GPU the check waits for the device once a
    call); "device" (GPU only) leaves that to the kernel, which never reads outside a table and gives a token with a
    bad id a row of NaN instead of raising, with no wait."""

    deterministic: bool = False
    id_checks: str = "host"

    def __post_init__(self) -> None:
        if self.id_checks not in ID_CHECKS:
            raise ValueError(f"id_checks must be one of {ID_CHECKS}, got {self.id_checks!r}")


def _missing(backend: str) -> str | None:
    """Why `backend` cannot run in this environment, or None when it can (looked up once per backend)."""
    module = "numba" if backend == "cpu" else "triton"
    if backend not in _found:
        _found[backend] = importlib.util.find_spec(module) is not None
    return None if _found[backend] else f"{module} is not installed: {_INSTALL[backend]}"


def check_backend(backend: str) -> str:
    """Validate a backend name at construction; an explicit fused backend must be installed. Returns the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend in ("cpu", "triton") and (reason := _missing(backend)):
        raise ImportError(f"backend={backend!r} is unavailable: {reason}")
    return backend


def _device_reason(backend: str, device: torch.device) -> str | None:
    if backend == "cpu" and device.type != "cpu":
        return f"the 'cpu' backend runs on CPU tensors, these are on {device}"
    if backend == "cpu" and _cpu_pool["lost"]:
        return _cpu_pool["lost"]
    if backend == "triton" and device.type != "cuda" \
            and (device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1"):
        return f"the 'triton' backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), these are on {device}"
    return None


def _transform_reason() -> str | None:
    """Why the kernels cannot run inside a torch.func transform (grad, vmap, jacrev, ...) or `torch.jit.trace`, or
    None outside them: a transform's tensors wrap others, with no memory of their own for a kernel to read, and
    `function.EagerEmbeddings` has no functorch rules; the tracer records torch operations, not numba's or Triton's
    code, and ONNX has no operator for them. (Under torch.compile the custom op is traced instead.)"""
    if not is_compiling():  # (dynamo cannot trace these two questions)
        if in_torch_func():
            return "a torch.func transform is running, and the fused kernels have no rules for its wrapped tensors"
        if forward_ad_on():
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
    reason = _missing(backend) or _device_reason(backend, device) or _transform_reason()
    if reason is None and dtype not in _DTYPES[backend]:
        reason = f"the {backend!r} kernels take {[str(d) for d in _DTYPES[backend]]} tables, not {dtype}"
    return ("reference", reason) if reason else (backend, None)


def _mixed(tables, ids) -> str | None:
    """Why the kernels cannot read these tables and (input, segment, position) ids together, or None: they read the
    three tables in one dtype (LayerNorm's weight and bias may be any float dtype), and ids on the tables' device.
    Ids elsewhere get the reference's answer: torch's error, or for ids on the meta device (a model run there for its
    shapes) what torch's lookup gives, with no memory read."""
    dtypes = {t.dtype for t in tables[:3] if t is not None}
    if len(dtypes) > 1:
        return f"the tables have different dtypes {sorted(map(str, dtypes))}"
    device = tables[0].device
    for name, given in zip(("input_ids", "token_type_ids", "position_ids"), ids, strict=True):
        if isinstance(given, Tensor) and given.device != device:
            return f"{name} is on {given.device}, the tables on {device}"
    return None


def _fall_back(reason: str) -> None:
    if reason not in _told:  # once per reason, not once per call
        _told.add(reason)
        log.info("bertembed: running the reference layer instead of the fused kernel: %s", reason)


def _run(config: EmbeddingConfig, backend: str, input_ids: Tensor, token_type_ids: Tensor | None,
         position_ids: Tensor | None, past_key_values_length: int, tables: tuple, p: float, padding_idx: int | None,
         options: KernelOptions, out: Tensor | None) -> Tensor:
    """Validate (same errors as the reference, before any kernel), run the op. Missing segment and position ids stay
    None down to the kernels (`function.flat_ids`): the GPU kernel computes them from the token's index."""
    device_checks = options.id_checks == "device" and backend == "triton" and input_ids.device.type == "cuda"
    check_table_shapes(tables)
    check_inputs(config, input_ids, token_type_ids, position_ids, None, past_key_values_length,
                 check_ranges=not device_checks, rows=table_rows(tables))
    past_key_values_length = offset(past_key_values_length)  # (a numpy integer or 0-d tensor: a Python int now)
    word, segment, position, weight, bias = tables
    check_norm_dtypes(word.dtype, weight, bias)  # (the three tables share a dtype here: `_mixed`)
    seed = int(torch.randint(0, 2**62, (1,))) if p > 0 else 0  # torch's generator: torch.manual_seed governs it
    if out is not None or not _needs_autograd(tables) and not is_compiling():
        # inference: the forward kernel alone, skipping the op's dispatch (~50 us)
        return _run_into(out, backend, input_ids, token_type_ids, position_ids, past_key_values_length, tables,
                         config.layer_norm_eps, p, seed)
    pad = -1 if padding_idx is None else int(padding_idx)
    from bertembed.kernels.function import EagerEmbeddings, embeddings_op

    run = embeddings_op if is_compiling() else EagerEmbeddings.apply  # the op only where it is traced
    result, _mean, _rstd = run(input_ids, token_type_ids, position_ids, past_key_values_length, word, segment,
                               position, weight, bias, config.layer_norm_eps, p, seed, pad, backend,
                               options.deterministic or torch.are_deterministic_algorithms_enabled())
    return result


def _needs_autograd(tables) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tables)


def _check_out(out: Tensor, ids_shape, tables) -> None:
    """A ValueError unless `out` can take the output: inference only, contiguous, of the word table's dtype and
    device, [B, L, H]. Every backend asks it, the reference included, so `out=` works or fails alike on all."""
    if _needs_autograd(tables):
        raise ValueError("out= is for inference: call under torch.no_grad() (or torch.inference_mode()), "
                         "or drop out= to get a tensor autograd can differentiate")
    word = tables[0]
    shape = (*ids_shape, word.shape[1])
    if tuple(out.shape) != shape or out.dtype != word.dtype or not out.is_contiguous() or out.device != word.device:
        raise ValueError(f"out= must be a contiguous {word.dtype} tensor of shape {list(shape)} on {word.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")


def _run_into(out, backend, input_ids, token_type_ids, position_ids, past, tables, eps, p, seed) -> Tensor:
    """The forward kernel alone, into a caller's buffer (`out`) or a new one: inference only (no autograd node).
    The GPU kernel computes default positions itself; the CPU one takes an id per token."""
    word, segment, position, weight, bias = tables
    if out is None:
        out = torch.empty((*input_ids.shape, word.shape[1]), dtype=word.dtype, device=word.device)
    else:
        _check_out(out, input_ids.shape, tables)
    from bertembed.kernels.function import _backend_module, flat_ids

    ids, extra = flat_ids(backend, input_ids, token_type_ids, position_ids, past)
    if backend == "triton":
        extra["stats"] = False
    _backend_module(backend).run_forward(*ids, word.contiguous(), segment.contiguous(),
                                         None if position is None else position.contiguous(), weight, bias, eps, p,
                                         seed, out=out, **extra)
    return out


@functools.lru_cache(maxsize=64)
def _config(vocab: int, hidden: int, positions: int | None, types: int, eps: float) -> EmbeddingConfig:
    return EmbeddingConfig(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=positions or 2**31 - 1,
                           type_vocab_size=types, layer_norm_eps=eps, hidden_dropout_prob=0.0,
                           position_embedding_type="none" if positions is None else "absolute")


def fused_embeddings(
    input_ids: Tensor,
    word_embeddings: Tensor,
    token_type_embeddings: Tensor,
    position_embeddings: Tensor | None,
    layer_norm_weight: Tensor,
    layer_norm_bias: Tensor,
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
        word_embeddings [V, H], token_type_embeddings [T, H], position_embeddings [P, H] or None (no position row),
            layer_norm_weight [H], layer_norm_bias [H]: the tables, differentiable (autograd-aware custom op).
        eps: LayerNorm's epsilon (BERT's 1e-12). dropout_p, training: dropout after LayerNorm when training (p in
            [0, 1], checked even when not training, as F.dropout checks it; p == 1 gives zeros).
        padding_idx: the word row whose gradient stays zero, as nn.Embedding's (None: none).
        backend: "auto", "cpu", "triton" or "reference" (the plain PyTorch ops, for comparison).
        deterministic: bitwise-reproducible gradients on GPU (the CPU backward always is).
        id_checks: "host" (ids checked before any kernel) or "device" (GPU: no wait; bad ids give NaN rows); see
            `KernelOptions`.
        out: a [B, L, H] buffer to write into; inference only.
    Raises the reference layer's ValueErrors on bad input, before any kernel runs.
    """
    tables = (word_embeddings, token_type_embeddings, position_embeddings, layer_norm_weight, layer_norm_bias)
    past_key_values_length = cache_offset(past_key_values_length, cache_length)
    options = KernelOptions(deterministic, id_checks)
    config = _config(word_embeddings.shape[0], word_embeddings.shape[1],
                     None if position_embeddings is None else position_embeddings.shape[0],
                     token_type_embeddings.shape[0], float(eps))
    chosen, reason = select_backend(check_backend(backend), word_embeddings.device, word_embeddings.dtype)
    if chosen != "reference" and (mixed := _mixed(tables, (input_ids, token_type_ids, position_ids))):
        chosen, reason = "reference", mixed
    p = check_dropout(dropout_p, "dropout_p")  # (in eval mode too, as F.dropout checks it)
    p = p if training else 0.0
    if chosen == "reference":
        if reason:
            _fall_back(reason)
        return _reference(config, input_ids, token_type_ids, position_ids, past_key_values_length, tables, p,
                          padding_idx, out)
    return _run(config, chosen, input_ids, token_type_ids, position_ids, past_key_values_length, tables, p,
                padding_idx, options, out)


def _reference(config, input_ids, token_type_ids, position_ids, past_key_values_length, tables, p, padding_idx, out):
    """The same computation with plain PyTorch ops, in the reference layer's order."""
    import torch.nn.functional as F

    check_table_shapes(tables)
    batch, length = check_inputs(config, input_ids, token_type_ids, position_ids, None, past_key_values_length,
                                 rows=table_rows(tables))
    past_key_values_length = offset(past_key_values_length)
    word, segment, position, weight, bias = tables
    check_norm_dtypes(summed_dtype(word, segment, position), weight, bias)
    if out is not None:
        _check_out(out, (batch, length), tables)
    if token_type_ids is None:
        token_type_ids = torch.zeros((batch, length), dtype=torch.int64, device=word.device)
    if position_ids is None:
        position_ids = torch.arange(past_key_values_length, past_key_values_length + length, device=word.device)[None]
    x = F.embedding(input_ids, word, padding_idx) + F.embedding(token_type_ids, segment)
    if position is not None:
        x = x + F.embedding(position_ids, position)
    result = F.dropout(F.layer_norm(x, (word.shape[1],), weight, bias, config.layer_norm_eps), p, training=p > 0)
    return result if out is None else out.copy_(result)


_short_paths: dict[tuple[str, bool], object] = {}
_UNSET = object()


def _short_path(backend: str, cuda: bool):
    """`try_infer` of the short path that a layer of `backend` takes for ids on the GPU (`cuda`) or not: `lean.py`
    (CPU), `lean_gpu.py`, or None; found once per pair (a plain dict, not functools.cache, which torch.compile warns
    about). Both the import statement (0.6 us) and the checks behind this lookup cost a sentence's latency."""
    if (backend, cuda) not in _short_paths:
        kernel, module = ("triton", "lean_gpu") if cuda else ("cpu", "lean")
        runs = backend in (kernel, "auto") and _missing(kernel) is None
        _short_paths[backend, cuda] = importlib.import_module(f"bertembed.kernels.{module}").try_infer if runs else None
    return _short_paths[backend, cuda]


def module_forward(layer, input_ids, token_type_ids, position_ids, inputs_embeds, past_key_values_length):
    """`BertEmbeddings.forward` on the fused kernel, or None when these inputs need the reference (reason logged)."""
    traced = is_compiling() or torch._C._is_tracing()
    if traced:  # traced (torch.compile, torch.export: the custom op below goes into
        short = None  # the graph; torch.jit.trace: the reference), since the short paths hand addresses to compiled
        # code, which no tracer can follow. (`torch.jit.is_tracing` costs 77 ns, its C function 29.)
    else:  # (a sentence's latency: the dict is read here, not through a call)
        cuda = type(input_ids) is torch.Tensor and input_ids.is_cuda
        short = _short_paths.get((layer.backend, cuda), _UNSET)
        if short is _UNSET:
            short = _short_path(layer.backend, cuda)
    if short is not None and (out := short(layer, input_ids, token_type_ids, position_ids, inputs_embeds,
                                           past_key_values_length)) is not None:
        return out
    if reason := submodule_reason(layer, torch.is_grad_enabled()):  # first: a wrapper may have no `weight` to read
        _fall_back(reason)
        return None
    if inputs_embeds is None and (position_ids is None or token_type_ids is None) and not traced \
            and not in_torch_func() and not default_ids_untouched(layer):  # (neither reads a traced or wrapped buffer)
        position_ids, token_type_ids = _ids_from_buffers(layer, input_ids, token_type_ids, position_ids,
                                                         past_key_values_length)
    word = layer.word_embeddings.weight
    chosen, reason = select_backend(layer.backend, word.device, word.dtype)
    positions = layer.position_embeddings
    tables = (word, layer.token_type_embeddings.weight, None if positions is None else positions.weight,
              layer.LayerNorm.weight, layer.LayerNorm.bias)
    if chosen != "reference" and inputs_embeds is not None:
        chosen, reason = "reference", "inputs_embeds was given (the kernels gather word rows themselves)"
    if chosen != "reference" and (mixed := _mixed(tables, (input_ids, token_type_ids, position_ids))):
        chosen, reason = "reference", mixed
    if chosen == "reference":
        if reason:
            _fall_back(reason)
        return None
    dropout = layer.dropout  # its own flag, not the layer's: Monte Carlo dropout trains only the dropouts
    p = check_dropout(dropout.p, "layer.dropout.p")  # (in eval mode too, as nn.Dropout checks it as it runs)
    p = p if dropout.training else 0.0
    return _run(layer.config, chosen, input_ids, token_type_ids, position_ids, past_key_values_length, tables, p,
                layer.word_embeddings.padding_idx, _layer_options(layer), None)


def _ids_from_buffers(layer, input_ids, token_type_ids, position_ids, past):
    """(position ids, segment ids), the missing ones sliced from the layer's default-id buffers as the reference
    slices them, for a layer whose buffers were edited (the kernels would compute 0, 1, 2, ... and zeros). Inputs
    the reference would refuse are left as they are, for the checks to name."""
    try:
        length, past = input_ids.shape[-1], offset(past)
    except (AttributeError, IndexError, ValueError, TypeError, RuntimeError):  # (RuntimeError: a nested one's shape)
        return position_ids, token_type_ids
    if past < 0:
        return position_ids, token_type_ids
    if position_ids is None:
        position_ids = layer._default_ids("position_ids", past, length)
    if token_type_ids is None:
        token_type_ids = layer._default_ids("token_type_ids", 0, length)
    return position_ids, token_type_ids


def _layer_options(layer) -> KernelOptions:
    """The layer's `deterministic` and `id_checks` attributes (set them on a layer to change how it runs)."""
    return KernelOptions(getattr(layer, "deterministic", False), getattr(layer, "id_checks", "host"))
