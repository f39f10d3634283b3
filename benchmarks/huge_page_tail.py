"""What 2 MB pages do to fresh memory, in the median and in the tail: allocate a new 94 MB block (BERT-base's word
gradient; glibc maps anything over 32 MB afresh), ask for 2 MB pages for it or not, zero it, free it; the ways take
turns in one process. The third asks for 2 MB pages and faults them in on one thread before zeroing.

    python benchmarks/huge_page_tail.py [--mb 94] [--rounds 400] [--threads 2]

Prints per way: the median, mean, 99th percentile and largest time of one round (ms), how many rounds took over 3x
the median, and the system time of the slowest round (the page faults are the kernel's work). This is the trade behind
`bertembed.kernels.pages.huge_pages` and its switch, BERTEMBED_HUGE_PAGES=0.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from bertembed.kernels import pages

WAYS = ("2 MB pages", "4 KB pages", "2 MB, faulted in on one thread first")


def one_round(nbytes: int, way: str) -> tuple[float, float]:
    """(wall, system) seconds to allocate, advise or not, zero and free `nbytes` of fresh memory."""
    before, began = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
    block = torch.empty(nbytes // 4)
    if way != "4 KB pages":
        pages.advise_huge_pages(block)
    if way == WAYS[2]:
        block[:: (2 << 20) // 4] = 0.0  # one write a 2 MB page, on this thread: each page faults in here
    block.zero_()
    del block
    return time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF).ru_stime - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=94, help="block size in MB (default 94; over 32 for a new mapping)")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads that zero the block, as the kernels' threads fault in their pages (default: "
                             "torch's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    for i in range(args.rounds + 1):
        for k in range(len(WAYS)):
            way = WAYS[(i + k) % len(WAYS)]  # each way in turn, in a rotating order
            result = one_round(args.mb << 20, way)
            if i:  # the first round of each way warms up
                times[way].append(result)
    print(f"{args.mb} MB of fresh memory, allocated, zeroed on {args.threads} threads and freed {args.rounds} times "
          f"each way (ms):")
    for way, rounds in times.items():
        walls = sorted(wall * 1e3 for wall, _ in rounds)
        median = statistics.median(walls)
        slowest_sys = max(rounds)[1] * 1e3
        print(f"  {way:<37} median {median:6.1f}  mean {statistics.mean(walls):6.1f}  "
              f"p99 {walls[int(0.99 * (len(walls) - 1))]:6.1f}  max {walls[-1]:6.1f}  "
              f"over 3x median: {sum(w > 3 * median for w in walls):3d}  system time of the slowest: {slowest_sys:.1f}")


if __name__ == "__main__":
    main()
