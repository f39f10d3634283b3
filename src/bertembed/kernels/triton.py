"""Triton kernels: BERT's embedding layer in one pass per token on a GPU, forward and backward.

One program per token row (forward): gather the word row, add the segment row then the position row (rounded to the
tables' dtype after each add, as torch does in float16/bfloat16), LayerNorm in float32, scale and shift, dropout from
`tl.rand(seed, element)` (recomputed in backward, never stored). Backward: each program takes a block of rows,
recomputes the sum from the tables, does the LayerNorm backward, and adds the row gradients into float32 table
gradients, with atomics (fast) or, with `deterministic=True`, through a [N, H] buffer summed per table row in a fixed
order by a second kernel. LayerNorm weight and bias gradients are per-program partials summed by torch.

Correctness is tested on CPU tensors with TRITON_INTERPRET=1 (set before this module is imported).

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments, G programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype`, to nearest even, returned as float32. bfloat16 is rounded with integer ops: the
    interpreter's own conversion truncates, and these give the same bits on the GPU."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _sum_rows(ids, tts, pids, word, seg, pos, row, cols, cmask, H, V, T, P,
              HAS_POS: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """(x [BLOCK] float32 = (word[w] + seg[s]) + pos[q], ids valid); invalid ids load nothing.

    Ids and `ok` are broadcast to [BLOCK]: the interpreter cannot mask a block with a scalar condition."""
    zero = tl.zeros([BLOCK], dtype=tl.int64)
    w = zero + tl.load(ids + row)
    s = zero + tl.load(tts + row)
    q = zero + tl.load(pids + row)
    ok = (w >= 0) & (w < V) & (s >= 0) & (s < T)
    if HAS_POS:
        ok = ok & (q >= 0) & (q < P)
    m = cmask & ok
    x = tl.load(word + w * H + cols, mask=m, other=0.0).to(tl.float32)
    x = x + tl.load(seg + s * H + cols, mask=m, other=0.0).to(tl.float32)
    if ROUND:
        x = _round_to(x, word.dtype.element_ty)
    if HAS_POS:
        x = x + tl.load(pos + q * H + cols, mask=m, other=0.0).to(tl.float32)
        if ROUND:
            x = _round_to(x, word.dtype.element_ty)
    return x, ok, w, s, q


@triton.jit
def _forward_kernel(ids, tts, pids, word, seg, pos, gamma, beta, out, mean, rstd, bad, H, V, T, P, eps, p, seed,
                    HAS_POS: tl.constexpr, ROUND: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    x, ok, w, s, q = _sum_rows(ids, tts, pids, word, seg, pos, row, cols, cmask, H, V, T, P, HAS_POS, ROUND, BLOCK)
    mu = tl.sum(x, axis=0) / H
    d = tl.where(cmask, x - mu, 0.0)
    r = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / H + eps)
    g = tl.load(gamma + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(beta + cols, mask=cmask, other=0.0).to(tl.float32)
    y = d * r * g + b
    if DROPOUT:
        keep = tl.rand(seed, row * H + cols) >= p
        y = tl.where(keep, y / (1.0 - p), 0.0)
    tl.store(out + row * H + cols, _round_to(y, out.dtype.element_ty).to(out.dtype.element_ty), mask=cmask & ok)
    tl.store(mean + row, mu)
    tl.store(rstd + row, r)
    tl.atomic_add(bad + cols * 0, 1, mask=(cols == 0) & (ok == 0))


@triton.jit
def _backward_kernel(grad, ids, tts, pids, word, seg, pos, gamma, mean, rstd, dx_buf, dword, dseg, dpos,
                     dgamma, dbeta, bad, N, H, V, T, P, p, seed, pad, ROWS: tl.constexpr, HAS_POS: tl.constexpr,
                     ROUND: tl.constexpr, DROPOUT: tl.constexpr, ATOMIC: tl.constexpr, WANT_WORD: tl.constexpr,
                     WANT_POS: tl.constexpr, BLOCK: tl.constexpr):
    prog = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    g = tl.load(gamma + cols, mask=cmask, other=0.0).to(tl.float32)
    acc_g = tl.zeros([BLOCK], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(ROWS):
        row = prog * ROWS + k
        live = (tl.zeros([BLOCK], dtype=tl.int64) + row) < N
        row = tl.minimum(row, N - 1)
        x, ok, w, s, q = _sum_rows(ids, tts, pids, word, seg, pos, row, cols, cmask, H, V, T, P, HAS_POS, ROUND,
                                   BLOCK)
        ok = ok & live
        xhat = tl.where(cmask, (x - tl.load(mean + row)) * tl.load(rstd + row), 0.0)
        gy = tl.load(grad + row * H + cols, mask=cmask & ok, other=0.0).to(tl.float32)
        if DROPOUT:
            gy = tl.where(tl.rand(seed, row * H + cols) >= p, gy / (1.0 - p), 0.0)
        acc_g += gy * xhat
        acc_b += gy
        gg = gy * g
        dx = tl.load(rstd + row) * (gg - tl.sum(gg, axis=0) / H - xhat * (tl.sum(gg * xhat, axis=0) / H))
        if ATOMIC:
            if WANT_WORD:
                tl.atomic_add(dword + w * H + cols, dx, mask=cmask & ok & (w != pad))
            tl.atomic_add(dseg + s * H + cols, dx, mask=cmask & ok)
            if WANT_POS:
                tl.atomic_add(dpos + q * H + cols, dx, mask=cmask & ok)
        else:
            tl.store(dx_buf + row * H + cols, dx, mask=cmask & ok)
        tl.atomic_add(bad + cols * 0, 1, mask=(cols == 0) & live & (ok == 0))
    tl.store(dgamma + prog * H + cols, acc_g, mask=cmask)
    tl.store(dbeta + prog * H + cols, acc_b, mask=cmask)


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


def _check_bad(bad: torch.Tensor, where: str) -> None:
    """Count of tokens a kernel skipped for bad ids; read only on CPU (interpreter), a GPU sync is not worth it: the
    loads are masked, so a bad id reads nothing either way."""
    if bad.device.type == "cpu" and int(bad):
        raise RuntimeError(f"{where}: {int(bad)} tokens had ids outside their tables and were skipped; ids must be "
                           f"checked with bertembed.validation.check_inputs before a kernel runs (this is a bug)")


def _block(hidden: int) -> int:
    return triton.next_power_of_2(hidden)


def run_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps: float, p: float, seed: int, out=None):
    """As `bertembed.kernels.cpu.run_forward`: (out [N, H] in the tables' dtype, mean [N], rstd [N] float32)."""
    n, h = ids.numel(), word.shape[1]
    out = torch.empty(n, h, dtype=word.dtype, device=word.device) if out is None else out.view(n, h)
    mean = torch.empty(n, device=word.device)
    rstd = torch.empty(n, device=word.device)
    bad = torch.zeros(1, dtype=torch.int32, device=word.device)
    if n:
        _forward_kernel[(n,)](ids, tts, pids, word, seg, word if pos is None else pos, gamma, beta, out, mean, rstd,
                              bad, h, word.shape[0], seg.shape[0], 0 if pos is None else pos.shape[0], eps, p, seed,
                              HAS_POS=pos is not None, ROUND=word.dtype != torch.float32, DROPOUT=p > 0,
                              BLOCK=_block(h), num_warps=min(max(_block(h) // 256, 1), 8))
    _check_bad(bad, "bertembed triton forward")
    return out, mean, rstd


def run_backward(grad, ids, tts, pids, word, seg, pos, gamma, mean, rstd, p: float, seed: int, pad: int,
                 need_word: bool = True, need_pos: bool = True, deterministic: bool = False):
    """As `bertembed.kernels.cpu.run_backward`; `deterministic` trades the atomics for a fixed summation order."""
    n, h = grad.shape
    dev = word.device
    want_pos = need_pos and pos is not None
    f32 = dict(dtype=torch.float32, device=dev)
    # Unwanted gradients get one row, never read or written: a kernel argument must point at real device memory.
    dword = torch.zeros(word.shape[0] if need_word else 1, h, **f32)
    dseg = torch.zeros(seg.shape[0], h, **f32)
    dpos = torch.zeros(pos.shape[0] if want_pos else 1, h, **f32)
    rows = max(1, triton.cdiv(n, 1024))  # about a thousand programs, each with partial LayerNorm gradients
    programs = max(1, triton.cdiv(n, rows))
    dgamma, dbeta = torch.zeros(programs, h, **f32), torch.zeros(programs, h, **f32)
    dx = torch.empty(n if deterministic else 1, h, **f32)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    if n:
        _backward_kernel[(programs,)](
            grad.contiguous(), ids, tts, pids, word, seg, word if pos is None else pos, gamma, mean, rstd, dx, dword,
            dseg, dpos, dgamma, dbeta, bad, n, h, word.shape[0], seg.shape[0], 0 if pos is None else pos.shape[0], p,
            seed, pad, ROWS=rows, HAS_POS=pos is not None, ROUND=word.dtype != torch.float32, DROPOUT=p > 0,
            ATOMIC=not deterministic, WANT_WORD=need_word, WANT_POS=want_pos, BLOCK=_block(h))
    _check_bad(bad, "bertembed triton backward")
    if deterministic and n:
        if need_word:
            _segment_sum(dx, ids, dword, skip=pad)
        _segment_sum(dx, tts, dseg)
        if want_pos:
            _segment_sum(dx, pids, dpos)
    dtype = word.dtype
    dword, dpos = dword if need_word else dword[:0], dpos if want_pos else dpos[:0]
    return (dword.to(dtype), dseg.to(dtype), dpos.to(dtype), dgamma.sum(0).to(gamma.dtype),
            dbeta.sum(0).to(gamma.dtype))


def _segment_sum(dx: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, skip: int = -1) -> None:
    """out[id] = sum of the dx rows of the tokens with that id, in token order (a stable sort): deterministic."""
    sorted_ids, order = torch.sort(ids, stable=True)
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=dx.device)
    starts[1:] = torch.cumsum(counts, 0)
    keep = rows != skip  # the padding row keeps a zero gradient
    begins, ends, rows = starts[:-1][keep].contiguous(), starts[1:][keep].contiguous(), rows[keep].contiguous()
    if rows.numel():
        _segment_sum_kernel[(rows.numel(),)](dx, order, begins, ends, rows, out, dx.shape[1], BLOCK=_block(dx.shape[1]))
