"""Does visiting tokens grouped by id make the Triton forward read fewer word rows from DRAM?

    python benchmarks/gpu_id_order.py

At (64, 512), hidden 1024, float32, the word table is 125 MB, the L2 cache 50 MB, and 32768 uniform random ids
hold about 20 000 distinct rows: a third of the word-row reads repeat a row read earlier, but in token order the
repeat comes too late to find the row still in L2. If the tokens whose ids fall in one slice of the table (2^SHIFT
rows) are visited together, a repeat comes while its slice is in L2, and DRAM reads each row about once.

Copies of the inference forward (default positions, segment ids given) over the id streams of `gpu_cache_hints.py`,
beside `torch.compile` of transformers' layer and the shipped kernel (token order):
- `sorted order (oracle)`: one program per token, visiting tokens in id order sorted outside the timing: the most
  ordering can give; `slice order SHIFT (oracle)`: the same, sorted by slice only; word rows `evict_first` unless
  named (without it the oracle was slower);
- `argsort + gather`: the order from `torch.argsort` of the slice numbers, timed;
- `slice order SHIFT, sorted in a kernel`: a first Triton kernel writes the slice order (one program a slice and
  chunk of tokens, no atomics), the forward reads its token from it.
Two tables per case: medians of event-timed loops (what a caller sees, the host's launch time included), then each
candidate's GPU time a call from the profiler (kernels only).

Tried before this version and dropped (results in benchmarks/results/gpu/h100-id-order-*.txt): one launch whose grid
is slices x chunks, slice-major, each program skipping its chunk's tokens of other slices (level with token order
at 2^12-row slices, up to 3.5x slower with smaller ones: the skipped tokens cost more than the reads saved); counts
by atomics (a zeroed counter tensor, a third launch); and one launch whose first programs sort while the rest wait
on a counter (about twice the shipped kernel's GPU time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gpu_cache_hints import _setup, hinted_row, report

from bertembed.bench.cases import Case
from bertembed.kernels import triton as triton_kernels


@triton.jit
def _ordered_forward(order, ids, tts, word, seg, pos, gamma, beta, out, H, L, eps, WORD_HINT: tl.constexpr,
                     BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    t = tl.load(order + tl.program_id(0)).to(tl.int64)
    hinted_row(t, ids, tts, word, seg, pos, gamma, beta, out, H, L, eps, cols, cols < H, WORD_HINT, "evict_first")


@triton.jit
def _slice_order_kernel(ids, order, N, V, C, SHIFT: tl.constexpr, CHUNK: tl.constexpr):
    """Program b * C + c: the tokens of chunk c (CHUNK tokens) whose ids fall in slice b (2^SHIFT rows), in token
    order, into block b * C + c of `order` (int32: S block sizes, then S blocks of CHUNK places), their count into the
    block's size. Read block by block, the places are the tokens sorted by slice, stably; no atomics, no zeroing."""
    block = tl.program_id(0)
    b, c = block // C, block % C
    t = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    live = t < N
    w = tl.load(ids + t, mask=live, other=0)
    mine = live & ((tl.minimum(tl.maximum(w, 0), V - 1) >> SHIFT) == b)
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    blocks = tl.num_programs(0)
    tl.store(order + blocks + block.to(tl.int64) * CHUNK + rank, t.to(tl.int32), mask=mine)
    tl.store(order + block, tl.sum(mine.to(tl.int32), axis=0))


