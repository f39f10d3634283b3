"""Do L2 cache hints on the word rows and the output make the Triton forward faster than `torch.compile`'s?

    python benchmarks/gpu_cache_hints.py [--shipped-only]

At (64, 512), hidden 1024, float32, both kernels move the same DRAM bytes (word rows in, output out), so only L2
hits on repeated word rows can make one faster. This times a copy of the inference forward (default positions,
segment ids given) with the word-row loads and the output stores under each hint, against the shipped kernel and
`torch.compile` of transformers' layer, back to back as `bertembed bench` does (no L2 flush), over three id streams:
- same: one uniform random id tensor every call (what `bertembed bench` does);
- fresh: a new uniform random id tensor each call (8 cycled, 134 MB of ids apart);
- zipf: ids drawn from a Zipf law over the vocabulary (exponent 1, like word frequencies in text), 8 cycled.
Medians of 7 rounds of 100 calls, CUDA events, candidates alternated within each round. Then the shipped kernel
with and without its `evict_first` hint (what it ships with), at the GPU targets' case, in bfloat16, and at the
smaller shapes, beside `torch.compile`.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from bertembed.bench.candidates import _hf_module, make_workload
from bertembed.bench.cases import Case
from bertembed.kernels import triton as triton_kernels


@triton.jit
def hinted_row(t, ids, tts, word, seg, pos, gamma, beta, out, H, L, eps, cols, m, WORD_HINT: tl.constexpr,
               OUT_HINT: tl.constexpr):
    """Token row `t` of the inference forward (default positions, segment ids given), no checks, with these hints on
    the word-row load and the output store."""
    w = tl.load(ids + t)
    s = tl.load(tts + t)
    x = tl.load(word + w * H + cols, mask=m, other=0.0, eviction_policy=WORD_HINT)
    x += tl.load(seg + s * H + cols, mask=m, other=0.0)
    x += tl.load(pos + (t % L) * H + cols, mask=m, other=0.0)
    mu = tl.sum(x, axis=0) / H
    d = tl.where(m, x - mu, 0.0)
    r = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / H + eps)
    y = d * r * tl.load(gamma + cols, mask=m) + tl.load(beta + cols, mask=m)
    if OUT_HINT == "cs":
        tl.store(out + t * H + cols, y, mask=m, cache_modifier=".cs")
    else:
        tl.store(out + t * H + cols, y, mask=m, eviction_policy=OUT_HINT)


@triton.jit
def _hinted_forward(ids, tts, word, seg, pos, gamma, beta, out, H, L, eps, WORD_HINT: tl.constexpr,
                    OUT_HINT: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    hinted_row(tl.program_id(0).to(tl.int64), ids, tts, word, seg, pos, gamma, beta, out, H, L, eps, cols, cols < H,
               WORD_HINT, OUT_HINT)


def id_streams(vocab: int, shape, device) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    zipf = zipf[torch.randperm(vocab, generator=gen)]  # frequent ids spread over the table, as in a vocabulary
    draw = [torch.randint(0, vocab, shape, generator=gen) for _ in range(8)]
    return {"same": [draw[0].to(device)] * 8, "fresh": [t.to(device) for t in draw],
            "zipf": [torch.multinomial(zipf, shape[0] * shape[1], replacement=True, generator=gen).view(shape)
                     .to(device) for _ in range(8)]}


def time_us(fn, streams: list[torch.Tensor], calls: int = 100) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fn(streams[i % len(streams)])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def _compare(candidates: dict, streams: dict, rounds: int = 7) -> dict[tuple[str, str], float]:
    """Median us a call of each candidate on each id stream, alternated within each round."""
    times = {(name, s): [] for name in candidates for s in streams}
    with torch.no_grad():
        for fn in candidates.values():
            time_us(fn, streams["same"], 20)
        for _ in range(rounds):
            for s, ids in streams.items():
                for name, fn in candidates.items():
                    times[name, s].append(time_us(fn, ids))
    return {key: sorted(t)[len(t) // 2] for key, t in times.items()}


def _print(title: str, medians: dict, candidates, streams) -> None:
    print(f"\n{title}; us a call\n{'candidate':34}" + "".join(f"{s:>10}" for s in streams))
    for name in candidates:
        print(f"{name:34}" + "".join(f"{medians[name, s]:10.1f}" for s in streams))


def _setup(case: Case):
    work = make_workload(case)
    dtype = getattr(torch, case.dtype)
    hf = _hf_module(work).to("cuda", dtype).eval()
    sd = {k: v.to("cuda", dtype) for k, v in work.state_dict.items()}
    tables = [sd[f"{t}_embeddings.weight"] for t in ("word", "token_type", "position")]
    return work, hf, tables, sd["LayerNorm.weight"], sd["LayerNorm.bias"]


def hint_matrix() -> None:
    """Every word-row and output hint in a copy of the kernel, at the GPU targets' case."""
    case = Case(1024, 64, 512, device="cuda")
    work, hf, (word, seg, pos), gamma, beta = _setup(case)
    tts = work.token_type_ids.view(-1)
    n, h = tts.numel(), case.hidden
    out = torch.empty(n, h, device="cuda")

    def hinted(word_hint, out_hint):
        return lambda ids: _hinted_forward[(n,)](ids, tts, word, seg, pos, gamma, beta, out, h, case.length, 1e-12,
                                                 WORD_HINT=word_hint, OUT_HINT=out_hint, BLOCK=1024, num_warps=4)

    compiled = torch.compile(hf, dynamic=False)
    candidates = {"torch.compile": lambda ids: compiled(ids, work.token_type_ids)}
    for word_hint in ("", "evict_last", "evict_first"):
        for out_hint in ("", "evict_first", "cs"):
            candidates[f"word {word_hint or '-'}, out {out_hint or '-'}"] = hinted(word_hint, out_hint)
    ref = hf(work.input_ids, work.token_type_ids).view(n, h)
    for name, fn in list(candidates.items())[1:]:
        out.fill_(float("nan"))
        fn(work.input_ids)
        assert (out - ref).abs().max().item() < 1e-5, name
    streams = id_streams(work.config.vocab_size, (case.batch, case.length), "cuda")
    _print(f"hint matrix, kernel copy, {case}", _compare(candidates, streams), candidates, streams)


