"""How the CPU kernels move rows between memory and the core (numba intrinsics): a prefetch of a row about to be read
or written, non-temporal stores for rows nobody reads soon (an output too large for the cache, the zeros of a word
gradient), and the bfloat16 output row, rounded by the CPU's own conversion instruction where it has one.
`bertembed.kernels.cpu` builds the per-token passes from these and from `bertembed.kernels.cpu_elements`.
"""

from __future__ import annotations

from llvmlite import binding, ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic, overload

_LINE = 64  # bytes in a cache line


def zen_core(cpu_name: str) -> bool:
    """Whether `cpu_name` (numba's name for a CPU) is one of AMD's Zen cores, where the kernels differ: `prefetch_row`
    asks for every line of a row, not its first alone (`WHOLE_ROWS`), and forward outputs stream from 12 MiB
    (`cpu_run._stream_out_from`). The prefetch, measured on two 2-vCPU VMs (BENCHMARKS.md, the seventh and fifteenth
    rounds): on an Intel Xeon the first line alone was 1.12-1.15x faster at (32, 128), the hardware's prefetcher
    following the row; on an AMD EPYC (Zen 3) prefetching every line was 1.2-1.3x faster, its prefetcher leaving the
    rest of a random row to be missed. Other CPUs keep the first line.
    `cpu_name`: the CPU numba compiles for, which is part of the key of numba's on-disk cache, so code compiled with
    one answer is never loaded where the answer differs."""
    return cpu_name.startswith("znver")


CPU_NAME = config.CPU_NAME or binding.get_host_cpu_name()  # what numba compiles for
WHOLE_ROWS = zen_core(CPU_NAME)


def _prefetch(context, builder, signature, args, write: int, whole: bool):
    """llvm.prefetch of table[row, 0]'s cache line (args: table, row), or with `whole` of each line of the row."""
    array_type = signature.args[0]
    array = context.make_array(array_type)(context, builder, args[0])
    int32, int64, byte_ptr = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, int32, int32, int32]), "llvm.prefetch.p0")
    first = builder.bitcast(cgutils.get_item_pointer(context, builder, array_type, array,
                                                     [args[1], ir.Constant(int64, 0)]), byte_ptr)
    # llvm.prefetch(address, read 0 / write 1, keep in all cache levels, data)
    hints = [ir.Constant(int32, write), ir.Constant(int32, 3), ir.Constant(int32, 1)]
    if not whole:
        builder.call(prefetch, [first, *hints])
        return context.get_dummy_value()
    size = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
    nbytes = builder.mul(builder.extract_value(array.shape, 1), ir.Constant(int64, size))
    with cgutils.for_range_slice(builder, ir.Constant(int64, 0), nbytes, ir.Constant(int64, _LINE),
                                 intp=int64) as (offset, _):
        builder.call(prefetch, [builder.gep(first, [offset]), *hints])
    return context.get_dummy_value()


@intrinsic
def prefetch_row(typingctx, table, row):
    """Start loading table[row, :] into the caches and return at once: one prefetch, of the row's first cache line,
    where the hardware's prefetcher follows the row once it is read (and the page's address translation is presumably
    warm by then); there, one prefetch a line of the row was slower, presumably because 48 of them (a float32 row at
    hidden 768) crowd the core's few outstanding misses (BENCHMARKS.md, the seventh round). On AMD's Zen cores, where
    it was the other way round, one prefetch a line (`WHOLE_ROWS`).

    A prefetch is a hint: it reads nothing the program sees and cannot fault, so the kernels run it for the next
    tokens' rows while they compute this one's. The caller still passes only rows inside the table."""
    def codegen(context, builder, signature, args):
        return _prefetch(context, builder, signature, args, 0, WHOLE_ROWS)

    return types.void(table, row), codegen


@intrinsic
def prefetch_row_for_write(typingctx, table, row):
    """`prefetch_row` for a row about to be written (`prefetchw`: the line comes ready to be changed)."""
    def codegen(context, builder, signature, args):
        return _prefetch(context, builder, signature, args, 1, False)

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


