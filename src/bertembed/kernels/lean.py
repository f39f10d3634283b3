"""The short path for CPU inference: the Python glue between `BertEmbeddings.forward` and the kernel, cut down.

A sentence's kernel work is a few microseconds, so the glue decides its latency; at (32, 128) the general path's glue
(input checks in torch, position and segment tensors, the custom op's argument handling) cost about 0.25 ms of 1.3, half
of what this path's does (docs/cpu-kernels.md), since it runs while the kernel has just flushed the caches.
Same per-token kernel as `cpu.forward` (`cpu._forward_token`), so the same numbers. The differences are all glue:
parameters are read through the module's dicts (no `nn.Module.__getattr__`), numpy views of the tables and their
addresses are cached while their storage stays the same, a sentence's ids reach the kernel as addresses
(`Tensor.numpy()` took 0.6 us a tensor), and one compiled call checks every id before any table row is read. Small
inputs run serially with positions computed in the kernel (all inputs do in a forked child, where numba's pool cannot
run); larger ones run `cpu.forward` on all threads, from one
compiled call that also checks the ids, builds the position and segment ids, asks whether the output's memory is fresh
and sets numba's thread count (`_infer_batch`; the output reaches it as an address too). Anything this
path does not cover (dropout in training mode, autograd, explicit position ids, `inputs_embeds`, a bad id) returns
None, and the general path takes over: it raises the reference layer's errors. A bfloat16 layer takes it too, with all
five tables bfloat16 (as `layer.to(torch.bfloat16)` leaves them) or with a float32 LayerNorm beside bfloat16 tables.

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import carray, njit, types
from numba.extending import overload
from torch.autograd import forward_ad as _forward_ad

from bertembed.embeddings import KERNEL_CACHE, default_ids_untouched
from bertembed.kernels import _cpu_pool, cpu, cpu_run, pages
from bertembed.kernels.cpu_elements import as_float32, borrowed, dropout_threshold, hold, pointer
from bertembed.kernels.submodules import short_path_tables

_NO_DROPOUT, _SCALE, _SEED = dropout_threshold(0.0), 1.0, np.uint64(0)
_HIDDEN, _NORM_BFLOAT16 = 8, 9  # in `_Tables.addresses`: H, and whether the LayerNorm weight and bias are bfloat16


@njit(cache=True)
def _ids_fit(ids, tts, has_tts, past, vocab, segments, positions):
    """Whether every id, segment id (when given) and position past + l lies inside its table."""
    batch, length = ids.shape
    if past > positions - length:  # (not past + length: a past near 2**63 would wrap around)
        return False
    for r in range(batch):
        for c in range(length):
            if not 0 <= ids[r, c] < vocab or has_tts and not 0 <= tts[r, c] < segments:
                return False
    return True


@njit(cache=True, inline="always")
def _views(ids_at, tts_at, batch, length, tables, dtype):
    """(ids, tts [B, L] int64; word, seg, pos of `dtype`: float32, or uint16 for bfloat16) as arrays over the
    addresses `try_infer` passes: ids_at, tts_at of C-contiguous int64 [B, L] (tts_at unread without segment ids);
    tables = `_Tables.addresses`. Building them reads nothing."""
    word_at, seg_at, pos_at, _, _, vocab, segments, positions, hidden, _ = tables
    ids = carray(pointer(ids_at, np.int64), (batch, length))
    tts = carray(pointer(tts_at, np.int64), (batch, length))
    word = carray(pointer(word_at, dtype), (vocab, hidden))
    seg = carray(pointer(seg_at, dtype), (segments, hidden))
    pos = carray(pointer(pos_at, dtype), (positions, hidden))
    return ids, tts, word, seg, pos


@njit(cache=True, inline="always")
def _norm_views(tables, into):
    """The LayerNorm weight and bias as float32 arrays: views of float32 ones, or bfloat16 ones widened into `into`
    (float32, 2H long; unread when the layer's LayerNorm is float32). The kernel reads them in its loop, where
    bfloat16 ones cost a sentence 4 us (8.4 against 4.3 in the compiled call)."""
    gamma_at, beta_at, hidden, narrow = tables[3], tables[4], tables[_HIDDEN], tables[_NORM_BFLOAT16]
    if narrow:
        return (as_float32(carray(pointer(gamma_at, np.uint16), hidden), into[:hidden]),
                as_float32(carray(pointer(beta_at, np.uint16), hidden), into[hidden:]))
    return carray(pointer(gamma_at, np.float32), hidden), carray(pointer(beta_at, np.float32), hidden)


@njit(cache=True, fastmath={"contract"})  # as `cpu._forward_chunk`: the same numbers
def _infer(ids_at, tts_at, has_tts, past, tables, eps, out):
    """out [B, L, H] = LayerNorm((word[ids] + seg[tts]) + pos[past + l]) on this thread; returns False, computing
    nothing, when an id, a segment id or a position lies outside its table. The five tables are of out's dtype:
    float32, or uint16 for bfloat16.

    The ids and tables arrive as addresses (`Tensor.data_ptr()`: a tenth of what `Tensor.numpy()` costs, and an int
    argument unboxes in half an array's time): see `_views`."""
    batch, length, hidden = out.shape
    ids, tts, word, seg, pos = _views(ids_at, tts_at, batch, length, tables, out.dtype)
    if not _ids_fit(ids, tts, has_tts, past, word.shape[0], seg.shape[0], pos.shape[0]):
        return False
    n = batch * length
    # One allocation: the row, the statistics (not kept), and a bfloat16 LayerNorm's weight and bias as float32.
    widened = 2 * hidden if tables[_NORM_BFLOAT16] else 0
    scratch = np.empty(hidden + 2 * n + widened, np.float32)
    end = hidden + 2 * n
    x, mean, rstd = borrowed(scratch[:hidden]), borrowed(scratch[hidden:hidden + n]), borrowed(scratch[hidden + n:end])
    gamma, beta = _norm_views(tables, borrowed(scratch[end:]))
    out = borrowed(out.reshape(batch * length, hidden))
    for r in range(batch):
        for c in range(length):
            s = tts[r, c] if has_tts else 0
            _sentence_token(r * length + c, ids[r, c], s, past + c, word, seg, pos, gamma, beta, eps, x, out, mean,
                            rstd)
    hold(scratch)
    return True


def _sentence_token(i, w, s, q, word, seg, pos, gamma, beta, eps, x, out, mean, rstd):
    """`cpu._forward_token` for `_infer`, without dropout or streaming: with wide vectors for bfloat16 (4.8 -> 4.3 us
    a sentence), LLVM's default for float32. Chosen as it compiles (a branch on the dtype in `_infer` compiled both
    ways for each dtype: seconds more compiling, for code that never ran)."""


@overload(_sentence_token, inline="always")
def _sentence_token_impl(i, w, s, q, word, seg, pos, gamma, beta, eps, x, out, mean, rstd):
    if out.dtype == types.uint16:
        def impl(i, w, s, q, word, seg, pos, gamma, beta, eps, x, out, mean, rstd):
            cpu._forward_token(i, w, s, q, word, seg, pos, True, gamma, beta, eps, _NO_DROPOUT, _SCALE, _SEED, x, out,
                               mean, rstd, True, False)
        return impl

    def impl(i, w, s, q, word, seg, pos, gamma, beta, eps, x, out, mean, rstd):
        cpu._forward_token(i, w, s, q, word, seg, pos, True, gamma, beta, eps, _NO_DROPOUT, _SCALE, _SEED, x, out,
                           mean, rstd, None, False)
    return impl


_FLOAT32, _BFLOAT16 = np.empty(0, np.float32), np.empty(0, np.uint16)  # `_infer_batch`'s `like`


@njit(cache=True)
def _infer_batch(ids_at, tts_at, has_tts, past, batch, length, tables, eps, out_at, like, stream_from, huge, threads):
    """`_infer` for a batch: `cpu.forward` on all threads, into the uninitialised [B*L, H] at `out_at`, its position
    and segment ids built here. The tables and the output are of `like`'s dtype (an empty array: float32, or uint16
    for bfloat16). Returns -1, computing nothing, on a bad id; else how many tokens the kernel skipped (0: any other
    count is a bug). The output is streamed from `stream_from` bytes unless its memory is fresh
    (`cpu_run.stream_output`, which gets 2 MB pages instead where `huge`: `pages.advise_if_fresh_at`); `threads`:
    (torch's thread count, numba's pool size).

    All of it one compiled call from Python: after the previous batch's kernel has left the caches cold, each Python
    step before it costs 6-17 us, against about 1 us in a loop (BENCHMARKS.md, the seventh and eighth rounds)."""
    ids, tts, word, seg, pos = _views(ids_at, tts_at, batch, length, tables, like.dtype)
    hidden = word.shape[1]
    if not _ids_fit(ids, tts, has_tts, past, word.shape[0], seg.shape[0], pos.shape[0]):
        return -1
    n = batch * length
    positions, segments = np.empty(n, np.int64), np.empty(n, np.int64)
    for r in range(batch):
        for c in range(length):
            positions[r * length + c] = past + c
            segments[r * length + c] = tts[r, c] if has_tts else 0
    stats = np.empty((2, n), np.float32)
    gamma, beta = _norm_views(tables, np.empty(2 * hidden if tables[_NORM_BFLOAT16] else 0, np.float32))
    nbytes = n * hidden * like.itemsize
    stream = not pages.advise_if_fresh_at(out_at, nbytes, huge) and nbytes >= stream_from
    chunks = cpu_run.chunks_for(n, cpu_run.use_threads(threads[0], threads[1]))
    out = carray(pointer(out_at, like.dtype), (n, hidden))
    return cpu.forward(ids.reshape(n), segments, positions, word, seg, pos, gamma, beta, eps, _NO_DROPOUT, _SCALE,
                       _SEED, out, stats[0], stats[1], chunks, stream)


class _Tables(NamedTuple):
    """The five CPU tables (word, segment, position, weight, bias) as numpy views (bfloat16 as uint16 bits), and as
    addresses followed by the rows of the first three, the hidden size (V, T, P, H) and 1 for a bfloat16 LayerNorm
    weight and bias (0: float32), for `_infer`. The views hold the tensors' storage, so the addresses stay valid while
    this is held; after them the two default-id buffers, held so that their ids in the cache key stay theirs.
    `dtype`: the word, segment and position tables', float32 or bfloat16; the LayerNorm's is the same, or float32
    beside bfloat16 tables (mixed precision)."""

    arrays: list
    addresses: tuple
    dtype: torch.dtype


_SHORT_DTYPES = (torch.float32, torch.bfloat16)


def _tables(layer, state: dict) -> tuple[_Tables, float] | None:
    """The layer's five CPU tables (all float32, all bfloat16, or bfloat16 with a float32 LayerNorm), cached on the
    layer while their storage and sizes are unchanged, and its LayerNorm's eps; None where the fused kernel may not
    stand in for the submodules (`submodules.short_path_tables`). `state`: the layer's `__dict__`."""
    found = short_path_tables(layer, state)
    if found is None:
        return None
    tensors, eps = found
    word, segment, position, weight, bias = tensors
    # The same storage (the cached views hold the old one, so no address is reused) and extents of the tables whose rows
    # the ids bound (`nbytes` costs 70 ns, `shape` 120). A view at the same address with other sizes reads inside the
    # held storage; the kernel can never read outside it.
    # And the default-id buffers, as they are and their versions (an edit): the kernel computes 0, 1, 2, ... and zeros
    # itself, so edited buffers send the call to the general path (`default_ids_untouched`). (About 150 ns.)
    buffers = state["_buffers"]
    positions, types = buffers["position_ids"], buffers["token_type_ids"]
    try:
        versions = positions._version, types._version
    except RuntimeError:  # inference tensors keep no version counter (`buffer_versions`)
        versions = 0, 0
    key = (word.data_ptr(), segment.data_ptr(), position.data_ptr(), weight.data_ptr(), bias.data_ptr(), word.nbytes,
           segment.nbytes, position.nbytes, id(positions), id(types), versions)
    cached = state.get(KERNEL_CACHE)
    if cached is not None and cached[0] == key:
        return cached[1], eps
    if not default_ids_untouched(layer):
        return None
    hidden, dtype, norm = word.shape[1], word.dtype, weight.dtype
    if dtype not in _SHORT_DTYPES or segment.dtype != dtype or position.dtype != dtype \
            or norm not in (dtype, torch.float32) or bias.dtype != norm \
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors) \
            or segment.shape[1] != hidden or position.shape[1] != hidden or weight.shape != (hidden,) \
            or bias.shape != (hidden,):
        return None  # not cached: a dtype or device change always comes with new storage
    # (the buffers are held too, so no other tensor takes their ids while this is cached)
    rows = (word.shape[0], segment.shape[0], position.shape[0])
    tables = _Tables([*(cpu_run._np(t) for t in tensors), positions, types],
                     (*key[:5], *rows, hidden, int(norm is torch.bfloat16)), dtype)
    state[KERNEL_CACHE] = (key, tables)  # (not pickled or copied: `BertEmbeddings.__getstate__`)
    return tables, eps


def try_infer(layer, input_ids, token_type_ids, position_ids, inputs_embeds, past_key_values_length):
    """The output [B, L, H], or None when these inputs are not for the short path. (A sentence's latency is mostly
    this function: each tensor attribute read costs 60-120 ns, so each is read once.)"""
    state = layer.__dict__  # (each attribute read of an nn.Module costs 50 ns, a dict read 15)
    if position_ids is not None or inputs_embeds is not None \
            or type(input_ids) is not torch.Tensor or type(past_key_values_length) is not int \
            or not 0 <= past_key_values_length < 1 << 31 or torch.is_grad_enabled() or _forward_ad._current_level >= 0:
        return None  # (autograd needs the custom op; forward-mode AD, the reference: `validation.forward_ad_on`)
    try:  # (free in Python 3.11 unless raised)
        shape = input_ids.shape
        if len(shape) != 2 or input_ids.dtype != torch.int64 or not input_ids.is_cpu or not input_ids.is_contiguous():
            return None
        ids_at = input_ids.data_ptr()
        if token_type_ids is None:
            tts_at, has_tts = ids_at, False  # never read
        elif type(token_type_ids) is torch.Tensor and token_type_ids.shape == shape \
                and token_type_ids.dtype == torch.int64 and token_type_ids.is_cpu and token_type_ids.is_contiguous():
            tts_at, has_tts = token_type_ids.data_ptr(), True
        else:
            return None
        found = _tables(layer, state)
    except RuntimeError:  # a tensor with no memory of its own (torch.func's wrapped ones: `vmap`, `grad`) or no
        return None  # strides (sparse CSR, a nested batch's shape): the general path runs, or names the problem
    if found is None:
        return None
    (batch, length), (tables, eps) = shape, found
    hidden = tables.addresses[_HIDDEN]
    bfloat16 = tables.dtype is torch.bfloat16
    # A batch runs on all threads, except in a forked child where numba's pool cannot run (`kernels.lose_cpu_pool`).
    if batch * length * hidden >= cpu_run._PARALLEL_FROM and not _cpu_pool["lost"]:
        out = torch.empty(batch, length, hidden, dtype=tables.dtype)  # torch's allocator: its profiler sees it
        pages.collapse_table(tables.addresses[0], tables.arrays[0].nbytes)  # a batch: rows from all over the table
        bad = _infer_batch(ids_at, tts_at, has_tts, past_key_values_length, batch, length, tables.addresses, eps,
                           out.data_ptr(), _BFLOAT16 if bfloat16 else _FLOAT32, cpu_run._STREAM_OUT_FROM,
                           pages.huge_pages(), (torch.get_num_threads(), cpu_run.POOL))
        if bad < 0:
            return None  # a bad id: the general path raises the reference's error
        cpu_run.check_bad(bad, "bertembed cpu forward (short path)")
        return out
    out = np.empty((batch, length, hidden), np.uint16 if bfloat16 else np.float32)
    if not _infer(ids_at, tts_at, has_tts, past_key_values_length, tables.addresses, eps, out):
        return None  # a bad id: the general path raises the reference's error
    return torch.from_numpy(out).view(torch.bfloat16) if bfloat16 else torch.from_numpy(out)
