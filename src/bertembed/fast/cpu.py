"""CPU kernels (numba): BERT's embedding layer in one pass per token, forward and backward, with their torch glue.
Design and measurements: docs/cpu-kernels.md. A token with an id outside a table is skipped, counted and reported.

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments, C chunks (one per thread).
"""

from __future__ import annotations

import os

import numba
import numpy as np
import torch
from numba import carray, njit, prange, types
from numba.extending import intrinsic

from bertembed.fast.cpu_ops import (  # noqa: F401  (cpu.round_like, cpu.keep, ... are the kernels' words)
    _stream_float_row,
    add_rounded,
    bfloat16_bits,
    borrowed,
    dropout_scale,
    dropout_threshold,
    hold,
    ids_ok,
    keep,
    prefetch_row,
    round_like,
    store_fence,
    stream_row,
    token_rows,
    wide_vectors,
    widen,
    write_row,
)
from bertembed.validation import RowsOverflowed, skipped_ids_error

# Start numba's thread pool now, keeping torch's thread count: numba's OpenMP layer sets the count torch reads.
_wanted = torch.get_num_threads()
numba.get_num_threads()
if torch.get_num_threads() != _wanted:
    torch.set_num_threads(_wanted)
POOL = numba.config.NUMBA_NUM_THREADS
_forked: list[bool] = []
if numba.threading_layer() == "omp":
    # GNU OpenMP cannot run in a process forked after it started: a forked child runs the serial kernels only.
    os.register_at_fork(after_in_child=lambda: _forked.append(True))

_PARALLEL_FROM = 1 << 17  # elements (N x H): below this, one thread beats waking the pool (a sentence is ~8k)
_STREAM_FROM = 12 << 20  # float32 output bytes from which rows go out by non-temporal stores (docs/memory.md)
_SHIFT_FROM = 64  # the moments are summed around the mean of the row's first this-many entries
_ODD = 1 << 32  # a chunk returns (bad ids) + _ODD x (tokens whose moments are not finite)


# `reassoc` lets the float32 sums vectorise; the tests hold `add_rounded` to the reference's roundings.
@njit(cache=True, fastmath={"reassoc", "contract"})
def _sum_row(word, seg, pos, w, s, q, has_pos, x, wide):
    """x[:] = (word[w] + seg[s]) + pos[q] in float32, rounded after each add as the tables' dtype rounds; returns x's
    mean and biased variance, in one pass around a shift, or two where the shift lies far from the mean."""
    wide_vectors(wide)
    wrow, srow, prow = token_rows(word, seg, pos, w, s, q, has_pos)
    head = min(x.size, _SHIFT_FROM)
    shift = np.float32(0.0)
    if has_pos:  # (a loop per case: a branch inside the loop kept the bfloat16 loops from vectorising)
        for j in range(head):
            shift += add_rounded(add_rounded(widen(wrow[j]), srow, j), prow, j)
    else:
        for j in range(head):
            shift += add_rounded(widen(wrow[j]), srow, j)
    shift = np.float32(shift / head)
    total, squares = np.float32(0.0), np.float32(0.0)
    if has_pos:
        for j in range(x.size):
            x[j] = v = add_rounded(add_rounded(widen(wrow[j]), srow, j), prow, j)
            d = v - shift
            total += d
            squares += d * d
    else:
        for j in range(x.size):
            x[j] = v = add_rounded(widen(wrow[j]), srow, j)
            d = v - shift
            total += d
            squares += d * d
    m = np.float32(total / x.size)
    var = np.float32(squares / x.size - m * m)
    if not m * m <= np.float32(0.25) * var:  # (NaN too)
        return _moments(x, shift, total, wide)
    return np.float32(shift + m), var


@njit(cache=True, fastmath={"reassoc"})
def _moments(x, shift, total, wide):
    """(float32 mean, biased variance) of x, the variance from a second pass around the mean."""
    wide_vectors(wide)
    mean = np.float32(shift + total / x.size)
    squares = np.float32(0.0)
    for j in range(x.size):
        squares += (x[j] - mean) ** 2
    return mean, squares / x.size


