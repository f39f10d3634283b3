"""Element-level building blocks of the CPU kernels (numba): the dropout hash, bfloat16 widening and rounding, a
token's table rows, arrays without reference counts, and a guard against stale on-disk caches.
`bertembed.kernels.cpu` builds the per-token passes from them, and from `bertembed.kernels.cpu_rows` (how rows move
between memory and the core).

numba has no bfloat16, so bfloat16 arrives as its uint16 bit pattern: widened to float32 by a shift, rounded back to
nearest-even by integer arithmetic (an output row: `cpu_rows`, by the CPU's own instruction where it has one).
Helpers that dispatch on dtype are `overload`s, resolved when a kernel compiles.

numba's on-disk cache (`cache=True`) is keyed on the file of the function it compiled, not on the helpers it inlined:
importing this module deletes the cached kernels of `cpu.py` and `lean.py` that are older than a file they inline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import errors, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_HERE = Path(__file__).parent
# numba keys a file's on-disk cache on that file alone (numba issue 1833): a kernel that inlines helpers from another
# file keeps running their old code after an edit there. Which files each cached module inlines:
_INLINES = {"cpu": ("cpu_elements.py", "cpu_rows.py"), "cpu_run": ("cpu_elements.py",), "pages": ("cpu_elements.py",),
            "lean": ("cpu_elements.py", "cpu_rows.py", "cpu.py", "cpu_run.py", "pages.py")}


def _drop_stale_caches(folder: Path = _HERE / "__pycache__") -> None:
    """Delete the cache index of a module in `_INLINES` when a file it inlines is newer, so numba compiles afresh.

    Runs when this module is imported, which `cpu.py` does first, before any kernel is compiled or loaded.

    Editing the source matters only in a checkout (an install rewrites every file, which numba does notice). With
    NUMBA_CACHE_DIR set the caches live elsewhere and this does nothing."""
    try:
        changed = {name: (_HERE / name).stat().st_mtime for name in {n for names in _INLINES.values() for n in names}}
        indexes = list(folder.glob("*.nbi"))
    except OSError:
        return
    for index in indexes:
        module = index.name.split(".", 1)[0]
        try:
            if any(changed[name] > index.stat().st_mtime for name in _INLINES.get(module, ())):
                index.unlink()
        except OSError:  # another process got there first
            pass


_drop_stale_caches()


def dropout_threshold(p: float) -> np.uint64:
    """An element is kept when its 24 random bits are >= this; 0 means no dropout, 2**24 (p == 1) drops every one."""
    return np.uint64(round(p * (1 << 24)))


def dropout_scale(p: float) -> float:
    """What a kept element is multiplied by, 1 / (1 - p); at p == 1 none is kept (torch's output is all zeros)."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


@njit(cache=True, inline="always")
def keep(seed, index, threshold):
    """splitmix64 of (seed, element index): the same mask in forward and backward without storing it."""
    z = seed + np.uint64(index) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)) >= threshold


def widen(v):
    """A table element as float32 (identity for float32, bit shift for bfloat16 bits)."""


@overload(widen, inline="always")
def _widen_impl(v):
    if isinstance(v, types.Float):
        return lambda v: v
    return lambda v: np.uint32(np.uint32(v) << 16).view(np.float32)


def round_like(table, x):
    """Round a float32 sum of two of the table's values to the table's precision, as torch rounds each add in the
    table's dtype.

    For bfloat16: to nearest-even by integer arithmetic, kept as float32 (five vector operations; rounding an output
    row, `cpu_rows._rounded_bits`, takes eight, for any NaN). Here a NaN needs no test of its own: the sum of two
    bfloat16 values is a NaN only as one of them (its low 16 bits zero) or as the CPU's default NaN, and adding at
    most 0x8000 to such bits carries nowhere. Checked against torch's bfloat16 adds for every NaN and infinity
    (tests/test_kernels_cpu_bfloat16.py)."""


@overload(round_like, inline="always")
def _round_like_impl(table, x):
    if isinstance(table.dtype, types.Float):
        return lambda table, x: x

    def impl(table, x):
        u = np.float32(x).view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return np.uint32(u).view(np.float32)
    return impl


def as_float32(row, into):
    """`row` (float32, or bfloat16 bits) as float32: row itself, or widened into `into` (a float32 array as long)."""


@overload(as_float32, inline="always")
def _as_float32_impl(row, into):
    if isinstance(row.dtype, types.Float):
        return lambda row, into: row

    def impl(row, into):
        for j in range(row.size):
            into[j] = widen(row[j])
        return into
    return impl


@njit(cache=True)
def ids_ok(w, s, q, v, t, p, has_pos):
    return 0 <= w < v and 0 <= s < t and (not has_pos or 0 <= q < p)


