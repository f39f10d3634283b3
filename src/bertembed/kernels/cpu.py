"""CPU kernels (numba): BERT's embedding layer in one pass per token, forward and backward.

Forward, per token, in two passes over the row: gather the word row, add the segment row, then the position row (the
reference's order) while accumulating the LayerNorm statistics; then normalise, scale and shift, dropout, store
(float32 mean/rstd are kept; a large float32 output is streamed out, see `cpu_run.stream_output`). Backward, per
token: recompute the sum from the tables (cheaper than keeping it: no [N, H] tensor is saved), LayerNorm backward, and
add the row gradient into the table gradients.

Tables and outputs are float32 or bfloat16 (as uint16 bits: `bertembed.kernels.cpu_elements`). The bfloat16 sums are
rounded after each add, as torch rounds `word + segment` and then `+ position`, so results follow the reference's order.

Ids are validated before any kernel runs (`bertembed.validation.check_inputs`); the kernels check them again and count
what they skipped, so an out-of-range id can never read outside a table. Tensors come in and go out through
`bertembed.kernels.cpu_run`, which allocates the outputs and gradients and hands numpy views to these kernels.

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments, C chunks (one per thread).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bertembed.kernels.cpu_elements import (
    add_rounded,
    borrowed,
    hold,
    ids_ok,
    keep,
    token_rows,
    wide_vectors,
    widen,
)
from bertembed.kernels.cpu_rows import (
    finished_in_rows,
    prefetch_row,
    prefetch_row_for_write,
    store_fence,
    stream_zeros,
    write_row,
)

# The mean of the row's first entries, this many, is the shift the moments are summed around: within a fraction of a
# spread of the row's mean, so the one-pass variance loses no digits (on all-MiniLM-L6-v2's rows the shifted mean's
# square is at most 0.19 of the variance, and no row needs the second pass). One pass instead of two: forward (32,
# 128) 1.11x, (64, 512) 1.13x (BENCHMARKS.md, the eighth round).
_SHIFT_FROM = 64


# `reassoc` lets the float32 sums vectorise (many partial sums, each short). It would also let LLVM regroup the adds
# of `add_rounded`, which it does not do: the tests hold the kernels to the reference's roundings. `contract`: the
# squares are summed by fused multiply-adds.
@njit(cache=True, fastmath={"reassoc", "contract"})
def _sum_row(word, seg, pos, w, s, q, has_pos, x, wide):
    """x[:] = (word[w] + seg[s]) + pos[q] in float32, rounded after each add as the tables' dtype rounds; returns x's
    mean and biased variance, from float32 sums of d = x - shift and d^2 in the same pass, around a shift that is the
    mean of the row's first entries. Where the shift lies far from the mean (mean(d)^2 over a quarter of the variance:
    the squares would then cancel), the variance comes from a second pass around the mean instead. As close to the
    float64 result as torch's LayerNorm is."""
    wide_vectors(wide)
    wrow, srow, prow = token_rows(word, seg, pos, w, s, q, has_pos)
    head = min(x.size, _SHIFT_FROM)
    shift = np.float32(0.0)
    if has_pos:
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
    """(float32 mean, biased variance) of x, given the sum of x - shift: the variance from a second pass around the
    mean (x is in L1 by then), so nothing cancels, wherever the row's entries lie. For rows whose first entries are
    far from their mean, which `_sum_row`'s one pass would lose digits on."""
    wide_vectors(wide)
    mean = np.float32(shift + total / x.size)
    squares = np.float32(0.0)
    for j in range(x.size):
        squares += (x[j] - mean) ** 2
    return mean, squares / x.size


