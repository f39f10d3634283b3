"""Where a GPU forward's host time goes: Python and launches, with kernels too small to hide them.

    python benchmarks/gpu_host_overhead.py

At (32, 128), hidden 768, the kernel takes about 15 us on an H100, so a loop of calls runs at the host's pace. This
times, per call (host clock over 2000 calls, then one synchronize): bertembed's module with id_checks "device" and
"host", the Triton launch alone (`run_forward`), an empty torch op (`torch.empty`) for scale, transformers' eager
layer and `torch.compile` of it; then prints cProfile's top entries for the module call.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from bertembed.bench.candidates import _hf_module, make_workload
from bertembed.bench.cases import Case
from bertembed.embeddings import BertEmbeddings
from bertembed.kernels import triton as triton_kernels


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    work = make_workload(Case(768, 32, 128, device="cuda"))
    ids, tts = work.input_ids, work.token_type_ids
    ours = BertEmbeddings(work.config, backend="triton")
    ours.load_state_dict(work.state_dict)
    ours = ours.cuda().eval()
    hf = _hf_module(work).cuda().eval()
    compiled = torch.compile(hf, dynamic=False)
    tables = [t.weight for t in (ours.word_embeddings, ours.token_type_embeddings, ours.position_embeddings)]
    ln, out = ours.LayerNorm, torch.empty(32, 128, 768, device="cuda")
    flat, types = ids.view(-1), tts.view(-1)
    rows = {}
    with torch.no_grad():
        ours.id_checks = "device"
        rows["module, id_checks device"] = per_call_us(lambda: ours(ids, tts))
        ours.id_checks = "host"
        rows["module, id_checks host"] = per_call_us(lambda: ours(ids, tts))
        rows["run_forward (launch only)"] = per_call_us(lambda: triton_kernels.run_forward(
            flat, types, None, *tables, ln.weight, ln.bias, ln.eps, 0.0, 0, out=out, stats=False, length=128))
        rows["torch.empty"] = per_call_us(lambda: torch.empty(1, device="cuda"))
        rows["hf eager"] = per_call_us(lambda: hf(ids, tts))
        compiled(ids, tts)
        rows["hf torch.compile"] = per_call_us(lambda: compiled(ids, tts))
        ours.id_checks = "device"
        profile = cProfile.Profile()
        profile.runcall(lambda: [ours(ids, tts) for _ in range(2000)])
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    print(f"host time per call, H768 B32 L128 ({torch.cuda.get_device_name(0)}):")
    for name, us in rows.items():
        print(f"  {name:<28} {us:7.1f} us")


if __name__ == "__main__":
    main()
