"""CPU kernels (numba): BERT's embedding layer in one pass per token, forward and backward.

Forward, per token, in two passes over the row: gather the word row, add the segment row, then the position row (the
reference's order) while accumulating the LayerNorm statistics in float64; then normalise, scale and shift, dropout,
store (float32 mean/rstd are kept). Backward, per token: recompute the sum from the tables (cheaper than keeping it:
no [N, H] tensor is saved), LayerNorm backward, and add the row gradient into the table gradients.

Tables and outputs are float32 or bfloat16. numba has no bfloat16, so bfloat16 arrives as its uint16 bit pattern:
widened to float32 by a shift, rounded back to nearest-even. The bfloat16 sums are rounded after each add, as torch
rounds `word + segment` and then `+ position`, so results follow the reference's order.

Ids are validated before any kernel runs (`bertembed.validation.check_inputs`); the kernels check them again and count
what they skipped, so an out-of-range id can never read outside a table.

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments, C chunks (one per thread).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload


def dropout_threshold(p: float) -> np.uint64:
    """An element is kept when its 24 random bits are >= this; 0 means no dropout."""
    return np.uint64(round(p * (1 << 24)))


@njit(cache=True, inline="always")
def _keep(seed, index, threshold):
    """splitmix64 of (seed, element index): the same mask in forward and backward without storing it."""
    z = seed + np.uint64(index) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)) >= threshold


def _widen(v):
    """A table element as float32 (identity for float32, bit shift for bfloat16 bits)."""


@overload(_widen, inline="always")
def _widen_impl(v):
    if isinstance(v, types.Float):
        return lambda v: v
    return lambda v: np.uint32(np.uint32(v) << 16).view(np.float32)


def _bf16_bits(x):
    """float32 -> bfloat16 bits (uint32 holding 16 bits), round to nearest even, NaN stays NaN."""


@overload(_bf16_bits)
def _bf16_bits_impl(x):
    def impl(x):
        u = np.float32(x).view(np.uint32)
        rounded = np.uint32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        return np.uint32(0x7FC0) if nan else rounded  # a select, not a branch: the loop stays vectorised
    return impl


def _round_like(table, x):
    """Round a float32 sum to the table's precision, as torch rounds each add in the table's dtype."""


@overload(_round_like, inline="always")
def _round_like_impl(table, x):
    if isinstance(table.dtype, types.Float):
        return lambda table, x: x
    return lambda table, x: np.uint32(_bf16_bits(x) << np.uint32(16)).view(np.float32)


def _narrow(out, y):
    """A float32 value as an element of `out` (identity for float32, rounded bits for bfloat16)."""


@overload(_narrow, inline="always")
def _narrow_impl(out, y):
    if isinstance(out.dtype, types.Float):
        return lambda out, y: y
    return lambda out, y: np.uint16(_bf16_bits(y))


@njit(cache=True)
def _ids_ok(w, s, q, v, t, p, has_pos):
    return 0 <= w < v and 0 <= s < t and (not has_pos or 0 <= q < p)


def _pair(word, seg, w, s, j):
    """Element j of word[w] + seg[s] in float32, rounded as the tables' dtype rounds."""


@overload(_pair, inline="always")
def _pair_impl(word, seg, w, s, j):
    return lambda word, seg, w, s, j: _round_like(word, _widen(word[w, j]) + _widen(seg[s, j]))


def _plus_pos(word, v, pos, q, j):
    """v + pos[q, j] in float32, rounded as the tables' dtype rounds."""


@overload(_plus_pos, inline="always")
def _plus_pos_impl(word, v, pos, q, j):
    return lambda word, v, pos, q, j: _round_like(word, v + _widen(pos[q, j]))


def _sum_row(word, seg, pos, w, s, q, has_pos, x):
    """x[:] = (word[w] + seg[s]) + pos[q] in float32, rounded after each add as the tables' dtype rounds; returns x's
    mean and biased variance, accumulated in float64. The sums are of x - x[0] (a shift near the mean), so the variance
    keeps its digits however large the mean."""


