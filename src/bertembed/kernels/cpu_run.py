"""The CPU kernels' torch glue: tensors in, tensors out. `run_forward` and `run_backward` take ids already validated
(`bertembed.validation.check_inputs`), allocate the outputs and gradients, hand numpy views to the numba kernels of
`bertembed.kernels.cpu`, raise if a kernel reports an id it skipped (a bug), and sum the per-thread partial gradients.

Dimension letters: N tokens (B*L), H hidden, V vocabulary, P positions, T segments, C chunks (one per thread).
"""

from __future__ import annotations

import os

import numba
import numpy as np
import torch
from numba import njit

from bertembed import kernels
from bertembed.kernels import cpu, cpu_rows, pages
from bertembed.kernels.cpu_elements import dropout_scale, dropout_threshold, set_thread_count
from bertembed.validation import skipped_ids_error


def _launch_pool() -> None:
    """Start numba's thread pool now (`use_threads` calls its `set_num_threads` by symbol, registered at launch),
    keeping torch's thread count: numba's OpenMP layer sets the OpenMP thread count at launch, and torch (built with
    OpenMP) reads the same one, so `torch.set_num_threads(1)` read 2 after the first fused forward."""
    wanted = torch.get_num_threads()
    numba.get_num_threads()  # launches the pool, once per process
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


_launch_pool()
POOL = numba.config.NUMBA_NUM_THREADS  # numba's pool size: read at its launch, fixed from then on
if numba.threading_layer() == "omp":  # GNU OpenMP (Intel's would do; numba does not tell them apart here)
    os.register_at_fork(after_in_child=kernels.lose_cpu_pool)  # a forked child: serial inference, else the reference


