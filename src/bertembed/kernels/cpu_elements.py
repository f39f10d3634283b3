"""Element-level building blocks of the CPU kernels (numba): the dropout hash, bfloat16 widening and rounding, a
token's table rows, prefetch and non-temporal zeros, and a guard against stale on-disk caches.
`bertembed.kernels.cpu` builds the per-token passes from them.

numba has no bfloat16, so bfloat16 arrives as its uint16 bit pattern: widened to float32 by a shift, rounded back to
nearest-even by integer arithmetic. Helpers that dispatch on dtype are `overload`s, resolved when a kernel compiles.

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
_INLINES = {"cpu": ("cpu_elements.py",), "cpu_run": ("cpu_elements.py",), "pages": ("cpu_elements.py",),
            "lean": ("cpu_elements.py", "cpu.py", "cpu_run.py", "pages.py")}


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
    """An element is kept when its 24 random bits are >= this; 0 means no dropout."""
    return np.uint64(round(p * (1 << 24)))


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


def bf16_bits(x):
    """float32 -> bfloat16 bits (uint32 holding 16 bits), round to nearest even, NaN stays NaN."""


@overload(bf16_bits)
def _bf16_bits_impl(x):
    def impl(x):
        u = np.float32(x).view(np.uint32)
        rounded = np.uint32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        return np.uint32(0x7FC0) if nan else rounded  # a select, not a branch: the loop stays vectorised
    return impl


def round_like(table, x):
    """Round a float32 sum to the table's precision, as torch rounds each add in the table's dtype."""


@overload(round_like, inline="always")
def _round_like_impl(table, x):
    if isinstance(table.dtype, types.Float):
        return lambda table, x: x
    return lambda table, x: np.uint32(bf16_bits(x) << np.uint32(16)).view(np.float32)


def narrow(out, y):
    """A float32 value as an element of `out` (identity for float32, rounded bits for bfloat16)."""


@overload(narrow, inline="always")
def _narrow_impl(out, y):
    if isinstance(out.dtype, types.Float):
        return lambda out, y: y
    return lambda out, y: np.uint16(bf16_bits(y))


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
    valid while the caller holds the tensor, and only as large as the caller says it is."""
    if not isinstance(address, types.Integer) or not isinstance(dtype, types.NumberClass):
        return None
    target = types.CPointer(dtype.instance_type)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(target))

    return target(address, dtype), codegen


_LINE = 64  # bytes in a cache line


def _prefetch_first_line(context, builder, signature, args, write: int):
    array_type = signature.args[0]
    array = context.make_array(array_type)(context, builder, args[0])
    int32, int64, byte_ptr = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, int32, int32, int32]), "llvm.prefetch.p0")
    address = cgutils.get_item_pointer(context, builder, array_type, array, [args[1], ir.Constant(int64, 0)])
    # llvm.prefetch(address, read 0 / write 1, keep in all cache levels, data)
    builder.call(prefetch, [builder.bitcast(address, byte_ptr), ir.Constant(int32, write), ir.Constant(int32, 3),
                            ir.Constant(int32, 1)])
    return context.get_dummy_value()


@intrinsic
def prefetch_row(typingctx, table, row):
    """Start loading table[row, :] into the caches: one prefetch, of the row's first cache line, and return at once.
    The hardware's prefetcher follows the row once it is read (and the page's address translation is presumably warm
    by then). One prefetch a line of the row was slower, presumably because 48 of them (a float32 row at hidden 768)
    crowd the core's few outstanding misses (BENCHMARKS.md, the seventh round).

    A prefetch is a hint: it reads nothing the program sees and cannot fault, so the kernels run it for the next
    tokens' rows while they compute this one's. The caller still passes only rows inside the table."""
    def codegen(context, builder, signature, args):
        return _prefetch_first_line(context, builder, signature, args, 0)

    return types.void(table, row), codegen


@intrinsic
def prefetch_row_for_write(typingctx, table, row):
    """`prefetch_row` for a row about to be written (`prefetchw`: the line comes ready to be changed)."""
    def codegen(context, builder, signature, args):
        return _prefetch_first_line(context, builder, signature, args, 1)

    return types.void(table, row), codegen