# `reassoc` lets the float64 sums vectorise (they lose nothing by it). It would also let LLVM regroup the float32 adds
# of `_pair` and `_plus_pos`, which it does not do: the tests hold the kernels to the reference's roundings. float32
# tables: one pass, the moments taken as x is written. bfloat16: the roundings' integer work leaves LLVM's vectoriser
# out when mixed with the sums, so x is written first (two short loops) and its moments taken from it.
@overload(_sum_row, jit_options={"fastmath": {"reassoc"}})
def _sum_row_impl(word, seg, pos, w, s, q, has_pos, x):
    if isinstance(word.dtype, types.Float):
        def fused(word, seg, pos, w, s, q, has_pos, x):
            first = _pair(word, seg, w, s, 0)
            shift = np.float64(_plus_pos(word, first, pos, q, 0) if has_pos else first)
            total, squares = 0.0, 0.0
            if has_pos:
                for j in range(x.size):
                    x[j] = v = _plus_pos(word, _pair(word, seg, w, s, j), pos, q, j)
                    total, squares = total + (v - shift), squares + (v - shift) ** 2
            else:
                for j in range(x.size):
                    x[j] = v = _pair(word, seg, w, s, j)
                    total, squares = total + (v - shift), squares + (v - shift) ** 2
            return _moments(total, squares, shift, x.size)
        return fused

    def separate(word, seg, pos, w, s, q, has_pos, x):
        for j in range(x.size):
            x[j] = _pair(word, seg, w, s, j)
        if has_pos:
            for j in range(x.size):
                x[j] = _plus_pos(word, x[j], pos, q, j)
        shift = np.float64(x[0])
        total, squares = 0.0, 0.0
        for j in range(x.size):
            total, squares = total + (x[j] - shift), squares + (x[j] - shift) ** 2
        return _moments(total, squares, shift, x.size)
    return separate


@njit(cache=True)
def _moments(total, squares, shift, h):
    """(mean, biased variance) from the sums of x - shift and of its squares over h elements."""
    centre = total / h
    return shift + centre, max(squares / h - centre * centre, 0.0)


@njit(cache=True)
def _forward_token(i, w, s, q, word, seg, pos, has_pos, gamma, beta, eps, threshold, scale, seed, x, out, mean, rstd):
    """Two passes over the row: the sum with its moments, then LayerNorm and dropout into out[i]."""
    h = x.size
    m, var = _sum_row(word, seg, pos, w, s, q, has_pos, x)
    # Statistics accumulate in float64, then round to float32: from there on the same float32 operations in the same
    # order as torch's LayerNorm, ((x - mean) * rstd) * weight + bias.
    m32, r32 = np.float32(m), np.float32(1.0 / np.sqrt(var + eps))
    mean[i], rstd[i] = m32, r32
    if threshold == 0:
        for j in range(h):
            out[i, j] = _narrow(out, (x[j] - m32) * r32 * gamma[j] + beta[j])
        return
    scale32 = np.float32(scale)
    for j in range(h):
        y = (x[j] - m32) * r32 * gamma[j] + beta[j]
        out[i, j] = _narrow(out, y * scale32 if _keep(seed, i * h + j, threshold) else np.float32(0.0))


@njit(cache=True)
def _forward_chunk(lo, hi, ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd):
    """Tokens [lo, hi) with one scratch row; returns how many had bad ids (skipped, nothing read)."""
    has_pos = pos.shape[0] > 0
    x = np.empty(out.shape[1], np.float32)
    bad = 0
    for i in range(lo, hi):
        w, s, q = ids[i], tts[i], pids[i]
        if _ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0], has_pos):
            _forward_token(i, w, s, q, word, seg, pos, has_pos, gamma, beta, eps, threshold, scale, seed, x, out, mean,
                           rstd)
        else:
            bad += 1
    return bad


@njit(parallel=True, cache=True)
def forward(ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd, chunks):
    """out[i] = dropout(LayerNorm((word[ids[i]] + seg[tts[i]]) + pos[pids[i]])); returns how many tokens had bad ids.

    ids, tts, pids: [N] int64. word [V, H], seg [T, H], pos [P, H] (P = 0: no position row), out [N, H]: float32, or
    uint16 bfloat16 bits. gamma, beta: [H] float32. mean, rstd: [N] float32, kept for backward. chunks: >= 1 blocks of
    tokens (a few per thread).
    """
    n = out.shape[0]
    bad = 0
    for c in prange(chunks):
        bad += _forward_chunk(c * n // chunks, (c + 1) * n // chunks, ids, tts, pids, word, seg, pos, gamma, beta, eps,
                              threshold, scale, seed, out, mean, rstd)
    return bad


@njit(cache=True)
def forward_serial(ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd, chunks):
    """`forward` on the calling thread: for a few tokens, starting the thread pool costs more than the work."""
    return _forward_chunk(0, out.shape[0], ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed,
                          out, mean, rstd)


