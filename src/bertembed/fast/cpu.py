"""CPU kernels (numba): BERT's embedding layer in one pass per token, forward and backward, with their torch glue.
Design and measurements: docs/cpu-kernels.md. A token with an id outside a table is skipped, counted and reported.
bfloat16 tables and outputs are their uint16 bits, handled by `overload`s resolved per dtype.

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments, C chunks (one per thread).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from bertembed.fast.function import STARTED_IN
from bertembed.validation import RowsOverflowed, skipped_ids_error

_PARALLEL_FROM = 1 << 17  # elements (N x H): below this, one thread beats waking the pool (a sentence is ~8k)
_SHIFT_FROM = 64  # the moments are summed around the mean of the row's first this-many entries
_ODD = 1 << 32  # a chunk returns (bad ids) + _ODD x (tokens whose moments are not finite)


def _dropout(p: float) -> tuple[np.uint64, float]:
    """(threshold: an element is kept when its 24 random bits are >= it, 0: no dropout, 2**24 (p == 1): none kept;
    scale: what a kept element is multiplied by, 1 / (1 - p))."""
    return np.uint64(round(p * (1 << 24))), 1.0 / (1.0 - p) if p < 1.0 else 0.0


@njit(cache=True, inline="always")
def keep(seed, index, threshold):
    """splitmix64 of (seed, element index): the same mask in forward and backward without storing it."""
    z = seed + np.uint64(index) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)) >= threshold


def widen(v):
    """A table element as float32 (identity for float32, bit shift for bfloat16 bits)."""


@overload(widen, inline="always")
def _widen_impl(v):
    if isinstance(v, types.Float):
        return lambda v: v
    return lambda v: np.uint32(np.uint32(v) << 16).view(np.float32)


def round_like(table, x):
    """Round a float32 sum of two of the table's values to the table's precision, as torch rounds each add (bfloat16:
    to nearest-even, kept as float32; no NaN test needed, docs/cpu-kernels.md)."""


@overload(round_like, inline="always")
def _round_like_impl(table, x):
    if isinstance(table.dtype, types.Float):
        return lambda table, x: x

    def impl(table, x):
        u = np.float32(x).view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return np.uint32(u).view(np.float32)
    return impl


@njit(cache=True, inline="always")
def bfloat16_bits(x):
    """float32 x as bfloat16 bits, to nearest-even as torch rounds; any NaN becomes torch's NaN, 0x7FC0."""
    u = np.float32(x).view(np.uint32)
    if u & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def write_row(y, out, i):
    """out[i, :] = y (float32 [H]) for a float32 or bfloat16 (uint16) `out`."""


@overload(write_row, inline="always")
def _write_row_impl(y, out, i):
    if out.dtype == types.float32:
        def impl(y, out, i):
            for j in range(y.size):  # (not `out[i] = y`: its shape-mismatch message is slow to compile)
                out[i, j] = y[j]
        return impl

    def impl(y, out, i):
        for j in range(y.size):
            out[i, j] = bfloat16_bits(y[j])
    return impl


@njit(cache=True, inline="always")
def _ids_ok(w, s, q, v, t, p):
    return 0 <= w < v and 0 <= s < t and 0 <= q < p


@njit(cache=True, inline="always")
def _add_rounded(v, row, j):
    """v + row[j] in float32, rounded as the row's dtype rounds (bfloat16 tables: each add, as torch rounds)."""
    return round_like(row, v + widen(row[j]))


# `reassoc` lets the float32 sums vectorise; the tests hold `_add_rounded` to the reference's roundings.
@njit(cache=True, fastmath={"reassoc", "contract"})
def _sum_row(word, seg, pos, w, s, q, x):
    """x[:] = (word[w] + seg[s]) + pos[q] in float32, rounded after each add as the tables' dtype rounds; returns x's
    mean and biased variance, in one pass around a shift, or two where the shift lies far from the mean."""
    wrow, srow, prow = word[w], seg[s], pos[q]  # (1-D rows vectorise where 2-D indexing does not)
    head = min(x.size, _SHIFT_FROM)
    shift = np.float32(0.0)
    for j in range(head):
        shift += _add_rounded(_add_rounded(widen(wrow[j]), srow, j), prow, j)
    shift = np.float32(shift / head)
    total, squares = np.float32(0.0), np.float32(0.0)
    for j in range(x.size):
        x[j] = v = _add_rounded(_add_rounded(widen(wrow[j]), srow, j), prow, j)
        d = v - shift
        total += d
        squares += d * d
    m = np.float32(total / x.size)
    var = np.float32(squares / x.size - m * m)
    if not m * m <= np.float32(0.25) * var:  # (NaN too)
        return _moments(x, shift, total)
    return np.float32(shift + m), var


