"""Nanoseconds a token of the CPU forward kernel, without any torch glue: one thread with the table rows in cache
(what the per-token code costs), and `cpu.forward` on all threads over random rows of a BERT-sized table.

    python benchmarks/per_token.py [--hidden 768] [--repeat 3]

Each line is the median of 30 calls; float32 and bfloat16 tables and outputs. Compare runs only side by side in
one period of the machine (see BENCHMARKS.md, "What this VM does to timings").
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bertembed.kernels import cpu, cpu_run
from bertembed.kernels.cpu_elements import dropout_threshold

CASES = (  # name, tokens, vocabulary rows the ids are drawn from, parallel
    ("one thread, 1024 tokens, rows in cache (100 distinct)", 1024, 100, False),
    ("all threads, 32768 tokens, random rows of 30522", 32768, 30522, True),
)


def ns_per_token(dtype: torch.dtype, hidden: int, tokens: int, rows: int, parallel: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    word, seg, pos = (torch.randn(n, hidden, generator=gen).to(dtype) for n in (30522, 2, 512))
    gamma, beta = torch.ones(hidden), torch.zeros(hidden)
    ids = torch.randint(0, rows, (tokens,), generator=gen)
    tts, pids = torch.zeros(tokens, dtype=torch.int64), torch.arange(tokens) % 512
    out, mean, rstd = torch.empty(tokens, hidden, dtype=dtype), torch.empty(tokens), torch.empty(tokens)
    args = (ids.numpy(), tts.numpy(), pids.numpy(), *(cpu_run._np(t) for t in (word, seg, pos, gamma, beta)), 1e-12,
            dropout_threshold(0.0), 1.0, np.uint64(1), cpu_run._np(out), mean.numpy(), rstd.numpy())
    stream = cpu_run.stream_output(out, fresh=False)  # as run_forward chooses for a buffer used again
    if parallel:
        def call():
            cpu.forward(*args, cpu_run.forward_chunks(tokens), stream)
    else:
        def call():
            cpu._forward_chunk(0, tokens, *args, stream)
    call()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / tokens * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()
    torch.set_num_threads(2)
    for name, tokens, rows, parallel in CASES:
        for _ in range(options.repeat):
            f32, bf16 = (ns_per_token(dtype, options.hidden, tokens, rows, parallel)
                         for dtype in (torch.float32, torch.bfloat16))
            print(f"{name}: float32 {f32:.0f} ns, bfloat16 {bf16:.0f} ns a token")


if __name__ == "__main__":
    main()