@njit(cache=True, fastmath={"reassoc"})
def _row_backward(word, seg, pos, w, s, q, has_pos, gout, i, m, r, gamma, threshold, scale, seed, dgamma, dbeta, x, dx):
    """LayerNorm (and dropout) backward of token i, float32 with float64 row sums: dx[:] = d loss / d sum.

    The sum is recomputed from the tables (cheaper than keeping it: no [N, H] tensor is saved), and xhat from it as the
    forward did, into x; dgamma, dbeta [H] float32 partials are added into. Each loop writes one or two arrays, few
    enough for LLVM's vectoriser to check them for overlap.
    """
    h = x.size
    if has_pos:  # xhat, from the sum recomputed as the forward computed it (its moments are saved: not taken again)
        for j in range(h):
            x[j] = (_plus_pos(word, _pair(word, seg, w, s, j), pos, q, j) - m) * r
    else:
        for j in range(h):
            x[j] = (_pair(word, seg, w, s, j) - m) * r
    if threshold > 0:
        for j in range(h):
            dx[j] = _widen(gout[i, j]) * scale if _keep(seed, i * h + j, threshold) else np.float32(0.0)
    else:
        for j in range(h):
            dx[j] = _widen(gout[i, j])
    sa, sb = 0.0, 0.0
    for j in range(h):
        dgamma[j] += dx[j] * x[j]
        dbeta[j] += dx[j]
        g = dx[j] * gamma[j]
        dx[j] = g
        sa += g
        sb += g * np.float64(x[j])
    a, b = np.float32(sa / h), np.float32(sb / h)
    for j in range(h):
        dx[j] = r * (dx[j] - a - x[j] * b)


@njit(parallel=True, cache=True)
def backward(order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout, threshold, scale,
             seed, pad, dword, dseg, dpos, dgamma, dbeta):
    """Table and LayerNorm gradients; returns how many tokens had bad ids.

    Chunk c handles tokens order[bounds[c]:bounds[c+1]], sorted by word id with no word id (other than `pad`) split
    between chunks, so each word-gradient row has one writer and a fixed summation order: deterministic. It also owns
    word-gradient rows [rows[c], rows[c+1]) and writes each exactly once, zeros included, in id order: dword [V, H]
    comes uninitialised, and the dense gradient costs one pass of writes, not a memset and then a scatter (shape
    (0, H): not wanted; rows all V: dword comes zeroed, and the kernel only adds). dseg [C, T, H], dpos [C, R, H]
    float32 per-chunk partials (R = 0: not wanted; row k is position pos_lo + k); dgamma, dbeta [C, H] float32
    per-chunk partials.
    """
    bad = 0
    for c in prange(bounds.size - 1):
        bad += _backward_chunk(c, order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout,
                               threshold, scale, seed, pad, dword, dseg, dpos, dgamma, dbeta)
    return bad


@njit(cache=True)
def backward_serial(order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout, threshold,
                    scale, seed, pad, dword, dseg, dpos, dgamma, dbeta):
    """`backward` on the calling thread, for a few tokens."""
    bad = 0
    for c in range(bounds.size - 1):
        bad += _backward_chunk(c, order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout,
                               threshold, scale, seed, pad, dword, dseg, dpos, dgamma, dbeta)
    return bad


@njit(cache=True)
def _backward_chunk(c, order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout, threshold,
                    scale, seed, pad, dword, dseg, dpos, dgamma, dbeta):
    h = gout.shape[1]
    has_pos, want_word = pos.shape[0] > 0, dword.shape[0] > 0
    x, dx = np.empty(h, np.float32), np.empty(h, np.float32)
    zeroed = rows[c]  # rows below this one are written
    bad = 0
    for k in range(bounds[c], bounds[c + 1]):
        i = order[k]
        w, s, q = ids[i], tts[i], pids[i]
        if not _ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0], has_pos):
            bad += 1
            continue
        _row_backward(word, seg, pos, w, s, q, has_pos, gout, i, mean[i], rstd[i], gamma, threshold, np.float32(scale),
                      seed, dgamma[c], dbeta[c], x, dx)
        if want_word and w >= zeroed:  # zero the rows up to this one (a [PAD] row may be the next chunk's)
            top = min(w + 1, rows[c + 1])
            dword[zeroed:top] = 0.0
            zeroed = top
        _add_row(dword, w, dx, w != pad)
        _add_row(dseg[c], s, dx, True)
        _add_row(dpos[c], q - pos_lo, dx, dpos.shape[1] > 0)
    if want_word and rows[c + 1] > zeroed:
        dword[zeroed:rows[c + 1]] = 0.0
    return bad


@njit(cache=True)
def _add_row(grad, row, dx, wanted):
    if wanted and grad.shape[0] > 0:
        for j in range(dx.size):
            grad[row, j] += dx[j]