@njit(cache=True, inline="always", fastmath={"contract"})
def _forward_token(i, w, s, q, word, seg, pos, has_pos, gamma, beta, eps, threshold, scale, seed, x, out, mean, rstd,
                   wide, stream):
    """The sum with its moments, then LayerNorm (as torch's: ((x - mean) * rstd) * weight + bias, `contract`ed) and
    dropout into x, then x into out[i]; returns whether the moments are not finite (a NaN or inf in the rows, or a
    variance, or a mean's square, past float32's range). Inlined: as a call it passed ten arrays by value per token."""
    h = x.size
    m, var = _sum_row(word, seg, pos, w, s, q, has_pos, x, wide)
    m32, r32 = np.float32(m), np.float32(1.0 / np.sqrt(var + eps))
    mean[i], rstd[i] = m32, r32
    if threshold == 0:
        for j in range(h):
            x[j] = (x[j] - m32) * r32 * gamma[j] + beta[j]
    else:
        for j in range(h):
            y = (x[j] - m32) * r32 * gamma[j] + beta[j]
            x[j] = y * np.float32(scale) if keep(seed, i * h + j, threshold) else np.float32(0.0)
    if stream:
        stream_row(x, out, i)
    else:
        write_row(x, out, i)
    return not (m * m < np.inf and var < np.inf)  # (NaN too; torch's vectorised moments square the mean)


_AHEAD = 2  # the token whose word row is prefetched: this many ahead


@njit(cache=True, fastmath={"contract"})
def _forward_chunk(lo, hi, ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd,
                   wide, stream):
    """Tokens [lo, hi) with one scratch row; returns how many had bad ids (skipped, nothing read), plus _ODD times how
    many had moments that are not finite."""
    has_pos = pos.shape[0] > 0
    scratch = np.empty(out.shape[1], np.float32)
    x = borrowed(scratch)
    word, seg, pos, gamma, beta = borrowed(word), borrowed(seg), borrowed(pos), borrowed(gamma), borrowed(beta)
    out, mean, rstd = borrowed(out), borrowed(mean), borrowed(rstd)
    bad, odd = 0, 0
    for i in range(lo, hi):
        if i + _AHEAD < hi and 0 <= ids[i + _AHEAD] < word.shape[0]:
            prefetch_row(word, ids[i + _AHEAD])
        w, s, q = ids[i], tts[i], pids[i]
        if ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0], has_pos):
            odd += _forward_token(i, w, s, q, word, seg, pos, has_pos, gamma, beta, eps, threshold, scale, seed, x, out,
                                  mean, rstd, wide, stream)
        else:
            bad += 1
    hold(scratch)
    if stream:
        store_fence()
    return bad + odd * _ODD


@njit(parallel=True, cache=True)
def forward(ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd, chunks, stream):
    """out[i] = dropout(LayerNorm((word[ids[i]] + seg[tts[i]]) + pos[pids[i]])); returns how many tokens had bad ids.

    ids, tts, pids: [N] int64. word [V, H], seg [T, H], pos [P, H] (P = 0: no position row), out [N, H]: float32, or
    uint16 bfloat16 bits. gamma, beta: [H] float32. mean, rstd: [N] float32, kept for backward. chunks: >= 1 blocks of
    tokens, a few per thread. stream: float32 rows go out by non-temporal stores. Returns as `_forward_chunk`.
    """
    n = out.shape[0]
    bad = 0
    for c in prange(chunks):
        bad += _forward_chunk(c * n // chunks, (c + 1) * n // chunks, ids, tts, pids, word, seg, pos, gamma, beta, eps,
                              threshold, scale, seed, out, mean, rstd, True, stream)
    return bad


