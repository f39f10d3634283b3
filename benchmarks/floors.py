"""How far the CPU forward kernel is from loops that only move its bytes: the same gather of random word rows and the
same output, with no LayerNorm, timed alternately in one process (hidden 768, 30522-row table on 2 MB pages, the
steady allocator's reused output, all threads).

    MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_MMAP_MAX_=0 python benchmarks/floors.py [--shape 32x128]

Loops, each over the same blocks of tokens per thread as the kernel:
    read rows      sum the word rows (reads only)
    write output   fill the output (writes only)
    gather + add   out[i] = word[ids[i]] + pos[pids[i]] (the kernel's traffic, with two adds an element)
    forward        `cpu.forward`, float32, no dropout
Prints the median of 15 alternating blocks of 20 calls each, in ms.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from bertembed.kernels import cpu, cpu_run, pages
from bertembed.kernels.cpu_elements import dropout_threshold


@njit(parallel=True, fastmath=True)
def read_rows(ids, word, chunks):
    n, total = ids.size, 0.0
    for c in prange(chunks):
        part = np.float32(0.0)
        for i in range(c * n // chunks, (c + 1) * n // chunks):
            row = word[ids[i]]
            for j in range(row.size):
                part += row[j]
        total += part
    return total


@njit(parallel=True)
def write_output(out, chunks):
    n = out.shape[0]
    for c in prange(chunks):
        out[c * n // chunks:(c + 1) * n // chunks] = 1.0


@njit(parallel=True, fastmath=True)
def gather_add(ids, pids, word, pos, out, chunks):
    n = out.shape[0]
    for c in prange(chunks):
        for i in range(c * n // chunks, (c + 1) * n // chunks):
            w, p = word[ids[i]], pos[pids[i]]
            for j in range(w.size):
                out[i, j] = w[j] + p[j]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="32x128", help="BxL")
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()
    batch, length = (int(v) for v in args.shape.split("x"))
    threads = torch.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    gen, n, hidden = np.random.default_rng(0), batch * length, args.hidden
    word = gen.standard_normal((30522, hidden), dtype=np.float32) * 0.05
    pages.collapse_table(word.ctypes.data, word.nbytes)  # as the layer does for a batch
    seg, pos = (gen.standard_normal((rows, hidden), dtype=np.float32) for rows in (2, 512))
    gamma, beta = np.ones(hidden, np.float32), np.zeros(hidden, np.float32)
    ids, tts, pids = gen.integers(0, 30522, n), gen.integers(0, 2, n), np.tile(np.arange(length), batch)
    out, mean, rstd = np.empty((n, hidden), np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
    chunks = cpu_run.chunks_for(n, threads)
    stream = n * hidden * 4 >= cpu_run._STREAM_OUT_FROM  # as the layer chooses for an output used again
    loops = {
        "read rows": lambda: read_rows(ids, word, chunks),
        "write output": lambda: write_output(out, chunks),
        "gather + add": lambda: gather_add(ids, pids, word, pos, out, chunks),
        "forward": lambda: cpu.forward(ids, tts, pids, word, seg, pos, gamma, beta, 1e-12, dropout_threshold(0.0),
                                       1.0, np.uint64(0), out, mean, rstd, chunks, stream),
    }
    times: dict[str, list[float]] = {name: [] for name in loops}
    for loop in loops.values():
        loop()
        loop()
    for _ in range(15):
        for name, loop in loops.items():
            start = time.perf_counter()
            for _ in range(20):
                loop()
            times[name].append((time.perf_counter() - start) / 20 * 1e3)
    print(f"({batch}, {length}), hidden {hidden}, {threads} threads, {chunks} chunks, streamed output: {stream}")
    floor = float(np.median(times["gather + add"]))
    for name, values in times.items():
        median = float(np.median(values))
        print(f"{name:14s} {median:7.3f} ms   {median / floor:5.2f}x gather + add")


if __name__ == "__main__":
    main()
