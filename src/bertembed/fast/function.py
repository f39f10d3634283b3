"""The fused layer as custom ops (`bertembed::embeddings` and its backward) that autograd and `torch.compile` see as
one node, in eager mode and traced alike.

Dimension letters: B batch, L length, H hidden, V vocabulary, P positions, T segments.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch
from torch import Tensor
from torch.compiler import is_compiling

from bertembed.tensor_files import unshared
from bertembed.validation import in_torch_func

log = logging.getLogger("bertembed.fast")
_told: set[str] = set()
_modules: dict = {}
# the process that named a fused backend (this module is loaded then, the kernels on first use): a child forked from
# it runs the CPU kernels serially, as GNU OpenMP, numba's or torch's pool, ends or hangs in such a child
STARTED_IN = os.getpid()


def backend_module(backend: str):
    """The kernels of `backend`, "cpu" or "triton" (imported on first use)."""
    if backend not in _modules:
        if backend not in ("cpu", "triton"):
            raise ValueError(f"unknown kernel backend {backend!r}: use 'cpu' or 'triton'")
        _modules[backend] = importlib.import_module(f"bertembed.fast.{backend}")
    return _modules[backend]


def flat_ids(input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor) -> list[Tensor]:
    """The three id tensors ([B, L], or segment and position ids of any shape that broadcasts to it) as contiguous
    int64 [B, L], which the kernels read as [N] (B x L tokens)."""
    shape = input_ids.shape
    return [t if t.shape == shape and t.dtype == torch.int64 and t.is_contiguous() else
            t.expand(shape).to(torch.int64).contiguous() for t in (input_ids, token_type_ids, position_ids)]


def kernel_forward(backend, input_ids, token_type_ids, position_ids, word, segment, position, weight, bias, eps, p,
                   seed, out=None, stats=True, strict=True):
    """`backend`'s forward kernel: (out [B, L, H], or the `out` given; mean [N], rstd [N], or None without stats).
    `strict`: RowsOverflowed where a token's moments are not finite, for the caller to run the reference instead.
    (`out` in its own shape, not a view of [N, H]: a view made in an autograd Function may not be changed in place.)"""
    return backend_module(backend).run_forward(*flat_ids(input_ids, token_type_ids, position_ids), word, segment,
                                               position, weight, bias, eps, p, seed, out, stats,
                                               (*input_ids.shape, word.shape[1]), strict)


def _forward(
    input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor, word: Tensor, segment: Tensor,
    position: Tensor, weight: Tensor, bias: Tensor, eps: float, p: float, seed: int, padding_idx: int,
    position_pad: int, backend: str, deterministic: bool, strict: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, L, H], mean [B, L], rstd [B, L]) of dropout(LayerNorm((word + segment) + position)) on validated
    inputs (segment and position ids: any shape that broadcasts to input_ids [B, L]). `padding_idx`, `position_pad`
    (the word and position tables' padding rows, -1: none) and `deterministic` are for the backward. `strict` (eager
    mode; a compiled graph cannot run the reference instead): as `kernel_forward`'s."""
    out, mean, rstd = kernel_forward(backend, input_ids, token_type_ids, position_ids, word, segment, position, weight,
                                     bias, eps, p, seed, strict=strict)
    return out, mean.view(input_ids.shape), rstd.view(input_ids.shape)


embeddings_op = torch.library.custom_op("bertembed::embeddings", _forward, mutates_args=())


@embeddings_op.register_fake
def _(input_ids, token_type_ids, position_ids, word, segment, position, weight, bias, eps, p, seed, padding_idx,
      position_pad, backend, deterministic, strict=False):
    batch, length = input_ids.shape
    stats = word.new_empty((batch, length), dtype=torch.float32)
    return word.new_empty((batch, length, word.shape[1])), stats, stats.new_empty((batch, length))


@torch.library.custom_op("bertembed::embeddings_backward", mutates_args=())
def embeddings_backward_op(
    grad: Tensor, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor, word: Tensor, segment: Tensor,
    position: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, p: float, seed: int, padding_idx: int,
    backend: str, deterministic: bool, need_word: bool, need_position: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d word [V, H], d segment [T, H], d position [P, H], d weight [H], d bias [H]); unwanted tables get [0, H]."""
    grads = backend_module(backend).run_backward(
        grad.reshape(-1, word.shape[1]), *flat_ids(input_ids, token_type_ids, position_ids), word, segment, position,
        weight, mean.reshape(-1), rstd.reshape(-1), p, seed, padding_idx, need_word=need_word,
        need_pos=need_position, deterministic=deterministic)  # (each backend makes the tables contiguous)
    # a custom op's outputs may not alias (the kernels return some gradients as views of one buffer)
    return tuple(unshared(dict(enumerate(grads))).values())


@embeddings_backward_op.register_fake
def _(grad, input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd, p, seed, padding_idx,
      backend, deterministic, need_word, need_position):
    hidden = word.shape[1]
    rows_pos = position.shape[0] if need_position else 0
    return (word.new_empty((word.shape[0] if need_word else 0, hidden)), segment.new_empty(segment.shape),
            word.new_empty((rows_pos, hidden)), weight.new_empty(weight.shape), weight.new_empty(weight.shape))


def _setup_context(ctx, inputs, output) -> None:
    (input_ids, token_type_ids, position_ids, word, segment, position, weight, _bias, eps, p, seed, padding_idx,
     position_pad, backend, deterministic, *_strict) = inputs
    _out, mean, rstd = output
    ctx.set_materialize_grads(False)  # (no zero gradients made for mean and rstd, which backward never reads)
    # the ids and tables but the bias are saved, not the [B, L, H] sum: backward re-gathers the rows
    ctx.save_for_backward(input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd)
    ctx.options = (p, seed, padding_idx, backend, deterministic, position_pad, eps)


_NO_GRADIENTS = (None,) * 8  # for the op's arguments past the tables (eps ... strict)


def _backward(ctx, grad, _grad_mean, _grad_rstd):
    """The layer's backward: the kernels' table gradients (`embeddings_backward_op`). Under `create_graph=True`
    (double backward) or a batched backward (`is_grads_batched`, run under vmap) in eager mode, the gradients come
    from torch's own ops instead (`_gradients_with_graph`), which can be differentiated again and read wrapped tensors;
    the kernels' gradients would silently be constants."""
    if not is_compiling() and (torch.is_grad_enabled() or in_torch_func()
                               or torch._C._functorch.is_legacy_batchedtensor(grad)):
        return _gradients_with_graph(ctx, grad)
    input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd = ctx.saved_tensors
    p, seed, padding_idx, backend, deterministic, position_pad, _eps = ctx.options
    need = ctx.needs_input_grad[3:8]  # word, segment, position, LayerNorm weight, bias
    dword, dseg, dpos, dweight, dbias = embeddings_backward_op(
        grad, input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd, p, seed,
        padding_idx, backend, deterministic, need[0], need[2])
    if need[2] and position_pad >= 0:
        dpos[position_pad] = 0  # (RoBERTa's padding row of the position table, as nn.Embedding keeps it)
    grads = (dword, dseg, dpos, dweight, dbias)
    return (None, None, None, *(g if wanted else None for g, wanted in zip(grads, need, strict=True)), *_NO_GRADIENTS)


embeddings_op.register_autograd(_backward, setup_context=_setup_context)


def _gradients_with_graph(ctx, grad):
    """The backward's return value from the reference `embed()` on the saved tables, by `torch.autograd.grad` (with
    `create_graph=True` under a double backward): the kernels have no rules of their own for either."""
    from bertembed.functional import embed

    input_ids, token_type_ids, position_ids, word, segment, position, weight, _mean, _rstd = ctx.saved_tensors
    p, _seed, padding_idx, _backend, _deterministic, position_pad, eps = ctx.options
    if p > 0:
        raise RuntimeError("a double backward (create_graph=True) or batched one (is_grads_batched) through the fused "
                           "layer's dropout is not supported: its mask lives in the kernel; use backend='reference', "
                           "or dropout off (eval mode)")
    if "twice" not in _told:
        _told.add("twice")
        log.info("bertembed: a double or batched backward runs through the reference layer, not the fused kernel")
    graph = torch.is_grad_enabled()  # create_graph=True; off for a batched backward without it
    with torch.enable_grad():  # (bias: the layer's output gradient summed, below; LayerNorm's own without it)
        out = embed(input_ids, word, segment, position, weight, None, token_type_ids, position_ids, eps=eps,
                    padding_idx=None if padding_idx < 0 else padding_idx,
                    position_padding_idx=None if position_pad < 0 else position_pad)
    need = ctx.needs_input_grad[3:7]  # (the op's inputs 3-6: word, segment, position, LayerNorm weight)
    leaves = [t for t, wanted in zip((word, segment, position, weight), need, strict=True) if wanted]
    found = iter(torch.autograd.grad(out, leaves, grad, create_graph=graph, materialize_grads=True) if leaves else ())
    dbias = grad.sum(dim=(0, 1)).to(weight.dtype) if ctx.needs_input_grad[7] else None
    return (None, None, None, *(next(found) if wanted else None for wanted in need), dbias, *_NO_GRADIENTS)
