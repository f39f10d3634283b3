"""Triton kernels: BERT's embedding layer in one pass per token on a GPU, forward and backward (design:
docs/gpu-kernels.md). A token whose id falls outside a table reads nothing and gets a row of NaN. Tested on CPU
tensors with TRITON_INTERPRET=1 (set before this module is imported) and on a GPU.

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from bertembed.validation import RowsOverflowed, skipped_ids_error

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # read at import, as Triton itself reads it


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype`, to nearest even (the GPU's own conversion), returned as float32."""
    if _INTERPRET and dtype == tl.bfloat16:  # by integer ops: the interpreter's conversion truncates
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _sum_rows(ids, tts, pids, word, seg, pos, rows, cols, cmask, H, V, T, P, EVICT: tl.constexpr):
    """(x [R, BLOCK] float32 = (word[w] + seg[s]) + pos[q], ok [R]: the row's ids are valid, w, s, q [R]) for token
    rows `rows` [R]; invalid ids load nothing. EVICT: the word rows are the first to leave the L2 cache."""
    w = tl.load(ids + rows)
    s = tl.load(tts + rows)
    q = tl.load(pids + rows)
    # each row is masked by its own id alone, so a load waits for no other id (the position row for none at all)
    ok_w, ok_s, ok_q = (w >= 0) & (w < V), (s >= 0) & (s < T), (q >= 0) & (q < P)
    ok = ok_w & ok_s & ok_q
    c, cm = cols[None, :], cmask[None, :]
    x = tl.load(word + w[:, None] * H + c, mask=ok_w[:, None] & cm, other=0.0,
                eviction_policy="evict_first" if EVICT else "")
    x = x.to(tl.float32) + tl.load(seg + s[:, None] * H + c, mask=ok_s[:, None] & cm, other=0.0).to(tl.float32)
    x = _round_to(x, word.dtype.element_ty)  # (each sum in the tables' dtype, as torch adds them)
    x = x + tl.load(pos + q[:, None] * H + c, mask=ok_q[:, None] & cm, other=0.0).to(tl.float32)
    x = _round_to(x, word.dtype.element_ty)
    return x, ok, w, s, q


