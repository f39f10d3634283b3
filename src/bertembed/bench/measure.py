"""Timers, peak memory, copy bandwidth and the allocator condition, the measuring half of `bertembed bench`."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import benchmark

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
STEADY_TRIM_THRESHOLD = 1 << 40  # never give freed heap memory back to the kernel
# The same settings as environment variables, read by glibc before the first malloc: the clean way to set them.
STEADY_ENV = {"MALLOC_TRIM_THRESHOLD_": str(STEADY_TRIM_THRESHOLD), "MALLOC_MMAP_MAX_": "0"}

PEAK_METHOD_CPU = ("torch.profiler(profile_memory=True): running sum of the allocator's alloc/free events during one "
                   "call, max above the level before it; sees torch tensors only (not ORT's or numpy's buffers)")
PEAK_METHOD_CUDA = "torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus the level before the call"


@dataclass
class Timing:
    """Seconds per call: median and interquartile range over the timer's blocks."""

    median: float
    iqr: float
    runs: int


def time_call(fn: Callable[[], Any], threads: int, min_run_time: float, label: str = "") -> Timing:
    """Time `fn()` with `torch.utils.benchmark.Timer.blocked_autorange` (it synchronises CUDA around blocks)."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads, label=label)
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(median=measurement.median, iqr=measurement.iqr, runs=len(measurement.times))


def warm_up(fn: Callable[[], Any], calls: int = 3) -> None:
    """Run `fn` a few times: compiles, first-touch page faults and caches settle before timing."""
    for _ in range(calls):
        fn()


def peak_bytes_cpu(fn: Callable[[], Any]) -> int:
    """Peak bytes that torch's CPU allocator held during one call of `fn`, above the level before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def peak_bytes_cuda(fn: Callable[[], Any]) -> int:
    """Peak bytes of the CUDA caching allocator during one call of `fn`, above the level before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


def peak_bytes(fn: Callable[[], Any], device: str) -> int:
    return peak_bytes_cuda(fn) if device.startswith("cuda") else peak_bytes_cpu(fn)


def copy_bandwidth(device: str = "cpu", nbytes: int = 1 << 30, threads: int = 2, min_run_time: float = 0.5) -> float:
    """Measured memory-copy bandwidth in bytes/s, counting read + write (2 x nbytes per copy): the best block of a
    `torch.utils.benchmark` run of `dst.copy_(src)` on float32 tensors above the last-level cache (1 GiB default)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    timer = benchmark.Timer(stmt="dst.copy_(src)", globals={"dst": dst, "src": src}, num_threads=threads)
    best = min(timer.blocked_autorange(min_run_time=min_run_time).times)
    return 2 * nbytes / best


def apply_steady_malloc() -> bool:
    """Set glibc's `M_MMAP_MAX` to 0 in this process, and `M_TRIM_THRESHOLD` to its largest int where `STEADY_ENV`
    did not already set it from the first allocation (mallopt takes an int: it would lower the 1 TiB of the
    environment to 2 GiB). Returns False where there is no glibc mallopt."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(M_MMAP_MAX, ctypes.c_int(0))
        if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
            ok = ok and libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))
    except (OSError, AttributeError) as err:
        log.warning("no glibc mallopt (%s): the steady allocator condition relies on %s alone", err, STEADY_ENV)
        return False
    return bool(ok)


def allocator_env(condition: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a worker in `condition` ("steady": STEADY_ENV set; "default": both variables removed)."""
    env = dict(os.environ if base is None else base)
    for name in STEADY_ENV:
        env.pop(name, None)
    if condition == "steady":
        env.update(STEADY_ENV)
    elif condition != "default":
        raise ValueError(f"allocator condition must be 'steady' or 'default', got {condition!r}")
    return env