def _row_in_lines(context, builder, signature, args, convert, store_line):
    """Code for out[i, :] = convert(y) (args: y [H], out [*, H], i; both C-contiguous): the unaligned head and tail
    of out's row (under a 64-byte line each) one element at a time, `convert`ing each; the whole lines between by
    `store_line(builder, src, dst, j)`, which writes the line of out's row that starts at element j."""
    row_type, out_type = signature.args[:2]
    row = context.make_array(row_type)(context, builder, args[0])
    table = context.make_array(out_type)(context, builder, args[1])
    int64, size = ir.IntType(64), context.get_abi_sizeof(context.get_data_type(out_type.dtype))
    lanes = _LINE // size
    n = builder.extract_value(row.shape, 0)
    dst = cgutils.get_item_pointer(context, builder, out_type, table, [args[2], ir.Constant(int64, 0)])
    src = cgutils.get_item_pointer(context, builder, row_type, row, [ir.Constant(int64, 0)])
    # elements before the first line boundary: (-address mod 64) / size, at most n
    head = builder.udiv(builder.and_(builder.neg(builder.ptrtoint(dst, int64)), int64(_LINE - 1)), int64(size))
    head = builder.select(builder.icmp_unsigned("<", head, n), head, n)
    lines_end = builder.add(head, builder.and_(builder.sub(n, head), int64(-lanes)))
    for lo, hi in ((int64(0), head), (lines_end, n)):
        with cgutils.for_range_slice(builder, lo, hi, int64(1), intp=int64) as (j, _):
            builder.store(convert(builder.load(builder.gep(src, [j]))), builder.gep(dst, [j]))
    with cgutils.for_range_slice(builder, head, lines_end, int64(lanes), intp=int64) as (j, _):
        store_line(builder, src, dst, j)
    return context.get_dummy_value()


def _is_row_pair(y, out, dtype) -> bool:
    return (isinstance(y, types.Array) and y.ndim == 1 and y.layout == "C" and y.dtype == types.float32
            and isinstance(out, types.Array) and out.ndim == 2 and out.layout == "C" and out.dtype == dtype)


@intrinsic
def _stream_float_row(typingctx, y, out, i):
    """out[i, :] = y for a float32 row y and a C-contiguous 2-D float32 out: whole 64-byte lines of the row by
    non-temporal stores, the unaligned head and tail (under a line each) by ordinary ones. See `stream_zeros`."""
    if not _is_row_pair(y, out, types.float32):
        return None
    line = ir.VectorType(ir.FloatType(), _LINE // 4)

    def store_line(builder, src, dst, j):
        value = builder.load(builder.bitcast(builder.gep(src, [j]), line.as_pointer()), align=4)
        store = builder.store(value, builder.bitcast(builder.gep(dst, [j]), line.as_pointer()), align=_LINE)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))

    def codegen(context, builder, signature, args):
        return _row_in_lines(context, builder, signature, args, lambda value: value, store_line)

    return types.void(y, out, i), codegen


