"""CPU kernels (numba): BERT's embedding layer in one pass per token, forward and backward.

Forward, per token, in two passes over the row: gather the word row, add the segment row, then the position row (the
reference's order) while accumulating the LayerNorm statistics; then normalise, scale and shift, dropout,
store (float32 mean/rstd are kept). Backward, per token: recompute the sum from the tables (cheaper than keeping it:
no [N, H] tensor is saved), LayerNorm backward, and add the row gradient into the table gradients.

Tables and outputs are float32 or bfloat16 (as uint16 bits: `bertembed.kernels.cpu_elements`). The bfloat16 sums are
rounded after each add, as torch rounds `word + segment` and then `+ position`, so results follow the reference's order.

Ids are validated before any kernel runs (`bertembed.validation.check_inputs`); the kernels check them again and count
what they skipped, so an out-of-range id can never read outside a table.

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments, C chunks (one per thread).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from bertembed.kernels import pages
from bertembed.kernels.cpu_elements import (
    add_rounded,
    borrowed,
    dropout_threshold,
    hold,
    ids_ok,
    keep,
    narrow,
    prefetch_row,
    store_fence,
    stream_zeros,
    token_rows,
    wide_vectors,
    widen,
)


# `reassoc` lets the float32 sums vectorise (many partial sums, each short). It would also let LLVM regroup the adds
# of `add_rounded`, which it does not do: the tests hold the kernels to the reference's roundings.
@njit(cache=True, fastmath={"reassoc"})
def _sum_row(word, seg, pos, w, s, q, has_pos, x, wide):
    """x[:] = (word[w] + seg[s]) + pos[q] in float32, rounded after each add as the tables' dtype rounds; returns x's
    mean and biased variance, from float32 sums: of x - x[0] for the mean (so a large mean loses no digits), then of
    (x - mean)^2. As close to the float64 result as torch's LayerNorm is."""
    wide_vectors(wide)
    wrow, srow, prow = token_rows(word, seg, pos, w, s, q, has_pos)
    first = add_rounded(widen(wrow[0]), srow, 0)
    shift = add_rounded(first, prow, 0) if has_pos else first
    total = np.float32(0.0)
    if has_pos:
        for j in range(x.size):
            x[j] = v = add_rounded(add_rounded(widen(wrow[j]), srow, j), prow, j)
            total += v - shift
    else:
        for j in range(x.size):
            x[j] = v = add_rounded(widen(wrow[j]), srow, j)
            total += v - shift
    return _moments(x, shift, total, wide)


@njit(cache=True, fastmath={"reassoc"})
def _moments(x, shift, total, wide):
    """(float32 mean, biased variance) of x, given the sum of x - shift: the variance from a second pass around the
    mean (x is in L1 by then), so nothing cancels, wherever the row's entries lie."""
    wide_vectors(wide)
    mean = np.float32(shift + total / x.size)
    squares = np.float32(0.0)
    for j in range(x.size):
        squares += (x[j] - mean) ** 2
    return mean, squares / x.size


@njit(cache=True, inline="always")
def _forward_token(i, w, s, q, word, seg, pos, has_pos, gamma, beta, eps, threshold, scale, seed, x, out, mean, rstd,
                   wide):
    """Two passes over the row: the sum with its moments, then LayerNorm and dropout into out[i]. Inlined: as a call
    it passed ten arrays by value (600 bytes) per token. `wide`: True for 512-bit vectors (many tokens a thread),
    None for LLVM's default (one sentence): see `wide_vectors`."""
    h = x.size
    m, var = _sum_row(word, seg, pos, w, s, q, has_pos, x, wide)
    # The statistics round to float32: from there on the same float32 operations in the same order as torch's
    # LayerNorm, ((x - mean) * rstd) * weight + bias.
    m32, r32 = np.float32(m), np.float32(1.0 / np.sqrt(var + eps))
    mean[i], rstd[i] = m32, r32
    if threshold == 0:
        for j in range(h):
            out[i, j] = narrow(out, (x[j] - m32) * r32 * gamma[j] + beta[j])
        return
    scale32 = np.float32(scale)
    for j in range(h):
        y = (x[j] - m32) * r32 * gamma[j] + beta[j]
        out[i, j] = narrow(out, y * scale32 if keep(seed, i * h + j, threshold) else np.float32(0.0))