@njit(cache=True, inline="always")
def _forward_token(i, w, s, q, word, seg, pos, has_pos, gamma, beta, eps, threshold, scale, seed, x, out, mean, rstd,
                   wide, stream):
    """Two passes over the row: the sum with its moments, then LayerNorm and dropout into out[i]. Inlined: as a call
    it passed ten arrays by value (600 bytes) per token. `wide`: True for 512-bit vectors (many tokens a thread),
    None for LLVM's default (one sentence): see `wide_vectors`. `stream`: the row is finished in x, then written out by
    non-temporal stores (`write_row`: for outputs too large to stay in cache). bfloat16 rows are always finished in x
    and rounded a line at a time by `write_row` (`finished_in_rows`)."""
    h = x.size
    m, var = _sum_row(word, seg, pos, w, s, q, has_pos, x, wide)
    # The statistics round to float32: from there on the same float32 operations in the same order as torch's
    # LayerNorm, ((x - mean) * rstd) * weight + bias, the last two fused where the caller allows (`_forward_chunk`).
    m32, r32 = np.float32(m), np.float32(1.0 / np.sqrt(var + eps))
    mean[i], rstd[i] = m32, r32
    if stream or finished_in_rows(out):
        for j in range(h):
            x[j] = _dropped(_normed(x, j, m32, r32, gamma, beta), seed, i * h + j, threshold, scale)
        write_row(x, out, i, stream)
    elif threshold == 0:  # a float32 out from here on: bfloat16 rows are finished above
        for j in range(h):
            out[i, j] = _normed(x, j, m32, r32, gamma, beta)
    else:
        for j in range(h):
            out[i, j] = _dropped(_normed(x, j, m32, r32, gamma, beta), seed, i * h + j, threshold, scale)


@njit(cache=True, inline="always")
def _normed(x, j, m, r, gamma, beta):
    """LayerNorm's element j, ((x - mean) * rstd) * weight + bias, with a float32 weight and bias."""
    return (x[j] - m) * r * gamma[j] + beta[j]


@njit(cache=True, inline="always")
def _dropped(y, seed, index, threshold, scale):
    """Dropout of element `index`: y / (1 - p), or 0 (y itself without dropout, threshold 0)."""
    if threshold == 0:
        return y
    return y * np.float32(scale) if keep(seed, index, threshold) else np.float32(0.0)


# The word row of the token this many ahead is prefetched: rows of a 94 MB table come from memory, and the hardware's
# own prefetcher only starts after a row's first miss. 2 ahead: (64, 512) forward 16.0 -> 11.9 ms (1 to 4: the same).
# Its first line alone (`prefetch_row`), against every line: (32, 128) 1.12-1.15x, (64, 512) 1.02x (1 to 8: the same).
# The first line of the output row too, for writing: float32 1.04-1.07x (1, 2 or 4 ahead), bfloat16 0.98-1.04x.
_AHEAD = 2


# `contract`: LayerNorm's `* weight + bias` is one fused multiply-add (one rounding, not two; lean's `_infer` does the
# same): forward (32, 128) 1.02-1.04x.
@njit(cache=True, fastmath={"contract"})
def _forward_chunk(lo, hi, ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd,
                   stream):
    """Tokens [lo, hi) with one scratch row; returns how many had bad ids (skipped, nothing read)."""
    wide_vectors(True)
    has_pos = pos.shape[0] > 0
    # Borrowed: no atomic reference counts per token, on counts both threads update (with `_forward_token` inlined,
    # one thread, rows in cache: about 460 -> 300 ns a token).
    scratch = np.empty(out.shape[1], np.float32)
    x = borrowed(scratch)
    word, seg, pos, gamma, beta = borrowed(word), borrowed(seg), borrowed(pos), borrowed(gamma), borrowed(beta)
    out, mean, rstd = borrowed(out), borrowed(mean), borrowed(rstd)
    bad = 0
    for i in range(lo, hi):
        if i + _AHEAD < hi:
            prefetch_row_for_write(out, i + _AHEAD)
            if 0 <= ids[i + _AHEAD] < word.shape[0]:
                prefetch_row(word, ids[i + _AHEAD])
        w, s, q = ids[i], tts[i], pids[i]
        if ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0], has_pos):
            _forward_token(i, w, s, q, word, seg, pos, has_pos, gamma, beta, eps, threshold, scale, seed, x, out, mean,
                           rstd, True, stream)
        else:
            bad += 1
    hold(scratch)
    if stream:
        store_fence()
    return bad


