"""Whether the CPU forward should stream outputs smaller than `cpu_run._STREAM_OUT_FROM`: the fused layer's eval
forward with that threshold at 1 MiB (streamed) and at 32 MiB (not, below it), alternating in one process, alone and
followed by a read of its output (`out.sum()`, as the next layer would read it).

    MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_MMAP_MAX_=0 python benchmarks/stream_threshold.py [--dtype bfloat16]

Hidden 768, random weights, 2 threads; each line: the median of 7 alternating blocks per side, in ms, and
cached / streamed (above 1: streaming is faster). Non-temporal stores skip reading each output line before writing
it, but send the lines to memory, where the next reader must fetch them from.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bertembed import BertEmbeddings, EmbeddingConfig
from bertembed.kernels import cpu_run

SHAPES = [(4, 128), (8, 128), (16, 128), (32, 128), (8, 512), (64, 512)]
STREAMED, CACHED = 1 << 20, 32 << 20  # the threshold, in bytes, for each side


def block_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def compare(fn, calls: int) -> tuple[float, float]:
    """Median block time (ms) with the threshold at STREAMED and at CACHED, blocks alternating."""
    blocks = {STREAMED: [], CACHED: []}
    for threshold in blocks:  # settle both
        cpu_run._STREAM_OUT_FROM = threshold
        fn(), fn()
    for _ in range(7):
        for threshold, times in blocks.items():
            cpu_run._STREAM_OUT_FROM = threshold
            times.append(block_ms(fn, calls))
    return float(np.median(blocks[STREAMED])), float(np.median(blocks[CACHED]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(2)
    dtype, hidden = getattr(torch, args.dtype), 768
    layer = BertEmbeddings(EmbeddingConfig(hidden_size=hidden), backend="cpu").eval().to(dtype)
    gen = torch.Generator().manual_seed(0)
    saved = cpu_run._STREAM_OUT_FROM
    try:
        with torch.no_grad():
            for shape in SHAPES:
                ids = torch.randint(0, 30522, shape, generator=gen)
                calls = 10 if shape[0] * shape[1] < 10000 else 4
                cells = []
                steps = (("forward", lambda ids=ids: layer(ids)), ("forward + read", lambda ids=ids: layer(ids).sum()))
                for name, fn in steps:
                    streamed, cached = compare(fn, calls)
                    cells.append(f"{name}: streamed {streamed:.3f} ms, cached {cached:.3f} ms, "
                                 f"{cached / streamed:.2f}x")
                mib = shape[0] * shape[1] * hidden * dtype.itemsize / 2**20
                print(f"{shape} {mib:5.1f} MiB | " + " | ".join(cells), flush=True)
    finally:
        cpu_run._STREAM_OUT_FROM = saved


if __name__ == "__main__":
    main()
