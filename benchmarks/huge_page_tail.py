"""What 2 MB pages do to fresh memory, in the median and in the tail: allocate a new 94 MB block (BERT-base's word
gradient; glibc maps anything over 32 MB afresh), ask for 2 MB pages for it or not, zero it, free it; the two ways
alternate in one process.

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


def one_round(nbytes: int, huge: bool) -> tuple[float, float]:
    """(wall, system) seconds to allocate, advise or not, zero and free `nbytes` of fresh memory."""
    before, began = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
    block = torch.empty(nbytes // 4)
    if huge:
        pages.advise_huge_pages(block)
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
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(args.rounds + 1):
        for huge in (i % 2 == 0, i % 2 == 1):
            result = one_round(args.mb << 20, huge)
            if i:  # the first round of each way warms up
                times[huge].append(result)
    print(f"{args.mb} MB of fresh memory, allocated, zeroed on {args.threads} threads and freed {args.rounds} times "
          f"each way (ms):")
    for huge, rounds in times.items():
        walls = sorted(wall * 1e3 for wall, _ in rounds)
        median = statistics.median(walls)
        slowest_sys = max(rounds)[1] * 1e3
        way = "2 MB pages" if huge else "4 KB pages"
        print(f"  {way:<11} median {median:6.1f}  mean {statistics.mean(walls):6.1f}  "
              f"p99 {walls[int(0.99 * (len(walls) - 1))]:6.1f}  max {walls[-1]:6.1f}  "
              f"over 3x median: {sum(w > 3 * median for w in walls):3d}  system time of the slowest: {slowest_sys:.1f}")


if __name__ == "__main__":
    main()