def time_forwards(case: Case, forwards: dict) -> None:
    """Each of `forwards` (name: a function called as `triton.run_forward`) as the short inference path calls it
    (default positions, segment ids given, no statistics), checked against transformers' layer, then timed beside
    `torch.compile` of that layer over the three id streams."""
    work, hf, tables, gamma, beta = _setup(case)
    tts = work.token_type_ids.view(-1)
    out = torch.empty(tts.numel(), case.hidden, device="cuda", dtype=tables[0].dtype)

    def call(run_forward):
        return lambda ids: run_forward(ids.view(-1), tts, None, *tables, gamma, beta, 1e-12, 0.0, 0, out=out,
                                       stats=False, length=case.length)

    reference = hf(work.input_ids, work.token_type_ids).view(out.shape).float()
    for name, run_forward in forwards.items():
        out.fill_(float("nan"))
        call(run_forward)(work.input_ids)
        print(f"{name}: max abs diff from transformers' layer {(out.float() - reference).abs().max().item():.1e}")
    report(case, work, hf, {name: call(run_forward) for name, run_forward in forwards.items()})


def report(case: Case, work, hf, found: dict) -> None:
    """`found` (name: a function of the ids) beside `torch.compile` of transformers' layer `hf`: event-timed loops over
    the three id streams, then each one's GPU time from the profiler."""
    compiled = torch.compile(hf, dynamic=False)
    candidates = {"torch.compile": lambda ids: compiled(ids, work.token_type_ids)} | found
    streams = id_streams(work.config.vocab_size, (case.batch, case.length), "cuda")
    _print(f"{case}", _compare(candidates, streams), candidates, streams)
    print("GPU us a call (profiler, kernels only), same ids: " + "; ".join(
        f"{name} {gpu_us(fn, work.input_ids):.1f}" for name, fn in candidates.items()))


def gpu_us(fn, ids, calls: int = 50) -> float:
    """The GPU time of one call of `fn(ids)`: every kernel it launches, summed, from the profiler. Unlike the loops
    above it leaves out the host: where a call's launches take longer than its kernels, the loops time the host."""
    with torch.no_grad():
        fn(ids)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn(ids)
            torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / calls


def shipped(case: Case) -> None:
    """The shipped forward with and without `evict_first`."""
    hinted = triton_kernels.run_forward
    without = functools.partial(hinted, evict_first=False)
    time_forwards(case, {"shipped, no hints (before)": without, "shipped, evict_first (after)": hinted})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shipped-only", action="store_true", help="skip the matrix of hints in the kernel copy")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if not args.shipped_only:
        hint_matrix()
    for case in (Case(1024, 64, 512, device="cuda"), Case(1024, 64, 512, dtype="bfloat16", device="cuda"),
                 Case(768, 32, 128, device="cuda"), Case(768, 1, 11, device="cuda")):
        shipped(case)


if __name__ == "__main__":
    main()
