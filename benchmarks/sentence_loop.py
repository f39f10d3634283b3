"""One sentence through a fused CPU layer in a tight loop: (1, 11), H 768, BERT-sized random tables, eval mode under
`torch.no_grad()`, 2 threads. Prints the median over 30 blocks of each block's median call, in ns: fine enough to see
a change of 0.1 us in the glue, which `glue_overhead.py`'s milliseconds round away.

    python benchmarks/sentence_loop.py

To compare revisions, run it with `PYTHONPATH=<worktree>/src` for each, alternating, several times: this VM drifts by
a few percent between processes.
"""

from __future__ import annotations

import statistics
import time

import torch

from bertembed import BertEmbeddings, EmbeddingConfig


def main() -> None:
    torch.set_num_threads(2)
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=30522, hidden_size=768), backend="cpu").eval()
    ids = torch.randint(0, 30522, (1, 11), generator=torch.Generator().manual_seed(0))
    types = torch.zeros_like(ids)
    medians = []
    with torch.no_grad():
        for _ in range(3000):  # compiled kernels loaded, caches built
            layer(ids, types)
        for _ in range(30):
            times = []
            for _ in range(2000):
                start = time.perf_counter_ns()
                layer(ids, types)
                times.append(time.perf_counter_ns() - start)
            medians.append(statistics.median(times))
    print(f"(1, 11) module call: {statistics.median(medians):.0f} ns")


if __name__ == "__main__":
    main()