@triton.jit
def _sliced_forward(order, ids, tts, word, seg, pos, gamma, beta, out, H, L, eps, S, CHUNK: tl.constexpr,
                    SLOTS: tl.constexpr, WORD_HINT: tl.constexpr, BLOCK: tl.constexpr):
    """Program j does the token at place j of the slice order: the block holding j is the first whose running end
    passes j."""
    j = tl.program_id(0)
    k = tl.arange(0, SLOTS)
    size = tl.load(order + k, mask=k < S, other=0)
    ends = tl.cumsum(size, axis=0)
    block = tl.sum((ends <= j).to(tl.int32), axis=0)
    start = tl.sum(tl.where(k == block, ends - size, 0), axis=0)
    t = tl.load(order + S + block.to(tl.int64) * CHUNK + (j - start)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    hinted_row(t, ids, tts, word, seg, pos, gamma, beta, out, H, L, eps, cols, cols < H, WORD_HINT, "evict_first")


def candidates_for(case: Case, work, tables, gamma, beta, out):
    word, seg, pos = tables
    tts = work.token_type_ids.view(-1)
    n, h = tts.numel(), case.hidden
    block = triton.next_power_of_2(h)
    orders: dict[tuple[int, int], torch.Tensor] = {}

    def oracle(shift, hint):
        """Tokens in the order of `id >> shift`, sorted once per id tensor, outside the timing."""
        def run(ids):
            flat = ids.view(-1)
            key = (id(ids), shift)
            order = orders.get(key)
            if order is None:
                order = orders[key] = torch.argsort(flat >> shift, stable=True)
            _ordered_forward[(n,)](order, flat, tts, word, seg, pos, gamma, beta, out, h, case.length, 1e-12,
                                   WORD_HINT=hint, BLOCK=block, num_warps=4)
        return run

    def sorted_here(shift):
        def run(ids):
            flat = ids.view(-1)
            order = torch.argsort(flat >> shift)
            _ordered_forward[(n,)](order, flat, tts, word, seg, pos, gamma, beta, out, h, case.length, 1e-12,
                                   WORD_HINT="", BLOCK=block, num_warps=4)
        return run

    def sliced(shift, hint="evict_first"):
        chunk = max(64, triton.next_power_of_2(triton.cdiv(n, 16)))
        chunks = triton.cdiv(n, chunk)
        blocks = triton.cdiv(word.shape[0], 1 << shift) * chunks

        def run(ids):
            flat = ids.view(-1)
            order = torch.empty(blocks * (chunk + 1), dtype=torch.int32, device="cuda")
            _slice_order_kernel[(blocks,)](flat, order, n, word.shape[0], chunks, SHIFT=shift, CHUNK=chunk,
                                           num_warps=max(4, min(16, chunk // 256)))
            _sliced_forward[(n,)](order, flat, tts, word, seg, pos, gamma, beta, out, h, case.length, 1e-12, blocks,
                                  CHUNK=chunk, SLOTS=triton.next_power_of_2(blocks), WORD_HINT=hint, BLOCK=block,
                                  num_warps=4)
        return run

    def shipped(ids):
        triton_kernels.run_forward(ids.view(-1), tts, None, word, seg, pos, gamma, beta, 1e-12, 0.0, 0, out=out,
                                   stats=False, length=case.length)

    found = {"shipped": shipped, "sorted order (oracle)": oracle(0, "evict_first"),
             "slice order 11 (oracle)": oracle(11, "evict_first"), "slice order 11 (oracle), no hint": oracle(11, ""),
             "argsort(id >> 11) + gather": sorted_here(11)}
    for shift in (10, 11, 12):
        found[f"slice order {shift}, sorted in a kernel"] = sliced(shift)
    return found


def run_case(case: Case) -> None:
    work, hf, tables, gamma, beta = _setup(case)
    n = work.input_ids.numel()
    out = torch.empty(n, case.hidden, device="cuda", dtype=tables[0].dtype)
    reference = hf(work.input_ids, work.token_type_ids).view(out.shape).float()
    found = candidates_for(case, work, tables, gamma, beta, out)
    for name, fn in found.items():
        out.fill_(float("nan"))
        fn(work.input_ids)
        err = (out.float() - reference).abs().max().item()
        assert err < 1e-4, (name, err)
    report(case, work, hf, found)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for case in (Case(1024, 64, 512, device="cuda"), Case(768, 64, 512, device="cuda"),
                 Case(768, 32, 128, device="cuda")):
        run_case(case)


if __name__ == "__main__":
    main()