@intrinsic
def stream_zeros(typingctx, table, lo, hi):
    """table[lo:hi] = 0 for a C-contiguous 2-D table, the 64-byte aligned middle with non-temporal stores.

    Non-temporal stores write whole cache lines straight to memory: no read of the old line first, and nothing of the
    cache evicted for zeros nobody reads soon. They are weakly ordered: call `store_fence` before other threads or
    Python read the table. The unaligned head and tail (under a line each) are ordinary stores."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        array = context.make_array(array_type)(context, builder, args[0])
        int1, int8, int64 = ir.IntType(1), ir.IntType(8), ir.IntType(64)
        column = ir.Constant(int64, 0)
        start, stop = (builder.ptrtoint(cgutils.get_item_pointer(context, builder, array_type, array, [row, column]),
                                        int64) for row in args[1:])
        first = builder.and_(builder.add(start, ir.Constant(int64, _LINE - 1)), ir.Constant(int64, -_LINE))
        first = builder.select(builder.icmp_unsigned("<", first, stop), first, stop)  # first aligned byte, or stop
        last = builder.and_(stop, ir.Constant(int64, -_LINE))
        last = builder.select(builder.icmp_unsigned("<", last, first), first, last)  # end of the aligned middle
        memset_type = ir.FunctionType(ir.VoidType(), [int8.as_pointer(), int8, int64, int1])
        memset = cgutils.get_or_insert_function(builder.module, memset_type, "llvm.memset.p0.i64")
        for begin, end in ((start, first), (last, stop)):
            builder.call(memset, [builder.inttoptr(begin, int8.as_pointer()), ir.Constant(int8, 0),
                                  builder.sub(end, begin), ir.Constant(int1, 0)])
        line = ir.VectorType(int64, _LINE // 8)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range_slice(builder, first, last, ir.Constant(int64, _LINE), intp=int64) as (address, _):
            store = builder.store(ir.Constant(line, None), builder.inttoptr(address, line.as_pointer()), align=_LINE)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.void(table, lo, hi), codegen


@intrinsic
def _stream_float_row(typingctx, y, out, i):
    """out[i, :] = y for a float32 row y and a C-contiguous 2-D float32 out: whole 64-byte lines of the row by
    non-temporal stores, the unaligned head and tail (under a line each) by ordinary ones. See `stream_zeros`."""
    if not (isinstance(y, types.Array) and y.ndim == 1 and y.layout == "C" and y.dtype == types.float32
            and isinstance(out, types.Array) and out.ndim == 2 and out.layout == "C" and out.dtype == types.float32):
        return None

    def codegen(context, builder, signature, args):
        row_type, out_type = signature.args[:2]
        row = context.make_array(row_type)(context, builder, args[0])
        table = context.make_array(out_type)(context, builder, args[1])
        int64, lanes = ir.IntType(64), _LINE // 4
        n = builder.extract_value(row.shape, 0)
        dst = cgutils.get_item_pointer(context, builder, out_type, table, [args[2], ir.Constant(int64, 0)])
        src = cgutils.get_item_pointer(context, builder, row_type, row, [ir.Constant(int64, 0)])
        # floats before the first line boundary: (-address mod 64) / 4, at most n
        head = builder.lshr(builder.and_(builder.neg(builder.ptrtoint(dst, int64)), int64(_LINE - 1)), int64(2))
        head = builder.select(builder.icmp_unsigned("<", head, n), head, n)
        lines_end = builder.add(head, builder.and_(builder.sub(n, head), int64(-lanes)))
        for lo, hi in ((int64(0), head), (lines_end, n)):
            with cgutils.for_range_slice(builder, lo, hi, int64(1), intp=int64) as (j, _):
                builder.store(builder.load(builder.gep(src, [j])), builder.gep(dst, [j]))
        line = ir.VectorType(ir.FloatType(), lanes)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range_slice(builder, head, lines_end, int64(lanes), intp=int64) as (j, _):
            value = builder.load(builder.bitcast(builder.gep(src, [j]), line.as_pointer()), align=4)
            store = builder.store(value, builder.bitcast(builder.gep(dst, [j]), line.as_pointer()), align=_LINE)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.void(y, out, i), codegen


def streams(out):
    """Whether rows of `out` can be streamed (`stream_row`): a constant, True for float32. (bfloat16 rows are not:
    streaming them gained nothing, see BENCHMARKS.md, and the branch alone cost their forward 2-3%.)"""


@overload(streams, inline="always")
def _streams_impl(out):
    able = out.dtype == types.float32
    return lambda out: able


def stream_row(y, out, i):
    """out[i, :] = y (float32 [H]) by non-temporal stores (`_stream_float_row`; call `store_fence` before others read
    out), where `streams(out)`; nothing elsewhere (a branch that `streams` rules out)."""


@overload(stream_row, inline="always")
def _stream_row_impl(y, out, i):
    if out.dtype == types.float32:
        return lambda y, out, i: _stream_float_row(y, out, i)
    return lambda y, out, i: None


@intrinsic
def store_fence(typingctx):
    """A full memory fence: every store before it, non-temporal ones included, is visible before any after it."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


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