def chunk_bounds(sorted_ids: np.ndarray, chunks: int, pad: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks of the tokens sorted by id: ([C + 1] token bounds of near-equal sizes, moved so that no id but `pad`
    spans two chunks; [C + 1] word-table row bounds, chunk c owning rows from its first id to the next chunk's)."""
    n = sorted_ids.size
    if chunks == 1:  # (numpy's linspace, clip and append cost 45 us of a sentence's 290 us backward)
        return np.array([0, n], np.int64), np.array([0, vocab], np.int64)
    bounds = np.linspace(0, n, chunks + 1).astype(np.int64)
    for c in range(1, chunks):
        b = bounds[c]
        if 0 < b < n and sorted_ids[b] == sorted_ids[b - 1] and sorted_ids[b] != pad:
            bounds[c] = np.searchsorted(sorted_ids, sorted_ids[b], side="right")
    bounds = np.maximum.accumulate(bounds)
    rows = np.append(sorted_ids, vocab)[bounds].clip(0, vocab)
    rows[0], rows[-1] = 0, vocab
    return bounds, np.maximum.accumulate(rows)


@njit(cache=True)
def use_threads(wanted, pool):
    """Set numba's thread count for the calling thread to `wanted` (torch's), within its pool of `pool` threads, and
    return it. Compiled, so the short path sets it inside its one compiled call (`lean._infer_batch`)."""
    count = max(1, min(wanted, pool))
    set_thread_count(count)
    return count


@njit(cache=True)
def chunks_for(tokens, count):
    """Blocks of tokens for `cpu.forward` on `count` threads: a few per thread, so a thread that started late does
    not hold up the rest."""
    return max(1, min(tokens, 4 * count))


def threads() -> int:
    """Use as many numba threads as torch does (`torch.set_num_threads` governs both)."""
    return use_threads(torch.get_num_threads(), POOL)


# Word gradients this large get their zeros by non-temporal stores, which skip reading each line first and leave the
# cache to data that is read again. Backward at (32, 128) on this 2-core VM, ordinary stores -> streamed, with the
# table still in cache / with the caches full of other data (as after an optimizer step): H 384 (47 MB) 5.46 -> 4.03
# / 6.68 -> 5.35 ms, H 192 (23 MB) 3.10 -> 2.64 / 4.13 -> 3.54 ms. A sentence zeroes the table in a pass of its own,
# on all threads, against torch.zeros: 16 MB 0.30 -> 0.35 / 1.15 -> 0.52 ms, 47 MB 0.94 -> 1.00 / 2.90 -> 1.22,
# 94 MB 2.08 -> 2.00 / 5.71 -> 2.20.
_STREAM_FROM = 16 << 20  # bytes
# Forward outputs this large are written by non-temporal stores: at this size they leave the cache before anyone reads
# them, and streaming skips reading each line before writing it. Forward, H 768, 2 threads, the Intel VM, ordinary ->
# streamed, alternating in one process: 12 MiB (32, 128) 0.87 -> 0.93 ms, 24 MiB 1.90 -> 1.92, 48 MiB 4.33 -> 3.83,
# 96 MiB (64, 512) 10.45 -> 8.03 ms. bfloat16 outputs too: where the CPU rounds rows itself, (64, 512) 1.25-1.30x over
# the unstreamed integer rounding (BENCHMARKS.md, the tenth round); with the integer rounding of whole lines (an AMD
# EPYC, the sixteenth round), 1.00-1.01x. On AMD's Zen cores (that EPYC: a 32 MiB L3 shared with other tenants) from
# 12 MiB: there, at 12 MiB, streaming made the forward 1.22-1.53x faster, and a forward followed by a read of its
# output (as the next layer reads it) 1.06-1.13x in four runs of five (0.96-1.01x in one); at 3-6 MiB the forward with
# the read lost (0.65-0.92x), the lines having gone to memory instead of the cache (docs/memory.md).
# Nor is memory fresh from the kernel (`kernels/pages.py`), as for the word gradient's zeros: under glibc's default
# settings, where a new output is a new mapping each call, streaming took 9.82 against 8.72 ms at 48 MiB and 18.86
# against 16.57 ms at 96 MiB.


def _stream_out_from(cpu_name: str) -> int:
    """Bytes from which forward outputs are streamed on the CPU numba compiles for (above): 12 MiB on AMD's Zen cores,
    32 MiB elsewhere."""
    return (12 << 20) if cpu_rows.zen_core(cpu_name) else (32 << 20)


_STREAM_OUT_FROM = _stream_out_from(cpu_rows.CPU_NAME)
_STREAMED = (torch.float32, torch.bfloat16)
_PARALLEL_FROM = 1 << 17  # elements (N x H): below this, one thread beats waking the pool (a sentence is ~8k)


def _np(t):
    """A numpy view of a CPU tensor sharing its memory (bfloat16 as uint16 bits)."""
    t = t.detach()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def check_bad(bad: int, where: str) -> None:
    if bad:
        raise skipped_ids_error(bad, where)


def forward_chunks(tokens: int) -> int:
    """`chunks_for` torch's thread count (which it sets numba's to)."""
    return chunks_for(tokens, threads())


def stream_output(out: torch.Tensor, fresh: bool | None = None) -> bool:
    """Whether the forward kernel writes `out` (float32 or bfloat16) by non-temporal stores: from `_STREAM_OUT_FROM`
    bytes, and not fresh memory (`fresh`: what `pages.advise_if_fresh` said of a new `out`; None: ask
    `pages.is_fresh`)."""
    if out.dtype not in _STREAMED or out.nbytes < _STREAM_OUT_FROM:
        return False
    return not (pages.is_fresh(out) if fresh is None else fresh)


def run_forward(ids, tts, pids, word, seg, pos, gamma, beta, eps: float, p: float, seed: int, out=None,
                shape=None):
    """ids, tts, pids: [N] int64; tables [*, H] float32 or bfloat16 (one dtype); pos may be None.

    Returns (out [N, H] in the tables' dtype, mean [N], rstd [N] float32). `out`, if given, is written in place;
    `shape`, if given, is the shape of a new `out` (of N x H elements), returned in it and not as a view.
    """
    n, h = ids.numel(), word.shape[1]
    fresh = None  # a caller's buffer: asked when it matters
    if out is None:
        out = torch.empty(shape or (n, h), dtype=word.dtype)
        fresh = pages.advise_if_fresh(out)
    whole, out = out, out.view(n, h)
    mean, rstd = torch.empty(n), torch.empty(n)
    pos_np = _np(pos) if pos is not None else _np(word[:0])
    chunks = forward_chunks(n)
    kernel = cpu.forward if n * h >= _PARALLEL_FROM else cpu.forward_serial
    if kernel is cpu.forward:
        pages.collapse_table(word.data_ptr(), word.nbytes)  # a batch: rows from all over the table
    bad = kernel(_np(ids), _np(tts), _np(pids), _np(word), _np(seg), pos_np, _np(gamma.float()), _np(beta.float()),
                  float(eps), dropout_threshold(p), dropout_scale(p), np.uint64(seed), _np(out), _np(mean), _np(rstd),
                  chunks, stream_output(out, fresh))
    check_bad(bad, "bertembed cpu forward")
    return whole if shape else out, mean, rstd


def _word_gradient(rows: int, h: int) -> tuple[torch.Tensor, bool]:
    """An uninitialised [rows, h] float32 word gradient, and whether to stream its zeros: from `_STREAM_FROM`, unless
    its memory is fresh from the kernel (`kernels/pages.py`), which gets 2 MB pages and ordinary stores instead."""
    table = torch.empty(rows, h)
    fresh = pages.advise_if_fresh(table)
    return table, table.nbytes >= _STREAM_FROM and not fresh


def _zero_on_all_threads(table: torch.Tensor, stream: bool) -> None:
    if stream:
        cpu.stream_zero_table(_np(table), 4 * threads())
    else:
        table.zero_()  # torch's fill, on all threads


def run_backward(grad, ids, tts, pids, word, seg, pos, gamma, mean, rstd, p: float, seed: int, pad: int,
                 need_word: bool = True, need_pos: bool = True):
    """Gradients (dword [V, H] or empty, dseg [T, H], dpos [P, H] or empty, dgamma [H], dbeta [H]) in the tables'
    dtype, from grad [N, H]. Always deterministic: see `backward`."""
    n, h = grad.shape
    chunks = max(1, min(threads(), n)) if n * h >= _PARALLEL_FROM else 1
    ids_np = _np(ids)
    order = np.argsort(ids_np, kind="stable")
    vocab = word.shape[0] if need_word else 0
    bounds, rows = chunk_bounds(ids_np[order], chunks, pad, vocab)
    dword, stream = _word_gradient(vocab, h)  # uninitialised: the kernel writes every row once, zeros included
    if chunks == 1 and vocab:  # few tokens: the zeros first, spread over the threads; then the kernel only adds
        _zero_on_all_threads(dword, stream)
        rows = np.full_like(rows, vocab)
    types = seg.shape[0]
    lo, hi = (int(pids.min()), int(pids.max())) if need_pos and pos is not None and n else (0, -1)
    if chunks == 1 and hi >= lo:  # one writer: the kernel adds straight into the whole position gradient
        lo, hi = 0, pos.shape[0] - 1
    # per-chunk partials, one tensor each
    dseg, dpos = torch.zeros(chunks, types, h), torch.zeros(chunks, hi - lo + 1, h)
    dgamma, dbeta = torch.zeros(chunks, h), torch.zeros(chunks, h)
    pos_np = _np(pos) if pos is not None else _np(word[:0])
    kernel = cpu.backward if chunks > 1 else cpu.backward_serial
    bad = kernel(order, bounds, rows, ids_np, _np(tts), _np(pids), lo, _np(word), _np(seg), pos_np,
                 _np(gamma.float()), _np(mean), _np(rstd), _np(grad.contiguous()), dropout_threshold(p),
                 dropout_scale(p), np.uint64(seed), pad, _np(dword), _np(dseg), _np(dpos), _np(dgamma), _np(dbeta),
                 stream)
    check_bad(bad, "bertembed cpu backward")
    want_pos = need_pos and pos is not None
    if chunks == 1:  # one chunk's partials are the sums (float64 sums of one term change nothing)
        dseg, dgamma, dbeta = dseg[0], dgamma[0], dbeta[0]
        full_pos = dpos[0] if hi >= lo else torch.zeros(pos.shape[0] if want_pos else 0, h)
    else:
        dseg, dgamma, dbeta = dseg.sum(0), dgamma.double().sum(0), dbeta.double().sum(0)
        full_pos = torch.zeros(pos.shape[0] if want_pos else 0, h)  # no tokens: zeros
        if hi >= lo:
            full_pos[lo:hi + 1] = dpos.sum(0)
    dtype = word.dtype
    return dword.to(dtype), dseg.to(dtype), full_pos.to(dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)
