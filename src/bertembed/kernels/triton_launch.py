"""Launching a Triton kernel with less Python per call than `kernel[grid](...)`.

`kernel[grid](...)` binds the arguments, asks Triton's C++ for each argument's specialisation (type, 16-byte alignment,
divisibility by 16, ints equal to 1), builds a cache key and looks the compiled kernel up. Where the kernel is short (15
us at (32, 128), hidden 768, on an H100) a loop of calls runs at the host's pace. `Launcher` keeps the compiled kernel
that Triton returned for a key of its own, which tells apart everything Triton's specialisation does (`spec`;
tests/test_kernels_triton.py checks that against Triton's), and launches it through the compiled kernel's own runner
(`compiled[grid](*args)`), which still calls Triton's launch hooks, so profilers see every launch. The first call for
each key, and every call under TRITON_INTERPRET=1, goes through `kernel[grid](...)`, so Triton compiles and caches as
usual. Measured on an H100 with Triton 3.6 (docs/gpu-kernels.md): 23.7 us a launch against Triton's 27.4
at (32, 128), 35.8 against 40.5 at (1, 11): a modest saving; the rest is the compiled kernel's runner and C launcher,
which this path still calls.
"""

from __future__ import annotations

import os

import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, as Triton reads it when kernels are decorated
_MAX_KEYS = 256  # distinct shapes and alignments remembered per kernel; past that the cache starts again


def spec(arg):
    """What Triton specialises a kernel on for this argument's value: a tensor's dtype and 16-byte alignment, an int's
    width, divisibility by 16 and equality to 1; a float or a bool only by type (bools by value here, finer)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if type(arg) is int:
        return arg == 1, arg & 15 == 0, -2**31 <= arg < 2**31, arg < 2**63
    return arg if type(arg) is bool or arg is None else type(arg)


class Launcher:
    """`Launcher(kernel)(programs, num_warps, **arguments)` runs a @triton.jit kernel on a 1-D grid."""

    def __init__(self, kernel):
        self.kernel = kernel
        if not _INTERPRET:
            self.names = kernel.arg_names
            self.constexpr = [p.is_constexpr for p in kernel.params]
        self.compiled: dict[tuple, object] = {}

    def __call__(self, programs: int, num_warps: int, **arguments) -> None:
        if _INTERPRET:
            self.kernel[(programs,)](**arguments, num_warps=num_warps)
            return
        args = [arguments[name] for name in self.names]  # Triton's runner takes every argument, constexprs too
        key = (num_warps, torch.cuda.current_device(),
               *[a if constant else spec(a) for a, constant in zip(args, self.constexpr, strict=True)])
        compiled = self.compiled.get(key)
        if compiled is not None:
            compiled[(programs, 1, 1)](*args)
            return
        if len(self.compiled) >= _MAX_KEYS:
            self.compiled.clear()
        self.compiled[key] = self.kernel[(programs,)](*args, num_warps=num_warps)
