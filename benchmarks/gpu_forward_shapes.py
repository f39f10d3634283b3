"""Launch shapes of the Triton inference forward against `torch.compile`'s kernel, alternated in one process.

    python benchmarks/gpu_forward_shapes.py [--hidden 1024 768] [--dtype float32 bfloat16]

At (64, 512) the shipped forward (one token row a program, four warps at hidden 1024) and Inductor's (one row a
program, one warp) move the same DRAM bytes and tie (BENCHMARKS.md, "The fourth GPU session"). Untried until now:
- Inductor's own shape, one warp a row, and two warps a row;
- several rows a program with one warp a row's worth of threads (`rows` = `num_warps`);
- a persistent kernel: a few programs a multiprocessor, each looping over tokens `t = pid, pid + G, ...`, with the
  same row code as the shipped kernel (`_sum_rows`, NaN rows for bad ids, `evict_first`), with and without
  loading the next token's rows before the current row's LayerNorm and store (a software pipeline by hand).
Each candidate is checked against transformers' layer, then timed by `gpu_cache_hints.time_forwards`: event-timed
back-to-back loops over three id streams (same, fresh uniform, Zipf), and GPU time from the profiler.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl
from gpu_cache_hints import time_forwards

from bertembed.bench.cases import Case
from bertembed.kernels import triton as triton_kernels


@triton.jit
def _normalised(x, ok, cmask, g, b, H, eps):
    mu = tl.sum(x, axis=1) / H
    d = tl.where(cmask[None, :], x - mu[:, None], 0.0)
    r = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / H + eps)
    y = d * r[:, None] * g[None, :] + b[None, :]
    return tl.where(ok[:, None], y, float("nan"))


@triton.jit
def _persistent_forward(ids, tts, word, seg, pos, gamma, beta, out, N, H, V, T, P, L, eps, HAS_TT: tl.constexpr,
                        ROUND: tl.constexpr, AHEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Tokens pid, pid + G, ... of the inference forward (default positions); AHEAD loads the next token's rows
    before the current one's LayerNorm and store."""
    pid, G = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    g = tl.load(gamma + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(beta + cols, mask=cmask, other=0.0).to(tl.float32)
    if AHEAD:
        one = tl.arange(0, 1).to(tl.int64)
        rows = tl.minimum(one + pid, N - 1)
        x, ok, w, s, q = triton_kernels._sum_rows(ids, tts, ids, word, seg, pos, rows, cols, cmask, H, V, T, P, L, 0,
                                                  True, False, ROUND, HAS_TT, True)
        for t in range(pid, N, G):
            here, x_here, ok_here = rows, x, ok
            rows = tl.minimum(one + t + G, N - 1)  # past the end: row N - 1 again
            x, ok, w, s, q = triton_kernels._sum_rows(ids, tts, ids, word, seg, pos, rows, cols, cmask, H, V, T, P,
                                                      L, 0, True, False, ROUND, HAS_TT, True)
            y = _normalised(x_here, ok_here, cmask, g, b, H, eps)
            tl.store(out + here[:, None] * H + cols[None, :], y.to(out.dtype.element_ty), mask=cmask[None, :],
                     eviction_policy="evict_first")
    else:
        for t in range(pid, N, G):
            rows = tl.arange(0, 1).to(tl.int64) + t
            x, ok, w, s, q = triton_kernels._sum_rows(ids, tts, ids, word, seg, pos, rows, cols, cmask, H, V, T, P,
                                                      L, 0, True, False, ROUND, HAS_TT, True)
            y = _normalised(x, ok, cmask, g, b, H, eps)
            tl.store(out + rows[:, None] * H + cols[None, :], y.to(out.dtype.element_ty), mask=cmask[None, :],
                     eviction_policy="evict_first")


def persistent_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps, p, seed, out=None, stats=False,
                       length=None, past=0, per_sm=16, num_warps=4, ahead=False):
    """`run_forward`'s signature, for the short path's call only (no position ids, no dropout, no statistics)."""
    assert pids is None and p == 0.0 and not stats and past == 0
    n, h = ids.numel(), word.shape[1]
    sms = torch.cuda.get_device_properties(word.device).multi_processor_count if word.is_cuda else 2
    programs = min(n, per_sm * sms)
    _persistent_forward[(programs,)](ids, ids if tts is None else tts, word, seg, pos, gamma, beta, out, n, h,
                                     word.shape[0], seg.shape[0], pos.shape[0], length, eps, HAS_TT=tts is not None,
                                     ROUND=word.dtype != torch.float32, AHEAD=ahead,
                                     BLOCK=triton.next_power_of_2(h), num_warps=num_warps)
    return out, None, None


def candidates(hidden: int, dtype: str, persistent: bool = True) -> dict:
    ship = triton_kernels.run_forward
    warps = triton_kernels._warps(triton.next_power_of_2(hidden), getattr(torch, dtype).itemsize)
    found = {f"shipped (1 row, {warps} warps)": ship,
             "1 row, 1 warp (Inductor's)": functools.partial(ship, num_warps=1),
             "1 row, 2 warps": functools.partial(ship, num_warps=2),
             "1 row, 4 warps": functools.partial(ship, num_warps=4),
             "2 rows, 2 warps": functools.partial(ship, rows=2, num_warps=2),
             "4 rows, 4 warps": functools.partial(ship, rows=4, num_warps=4)}
    for per_sm, num_warps in ((16, warps), (8, warps), (32, 1)) if persistent else ():
        for ahead in (False, True):
            name = f"persistent {per_sm}/SM, {num_warps} warps{', next row ahead' if ahead else ''}"
            found[name] = functools.partial(persistent_forward, per_sm=per_sm, num_warps=num_warps, ahead=ahead)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 768])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--no-persistent", action="store_true", help="the one-launch-per-row shapes only")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for hidden in args.hidden:
        for dtype in args.dtype:
            case = Case(hidden, 64, 512, dtype=dtype, device="cuda")
            time_forwards(case, candidates(hidden, dtype, persistent=not args.no_persistent))


if __name__ == "__main__":
    main()