# The word row of the token this many ahead is prefetched: rows of a 94 MB table come from memory, and the hardware's
# own prefetcher only starts after a row's first miss. 2 ahead: (64, 512) forward 16.0 -> 11.9 ms (1 to 4: the same).
_AHEAD = 2


@njit(cache=True)
def _forward_chunk(lo, hi, ids, tts, pids, word, seg, pos, gamma, beta, eps, threshold, scale, seed, out, mean, rstd):
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
        if i + _AHEAD < hi and 0 <= ids[i + _AHEAD] < word.shape[0]:
            prefetch_row(word, ids[i + _AHEAD])
        w, s, q = ids[i], tts[i], pids[i]
        if ids_ok(w, s, q, word.shape[0], seg.shape[0], pos.shape[0], has_pos):
            _forward_token(i, w, s, q, word, seg, pos, has_pos, gamma, beta, eps, threshold, scale, seed, x, out, mean,
                           rstd, True)
        else:
            bad += 1
    hold(scratch)
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
    for c in prange(bounds.size - 1):
        bad += _backward_chunk(c, order, bounds, rows, ids, tts, pids, pos_lo, word, seg, pos, gamma, mean, rstd, gout,
                               threshold, scale, seed, pad, dword, dseg, dpos, dgamma, dbeta, stream)
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
        dword[w] = dx
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