@njit(parallel=True, cache=True)
def forward(ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd, chunks, stream):
    """out[i] = dropout(LayerNorm((word[ids[i]] + seg[tts[i]]) + pos[pids[i]])); returns how many tokens had bad ids.

    ids, tts, pids: [N] int64. word [V, H], seg [T, H], pos [P, H] (P = 0: no position row), out [N, H]: float32, or
    uint16 bfloat16 bits. gamma, beta: [H] float32. mean, rstd: [N] float32, kept for backward. chunks: >= 1 blocks of
    tokens (a few per thread). stream: rows go out by non-temporal stores (`write_row`), for a large out.
    """
    n = out.shape[0]
    bad = 0
    for c in prange(chunks):
        bad += _forward_chunk(c * n // chunks, (c + 1) * n // chunks, ids, tts, pids, word, seg, pos, gamma, beta, eps,
                              threshold, scale, seed, out, mean, rstd, stream)
    return bad


@njit(cache=True)
def forward_serial(ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd, chunks,
                   stream):
    """`forward` on the calling thread: for a few tokens, starting the thread pool costs more than the work. (An int64
    0, not a literal one, so `forward`'s compiled `_forward_chunk` serves: one compile, not two.)"""
    return _forward_chunk(np.int64(0), out.shape[0], ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold,
                          scale, seed, out, mean, rstd, stream)


@njit(cache=True, fastmath={"reassoc"})
def _row_backward(word, seg, pos, w, s, q, has_pos, gout, i, m, r, gamma, threshold, scale, seed, dgamma, dbeta, x, dx):
    """LayerNorm (and dropout) backward of token i, in float32: dx[:] = d loss / d sum.

    The sum is recomputed from the tables (cheaper than keeping it: no [N, H] tensor is saved), and xhat from it as the
    forward did, into x; dgamma, dbeta [H] float32 partials are added into. Each loop writes one or two arrays, few
    enough for LLVM's vectoriser to check them for overlap.
    """
    wide_vectors(True)
    h = x.size
    wrow, srow, prow = token_rows(word, seg, pos, w, s, q, has_pos)
    if has_pos:  # xhat, from the sum recomputed as the forward computed it (its moments are saved: not taken again)
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
    # float32 row sums (`reassoc`: many short partial sums) keep the gradient as close to the float64 result as float64
    # sums did (1.2e-7 to 4.3e-6 of the largest entry, H 97 to 4096, row means 0 and 300), closer than torch's float32
    # LayerNorm backward (1.4e-7 to 9.4e-6); float64 ones took twice the vector work.
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
def backward(order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout, threshold, scale,
             seed, pad, dword, dseg, dpos, dgamma, dbeta, stream):
    """Table and LayerNorm gradients; returns how many tokens had bad ids.

    Chunk c handles tokens order[bounds[c]:bounds[c+1]], sorted by word id with no word id (other than `pad`) split
    between chunks, so each word-gradient row has one writer and a fixed summation order: deterministic. It also owns
    word-gradient rows [rows[c], rows[c+1]) and writes each once, zeros included, in id order: dword [V, H] comes
    uninitialised, and the dense gradient costs one pass of writes, not a memset and then a scatter (shape (0, H): not
    wanted; rows all V: dword comes zeroed, and the kernel only adds). `stream`: the zeros go out as non-temporal
    stores (for a large table: see `_STREAM_FROM`). dseg [C, T, H], dpos [C, R, H] float32 per-chunk partials (R = 0:
    not wanted; row k is position pos_lo + k); dgamma, dbeta [C, H] float32 per-chunk partials.
    """
    bad = 0
    for c in prange(bounds.size - 1):  # (c is unsigned here: as int64, `backward_serial`'s compiled chunk serves)
        bad += _backward_chunk(np.int64(c), order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean,
                               rstd, gout, threshold, scale, seed, pad, dword, dseg, dpos, dgamma, dbeta, stream)
    return bad