@njit(cache=True, fastmath={"reassoc"})
def _moments(x, shift, total):
    """(float32 mean, biased variance) of x, the variance from a second pass around the mean."""
    mean = np.float32(shift + total / x.size)
    squares = np.float32(0.0)
    for j in range(x.size):
        squares += (x[j] - mean) ** 2
    return mean, squares / x.size


@njit(cache=True, fastmath={"contract"})
def _forward_chunk(lo, hi, ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd):
    """Tokens [lo, hi) with one scratch row x: the sum with its moments, then LayerNorm (as torch's: ((x - mean) *
    rstd) * weight + bias, `contract`ed) and dropout into x, then x into out[i]. Returns how many had bad ids (skipped,
    nothing read), plus _ODD times how many had moments that are not finite (a NaN or inf in the rows, or a variance,
    or a mean's square, past float32's range)."""
    h = out.shape[1]
    x = np.empty(h, np.float32)
    bad, odd = 0, 0
    for i in range(lo, hi):
        w, s, q = ids[i], tts[i], pids[i]
        if not _ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0]):
            bad += 1
            continue
        m, var = _sum_row(word, seg, pos, w, s, q, x)
        m32, r32 = np.float32(m), np.float32(1.0 / np.sqrt(var + eps))
        mean[i], rstd[i] = m32, r32
        if threshold == 0:
            for j in range(h):
                x[j] = (x[j] - m32) * r32 * gamma[j] + beta[j]
        else:
            for j in range(h):
                y = (x[j] - m32) * r32 * gamma[j] + beta[j]
                x[j] = y * np.float32(scale) if keep(seed, i * h + j, threshold) else np.float32(0.0)
        write_row(x, out, i)
        odd += not (m * m < np.inf and var < np.inf)  # (NaN too; torch's vectorised moments square the mean)
    return bad + odd * _ODD


@njit(parallel=True, cache=True)
def forward(ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd, chunks):
    """out[i] = dropout(LayerNorm((word[ids[i]] + seg[tts[i]]) + pos[pids[i]])), returned as `_forward_chunk`'s. ids,
    tts, pids: [N] int64. word [V, H], seg [T, H], pos [P, H], out [N, H]: float32, or uint16 bfloat16 bits. gamma,
    beta: [H] float32. mean, rstd: [N] float32, kept for backward. chunks: >= 1 blocks of tokens, a few per thread."""
    n = out.shape[0]
    bad = 0
    for c in prange(chunks):
        bad += _forward_chunk(c * n // chunks, (c + 1) * n // chunks, ids, tts, pids, word, seg, pos, gamma, beta, eps,
                              threshold, scale, seed, out, mean, rstd)
    return bad


@njit(cache=True, fastmath={"reassoc"})
def _row_backward(word, seg, pos, w, s, q, gout, i, m, r, gamma, threshold, scale, seed, dgamma, dbeta, x, dx):
    """LayerNorm (and dropout) backward of token i, in float32: dx[:] = d loss / d sum, with xhat recomputed from the
    tables into x; adds into the dgamma, dbeta [H] float32 partials."""
    h = x.size
    wrow, srow, prow = word[w], seg[s], pos[q]
    for j in range(h):
        x[j] = (_add_rounded(_add_rounded(widen(wrow[j]), srow, j), prow, j) - m) * r
    if threshold > 0:
        for j in range(h):
            dx[j] = widen(gout[i, j]) * scale if keep(seed, i * h + j, threshold) else np.float32(0.0)
    else:
        for j in range(h):
            dx[j] = widen(gout[i, j])
    sa, sb = np.float32(0.0), np.float32(0.0)
    for j in range(h):
        dgamma[j] += dx[j] * x[j]
        dbeta[j] += dx[j]
        g = dx[j] * gamma[j]
        dx[j] = g
        sa += g
        sb += g * x[j]
    a, b = np.float32(sa / h), np.float32(sb / h)
    for j in range(h):
        dx[j] = r * (dx[j] - a - x[j] * b)


@njit(parallel=True, cache=True)
def backward(order, bounds, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout, threshold, scale, seed,
             pad, dword, dseg, dpos, dgamma, dbeta):
    """Table and LayerNorm gradients; returns how many tokens had bad ids. Chunk c handles tokens
    order[bounds[c]:bounds[c+1]], sorted by word id with no word id (other than `pad`) split between chunks: each
    word-gradient row has one writer, in a fixed order. dword [V, H] comes zeroed ((0, H): not wanted). dseg [C, T, H],
    dpos [C, R, H] (R = 0: not wanted; row k is position pos_lo + k), dgamma, dbeta [C, H]: float32 per-chunk partials.
    """
    bad = 0
    for c in prange(bounds.size - 1):
        bad += _backward_chunk(np.int64(c), order, bounds, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd,
                               gout, threshold, scale, seed, pad, dword, dseg, dpos, dgamma, dbeta)
    return bad


