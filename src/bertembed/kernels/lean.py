"""The short path for CPU inference: the Python glue between `BertEmbeddings.forward` and the kernel, cut down.

A sentence's kernel work is a few microseconds, so the glue decides its latency; at (32, 128) the general path's glue
(input checks in torch, position and segment tensors, the custom op's argument handling) cost about 0.25 ms of 1.3,
half of what this path's does (`benchmarks/glue_overhead.py`), since it runs while the kernel has just flushed the
caches. Same per-token kernel as `cpu.forward`
(`cpu._forward_token`), so the same numbers. The differences are all glue: parameters are read through the module's
dicts (no `nn.Module.__getattr__`), numpy views of the tables are cached while their storage stays the same, and one
compiled call checks every id before any table row is read. Small inputs run serially with positions computed in the
kernel; larger ones run `cpu.forward` on all threads. Anything this path does not cover (training, autograd, bfloat16,
explicit position ids, `inputs_embeds`, a bad id) returns None, and the general path takes over: it raises the
reference layer's errors.

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from bertembed.kernels import cpu, pages
from bertembed.kernels.cpu_elements import borrowed, hold

_NO_DROPOUT, _SCALE, _SEED = cpu.dropout_threshold(0.0), 1.0, np.uint64(0)


@njit(cache=True)
def _ids_fit(ids, tts, has_tts, past, vocab, segments, positions):
    """Whether every id, segment id (when given) and position past + l lies inside its table."""
    batch, length = ids.shape
    if past + length > positions:
        return False
    for r in range(batch):
        for c in range(length):
            if not 0 <= ids[r, c] < vocab or has_tts and not 0 <= tts[r, c] < segments:
                return False
    return True


@njit(cache=True)
def _infer(ids, tts, has_tts, past, word, seg, pos, gamma, beta, eps, out):
    """out [B*L, H] = LayerNorm((word[ids] + seg[tts]) + pos[past + l]) on this thread; returns False, computing
    nothing, when an id, a segment id or a position lies outside its table."""
    if not _ids_fit(ids, tts, has_tts, past, word.shape[0], seg.shape[0], pos.shape[0]):
        return False
    batch, length = ids.shape
    n = batch * length
    scratch, stats = np.empty(out.shape[1], np.float32), np.empty((2, n), np.float32)
    x, mean, rstd = borrowed(scratch), borrowed(stats[0]), borrowed(stats[1])
    word, seg, pos, gamma, beta, out = borrowed(word), borrowed(seg), borrowed(pos), borrowed(gamma), borrowed(beta), \
        borrowed(out)
    for r in range(batch):
        for c in range(length):
            s = tts[r, c] if has_tts else 0
            cpu._forward_token(r * length + c, ids[r, c], s, past + c, word, seg, pos, True, gamma, beta, eps,
                               _NO_DROPOUT, _SCALE, _SEED, x, out, mean, rstd, None)
    hold(scratch)
    hold(stats)
    return True


def _infer_parallel(ids, tts, has_tts, past, tables, eps) -> torch.Tensor | None:
    """`cpu.forward` on all threads, the ids checked first; None on a bad id (nothing computed)."""
    word, seg, pos = tables[:3]
    if not _ids_fit(ids, tts, has_tts, past, word.shape[0], seg.shape[0], pos.shape[0]):
        return None
    batch, length = ids.shape
    n = batch * length
    out = torch.empty(batch, length, word.shape[1])  # torch's allocator: its memory profiler sees the output
    pages.advise_if_fresh(out)
    stats = np.empty(2 * n, np.float32)
    segments = tts.reshape(n) if has_tts else np.zeros(n, np.int64)
    positions = np.tile(np.arange(past, past + length, dtype=np.int64), batch)
    bad = cpu.forward(ids.reshape(n), segments, positions, *tables, eps, _NO_DROPOUT, _SCALE, _SEED,
                      out.numpy().reshape(n, word.shape[1]), stats[:n], stats[n:], cpu.forward_chunks(n))
    cpu.check_bad(bad, "bertembed cpu forward (short path)")
    return out


def _tables(layer) -> list[np.ndarray] | None:
    """Numpy views of the five float32 CPU tables, cached on the layer while their storage is unchanged."""
    modules = layer._modules
    positions = modules["position_embeddings"]
    if positions is None or not isinstance(positions, torch.nn.Embedding):
        return None
    norm = modules["LayerNorm"]._parameters
    tensors = word, segment, position, weight, bias = (
        modules["word_embeddings"]._parameters["weight"], modules["token_type_embeddings"]._parameters["weight"],
        positions._parameters["weight"], norm["weight"], norm["bias"])
    key = (word.data_ptr(), segment.data_ptr(), position.data_ptr(), weight.data_ptr(), bias.data_ptr(), word.shape,
           position.shape)  # same storage (the cached views keep the old one alive, so no reuse) and sizes
    cached = layer.__dict__.get("_lean_tables")
    if cached is not None and cached[0] == key:
        return cached[1]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None  # not cached: a dtype or device change always comes with new storage
    arrays = [t.detach().numpy() for t in tensors]
    layer.__dict__["_lean_tables"] = (key, arrays)
    return arrays


def try_infer(layer, input_ids, token_type_ids, position_ids, inputs_embeds, past_key_values_length):
    """The output [B, L, H], or None when these inputs are not for the short path."""
    if layer.training or position_ids is not None or inputs_embeds is not None or type(input_ids) is not torch.Tensor \
            or input_ids.dtype != torch.int64 or input_ids.dim() != 2 or type(past_key_values_length) is not int \
            or past_key_values_length < 0:
        return None
    if torch.is_grad_enabled() or not input_ids.is_cpu or not input_ids.is_contiguous():
        return None  # autograd needs the custom op
    tables = _tables(layer)
    if tables is None:
        return None
    ids = input_ids.numpy()
    if token_type_ids is None:
        tts, has_tts = ids, False
    elif type(token_type_ids) is torch.Tensor and token_type_ids.dtype == torch.int64 \
            and token_type_ids.shape == input_ids.shape and token_type_ids.is_contiguous() \
            and token_type_ids.is_cpu:
        tts, has_tts = token_type_ids.numpy(), True
    else:
        return None
    batch, length = ids.shape
    eps = layer.config.layer_norm_eps
    if batch * length * tables[0].shape[1] >= cpu._PARALLEL_FROM:
        return _infer_parallel(ids, tts, has_tts, past_key_values_length, tables, eps)
    out = np.empty((batch, length, tables[0].shape[1]), np.float32)
    if not _infer(ids, tts, has_tts, past_key_values_length, *tables, eps, out.reshape(batch * length, out.shape[2])):
        return None  # a bad id: the general path raises the reference's error
    return torch.from_numpy(out)
