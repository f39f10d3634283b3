"""The spread of a fused training step, not just its median: forward and backward of the fused layer in a loop, a
fresh word gradient each step (`zero_grad(set_to_none=True)`, as optimizers do by default), glibc's settings as the
process got them.

    python benchmarks/training_step_tail.py [--shape 32x128] [--hidden 768] [--steps 300]
    BERTEMBED_HUGE_PAGES=0 python benchmarks/training_step_tail.py      # fresh memory on 4 KB pages

Prints the median, 90th and 99th percentiles and the largest step (ms), and how many steps took over 3x the median;
the first step (compiling or loading the kernels) is left out.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bertembed import BertEmbeddings, EmbeddingConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="32x128", help="BxL (default 32x128)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    batch, length = (int(x) for x in args.shape.split("x"))
    layer = BertEmbeddings(EmbeddingConfig(hidden_size=args.hidden), backend=args.backend).train()
    ids = torch.randint(1, layer.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    steps = []
    for _ in range(args.steps + 1):
        began = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        layer(ids).sum().backward()
        steps.append((time.perf_counter() - began) * 1e3)
    steps = sorted(steps[1:])
    median = statistics.median(steps)
    p90, p99 = (steps[int(q * (len(steps) - 1))] for q in (0.9, 0.99))
    print(f"{args.backend} training step, H {args.hidden}, ({batch}, {length}), {args.steps} steps: median "
          f"{median:.1f} ms, p90 {p90:.1f}, p99 {p99:.1f}, max {steps[-1]:.1f}; "
          f"over 3x the median: {sum(s > 3 * median for s in steps)}")


if __name__ == "__main__":
    main()