@njit(cache=True)
def _backward_chunk(c, order, bounds, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout, threshold, scale,
                    seed, pad, dword, dseg, dpos, dgamma, dbeta):
    h = gout.shape[1]
    want_word = dword.shape[0] > 0
    x, dx = np.empty(h, np.float32), np.empty(h, np.float32)
    dgamma, dbeta, dseg, dpos = dgamma[c], dbeta[c], dseg[c], dpos[c]
    bad = 0
    for k in range(bounds[c], bounds[c + 1]):
        i = order[k]
        w, s, q = ids[i], tts[i], pids[i]
        if not _ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0]):
            bad += 1
            continue
        _row_backward(word, seg, pos, w, s, q, gout, i, mean[i], rstd[i], gamma, threshold, np.float32(scale),
                      seed, dgamma, dbeta, x, dx)
        _add_row(dword, w, dx, want_word and w != pad)  # (the [PAD] row keeps a zero gradient)
        _add_row(dseg, s, dx, True)
        _add_row(dpos, q - pos_lo, dx, True)  # (no-op for a [0, H] dpos: positions not wanted)
    return bad


@njit(cache=True)
def _add_row(grad, row, dx, wanted):
    if wanted and grad.shape[0] > 0:
        for j in range(dx.size):
            grad[row, j] += dx[j]


_TYPESTR = {torch.float32: "<f4", torch.bfloat16: "<u2", torch.int64: "<i8"}  # (bfloat16 as uint16 bits)
_NUMPY = {dtype: np.dtype(typestr) for dtype, typestr in _TYPESTR.items()}


def _memory(t: torch.Tensor, hold: bool = True, shape=None) -> SimpleNamespace:
    """A contiguous CPU tensor's memory under numpy's array interface, holding `tensor` (or not: a parameter's view)."""
    return SimpleNamespace(tensor=t if hold else None, __array_interface__={
        "data": (t.data_ptr(), False), "shape": shape or t.shape, "typestr": _TYPESTR[t.dtype], "version": 3})


_views: dict[tuple, np.ndarray] = {}  # a contiguous parameter's (address, shape, dtype) -> a view of that memory


