"""Triton kernels: BERT's embedding layer in one pass per token on a GPU, forward and backward (design:
docs/gpu-kernels.md). A token whose id falls outside a table reads nothing and gets a row of NaN. Tested on CPU
tensors with TRITON_INTERPRET=1 (set before this module is imported) and on a GPU.

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments, G programs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from bertembed.validation import RowsOverflowed, skipped_ids_error

if os.environ.get("TRITON_INTERPRET") == "1":  # read when @triton.jit decorates, as Triton itself reads it

    @triton.jit
    def _round_to(x, dtype: tl.constexpr):
        """float32 x rounded to `dtype`, to nearest even, returned as float32 (bfloat16 by integer ops: the
        interpreter's own conversion truncates)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        else:
            return x.to(dtype).to(tl.float32)
else:

    @triton.jit
    def _round_to(x, dtype: tl.constexpr):
        """float32 x rounded to `dtype`, to nearest even, returned as float32, by the GPU's own conversion."""
        if dtype == tl.float32:
            return x
        else:
            return x.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _sum_rows(ids, tts, pids, word, seg, pos, rows, cols, cmask, H, V, T, P, HAS_POS: tl.constexpr,
              ROUND: tl.constexpr, EVICT: tl.constexpr):
    """(x [R, BLOCK] float32 = (word[w] + seg[s]) + pos[q], ok [R]: the row's ids are valid, w, s, q [R]) for token
    rows `rows` [R]; invalid ids load nothing. EVICT: the word rows are the first to leave the L2 cache."""
    w = tl.load(ids + rows)
    s = tl.load(tts + rows)
    q = tl.load(pids + rows)
    # each row is masked by its own id alone, so a load waits for no other id (the position row for none at all)
    ok_w, ok_s = (w >= 0) & (w < V), (s >= 0) & (s < T)
    ok = ok_w & ok_s
    cm = cmask[None, :]
    c = cols[None, :]
    if EVICT:
        x = tl.load(word + w[:, None] * H + c, mask=ok_w[:, None] & cm, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(word + w[:, None] * H + c, mask=ok_w[:, None] & cm, other=0.0)
    x = x.to(tl.float32) + tl.load(seg + s[:, None] * H + c, mask=ok_s[:, None] & cm, other=0.0).to(tl.float32)
    if ROUND:
        x = _round_to(x, word.dtype.element_ty)
    if HAS_POS:
        ok_q = (q >= 0) & (q < P)
        ok = ok & ok_q
        x = x + tl.load(pos + q[:, None] * H + c, mask=ok_q[:, None] & cm, other=0.0).to(tl.float32)
        if ROUND:
            x = _round_to(x, word.dtype.element_ty)
    return x, ok, w, s, q


@triton.jit
def _forward_kernel(ids, tts, pids, word, seg, pos, gamma, beta, out, mean, rstd, bad, N, H, V, T, P, eps, p, seed,
                    HAS_POS: tl.constexpr, ROUND: tl.constexpr,
                    DROPOUT: tl.constexpr, STATS: tl.constexpr, COUNT: tl.constexpr, EVICT: tl.constexpr,
                    R: tl.constexpr, BLOCK: tl.constexpr):
    """R token rows. COUNT adds each token with a bad id to bad[0], and each whose moments are not finite (a NaN or
    inf in its rows, a variance or a mean's square past float32's range) to bad[1] (read back on CPU tensors, in the
    interpreter). STATS stores the rows' mean and 1/std (training)."""
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    live = rows < N
    rows = tl.minimum(rows, N - 1)  # the last program's spare rows recompute row N - 1 and store nothing
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    x, ok, w, s, q = _sum_rows(ids, tts, pids, word, seg, pos, rows, cols, cmask, H, V, T, P, HAS_POS, ROUND, EVICT)
    shift = tl.sum(tl.where(cols[None, :] == 0, x, 0.0), axis=1)  # (x[:, 0]: a constant row's mean comes out exact)
    mu = shift + tl.sum(tl.where(cmask[None, :], x - shift[:, None], 0.0), axis=1) / H
    d = tl.where(cmask[None, :], x - mu[:, None], 0.0)
    r = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / H + eps)
    g = tl.load(gamma + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(beta + cols, mask=cmask, other=0.0).to(tl.float32)
    y = d * r[:, None] * g[None, :] + b[None, :]
    at = rows[:, None] * H + cols[None, :]
    if DROPOUT:
        y = tl.where(tl.rand(seed, at) >= p, y / (1.0 - p), 0.0)
    y = tl.where(ok[:, None], y, float("nan"))
    y = _round_to(y, out.dtype.element_ty).to(out.dtype.element_ty)
    if EVICT:
        tl.store(out + at, y, mask=live[:, None] & cmask[None, :], eviction_policy="evict_first")
    else:
        tl.store(out + at, y, mask=live[:, None] & cmask[None, :])
    if STATS:
        tl.store(mean + rows, mu, mask=live)
        tl.store(rstd + rows, r, mask=live)
    if COUNT:
        tl.atomic_add(bad + rows * 0, 1, mask=live & (ok == 0))
        finite = (mu * mu < float("inf")) & (r > 0)  # (NaN compares false; r is 0 where the variance is inf)
        tl.atomic_add(bad + 1 + rows * 0, 1, mask=live & ok & (finite == 0))


@triton.jit
def _backward_kernel(grad, ids, tts, pids, word, seg, pos, gamma, mean, rstd, dx_buf, dword, dpos, part, bad, N, H, V,
                     T, P, p, seed, pad, ROWS: tl.constexpr, HAS_POS: tl.constexpr, ROUND: tl.constexpr,
                     DROPOUT: tl.constexpr, ATOMIC: tl.constexpr, WANT_WORD: tl.constexpr, WANT_POS: tl.constexpr,
                     COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS token rows per program, one at a time (as [1, BLOCK] blocks). Each program owns a [T + 2, H] slab of
    `part`: the segment gradient's T rows, zeroed here first (every token adds to one of a few segment rows: atomics
    there would serialise), then LayerNorm's weight and bias gradients; torch sums the slabs."""
    prog = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    c, cm = cols[None, :], cmask[None, :]
    mine = part + prog * (T + 2) * H  # only this program touches its slab: plain stores and read-add-writes
    for t in range(T):
        tl.store(mine + t * H + c, tl.zeros([1, BLOCK], dtype=tl.float32), mask=cm)
    g = tl.load(gamma + c, mask=cm, other=0.0).to(tl.float32)
    acc_g = tl.zeros([1, BLOCK], dtype=tl.float32)
    acc_b = tl.zeros([1, BLOCK], dtype=tl.float32)
    for k in range(ROWS):
        rows = prog * ROWS + k + tl.arange(0, 1)
        live = rows < N
        rows = tl.minimum(rows, N - 1)
        x, ok, w, s, q = _sum_rows(ids, tts, pids, word, seg, pos, rows, cols, cmask, H, V, T, P, HAS_POS, ROUND,
                                   False)
        m = (ok & live)[:, None] & cm
        xhat = tl.where(cm, (x - tl.load(mean + rows)[:, None]) * tl.load(rstd + rows)[:, None], 0.0)
        at = rows[:, None] * H + c
        gy = tl.load(grad + at, mask=m, other=0.0).to(tl.float32)
        if DROPOUT:
            gy = tl.where(tl.rand(seed, at) >= p, gy / (1.0 - p), 0.0)
        acc_g += gy * xhat
        acc_b += gy
        gg = gy * g
        mean_gg = tl.sum(gg, axis=1)[:, None] / H
        mean_ggx = tl.sum(gg * xhat, axis=1)[:, None] / H
        dx = tl.load(rstd + rows)[:, None] * (gg - mean_gg - xhat * mean_ggx)
        slab = mine + s[:, None] * H + c
        tl.store(slab, tl.load(slab, mask=m, other=0.0) + dx, mask=m)
        if ATOMIC:
            if WANT_WORD:
                tl.atomic_add(dword + w[:, None] * H + c, dx, mask=m & (w != pad)[:, None])
            if WANT_POS:
                tl.atomic_add(dpos + q[:, None] * H + c, dx, mask=m)
        else:
            tl.store(dx_buf + at, dx, mask=m)
        if COUNT:
            tl.atomic_add(bad + rows * 0, 1, mask=live & (ok == 0))
    tl.store(mine + T * H + c, acc_g, mask=cm)
    tl.store(mine + (T + 1) * H + c, acc_b, mask=cm)


@triton.jit
def _segment_sum_kernel(dx, order, begins, ends, rows, out, H, BLOCK: tl.constexpr):
    """out[rows[i]] = sum of dx[order[k]] for k in [begins[i], ends[i]), in that order: deterministic."""
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(tl.load(begins + i), tl.load(ends + i)):
        acc += tl.load(dx + tl.load(order + k).to(tl.int64) * H + cols, mask=cmask, other=0.0)
    tl.store(out + tl.load(rows + i).to(tl.int64) * H + cols, acc, mask=cmask)


def _warps(elements: int, itemsize: int) -> int:
    """The forward's warps for a program of `elements` row elements: one per KB of row block (four at hidden 1024 in
    float32), but one for float16/bfloat16 rows of up to 1024 elements, the fastest on an H100 (docs/gpu-kernels.md)."""
    if itemsize < 4 and elements <= 1024:
        return 1
    return min(max(elements * itemsize // 1024, 1), 8)


def run_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps: float, p: float, seed: int, out=None,
                stats: bool = True, num_warps: int | None = None, rows: int = 1, evict_first: bool = True, shape=None,
                strict: bool = False):
    """As `bertembed.fast.cpu.run_forward`, but `strict` holds on CPU tensors only (a GPU read-back would wait for the
    device): on a GPU a token whose moments are not finite keeps the kernel's answer. Tuning (docs/gpu-kernels.md):
    `rows` token rows per program (a power of 2) and `num_warps`, defaults the fastest on an H100; `evict_first` marks
    the word rows read and the output written as the first to leave the L2 cache, so the few shared rows stay."""
    n, h = ids.numel(), word.shape[1]
    dev = word.device
    if out is None:  # (any contiguous shape: the kernel reads its address)
        out = torch.empty(shape or (n, h), dtype=word.dtype, device=dev)
    # without stats `out` stands in for mean and rstd, as a pointer never written through
    mean, rstd = (torch.empty(n, device=dev), torch.empty(n, device=dev)) if stats else (out, out)
    bad = torch.zeros(2, dtype=torch.int32, device=dev) if dev.type == "cpu" else None  # (a GPU read-back would sync)
    if n:
        block = triton.next_power_of_2(h)
        _forward_kernel[(triton.cdiv(n, rows),)](
            ids, tts, pids, word, seg, word if pos is None else pos, gamma, beta, out, mean, rstd,
            ids if bad is None else bad, n, h, word.shape[0], seg.shape[0], 0 if pos is None else pos.shape[0], eps, p,
            seed, HAS_POS=pos is not None, ROUND=word.dtype != torch.float32, DROPOUT=p > 0, STATS=stats,
            COUNT=bad is not None, EVICT=evict_first, R=rows, BLOCK=block,
            num_warps=num_warps or _warps(rows * block, word.element_size()))
    bad, odd = (0, 0) if bad is None else bad.tolist()
    if bad:
        raise skipped_ids_error(bad, "bertembed triton forward")
    if odd and strict:
        raise RowsOverflowed(odd)
    return (out, mean, rstd) if stats else (out, None, None)


def run_backward(grad, ids, tts, pids, word, seg, pos, gamma, mean, rstd, p: float, seed: int, pad: int,
                 need_word: bool = True, need_pos: bool = True, deterministic: bool = False):
    """As `bertembed.fast.cpu.run_backward`; `deterministic` trades the atomics for a fixed summation order."""
    n, h = grad.shape
    ids, tts, pids = ids.reshape(-1), tts.reshape(-1), pids.reshape(-1)
    dev = word.device
    want_pos = need_pos and pos is not None
    f32 = dict(dtype=torch.float32, device=dev)
    rows = max(1, triton.cdiv(n, 1024))  # about a thousand programs, each with partial LayerNorm gradients
    programs = max(1, triton.cdiv(n, rows))
    # Unwanted gradients get one row, never read or written: a kernel argument must point at real device memory.
    dword = torch.zeros(word.shape[0] if need_word else 1, h, **f32)
    dpos = torch.zeros(pos.shape[0] if want_pos else 1, h, **f32)
    types = seg.shape[0]
    part = (torch.empty if n else torch.zeros)(programs, types + 2, h, **f32)  # each program's slab, filled by it
    dx = torch.empty(n if deterministic else 1, h, **f32)
    bad = torch.zeros(1, dtype=torch.int32, device=dev) if dev.type == "cpu" else None
    if n:
        _backward_kernel[(programs,)](
            grad.contiguous(), ids, tts, pids, word, seg, word if pos is None else pos, gamma, mean, rstd, dx, dword,
            dpos, part, ids if bad is None else bad, n, h, word.shape[0], types, 0 if pos is None else pos.shape[0],
            p, seed, pad, ROWS=rows, HAS_POS=pos is not None, ROUND=word.dtype != torch.float32, DROPOUT=p > 0,
            ATOMIC=not deterministic, WANT_WORD=need_word, WANT_POS=want_pos, COUNT=bad is not None,
            BLOCK=triton.next_power_of_2(h), num_warps=4)
    if bad is not None and int(bad):
        raise skipped_ids_error(int(bad), "bertembed triton backward")
    if deterministic and n:
        if need_word:
            _segment_sum(dx, ids, dword, skip=pad)
        if want_pos:
            _segment_sum(dx, pids, dpos)
    dtype = word.dtype
    dword, dpos = dword if need_word else dword[:0], dpos if want_pos else dpos[:0]
    sums = part.sum(0)  # [T + 2, H]: segment gradient, LayerNorm weight and bias gradients, in one reduction
    # views of one buffer; the custom op copies them apart (`function.embeddings_backward_op`), eager autograd need not
    return dword.to(dtype), sums[:types].to(dtype), dpos.to(dtype), sums[types].to(gamma.dtype), \
        sums[types + 1].to(gamma.dtype)


def _segment_sum(dx: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, skip: int = -1) -> None:
    """out[id] = sum of the dx rows of the tokens with that id, in token order (a stable sort): deterministic."""
    sorted_ids, order = torch.sort(ids, stable=True)
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=dx.device)
    starts[1:] = torch.cumsum(counts, 0)
    keep = rows != skip  # the padding row keeps a zero gradient
    begins, ends, rows = starts[:-1][keep].contiguous(), starts[1:][keep].contiguous(), rows[keep].contiguous()
    if rows.numel():
        _segment_sum_kernel[(rows.numel(),)](dx, order, begins, ends, rows, out, dx.shape[1],
                                             BLOCK=triton.next_power_of_2(dx.shape[1]), num_warps=4)
