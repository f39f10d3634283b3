"""Fresh memory for large outputs and gradients: telling it apart, and asking for huge pages for it (Linux; elsewhere
no-ops).

Under glibc's default settings an allocation over 32 MB (BERT-base's 94 MB word gradient) is a new mapping: none of
its pages is in RAM, and the kernel zero-fills each 4 KB page at its first write, one fault per page. On this VM,
allocating and zeroing 94 MB that way took 18 ms with ordinary stores and 31 ms with non-temporal ones (which write
around the line the fault has just zeroed in the cache), against 2 ms for memory glibc kept. With 2 MB pages
(`madvise(MADV_HUGEPAGE)`, honoured when /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`) the
same took 8 ms, with a rare stall of 100+ ms (`huge_pages`, which `BERTEMBED_HUGE_PAGES=0` turns off). The CPU
kernels' outputs and word gradients go through `advise_if_fresh`; the zeros of kept memory are streamed
(`bertembed.kernels.cpu`).

Tables are read, not written: a batch reads rows all over a 94 MB word table, and on 4 KB pages each row is a page the
TLB (8 MB of 4 KB pages on this VM's CPU) has not mapped. `collapse_table` moves a large table onto 2 MB pages once,
at its first batch (`madvise(MADV_COLLAPSE)`, Linux 6.1+): 25-185 ms once, then forward at (32, 128) 1.15x and
(64, 512) 1.10x faster. Its values do not change. `BERTEMBED_COLLAPSE_TABLES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import time

import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from bertembed.kernels.cpu_elements import call_symbol

_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14  # <linux/mman.h>
_ADVISE_FROM = 4 << 20  # bytes: two huge pages at least
_MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1+
_COLLAPSE_FROM = 16 << 20  # bytes: past the reach of the TLB's 4 KB entries
_LINUX = sys.platform.startswith("linux")
_libc: list = []
_collapsed: set = set()  # (address, bytes) of the tables asked for already
_advice: list = []  # `huge_pages`'s answer, once read
logger = logging.getLogger(__name__)


def _linux_libc():
    """The C library with `madvise` declared, or None off Linux (for `collapse_table`, which reports errno)."""
    if not _LINUX:
        return None
    if not _libc:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.append(libc)
    return _libc[0]


@intrinsic
def _page_absent(typingctx, address):
    """Whether the page at `address` (page-aligned) is not in RAM: `mincore` says so, and succeeds. False off Linux."""
    def codegen(context, builder, signature, args):
        int8, int32, int64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        if not _LINUX:
            return ir.Constant(ir.IntType(1), 0)
        resident = cgutils.alloca_once_value(builder, ir.Constant(int8, 1))
        failed = call_symbol(builder, "mincore", int32,
                             [builder.inttoptr(args[0], int8.as_pointer()), ir.Constant(int64, _PAGE), resident])
        absent = builder.icmp_unsigned("==", builder.and_(builder.load(resident), ir.Constant(int8, 1)),
                                       ir.Constant(int8, 0))
        return builder.and_(builder.icmp_signed("==", failed, ir.Constant(int32, 0)), absent)

    return types.boolean(address), codegen


@intrinsic
def _advise(typingctx, address, length, advice):
    """`madvise(address, length, advice)` on Linux, its result ignored (advice only changes speed); elsewhere
    nothing."""
    def codegen(context, builder, signature, args):
        if _LINUX:
            start, length, advice = (context.cast(builder, value, kind, wanted) for value, kind, wanted
                                     in zip(args, signature.args, (types.intp, types.intp, types.int32), strict=True))
            call_symbol(builder, "madvise", ir.IntType(32),
                        [builder.inttoptr(start, ir.IntType(8).as_pointer()), length, advice])
        return context.get_dummy_value()

    return types.void(address, length, advice), codegen


@njit(cache=True)
def fresh_at(address, nbytes):
    """Whether the first whole page of the `nbytes` at `address` is not in RAM yet (`mincore`): a new mapping, whose
    pages fault in at their first write. A hint for choosing how to write the memory, never for skipping a write.
    Compiled, as the other `_at` functions: the short path calls it from its one compiled call (from Python, it costs
    a tenth of a `ctypes` call)."""
    start = (address + _PAGE - 1) & -_PAGE
    return start + _PAGE <= address + nbytes and _page_absent(start)


@njit(cache=True)
def advise_huge_pages_at(address, nbytes):
    """Ask the kernel for 2 MB pages over the 2 MB-aligned middle of the `nbytes` at `address` (one fault per 2 MB at
    first write instead of 512); the kernel may decline, which changes nothing but speed."""
    start, stop = (address + _HUGE - 1) & -_HUGE, (address + nbytes) & -_HUGE
    if stop > start:
        _advise(start, stop - start, _MADV_HUGEPAGE)


def huge_pages() -> bool:
    """Whether fresh memory is asked onto 2 MB pages: yes, unless the environment variable BERTEMBED_HUGE_PAGES=0
    (read at the first large output or gradient).

    The trade, measured on this VM (docs/memory.md, "The tail": a fresh 94 MB block allocated, zeroed on two
    threads and freed, 400 times each way, two runs): on 2 MB pages 8.9-9.5 ms in the median and 9.5-14.0 on average,
    against 20.4-20.8 and 20.6-21.1 on 4 KB pages; but 3 and 17 of the 400 took over 3x the median, the slowest
    122-158 ms, nearly all of it in the kernel, where 4 KB pages never passed 40 ms. A fused training step at
    (32, 128), hidden 768, under glibc's default settings (docs/memory.md, 300 steps, two runs):
    18.3-19.9 ms in the median with a 99th percentile of 121-132 ms, against 34.7-36.0 and 40-45 ms with the switch
    off. A program that needs every call fast, rather than many calls fast on average, can turn them off."""
    if not _advice:
        _advice.append(os.environ.get("BERTEMBED_HUGE_PAGES") != "0")
    return _advice[0]


@njit(cache=True)
def advise_if_fresh_at(address, nbytes, huge):
    """For memory of `_ADVISE_FROM` bytes or more: whether it is fresh (`fresh_at`), and if so and `huge`
    (`huge_pages()`), ask for 2 MB pages for it."""
    if nbytes < _ADVISE_FROM or not fresh_at(address, nbytes):
        return False
    if huge:
        advise_huge_pages_at(address, nbytes)
    return True


def is_fresh(t: torch.Tensor) -> bool:
    """`fresh_at` of a tensor's memory."""
    return fresh_at(t.data_ptr(), t.nbytes)


def advise_huge_pages(t: torch.Tensor) -> None:
    """`advise_huge_pages_at` of a tensor's memory."""
    advise_huge_pages_at(t.data_ptr(), t.nbytes)


def advise_if_fresh(t: torch.Tensor) -> bool:
    """`advise_if_fresh_at` of a new tensor's memory: whether it was fresh."""
    return advise_if_fresh_at(t.data_ptr(), t.nbytes, huge_pages())


def collapse_table(address: int, nbytes: int) -> bool:
    """Move the 2 MB-aligned middle of a table (at `address`, `nbytes` long, of `_COLLAPSE_FROM` bytes or more) onto
    2 MB pages now, once per table (`MADV_COLLAPSE`: the kernel copies it into huge pages, values unchanged). Returns
    whether it asked now; the kernel may decline (an older kernel, no free huge pages), which changes nothing but
    speed. Off with the environment variable BERTEMBED_COLLAPSE_TABLES=0, read at a table's first batch. Every later
    batch costs one set lookup."""
    if (address, nbytes) in _collapsed or nbytes < _COLLAPSE_FROM:
        return False
    _collapsed.add((address, nbytes))
    libc = _linux_libc()
    if libc is None or os.environ.get("BERTEMBED_COLLAPSE_TABLES") == "0":
        return False
    start, stop = (address + _HUGE - 1) & -_HUGE, (address + nbytes) & -_HUGE
    began = time.perf_counter()
    failed = stop > start and libc.madvise(start, stop - start, _MADV_COLLAPSE) != 0
    outcome = f"declined ({os.strerror(ctypes.get_errno())})" if failed else "done"
    logger.debug("a %d MB table onto 2 MB pages: %s in %.1f ms", nbytes >> 20, outcome,
                 (time.perf_counter() - began) * 1e3)
    return True