class _BFloat(ir.Type):
    """LLVM's `bfloat`, which llvmlite's IR layer does not name."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash(_BFloat)


def _has_bf16_conversion() -> bool:
    """Whether numba compiles for this host with AVX512-BF16 (`vcvtneps2bf16`: 16 floats rounded to nearest-even
    bfloat16 in one instruction), and llvmlite can assemble the one instruction `_bfloat16_row` writes out. Not where
    NUMBA_CPU_NAME or NUMBA_CPU_FEATURES ask for another CPU (a portable cache)."""
    if config.CPU_NAME or config.CPU_FEATURES:
        return False
    try:
        features = binding.get_host_cpu_features()
        if not (features.get("avx512bf16") and features.get("avx512vl")):
            return False
        binding.initialize_native_asmparser()
    except (AttributeError, RuntimeError):  # a host it cannot ask, an llvmlite without the parser
        return False
    return True


BF16_CONVERSION = _has_bf16_conversion()


def _rounded_bits(builder, value):
    """float32 (a scalar or a vector) -> bfloat16 bits of the same shape (i16), round to nearest-even, a NaN stays
    a NaN (0x7FC0): in integer arithmetic, for CPUs without a conversion instruction."""
    lanes = value.type.count if isinstance(value.type, ir.VectorType) else None

    def of(bits: int, constant: int):
        kind = ir.IntType(bits)
        return ir.Constant(ir.VectorType(kind, lanes), [constant] * lanes) if lanes else ir.Constant(kind, constant)

    u = builder.bitcast(value, ir.VectorType(ir.IntType(32), lanes) if lanes else ir.IntType(32))
    odd = builder.and_(builder.lshr(u, of(32, 16)), of(32, 1))
    rounded = builder.lshr(builder.add(builder.add(u, of(32, 0x7FFF)), odd), of(32, 16))
    nan = builder.icmp_unsigned(">", builder.and_(u, of(32, 0x7FFFFFFF)), of(32, 0x7F800000))
    bits = builder.select(nan, of(32, 0x7FC0), rounded)
    return builder.trunc(bits, ir.VectorType(ir.IntType(16), lanes) if lanes else ir.IntType(16))


@intrinsic
def _bfloat16_row(typingctx, y, out, i, nontemporal):
    """out[i, :] = y rounded to bfloat16, for a float32 row y and a C-contiguous 2-D uint16 out: to nearest-even as
    torch rounds, NaN stays NaN. Where `BF16_CONVERSION`, by LLVM's `fptrunc ... to bfloat`, which is
    `vcvtneps2bf16` (compile it nowhere else); elsewhere by integer arithmetic (`_rounded_bits`). Whole 64-byte lines
    by vector stores (non-temporal with `nontemporal` a literal True: see `stream_zeros`), the unaligned head and
    tail one element at a time.

    The instruction makes a result below bfloat16's smallest normal (1.2e-38) a zero of the same sign; the integer
    rounding keeps it (tests/test_kernels_cpu_bfloat16.py)."""
    if not (_is_row_pair(y, out, types.uint16) and isinstance(nontemporal, types.BooleanLiteral)):
        return None
    streamed, instruction = nontemporal.literal_value, BF16_CONVERSION
    lanes, int16 = _LINE // 2, ir.IntType(16)
    floats, line = ir.VectorType(ir.FloatType(), lanes), ir.VectorType(ir.IntType(64), _LINE // 8)

    def rounded(builder, value):  # a float or a line of them -> i16 bits of the same shape
        if not instruction:
            return _rounded_bits(builder, value)
        if isinstance(value.type, ir.VectorType):
            return builder.bitcast(builder.fptrunc(value, ir.VectorType(_BFloat(), lanes)), ir.VectorType(int16, lanes))
        return builder.bitcast(builder.fptrunc(value, _BFloat()), int16)

    def store_line(builder, src, dst, j):
        value = builder.load(builder.bitcast(builder.gep(src, [j]), floats.as_pointer()), align=4)
        value = builder.bitcast(rounded(builder, value), line)
        address = builder.gep(dst, [j])
        if streamed and instruction:
            # LLVM writes a bfloat vector tagged !nontemporal with an ordinary store (folding any bitcast away), so
            # the non-temporal store is spelt out.
            builder.asm(ir.FunctionType(ir.VoidType(), [line, address.type]), "vmovntdq $0, ($1)", "v,r,~{memory}",
                        [value, address], side_effect=True)
            return
        store = builder.store(value, builder.bitcast(address, line.as_pointer()), align=_LINE)
        if streamed:
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))

    def codegen(context, builder, signature, args):
        return _row_in_lines(context, builder, signature, args, lambda value: rounded(builder, value), store_line)

    return types.void(y, out, i, nontemporal), codegen


def finished_in_rows(out):
    """Whether the kernels finish each row of `out` in a float32 row and write it with `write_row` (a constant):
    True for bfloat16 outputs, rounded a 64-byte line at a time (`_bfloat16_row`); float32 outputs are stored element
    by element as they are computed, unless they are streamed. One pass that rounds whole lines, after the row is
    finished, beat rounding each element in the loop that computes it on an AVX2 CPU (BENCHMARKS.md, the sixteenth
    round): there the rounding and its NaN test made that loop 8 elements wide where this one packs 32."""


@overload(finished_in_rows, inline="always")
def _finished_in_rows_impl(out):
    able = out.dtype == types.uint16
    return lambda out: able


def write_row(y, out, i, stream):
    """out[i, :] = y (float32 [H]) for a float32 or bfloat16 (uint16) `out`; `stream`: by non-temporal stores (call
    `store_fence` before others read out)."""


@overload(write_row, inline="always")
def _write_row_impl(y, out, i, stream):
    if out.dtype == types.float32:
        def impl(y, out, i, stream):
            if stream:
                _stream_float_row(y, out, i)
            else:
                for j in range(y.size):  # (not `out[i] = y`: its shape-mismatch message costs seconds of compiling)
                    out[i, j] = y[j]
        return impl

    def impl(y, out, i, stream):
        if stream:
            _bfloat16_row(y, out, i, True)
        else:
            _bfloat16_row(y, out, i, False)
    return impl


@intrinsic
def store_fence(typingctx):
    """A full memory fence: every store before it, non-temporal ones included, is visible before any after it."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen
