"""The fused layer as a PyTorch custom op with its own backward, so autograd and `torch.compile` both see one node.

`bertembed::embeddings` runs the forward kernel of a backend ("cpu": numba, "triton"), `bertembed::embeddings_backward`
the backward one. `torch.library.register_autograd` ties them together and `register_fake` gives `torch.compile` the
output shapes without running a kernel. In eager mode the same forward and backward run as `EagerEmbeddings`, a plain
`torch.autograd.Function`, which skips the custom op's dispatch (Python, slower than a sentence's kernels).

Dimension letters: B batch, L length, H hidden, V vocabulary, P positions, T segments.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.nn import functional as F

from bertembed.validation import in_torch_func


def backend_module(backend: str):
    if backend == "cpu":
        import bertembed.fast.cpu as cpu

        return cpu
    if backend == "triton":
        import bertembed.fast.triton as triton_kernels

        return triton_kernels
    raise ValueError(f"unknown kernel backend {backend!r}: use 'cpu' or 'triton'")


def flat_ids(input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor) -> list[Tensor]:
    """The three id tensors ([B, L], or segment and position ids of any shape that broadcasts to it) as contiguous
    int64 [B, L], which the kernels read as [N] (B x L tokens)."""
    shape = input_ids.shape
    return [t if t.shape == shape and t.dtype == torch.int64 and t.is_contiguous() else
            t.expand(shape).to(torch.int64).contiguous() for t in (input_ids, token_type_ids, position_ids)]


def _forward(input_ids, token_type_ids, position_ids, word, segment, position, weight, bias, eps, p, seed, padding_idx,
             position_pad, backend, deterministic):
    batch, length = input_ids.shape
    # the output comes in its own shape, not as a view of the kernel's [N, H]: a view made inside an autograd Function
    # may not be changed in place afterwards (`out.mul_(2)`, a forward hook's edit), which a plain tensor may
    out, mean, rstd = backend_module(backend).run_forward(
        *flat_ids(input_ids, token_type_ids, position_ids), word.contiguous(), segment.contiguous(),
        None if position is None else position.contiguous(), weight, bias, eps, p, seed,
        shape=(batch, length, word.shape[1]))
    return out, mean.view(batch, length), rstd.view(batch, length)


@torch.library.custom_op("bertembed::embeddings", mutates_args=())
def embeddings_op(
    input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor, word: Tensor, segment: Tensor,
    position: Optional[Tensor], weight: Tensor, bias: Tensor, eps: float, p: float, seed: int, padding_idx: int,
    position_pad: int, backend: str, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, L, H], mean [B, L], rstd [B, L]) of dropout(LayerNorm((word + segment) + position)).

    input_ids [B, L]; segment and position ids of any shape that broadcasts to it; all already validated.
    `padding_idx` and `position_pad` (the word and position tables' padding rows, whose gradients stay zero; -1:
    none) and `deterministic` are read by the backward.
    """
    return _forward(input_ids, token_type_ids, position_ids, word, segment, position, weight, bias, eps, p, seed,
                    padding_idx, position_pad, backend, deterministic)


@embeddings_op.register_fake
def _(input_ids, token_type_ids, position_ids, word, segment, position, weight, bias, eps, p, seed, padding_idx,
      position_pad, backend, deterministic):
    batch, length = input_ids.shape
    stats = word.new_empty((batch, length), dtype=torch.float32)
    return word.new_empty((batch, length, word.shape[1])), stats, stats.new_empty((batch, length))


def _gradients(grad, input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd, p, seed,
               padding_idx, backend, deterministic, need_word, need_position):
    hidden = word.shape[1]
    kwargs = {"deterministic": deterministic} if backend == "triton" else {}
    return backend_module(backend).run_backward(
        grad.reshape(-1, hidden), *flat_ids(input_ids, token_type_ids, position_ids), word.contiguous(),
        segment.contiguous(),
        None if position is None else position.contiguous(), weight, mean.reshape(-1), rstd.reshape(-1), p, seed,
        padding_idx, need_word=need_word, need_pos=need_position, **kwargs)