@njit(cache=True, fastmath={"reassoc"})
def _row_backward(word, seg, pos, w, s, q, has_pos, gout, i, m, r, gamma, threshold, scale, seed, dgamma, dbeta, x, dx):
    """LayerNorm (and dropout) backward of token i, in float32: dx[:] = d loss / d sum, with xhat recomputed from the
    tables into x; adds into the dgamma, dbeta [H] float32 partials."""
    wide_vectors(True)
    h = x.size
    wrow, srow, prow = token_rows(word, seg, pos, w, s, q, has_pos)
    if has_pos:
        for j in range(h):
            x[j] = (add_rounded(add_rounded(widen(wrow[j]), srow, j), prow, j) - m) * r
    else:
        for j in range(h):
            x[j] = (add_rounded(widen(wrow[j]), srow, j) - m) * r
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
    """Table and LayerNorm gradients; returns how many tokens had bad ids.

    Chunk c handles tokens order[bounds[c]:bounds[c+1]], sorted by word id with no word id (other than `pad`) split
    between chunks: each word-gradient row has one writer, in a fixed order. dword [V, H] comes zeroed ((0, H): not
    wanted). dseg [C, T, H], dpos [C, R, H] (R = 0: not wanted; row k is position pos_lo + k), dgamma, dbeta [C, H]:
    float32 per-chunk partials.
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
    has_pos, want_word = pos.shape[0] > 0, dword.shape[0] > 0
    scratch = np.empty((2, h), np.float32)
    x, dx = borrowed(scratch[0]), borrowed(scratch[1])
    word, seg, pos, gamma, gout = borrowed(word), borrowed(seg), borrowed(pos), borrowed(gamma), borrowed(gout)
    dword, dgamma, dbeta = borrowed(dword), borrowed(dgamma[c]), borrowed(dbeta[c])
    dseg, dpos = borrowed(dseg[c]), borrowed(dpos[c])
    bad = 0
    for k in range(bounds[c], bounds[c + 1]):
        i = order[k]
        w, s, q = ids[i], tts[i], pids[i]
        if not ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0], has_pos):
            bad += 1
            continue
        _row_backward(word, seg, pos, w, s, q, has_pos, gout, i, mean[i], rstd[i], gamma, threshold, np.float32(scale),
                      seed, dgamma, dbeta, x, dx)
        _add_row(dword, w, dx, want_word and w != pad)  # (the [PAD] row keeps a zero gradient)
        _add_row(dseg, s, dx, True)
        _add_row(dpos, q - pos_lo, dx, True)  # (no-op for a [0, H] dpos: positions not wanted)
    hold(scratch)
    return bad


@njit(cache=True)
def _add_row(grad, row, dx, wanted):
    wide_vectors(True)
    if wanted and grad.shape[0] > 0:
        for j in range(dx.size):
            grad[row, j] += dx[j]


_NUMPY = {torch.float32: np.dtype(np.float32), torch.bfloat16: np.dtype(np.uint16), torch.int64: np.dtype(np.int64)}


class _Memory:
    """A CPU tensor's memory under numpy's array interface (bfloat16 as uint16 bits), holding the tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        dtype, self.tensor = _NUMPY[t.dtype], t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape), "version": 3,
                                    "strides": tuple(s * dtype.itemsize for s in t.stride()), "typestr": dtype.str}


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor sharing its memory (bfloat16 as uint16 bits). Not by `Tensor.numpy()`, which marks
    the storage as never resizable: FSDP2 frees the tables it gathers by resizing their storage to nothing."""
    return np.asarray(_Memory(t)) if t.numel() else np.zeros(t.shape, _NUMPY[t.dtype])


def _threads() -> int:
    """numba's thread count, set to torch's (`torch.set_num_threads` governs both); 1 in a forked child."""
    if _forked:
        return 1
    count = max(1, min(torch.get_num_threads(), POOL))
    numba.set_num_threads(count)
    return count


@intrinsic
def _pointer(typingctx, address, dtype):
    """The integer `address` as a pointer to `dtype` elements (a numpy scalar type or an array's `.dtype`), for
    `numba.carray` over a `Tensor.data_ptr()` (cheaper than `Tensor.numpy()`). Valid while the caller holds it."""
    if not isinstance(address, types.Integer) or not isinstance(dtype, (types.NumberClass, types.DType)):
        return None
    target = types.CPointer(dtype.instance_type if isinstance(dtype, types.NumberClass) else dtype.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(target))

    return target(address, dtype), codegen


@njit(cache=True)
def _forward_at(at, sizes, like, eps, threshold, scale, seed, chunks, stream):
    """`forward` (chunks > 0) or its chunk on this thread, with LLVM's own vector width (chunks 0: a few tokens), over
    the tensors at the addresses `at` (ids, segment ids, position ids: [N] int64; word, segment, position tables and
    out: `like`'s dtype; weight, bias: float32 [H]; mean, rstd: float32 [N], or 0 and 0 where not kept), of sizes
    (N, H, V, T, P)."""
    n, h, v, t, p = sizes
    ids, tts, pids = (carray(_pointer(at[0], np.int64), n), carray(_pointer(at[1], np.int64), n),
                      carray(_pointer(at[2], np.int64), n))
    word = carray(_pointer(at[3], like.dtype), (v, h))
    seg = carray(_pointer(at[4], like.dtype), (t, h))
    pos = carray(_pointer(at[5], like.dtype), (p, h))
    gamma, beta = carray(_pointer(at[6], np.float32), h), carray(_pointer(at[7], np.float32), h)
    out = carray(_pointer(at[8], like.dtype), (n, h))
    if at[9] == 0:
        stats = np.empty((2, n), np.float32)
        mean, rstd = stats[0], stats[1]
    else:
        mean, rstd = carray(_pointer(at[9], np.float32), n), carray(_pointer(at[10], np.float32), n)
    if chunks > 0:
        return forward(ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd,
                       chunks, stream)
    return _forward_chunk(0, n, ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean,
                          rstd, False, False)


_LIKE = {torch.float32: np.empty(0, np.float32), torch.bfloat16: np.empty(0, np.uint16)}
_NO_DROPOUT = (dropout_threshold(0.0), dropout_scale(0.0), np.uint64(0))  # (threshold, scale, seed)


def run_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps: float, p: float, seed: int, out=None,
                stats: bool = True, shape=None, strict: bool = False):
    """ids, tts, pids: contiguous int64, N of each; tables [*, H] float32 or bfloat16 (one dtype), contiguous; pos may
    be None. Returns (out [N, H] (or of `shape`; or the N x H buffer `out` given), mean [N], rstd [N] float32, or
    None and None with `stats=False`). `strict`: RowsOverflowed where a token's moments are not finite."""
    n, h = ids.numel(), word.shape[1]
    out = torch.empty(shape or (n, h), dtype=word.dtype) if out is None else out
    mean, rstd = (torch.empty(n), torch.empty(n)) if stats else (None, None)
    gamma, beta = gamma.float(), beta.float()  # (held until the kernel returns: it reads them by address)
    at = (ids.data_ptr(), tts.data_ptr(), pids.data_ptr(), word.data_ptr(), seg.data_ptr(),
          (word if pos is None else pos).data_ptr(), gamma.data_ptr(), beta.data_ptr(), out.data_ptr(),
          *((mean.data_ptr(), rstd.data_ptr()) if stats else (0, 0)))
    sizes = (n, h, word.shape[0], seg.shape[0], 0 if pos is None else pos.shape[0])
    chunks = max(1, min(n, 4 * _threads())) if n * h >= _PARALLEL_FROM and not _forked else 0
    dropout = (dropout_threshold(p), dropout_scale(p), np.uint64(seed)) if p else _NO_DROPOUT
    found = _forward_at(at, sizes, _LIKE[word.dtype], float(eps), *dropout, chunks,
                        chunks > 0 and out.nbytes >= _STREAM_FROM)
    bad, odd = found % _ODD, found // _ODD
    if bad:
        raise skipped_ids_error(bad, "bertembed cpu forward")
    if odd and strict:
        raise RowsOverflowed(odd)
    return out, mean, rstd


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
                 need_word: bool = True, need_pos: bool = True):
    """Gradients (dword [V, H] or empty, dseg [T, H], dpos [P, H] or empty, dgamma [H], dbeta [H]) in the tables'
    dtypes, from grad [N, H]. Deterministic: see `backward`. One chunk (a small batch, a forked child) runs on this
    thread alone, with no torch op on [N, H] or [V, H] but a bfloat16 table's casts."""
    n, h = grad.shape
    ids, tts, pids = ids.reshape(-1), tts.reshape(-1), pids.reshape(-1)
    chunks = max(1, min(_threads(), n)) if n * h >= _PARALLEL_FROM and not _forked else 1
    ids_np, pids_np = _np(ids), _np(pids)
    order = np.argsort(ids_np, kind="stable")
    bounds = chunk_bounds(ids_np[order], chunks, pad)
    dword = _zeros(word.shape[0] if need_word else 0, h)  # (only the rows of the batch's ids are touched)
    want_pos = need_pos and pos is not None
    lo, hi = (int(pids_np.min()), int(pids_np.max())) if want_pos and n else (0, -1)
    if chunks == 1 and hi >= lo:  # one writer: the kernel adds straight into the whole position gradient
        lo, hi = 0, pos.shape[0] - 1
    dseg, dpos, dgamma, dbeta = _zeros(chunks, seg.shape[0], h), _zeros(chunks, hi - lo + 1, h), _zeros(chunks, h), \
        _zeros(chunks, h)
    args = (order, bounds, ids_np, _np(tts), pids_np, lo, _np(word), _np(seg), _np(word[:0] if pos is None else pos),
            _np(gamma.float()), _np(mean), _np(rstd), np.ascontiguousarray(_np(grad)), dropout_threshold(p),
            dropout_scale(p), np.uint64(seed), pad, _np(dword), _np(dseg), _np(dpos), _np(dgamma), _np(dbeta))
    bad = backward(*args) if chunks > 1 else _backward_chunk(0, *args)  # (one chunk: on this thread)
    if bad:
        raise skipped_ids_error(bad, "bertembed cpu backward")
    if chunks == 1:  # one chunk's partials are the sums
        dseg, dgamma, dbeta = dseg[0], dgamma[0], dbeta[0]
        full_pos = dpos[0] if hi >= lo else _zeros(pos.shape[0] if want_pos else 0, h)
    else:
        dseg, dgamma, dbeta = dseg.sum(0), dgamma.double().sum(0), dbeta.double().sum(0)
        full_pos = _zeros(pos.shape[0] if want_pos else 0, h)
        if hi >= lo:
            full_pos[lo:hi + 1] = dpos.sum(0)
    dtype = word.dtype
    return dword.to(dtype), dseg.to(dtype), full_pos.to(dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)