def _np(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """A numpy view of a CPU tensor (made contiguous) sharing its memory (bfloat16 as uint16 bits). Not by
    `Tensor.numpy()`, which marks the storage as never resizable: FSDP2 frees the tables it gathers by resizing their
    storage to nothing. `shape`: another shape of the same elements. A parameter's view is kept by its memory's
    address, shape and dtype, which are all it reads (making one costs a sentence's forward more than its kernel),
    and holds no reference to the parameter: `torch.utils.swap_tensors` (`.to()` in torch's swap mode) refuses one."""
    key = (t.data_ptr(), t.shape, t.dtype) if type(t) is torch.nn.Parameter and t.is_contiguous() else None
    if (kept := _views.get(key)) is not None:
        return kept
    t = t.contiguous()
    if not t.numel():
        return np.zeros(shape or t.shape, _NUMPY[t.dtype])
    if key is None:
        return np.asarray(_memory(t, shape=shape))
    if len(_views) > 256:  # (parameters that were freed)
        _views.clear()
    _views[key] = view = np.asarray(_memory(t, hold=False))
    return view


def _threads(elements: int) -> int:
    """How many threads a kernel on `elements` (N x H) runs on: 1 below _PARALLEL_FROM, or in a child forked from the
    process that named the backend (`function.STARTED_IN`: GNU OpenMP ends or hangs a child forked after numba's pool
    or torch's ran, "fork() called from a process already using GNU OpenMP"), else torch's count
    (`torch.set_num_threads` governs both)."""
    if elements < _PARALLEL_FROM or os.getpid() != STARTED_IN:
        return 1
    wanted = torch.get_num_threads()
    count = max(1, min(wanted, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(count)  # (starts the pool on first use, which sets the OpenMP count torch reads)
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return count


def run_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps: float, p: float, seed: int, out=None,
                stats: bool = True, shape=None, strict: bool = False):
    """ids, tts, pids: contiguous int64, N of each; tables [*, H] float32 or bfloat16 (one dtype).
    Returns (out [N, H] (or of `shape`; or the N x H buffer `out` given), mean [N], rstd [N] float32, or None and None
    with `stats=False`). `strict`: RowsOverflowed where a token's moments are not finite."""
    n, h = ids.numel(), word.shape[1]
    out = torch.empty(shape or (n, h), dtype=word.dtype) if out is None else out
    # numpy owns the statistics' memory: cheaper than a view of a tensor torch made (not so the output, whose storage
    # a user may resize; `torch.from_numpy`'s cannot be)
    mean, rstd = np.empty(n, np.float32), np.empty(n, np.float32)
    threads = _threads(n * h)
    args = (_np(ids, (n,)), _np(tts, (n,)), _np(pids, (n,)), _np(word), _np(seg), _np(pos), _np(gamma.float()),
            _np(beta.float()), float(eps), *_dropout(p), np.uint64(seed), _np(out, (n, h)), mean, rstd)
    if threads > 1:
        found = forward(*args, max(1, min(n, 4 * threads)))  # (four chunks a thread: a late thread holds up less)
    else:
        found = _forward_chunk(0, n, *args)
    if found % _ODD:
        raise skipped_ids_error(found % _ODD, "bertembed cpu forward")
    if found // _ODD and strict:
        raise RowsOverflowed(found // _ODD)
    return (out, torch.from_numpy(mean), torch.from_numpy(rstd)) if stats else (out, None, None)


def chunk_bounds(sorted_ids: np.ndarray, chunks: int, pad: int) -> np.ndarray:
    """[C + 1] bounds of chunks of the tokens sorted by id, of near-equal sizes, moved so that no id but `pad` spans
    two chunks."""
    n = sorted_ids.size
    if chunks == 1:
        return np.array([0, n], np.int64)
    bounds = np.linspace(0, n, chunks + 1).astype(np.int64)
    for c in range(1, chunks):
        b = bounds[c]
        if 0 < b < n and sorted_ids[b] == sorted_ids[b - 1] and sorted_ids[b] != pad:
            bounds[c] = np.searchsorted(sorted_ids, sorted_ids[b], side="right")
    return np.maximum.accumulate(bounds)


def _zeros(*shape: int) -> torch.Tensor:
    """float32 zeros by numpy's calloc: fresh pages need no writing, and torch's thread pool does not run (in a child
    forked after that pool ran, it never returns)."""
    return torch.from_numpy(np.zeros(shape, np.float32))


def run_backward(grad, ids, tts, pids, word, seg, pos, gamma, mean, rstd, p: float, seed: int, pad: int,
                 need_word: bool = True, need_pos: bool = True, deterministic: bool = True):
    """Gradients (dword [V, H] or empty, dseg [T, H], dpos [P, H] or empty, dgamma [H], dbeta [H]) in the tables'
    dtypes, from grad [N, H]; always deterministic (`backward`; `deterministic` is for the Triton backward). One chunk
    (a small batch, a forked child) runs on this thread alone, with no torch op on [N, H] or [V, H] but a bfloat16
    table's casts."""
    n, h = grad.shape
    ids, tts, pids = ids.reshape(-1), tts.reshape(-1), pids.reshape(-1)
    chunks = max(1, min(_threads(n * h), n))
    ids_np, pids_np = _np(ids), _np(pids)
    order = np.argsort(ids_np, kind="stable")
    bounds = chunk_bounds(ids_np[order], chunks, pad)
    dword = _zeros(word.shape[0] if need_word else 0, h)  # (only the rows of the batch's ids are touched)
    lo, hi = (int(pids_np.min()), int(pids_np.max())) if need_pos and n else (0, -1)
    if chunks == 1 and hi >= lo:  # one writer: the kernel adds straight into the whole position gradient
        lo, hi = 0, pos.shape[0] - 1
    dseg, dpos, dgamma, dbeta = _zeros(chunks, seg.shape[0], h), _zeros(chunks, hi - lo + 1, h), _zeros(chunks, h), \
        _zeros(chunks, h)
    args = (order, bounds, ids_np, _np(tts), pids_np, lo, _np(word), _np(seg), _np(pos), _np(gamma.float()),
            _np(mean), _np(rstd), _np(grad), *_dropout(p), np.uint64(seed), pad, _np(dword), _np(dseg), _np(dpos),
            _np(dgamma), _np(dbeta))
    bad = backward(*args) if chunks > 1 else _backward_chunk(0, *args)  # (one chunk: on this thread)
    if bad:
        raise skipped_ids_error(bad, "bertembed cpu backward")
    if chunks == 1:  # one chunk's partials are the sums
        dseg, dgamma, dbeta = dseg[0], dgamma[0], dbeta[0]
        full_pos = dpos[0] if hi >= lo else _zeros(pos.shape[0] if need_pos else 0, h)
    else:
        dseg, dgamma, dbeta = dseg.sum(0), dgamma.double().sum(0), dbeta.double().sum(0)
        full_pos = _zeros(pos.shape[0] if need_pos else 0, h)
        if hi >= lo:
            full_pos[lo:hi + 1] = dpos.sum(0)
    dtype = word.dtype
    return dword.to(dtype), dseg.to(dtype), full_pos.to(dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)
