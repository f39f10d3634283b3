"""The CPU kernels' building blocks (numba), inlined by `cpu.py`: bfloat16 (as uint16 bits) handling as `overload`s
resolved per dtype, and `intrinsic`s for LLVM IR numba has no words for (docs/cpu-kernels.md). H: hidden size.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import errors, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload


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
    """Round a float32 sum of two of the table's values to the table's precision, as torch rounds each add (bfloat16:
    to nearest-even, kept as float32; no NaN test needed, docs/cpu-kernels.md)."""


@overload(round_like, inline="always")
def _round_like_impl(table, x):
    if isinstance(table.dtype, types.Float):
        return lambda table, x: x

    def impl(table, x):
        u = np.float32(x).view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return np.uint32(u).view(np.float32)
    return impl


@njit(cache=True, inline="always")
def bfloat16_bits(x):
    """float32 x as bfloat16 bits, to nearest-even as torch rounds; any NaN becomes torch's NaN, 0x7FC0."""
    u = np.float32(x).view(np.uint32)
    if u & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def write_row(y, out, i):
    """out[i, :] = y (float32 [H]) for a float32 or bfloat16 (uint16) `out`."""


@overload(write_row, inline="always")
def _write_row_impl(y, out, i):
    if out.dtype == types.float32:
        def impl(y, out, i):
            for j in range(y.size):  # (not `out[i] = y`: its shape-mismatch message is slow to compile)
                out[i, j] = y[j]
        return impl

    def impl(y, out, i):
        for j in range(y.size):
            out[i, j] = bfloat16_bits(y[j])
    return impl


@njit(cache=True, inline="always")
def ids_ok(w, s, q, v, t, p, has_pos):
    return 0 <= w < v and 0 <= s < t and (not has_pos or 0 <= q < p)


@njit(cache=True, inline="always")
def add_rounded(v, row, j):
    """v + row[j] in float32, rounded as the row's dtype rounds (bfloat16 tables: each add, as torch rounds)."""
    return round_like(row, v + widen(row[j]))


@njit(cache=True, inline="always")
def token_rows(word, seg, pos, w, s, q, has_pos):
    """The token's three table rows as 1-D views, which vectorise where 2-D indexing does not (`seg`'s row stands in
    for an absent position row, never read)."""
    srow = seg[s]
    return word[w], srow, pos[q] if has_pos else srow


@intrinsic
def borrowed(typingctx, array):
    """The same array without its reference to the memory's owner: no atomic reference counting per token. Valid
    while the caller holds the original."""
    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, args[0])
        view.meminfo = context.get_constant_null(types.MemInfoPointer(types.voidptr))
        view.parent = context.get_constant_null(types.pyobject)
        return view._getvalue()

    return array(array), codegen


@intrinsic
def hold(typingctx, array):
    """Nothing, but a use of `array`, so that numba keeps it alive until here, past its `borrowed` views' last use."""
    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.void(array), codegen


@intrinsic
def prefetch_row(typingctx, table, row):
    """Start loading every cache line of table[row, :] into the caches, and return at once (`llvm.prefetch`): the
    hardware's prefetcher starts on a row only after its first miss."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        array = context.make_array(array_type)(context, builder, args[0])
        int32, int64, byte_ptr = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, int32, int32, int32]), "llvm.prefetch.p0")
        first = builder.bitcast(cgutils.get_item_pointer(context, builder, array_type, array,
                                                         [args[1], ir.Constant(int64, 0)]), byte_ptr)
        nbytes = builder.mul(builder.extract_value(array.shape, 1),
                             ir.Constant(int64, context.get_abi_sizeof(context.get_data_type(array_type.dtype))))
        hints = [ir.Constant(int32, 0), ir.Constant(int32, 3), ir.Constant(int32, 1)]  # read, keep in all levels, data
        with cgutils.for_range_slice(builder, ir.Constant(int64, 0), nbytes, ir.Constant(int64, 64),
                                     intp=int64) as (offset, _):
            builder.call(prefetch, [builder.gep(first, [offset]), *hints])
        return context.get_dummy_value()

    return types.void(table, row), codegen


@intrinsic
def _stream_float_row(typingctx, y, out, i):
    """out[i, :] = y (float32 [H], into a C-contiguous float32 [*, H]): whole 64-byte lines by non-temporal stores,
    the unaligned head and tail by ordinary ones. Call `store_fence` before anyone reads `out`."""
    line = ir.VectorType(ir.FloatType(), 16)

    def codegen(context, builder, signature, args):
        row_type, out_type = signature.args[:2]
        row = context.make_array(row_type)(context, builder, args[0])
        table = context.make_array(out_type)(context, builder, args[1])
        int64 = ir.IntType(64)
        n = builder.extract_value(row.shape, 0)
        dst = cgutils.get_item_pointer(context, builder, out_type, table, [args[2], int64(0)])
        src = cgutils.get_item_pointer(context, builder, row_type, row, [int64(0)])
        head = builder.udiv(builder.and_(builder.neg(builder.ptrtoint(dst, int64)), int64(63)), int64(4))
        head = builder.select(builder.icmp_unsigned("<", head, n), head, n)  # elements before a line boundary
        lines_end = builder.add(head, builder.and_(builder.sub(n, head), int64(-16)))
        for lo, hi in ((int64(0), head), (lines_end, n)):
            with cgutils.for_range_slice(builder, lo, hi, int64(1), intp=int64) as (j, _):
                builder.store(builder.load(builder.gep(src, [j])), builder.gep(dst, [j]))
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range_slice(builder, head, lines_end, int64(16), intp=int64) as (j, _):
            value = builder.load(builder.bitcast(builder.gep(src, [j]), line.as_pointer()), align=4)
            store = builder.store(value, builder.bitcast(builder.gep(dst, [j]), line.as_pointer()), align=64)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    if not (isinstance(out, types.Array) and out.dtype == types.float32 and out.layout == "C"):
        return None
    return types.void(y, out, i), codegen


@intrinsic
def store_fence(typingctx):
    """A full memory fence: every store before it, non-temporal ones included, is visible before any after it."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


def stream_row(y, out, i):
    """out[i, :] = y by non-temporal stores where `out` is float32; bfloat16 rows as `write_row` writes them."""


@overload(stream_row, inline="always")
def _stream_row_impl(y, out, i):
    if out.dtype == types.float32:
        return lambda y, out, i: _stream_float_row(y, out, i)
    return lambda y, out, i: write_row(y, out, i)


@intrinsic
def wide_vectors(typingctx, wide):
    """With `wide` a literal True, asks LLVM to vectorise the calling function with 512-bit vectors where the CPU has
    them; with a literal False, leaves LLVM's choice."""
    if not isinstance(wide, types.BooleanLiteral):
        raise errors.TypingError(f"wide_vectors takes a constant True or False, not {wide}")

    def codegen(context, builder, signature, args):
        if wide.literal_value:
            try:  # (llvmlite writes a string attribute out as given; should that change, only the hint is lost)
                set.add(builder.function.attributes, '"prefer-vector-width"="512"')
            except TypeError:
                pass
        return context.get_dummy_value()

    return types.void(wide), codegen