def add_rounded(v, row, j):
    """v + row[j] in float32, rounded as the row's dtype rounds (bfloat16 tables: each add, as torch rounds)."""


@overload(add_rounded, inline="always")
def _add_rounded_impl(v, row, j):
    return lambda v, row, j: round_like(row, v + widen(row[j]))


def token_rows(word, seg, pos, w, s, q, has_pos):
    """The token's three table rows as 1-D views (`seg`'s row stands in for an absent position row, never read).

    Loops over 1-D rows vectorise where the same loops indexing two 2-D tables do not: for bfloat16, word[w, j] +
    seg[s, j] with its rounding ran 5x slower than over the rows (LLVM left it scalar)."""


@overload(token_rows, inline="always")
def _token_rows_impl(word, seg, pos, w, s, q, has_pos):
    def impl(word, seg, pos, w, s, q, has_pos):
        srow = seg[s]
        return word[w], srow, pos[q] if has_pos else srow
    return impl


@intrinsic
def borrowed(typingctx, array):
    """The same array without its reference to the memory's owner: copies and views of it take no reference either,
    so per-token code that passes it on makes no atomic reference-count updates (numba's would, on counts that all
    threads share). Valid while the caller holds the original."""
    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, args[0])
        null = context.get_constant_null(types.MemInfoPointer(types.voidptr))
        view.meminfo = null
        view.parent = context.get_constant_null(types.pyobject)
        return view._getvalue()

    return array(array), codegen


@intrinsic
def hold(typingctx, array):
    """Nothing, but a use of `array`: numba frees a local array after its last use, and a `borrowed` view of it must
    not outlive it. Call it after the view's last use."""
    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.void(array), codegen


@intrinsic
def pointer(typingctx, address, dtype):
    """The integer `address` as a pointer to `dtype` elements, for `numba.carray`: an array over memory that Python
    hands in as a number (`Tensor.data_ptr()`, 60 ns, where `Tensor.numpy()` takes 600). The array holds no reference:
    valid while the caller holds the tensor, and only as large as the caller says it is. `dtype`: a numpy scalar
    type (`np.float32`) or an array's `.dtype`."""
    if not isinstance(address, types.Integer) or not isinstance(dtype, (types.NumberClass, types.DType)):
        return None
    target = types.CPointer(dtype.instance_type if isinstance(dtype, types.NumberClass) else dtype.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(target))

    return target(address, dtype), codegen


@intrinsic
def wide_vectors(typingctx, wide):
    """Nothing, but with `wide` a literal True, asks LLVM to vectorise the calling function with 512-bit vectors where
    the CPU has them; with None or a literal False, leaves LLVM's choice (a run-time bool does not compile). The
    choice goes by the argument's type, so a helper that passes its own `wide` on is compiled once for each.

    LLVM's x86 tuning prefers 256-bit vectors on most AVX-512 CPUs (the wide ones used to lower the clock), so numba's
    loops use half the register width. Per function, through the `prefer-vector-width` attribute; on a CPU without
    AVX-512 it changes nothing. Wide vectors pay where a thread runs many tokens; one sentence (11 tokens) ran
    0.4 us slower with them."""
    if isinstance(wide, types.NoneType):
        asked = False
    elif isinstance(wide, types.BooleanLiteral):
        asked = wide.literal_value
    else:
        raise errors.TypingError(f"wide_vectors takes a constant True, False or None, not {wide}")

    def codegen(context, builder, signature, args):
        if asked:
            # llvmlite's attribute set accepts only enum attributes; a string attribute is written out as given. Should
            # a later llvmlite keep them otherwise, the hint is lost and nothing else.
            try:
                set.add(builder.function.attributes, '"prefer-vector-width"="512"')
            except TypeError:
                pass
        return context.get_dummy_value()

    return types.void(wide), codegen


@intrinsic
def set_thread_count(typingctx, count):
    """`numba.set_num_threads(count)` for compiled code that numba can keep in its on-disk cache: numba's own compiled
    version calls through a ctypes pointer, which keeps a function out of the cache. This calls the threading layer's
    `set_num_threads` by symbol, which numba registers when it launches its thread pool (`numba.get_num_threads()`
    does, from Python; `cpu_run` calls it on import). The caller keeps count within 1..NUMBA_NUM_THREADS."""
    if not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        call_symbol(builder, "set_num_threads", ir.VoidType(),
                    [context.cast(builder, args[0], signature.args[0], types.int32)])
        return context.get_dummy_value()

    return types.void(count), codegen


def call_symbol(builder, name: str, result, arguments: list):
    """In an intrinsic's code: call the C function `name`, found by symbol when the code is linked (numba's on-disk
    cache keeps such code, where a ctypes function's address would keep it out), with LLVM `arguments`."""
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [a.type for a in arguments]),
                                              name)
    return builder.call(function, arguments)

