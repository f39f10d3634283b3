"""How long numba takes to compile the fused CPU kernels that `bertembed bench --quick` calls, from an empty cache:
each of the four first calls (as `bertembed.bench.prewarm` makes them), and the compile time of each function with
the time of the functions it compiled on the way taken out.

    NUMBA_CACHE_DIR=$(mktemp -d) python benchmarks/compile_time.py

Run it with an empty NUMBA_CACHE_DIR, or it times loading the cache instead.
"""

from __future__ import annotations

import time

from numba.core import event

from bertembed.bench import candidates as cands
from bertembed.bench.cases import default_cases
from bertembed.bench.prewarm import kernel_cases


def main() -> None:
    import bertembed.kernels.lean  # noqa: F401  (imported before the clock starts, as the bench has it)

    recorder = event.RecordingListener()
    event.register("numba:compile", recorder)
    started = time.perf_counter()
    for case in kernel_cases(default_cases(quick=True)):
        candidate = cands.build("bertembed-fused", cands.make_workload(case, vocab_size=30522))
        start = time.perf_counter()
        candidate.call()
        print(f"{case.key:40s} first call {time.perf_counter() - start:5.1f} s", flush=True)
    print(f"{'all four':40s}            {time.perf_counter() - started:5.1f} s")
    stack, own = [], {}  # [name, start, time in callees]; seconds of each function's own compiling
    for stamp, ev in recorder.buffer:
        if ev.is_start:
            stack.append([ev.data["dispatcher"].py_func.__qualname__, stamp, 0.0])
            continue
        name, start, inner = stack.pop()
        own[name] = own.get(name, 0.0) + (stamp - start) - inner
        if stack:
            stack[-1][2] += stamp - start
    print("own compile time, largest first:")
    for name, seconds in sorted(own.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {seconds:5.2f} s  {name}")


if __name__ == "__main__":
    main()
