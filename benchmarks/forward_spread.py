"""Where the fused forward's spread between processes comes from: the same forward over several freshly drawn
tables, taken in turn in one process, at one thread and at two.

    MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_MMAP_MAX_=0 python benchmarks/forward_spread.py [--tables 6]

Hidden 768, (B, L) = (32, 128), random weights and ids, the CPU kernel into one `out=` buffer. Each round times
every table once (a block of calls, one thread then two), so a slow table shows in every round and a slow minute
in every table. Prints, per thread count, each table's median block in ms with its range over the rounds, and the
two-thread speed-up. Same table medians mean the spread is not the tables' memory (their pages, where the host put
them); levels that move between runs of this script mean it comes with the machine's state.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bertembed import BertEmbeddings, EmbeddingConfig
from bertembed.kernels import fused_embeddings


def block_ms(tables, ids, segments, out, calls: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(calls):
            fused_embeddings(ids, *tables, token_type_ids=segments, backend="cpu", out=out)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="calls in a timed block")
    args = parser.parse_args()
    layers = [BertEmbeddings(EmbeddingConfig(hidden_size=768), backend="cpu").eval() for _ in range(args.tables)]
    tables = [(m.word_embeddings.weight, m.token_type_embeddings.weight, m.position_embeddings.weight,
               m.LayerNorm.weight, m.LayerNorm.bias) for m in layers]
    ids, segments = torch.randint(0, 30522, (32, 128)), torch.randint(0, 2, (32, 128))
    out = torch.empty(32, 128, 768)
    times = {threads: [[] for _ in tables] for threads in (1, 2)}
    for threads in times:  # settle: compile, collapse each table onto 2 MB pages, start the pool
        torch.set_num_threads(threads)
        for t in tables:
            block_ms(t, ids, segments, out, 3)
    for _ in range(args.rounds):
        for threads, per_table in times.items():
            torch.set_num_threads(threads)
            for t, row in zip(tables, per_table, strict=True):
                row.append(block_ms(t, ids, segments, out, args.calls))
    medians = {}
    for threads, per_table in times.items():
        medians[threads] = float(np.median([np.median(row) for row in per_table]))
        cells = " ".join(f"{np.median(row):.2f} ({min(row):.2f}-{max(row):.2f})" for row in per_table)
        print(f"{threads} thread{'s' if threads > 1 else ''}, ms a call per table: {cells}")
    print(f"two threads' speed-up: {medians[1] / medians[2]:.2f}x")


if __name__ == "__main__":
    main()