@torch.library.custom_op("bertembed::embeddings_backward", mutates_args=())
def embeddings_backward_op(
    grad: Tensor, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor, word: Tensor, segment: Tensor,
    position: Optional[Tensor], weight: Tensor, mean: Tensor, rstd: Tensor, p: float, seed: int, padding_idx: int,
    backend: str, deterministic: bool, need_word: bool, need_position: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d word [V, H], d segment [T, H], d position [P, H], d weight [H], d bias [H]); unwanted tables get [0, H]."""
    return _own_storage(_gradients(grad, input_ids, token_type_ids, position_ids, word, segment, position,
                                   weight, mean, rstd, p, seed, padding_idx, backend, deterministic, need_word,
                                   need_position))


def _own_storage(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """`tensors` with each one that shares storage with an earlier one copied: a custom op's outputs may not alias
    one another (`torch.compile` refuses them). The kernels return some gradients as views of one buffer, which eager
    autograd takes as they are (two copies fewer a training step)."""
    seen, own = set(), []
    for t in tensors:
        storage = t.untyped_storage().data_ptr()
        own.append(t.clone() if storage in seen else t)
        seen.add(storage)
    return tuple(own)


@embeddings_backward_op.register_fake
def _(grad, input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd, p, seed, padding_idx,
      backend, deterministic, need_word, need_position):
    hidden = word.shape[1]
    rows_pos = position.shape[0] if position is not None and need_position else 0
    return (word.new_empty((word.shape[0] if need_word else 0, hidden)), segment.new_empty(segment.shape),
            word.new_empty((rows_pos, hidden)), weight.new_empty(weight.shape), weight.new_empty(weight.shape))


def _setup_context(ctx, inputs, output) -> None:
    (input_ids, token_type_ids, position_ids, word, segment, position, weight, _bias, eps, p, seed, padding_idx,
     position_pad, backend, deterministic) = inputs
    _out, mean, rstd = output
    # mean and rstd get no gradient: without this autograd would fill a [B, L] zero tensor for each, every step;
    # backward never reads them
    ctx.set_materialize_grads(False)
    # The tables are saved, not the [B, L, H] sum: backward re-gathers the rows, so training keeps no extra tensor.
    ctx.save_for_backward(input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd)
    ctx.options = (p, seed, padding_idx, backend, deterministic)
    ctx.position_pad = position_pad
    ctx.eps = eps  # (for `_gradients_with_graph` alone)


def _backward_with(gradients):
    """The backward of the layer, computing the table gradients with `gradients` (the op, or its body in eager)."""
    def backward(ctx, grad, _grad_mean, _grad_rstd):
        input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd = ctx.saved_tensors
        p, seed, padding_idx, backend, deterministic = ctx.options
        need = ctx.needs_input_grad[3:8]  # word, segment, position, LayerNorm weight, bias
        dword, dseg, dpos, dweight, dbias = gradients(
            grad, input_ids, token_type_ids, position_ids, word, segment, position, weight, mean, rstd, p, seed,
            padding_idx, backend, deterministic, need[0], position is not None and need[2])
        if position is not None and need[2] and ctx.position_pad >= 0:
            dpos[ctx.position_pad] = 0  # (RoBERTa's padding row of the position table, as nn.Embedding keeps it)
        return (None, None, None, dword if need[0] else None, dseg if need[1] else None,
                dpos if position is not None and need[2] else None, dweight if need[3] else None,
                dbias if need[4] else None, None, None, None, None, None, None, None)

    return backward


embeddings_op.register_autograd(_backward_with(embeddings_backward_op), setup_context=_setup_context)


def _twice_differentiable(backward):
    """`backward`, except under `create_graph=True` (double backward, as a gradient penalty asks), where autograd runs
    a backward with grad mode on: there the gradients come from torch's own ops (`_gradients_with_graph`), so they can
    be differentiated again. The kernels' gradients cannot, and leaving them as constants would drop the layer's part
    of a penalty unseen: its gradients depend on the tables and LayerNorm's weight even when the upstream gradient is
    constant. The same for a batched backward (`is_grads_batched=True`, `jacobian(vectorize=True)`), which runs under
    vmap, where the kernels cannot read the wrapped gradient. """

    def run(ctx, grad, *_stats_grads):
        if torch.is_grad_enabled() or in_torch_func() or torch._C._functorch.is_legacy_batchedtensor(grad):
            return _gradients_with_graph(ctx, grad)
        return backward(ctx, grad, *_stats_grads)

    return run


def _gradients_with_graph(ctx, grad):
    """The backward's return value recomputed with a graph: the forward again in torch's ops on the saved tables
    (embedding lookups, the two adds, `layer_norm`), then `torch.autograd.grad(create_graph=True)` through it. Its
    first-order values equal the kernels' to float32 rounding (the reference layer's tests hold both to it)."""
    input_ids, token_type_ids, position_ids, word, segment, position, weight, _mean, _rstd = ctx.saved_tensors
    p, _seed, padding_idx, _backend, _deterministic = ctx.options
    if p > 0:
        raise RuntimeError("a double backward (create_graph=True) or batched one (is_grads_batched) through the fused "
                           "layer's dropout is not supported: its mask lives in the kernel; use backend='reference', "
                           "or dropout off (eval mode)")
    graph = torch.is_grad_enabled()  # create_graph=True; off for a batched backward without it
    with torch.enable_grad():
        summed = F.embedding(input_ids, word, padding_idx=None if padding_idx < 0 else padding_idx)
        summed = summed + F.embedding(token_type_ids, segment)
        if position is not None:
            summed = summed + F.embedding(position_ids, position, None if ctx.position_pad < 0 else ctx.position_pad)
        out = F.layer_norm(summed, weight.shape, weight, None, ctx.eps)
    chosen = [(i, t) for i, t in enumerate((word, segment, position, weight))
              if t is not None and ctx.needs_input_grad[3 + i]]  # (the op's inputs 3-6)
    found = torch.autograd.grad(out, [t for _, t in chosen], grad, create_graph=graph,
                                materialize_grads=True) if chosen else ()
    tables = [None] * 4
    for (i, _), g in zip(chosen, found, strict=True):
        tables[i] = g
    dbias = grad.sum(dim=(0, 1)).to(weight.dtype) if ctx.needs_input_grad[7] else None
    return (None, None, None, *tables, dbias, None, None, None, None, None, None, None)


class EagerEmbeddings(torch.autograd.Function):
    """The op's forward and backward as a plain autograd.Function, for eager mode: torch.library's dispatch of a
    custom op costs more Python a call than a sentence's kernels. `torch.compile` gets the op, which it can trace.
    `EagerEmbeddings.apply` takes the op's arguments and returns its three outputs."""

    @staticmethod
    def forward(ctx, *inputs):  # the old style, with ctx: a separate setup_context makes apply bind the signature
        output = _forward(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1:])
        return output

    backward = staticmethod(_twice_differentiable(_backward_with(_gradients)))