def chunk_bounds(sorted_ids: np.ndarray, chunks: int, pad: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks of the tokens sorted by id: ([C + 1] token bounds of near-equal sizes, moved so that no id but `pad`
    spans two chunks; [C + 1] word-table row bounds, chunk c owning rows from its first id to the next chunk's)."""
    n = sorted_ids.size
    bounds = np.linspace(0, n, chunks + 1).astype(np.int64)
    for c in range(1, chunks):
        b = bounds[c]
        if 0 < b < n and sorted_ids[b] == sorted_ids[b - 1] and sorted_ids[b] != pad:
            bounds[c] = np.searchsorted(sorted_ids, sorted_ids[b], side="right")
    bounds = np.maximum.accumulate(bounds)
    rows = np.append(sorted_ids, vocab)[bounds].clip(0, vocab)
    rows[0], rows[-1] = 0, vocab
    return bounds, np.maximum.accumulate(rows)


def threads() -> int:
    """Use as many numba threads as torch does (`torch.set_num_threads` governs both)."""
    import torch

    count = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(count)
    return count


# ---- torch glue: tensors in, tensors out ------------------------------------------------------------------------

_PARALLEL_FROM = 1 << 17  # elements (N x H): below this, one thread beats waking the pool (a sentence is ~8k)


def _np(t):
    """A numpy view of a CPU tensor sharing its memory (bfloat16 as uint16 bits)."""
    t = t.detach()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _check_bad(bad: int, where: str) -> None:
    if bad:
        raise RuntimeError(f"{where}: {bad} tokens had ids outside their tables and were skipped; ids must be checked "
                           f"with bertembed.validation.check_inputs before a kernel runs (this is a bug)")


def run_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps: float, p: float, seed: int, out=None):
    """ids, tts, pids: [N] int64; tables [*, H] float32 or bfloat16 (one dtype); pos may be None.

    Returns (out [N, H] in the tables' dtype, mean [N], rstd [N] float32). `out`, if given, is written in place.
    """
    n, h = ids.numel(), word.shape[1]
    out = torch.empty(n, h, dtype=word.dtype) if out is None else out.view(n, h)
    mean, rstd = torch.empty(n), torch.empty(n)
    pos_np = _np(pos) if pos is not None else _np(word[:0])
    chunks = max(1, min(n, 4 * threads()))
    kernel = forward if n * h >= _PARALLEL_FROM else forward_serial
    bad = kernel(_np(ids), _np(tts), _np(pids), _np(word), _np(seg), pos_np, _np(gamma.float()), _np(beta.float()),
                  float(eps), dropout_threshold(p), 1.0 / (1.0 - p), np.uint64(seed), _np(out), _np(mean), _np(rstd),
                  chunks)
    _check_bad(bad, "bertembed cpu forward")
    return out, mean, rstd


def run_backward(grad, ids, tts, pids, word, seg, pos, gamma, mean, rstd, p: float, seed: int, pad: int,
                 need_word: bool = True, need_pos: bool = True):
    """Gradients (dword [V, H] or empty, dseg [T, H], dpos [P, H] or empty, dgamma [H], dbeta [H]) in the tables'
    dtype, from grad [N, H]. Always deterministic: see `backward`."""
    n, h = grad.shape
    chunks = max(1, min(threads(), n)) if n * h >= _PARALLEL_FROM else 1
    ids_np = _np(ids)
    order = np.argsort(ids_np, kind="stable")
    vocab = word.shape[0] if need_word else 0
    bounds, rows = chunk_bounds(ids_np[order], chunks, pad, vocab)
    if chunks == 1 and vocab:  # few tokens: one thread would write all V rows; torch's memset spreads the zeros
        dword, rows = torch.zeros(vocab, h), np.full_like(rows, vocab)  # every row written: the kernel only adds
    else:
        dword = torch.empty(vocab, h)  # the kernel writes every row once, zeros included
    dseg = torch.zeros(chunks, seg.shape[0], h)
    lo, hi = (int(pids.min()), int(pids.max())) if need_pos and pos is not None and n else (0, -1)
    dpos = torch.zeros(chunks, hi - lo + 1, h)
    dgamma, dbeta = torch.zeros(chunks, h), torch.zeros(chunks, h)
    pos_np = _np(pos) if pos is not None else _np(word[:0])
    kernel = backward if chunks > 1 else backward_serial
    bad = kernel(order, bounds, rows, ids_np, _np(tts), _np(pids), lo, _np(word), _np(seg), pos_np,
                   _np(gamma.float()), _np(mean), _np(rstd), _np(grad.contiguous()), dropout_threshold(p),
                   1.0 / (1.0 - p), np.uint64(seed), pad, _np(dword), _np(dseg), _np(dpos), _np(dgamma), _np(dbeta))
    _check_bad(bad, "bertembed cpu backward")
    full_pos = torch.empty(0, h)
    if hi >= lo:
        full_pos = torch.zeros(pos.shape[0], h)
        full_pos[lo:hi + 1] = dpos.sum(0)
    dtype = word.dtype
    return (dword.to(dtype), dseg.sum(0).to(dtype), full_pos.to(dtype), dgamma.double().sum(0).to(gamma.dtype),
            dbeta.double().sum(0).to(gamma.dtype))