def chunk_bounds(sorted_ids: np.ndarray, chunks: int, pad: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks of the tokens sorted by id: ([C + 1] token bounds of near-equal sizes, moved so that no id but `pad`
    spans two chunks; [C + 1] word-table row bounds, chunk c owning rows from its first id to the next chunk's)."""
    n = sorted_ids.size
    if chunks == 1:  # (numpy's linspace, clip and append cost 45 us of a sentence's 290 us backward)
        return np.array([0, n], np.int64), np.array([0, vocab], np.int64)
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
    count = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(count)
    return count


# ---- torch glue: tensors in, tensors out ------------------------------------------------------------------------

# Word gradients this large get their zeros by non-temporal stores, which skip reading each line first and leave the
# cache to data that is read again. Backward at (32, 128) on this 2-core VM, ordinary stores -> streamed, with the
# table still in cache / with the caches full of other data (as after an optimizer step): H 384 (47 MB) 5.46 -> 4.03
# / 6.68 -> 5.35 ms, H 192 (23 MB) 3.10 -> 2.64 / 4.13 -> 3.54 ms. A sentence zeroes the table in a pass of its own,
# on all threads, against torch.zeros: 16 MB 0.30 -> 0.35 / 1.15 -> 0.52 ms, 47 MB 0.94 -> 1.00 / 2.90 -> 1.22,
# 94 MB 2.08 -> 2.00 / 5.71 -> 2.20.
_STREAM_FROM = 16 << 20  # bytes
_PARALLEL_FROM = 1 << 17  # elements (N x H): below this, one thread beats waking the pool (a sentence is ~8k)


def _np(t):
    """A numpy view of a CPU tensor sharing its memory (bfloat16 as uint16 bits)."""
    t = t.detach()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def check_bad(bad: int, where: str) -> None:
    if bad:
        raise RuntimeError(f"{where}: {bad} tokens had ids outside their tables and were skipped; ids must be checked "
                           f"with bertembed.validation.check_inputs before a kernel runs (this is a bug)")


def forward_chunks(tokens: int) -> int:
    """Blocks of tokens for `forward`: a few per thread, so a thread that started late does not hold up the rest."""
    return max(1, min(tokens, 4 * threads()))


def run_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps: float, p: float, seed: int, out=None):
    """ids, tts, pids: [N] int64; tables [*, H] float32 or bfloat16 (one dtype); pos may be None.

    Returns (out [N, H] in the tables' dtype, mean [N], rstd [N] float32). `out`, if given, is written in place.
    """
    n, h = ids.numel(), word.shape[1]
    if out is None:
        out = torch.empty(n, h, dtype=word.dtype)
        pages.advise_if_fresh(out)
    out = out.view(n, h)
    mean, rstd = torch.empty(n), torch.empty(n)
    pos_np = _np(pos) if pos is not None else _np(word[:0])
    chunks = forward_chunks(n)
    kernel = forward if n * h >= _PARALLEL_FROM else forward_serial
    bad = kernel(_np(ids), _np(tts), _np(pids), _np(word), _np(seg), pos_np, _np(gamma.float()), _np(beta.float()),
                  float(eps), dropout_threshold(p), 1.0 / (1.0 - p), np.uint64(seed), _np(out), _np(mean), _np(rstd),
                  chunks)
    check_bad(bad, "bertembed cpu forward")
    return out, mean, rstd


def _word_gradient(rows: int, h: int) -> tuple[torch.Tensor, bool]:
    """An uninitialised [rows, h] float32 word gradient, and whether to stream its zeros: from `_STREAM_FROM`, unless
    its memory is fresh from the kernel (`kernels/pages.py`), which gets 2 MB pages and ordinary stores instead."""
    table = torch.empty(rows, h)
    fresh = pages.advise_if_fresh(table)
    return table, table.nbytes >= _STREAM_FROM and not fresh


def _zero_on_all_threads(table: torch.Tensor, stream: bool) -> None:
    if stream:
        stream_zero_table(_np(table), 4 * threads())
    else:
        table.zero_()  # torch's fill, on all threads


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
    dword, stream = _word_gradient(vocab, h)  # uninitialised: the kernel writes every row once, zeros included
    if chunks == 1 and vocab:  # few tokens: the zeros first, spread over the threads; then the kernel only adds
        _zero_on_all_threads(dword, stream)
        rows = np.full_like(rows, vocab)
    types = seg.shape[0]
    lo, hi = (int(pids.min()), int(pids.max())) if need_pos and pos is not None and n else (0, -1)
    if chunks == 1 and hi >= lo:  # one writer: the kernel adds straight into the whole position gradient
        lo, hi = 0, pos.shape[0] - 1
    # per-chunk partials; each in storage of its own: the custom op's outputs may not alias one another
    dseg, dpos = torch.zeros(chunks, types, h), torch.zeros(chunks, hi - lo + 1, h)
    dgamma, dbeta = torch.zeros(chunks, h), torch.zeros(chunks, h)
    pos_np = _np(pos) if pos is not None else _np(word[:0])
    kernel = backward if chunks > 1 else backward_serial
    bad = kernel(order, bounds, rows, ids_np, _np(tts), _np(pids), lo, _np(word), _np(seg), pos_np,
                 _np(gamma.float()), _np(mean), _np(rstd), _np(grad.contiguous()), dropout_threshold(p),
                 1.0 / (1.0 - p), np.uint64(seed), pad, _np(dword), _np(dseg), _np(dpos), _np(dgamma), _np(dbeta),
                 stream)
    check_bad(bad, "bertembed cpu backward")
    want_pos = need_pos and pos is not None
    if chunks == 1:  # one chunk's partials are the sums (float64 sums of one term change nothing)
        dseg, dgamma, dbeta = dseg[0], dgamma[0], dbeta[0]
        full_pos = dpos[0] if hi >= lo else torch.zeros(pos.shape[0] if want_pos else 0, h)
    else:
        dseg, dgamma, dbeta = dseg.sum(0), dgamma.double().sum(0), dbeta.double().sum(0)
        full_pos = torch.zeros(pos.shape[0] if want_pos else 0, h)  # no tokens: zeros
        if hi >= lo:
            full_pos[lo:hi + 1] = dpos.sum(0)
    dtype = word.dtype
    return dword.to(dtype), dseg.to(dtype), full_pos.to(dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)