@triton.jit
def _forward_kernel(ids, tts, pids, word, seg, pos, bad, N, H, V, T, P, p, seed, gamma, beta, out, mean, rstd, eps,
                    DROPOUT: tl.constexpr, COUNT: tl.constexpr, STATS: tl.constexpr,
                    EVICT: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    """R token rows. COUNT adds each token with a bad id to bad[0], and each whose moments are not finite (a NaN or
    inf in its rows, a variance or a mean's square past float32's range) to bad[1]. STATS stores the rows' mean and
    1/std (training)."""
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    live = rows < N
    rows = tl.minimum(rows, N - 1)  # the last program's spare rows recompute row N - 1 and store nothing
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    x, ok, w, s, q = _sum_rows(ids, tts, pids, word, seg, pos, rows, cols, cmask, H, V, T, P, EVICT)
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
    tl.store(out + at, y, mask=live[:, None] & cmask[None, :], eviction_policy="evict_first" if EVICT else "")
    if STATS:
        tl.store(mean + rows, mu, mask=live)
        tl.store(rstd + rows, r, mask=live)
    if COUNT:
        tl.atomic_add(bad + rows * 0, 1, mask=live & (ok == 0))
        finite = (mu * mu < float("inf")) & (r > 0)  # (NaN compares false; r is 0 where the variance is inf)
        tl.atomic_add(bad + 1 + rows * 0, 1, mask=live & ok & (finite == 0))


@triton.jit
def _backward_kernel(ids, tts, pids, word, seg, pos, bad, N, H, V, T, P, p, seed, grad, gamma, mean, rstd, dx_buf,
                     dword, dpos, part, pad, DROPOUT: tl.constexpr, COUNT: tl.constexpr,
                     ROWS: tl.constexpr, ATOMIC: tl.constexpr, WANT_WORD: tl.constexpr, WANT_POS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """ROWS token rows per program, one at a time (as [1, BLOCK] blocks). Each program owns a [T + 2, H] slab of
    `part`: the segment gradient's T rows, zeroed here first (every token adds to one of a few segment rows: atomics
    there would serialise), then LayerNorm's weight and bias gradients; torch sums the slabs. Without ATOMIC the
    tokens' gradients go to `dx_buf`."""
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
        x, ok, w, s, q = _sum_rows(ids, tts, pids, word, seg, pos, rows, cols, cmask, H, V, T, P, False)
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
            tl.store(dx_buf + at, tl.where(m, dx, 0.0), mask=live[:, None] & cm)
        if COUNT:
            tl.atomic_add(bad + rows * 0, 1, mask=live & (ok == 0))
    tl.store(mine + T * H + c, acc_g, mask=cm)
    tl.store(mine + (T + 1) * H + c, acc_b, mask=cm)


def _launch(kernel, programs: int, name: str, ids, tts, pids, word, seg, pos, p: float, seed: int, *args, **options):
    """`kernel` on the arguments both kernels start with. On CPU tensors it counts bad ids, raised here, and rows that
    are not finite, returned; on a GPU nothing (a read-back would wait for the device)."""
    cpu = word.device.type == "cpu"
    bad = torch.zeros(2, dtype=torch.int32, device=word.device) if cpu else ids  # (ids, word: stand-ins, never written)
    if ids.numel():
        kernel[(programs,)](ids, tts, pids, word, seg, pos, bad, ids.numel(), word.shape[1], word.shape[0],
                            seg.shape[0], pos.shape[0], p, seed, *args, DROPOUT=p > 0, COUNT=cpu,
                            BLOCK=triton.next_power_of_2(word.shape[1]), **options)
    skipped, odd = bad.tolist() if cpu else (0, 0)
    if skipped:
        raise skipped_ids_error(skipped, f"bertembed triton {name}")
    return odd


def run_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps: float, p: float, seed: int, out=None,
                stats: bool = True, shape=None, strict: bool = False, num_warps: int | None = None, rows: int = 1,
                evict_first: bool = True):
    """As `bertembed.fast.cpu.run_forward` (`strict` on CPU tensors only: on a GPU a token whose moments are not finite
    keeps the kernel's answer). Tuning, defaults the fastest on an H100 (docs/gpu-kernels.md): `rows` token rows per
    program (a power of 2), `num_warps`, `evict_first` (the word rows read and the output written leave L2 first)."""
    n, h = ids.numel(), word.shape[1]
    # (the kernels read rows at a stride of 1: a LayerNorm weight may be a view, a column of a matrix)
    word, seg, pos, gamma, beta = (t.contiguous() for t in (word, seg, pos, gamma, beta))
    if out is None:  # (any contiguous shape: the kernel reads its address)
        out = torch.empty(shape or (n, h), dtype=word.dtype, device=word.device)
    # without stats `out` stands in for mean and rstd, as a pointer never written through
    mean, rstd = (torch.empty(n, device=word.device), torch.empty(n, device=word.device)) if stats else (out, out)
    # warps: one per KB of the row block, but one for float16/bfloat16 blocks of up to 1024 elements (measured)
    block, size = rows * triton.next_power_of_2(h), word.element_size()
    warps = num_warps or (1 if size < 4 and block <= 1024 else min(max(block * size // 1024, 1), 8))
    odd = _launch(_forward_kernel, triton.cdiv(n, rows), "forward", ids, tts, pids, word, seg, pos, p, seed, gamma,
                  beta, out, mean, rstd, eps, STATS=stats, EVICT=evict_first, R=rows, num_warps=warps)
    if odd and strict:
        raise RowsOverflowed(odd)
    return (out, mean, rstd) if stats else (out, None, None)


def run_backward(grad, ids, tts, pids, word, seg, pos, gamma, mean, rstd, p: float, seed: int, pad: int,
                 need_word: bool = True, need_pos: bool = True, deterministic: bool = False):
    """As `bertembed.fast.cpu.run_backward`; `deterministic` trades the atomics for a fixed summation order."""
    n, h = grad.shape
    word, seg, pos, gamma = (t.contiguous() for t in (word, seg, pos, gamma))  # (the kernel reads rows at stride 1)
    f32 = dict(dtype=torch.float32, device=word.device)
    rows = max(1, triton.cdiv(n, 1024))  # about a thousand programs, each with partial LayerNorm gradients
    programs = max(1, triton.cdiv(n, rows))
    # A table's gradient not summed by atomics gets one row, never used: a kernel argument must point at real memory
    dword = torch.zeros(word.shape[0] if need_word and not deterministic else 1, h, **f32)
    dpos = torch.zeros(pos.shape[0] if need_pos and not deterministic else 1, h, **f32)
    types = seg.shape[0]
    part = (torch.empty if n else torch.zeros)(programs, types + 2, h, **f32)  # each program's slab, filled by it
    dx = torch.empty(n if deterministic else 1, h, **f32)
    _launch(_backward_kernel, programs, "backward", ids, tts, pids, word, seg, pos, p, seed, grad.contiguous(), gamma,
            mean, rstd, dx, dword, dpos, part, pad, ROWS=rows, ATOMIC=not deterministic, WANT_WORD=need_word,
            WANT_POS=need_pos, num_warps=4)
    if deterministic:  # torch's embedding backward sums dx by id (a bad id's row is zero: clamped, it adds nothing)
        dense = torch.ops.aten.embedding_dense_backward
        dword = dense(dx, ids.clamp(0, word.shape[0] - 1), word.shape[0], pad, False) if need_word else dword
        dpos = dense(dx, pids.clamp(0, pos.shape[0] - 1), pos.shape[0], -1, False) if need_pos else dpos
    dword, dpos = dword if need_word else dword[:0], dpos if need_pos else dpos[:0]
    sums = part.sum(0)  # [T + 2, H]: segment gradient, LayerNorm weight and bias gradients, in one reduction
    # views of one buffer; the custom op copies them apart (`function.embeddings_backward_op`)
    return dword.to(word.dtype), sums[:types].to(word.dtype), dpos.to(word.dtype), sums[types].to(gamma.dtype), \
        sums[types + 1].to(gamma.dtype)