@njit(cache=True)
def backward_serial(order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout, threshold,
                    scale, seed, pad, dword, dseg, dpos, dgamma, dbeta, stream):
    """`backward` on the calling thread, for a few tokens."""
    bad = 0
    for c in range(bounds.size - 1):
        bad += _backward_chunk(c, order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout,
                               threshold, scale, seed, pad, dword, dseg, dpos, dgamma, dbeta, stream)
    return bad


@njit(cache=True)
def _backward_chunk(c, order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout, threshold,
                    scale, seed, pad, dword, dseg, dpos, dgamma, dbeta, stream):
    wide_vectors(True)
    h = gout.shape[1]
    has_pos, want_word = pos.shape[0] > 0, dword.shape[0] > 0
    scratch = np.empty((2, h), np.float32)
    x, dx = borrowed(scratch[0]), borrowed(scratch[1])
    word, seg, pos, gamma, gout = borrowed(word), borrowed(seg), borrowed(pos), borrowed(gamma), borrowed(gout)
    dword, dgamma, dbeta = borrowed(dword), borrowed(dgamma[c]), borrowed(dbeta[c])
    dseg, dpos = borrowed(dseg[c]), borrowed(dpos[c])
    zeroed = rows[c]  # rows below this one are written
    bad = 0
    for k in range(bounds[c], bounds[c + 1]):
        if k + _AHEAD < bounds[c + 1]:  # tokens come in id order: their gradient rows are scattered
            ahead = order[k + _AHEAD]
            prefetch_row(gout, ahead)
            if 0 <= ids[ahead] < word.shape[0]:
                prefetch_row(word, ids[ahead])
        i = order[k]
        w, s, q = ids[i], tts[i], pids[i]
        if not ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0], has_pos):
            bad += 1
            continue
        _row_backward(word, seg, pos, w, s, q, has_pos, gout, i, mean[i], rstd[i], gamma, threshold, np.float32(scale),
                      seed, dgamma, dbeta, x, dx)
        if want_word:
            zeroed = _word_row(dword, w, pad, dx, zeroed, rows[c + 1], stream)
        _add_row(dseg, s, dx, True)
        _add_row(dpos, q - pos_lo, dx, True)  # (no-op for a [0, H] dpos: positions not wanted)
    hold(scratch)
    if want_word:
        _zero_rows(dword, zeroed, rows[c + 1], stream)
        if stream:
            store_fence()
    return bad


@njit(cache=True)
def _word_row(dword, w, pad, dx, zeroed, end, stream):
    """Token's dx into the word gradient; returns the new `zeroed`. Rows [zeroed, end) are this chunk's and not written
    yet: the rows between the last id and this one had no token (zeros), the first token of an id sets its row (no
    zeros written first, then read back), later ones add. A [PAD] row gets zeros; it may be the next chunk's (end)."""
    wide_vectors(True)
    if w < zeroed:
        _add_row(dword, w, dx, w != pad)
        return zeroed
    _zero_rows(dword, zeroed, min(w, end), stream)
    if w >= end:
        return end
    if w == pad:
        dword[w] = 0.0
    else:
        for j in range(dx.size):  # (as `write_row`: no array assignment, whose error message is slow to compile)
            dword[w, j] = dx[j]
    return w + 1


@njit(cache=True)
def _zero_rows(dword, lo, hi, stream):
    if hi <= lo:
        return
    if stream:
        stream_zeros(dword, lo, hi)
    else:
        dword[lo:hi] = 0.0


@njit(parallel=True, cache=True)
def stream_zero_table(table, pieces):
    """table[:] = 0 by non-temporal stores, in `pieces` blocks of rows spread over the threads."""
    rows = table.shape[0]
    for c in prange(pieces):
        stream_zeros(table, c * rows // pieces, (c + 1) * rows // pieces)
        store_fence()


@njit(cache=True)
def _add_row(grad, row, dx, wanted):
    wide_vectors(True)
    if wanted and grad.shape[0] > 0:
        for j in range(dx.size):
            grad[row, j] += dx[j]
