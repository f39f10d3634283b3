"""Where a GPU call's host time goes: Python and launches, with kernels too small to hide them.

    python benchmarks/gpu_host_overhead.py [--profile]

At (32, 128), hidden 768, the forward kernel takes about 15 us on an H100, so a loop of calls runs at the host's
pace. This times, per call (host clock over 1000 calls, then one synchronize), at (1, 11) and (32, 128):
- the forward: bertembed's module with id_checks "device" and "host", the kernel launched through
  `triton_launch.Launcher` (what run_forward does) and through Triton's own `kernel[grid](...)`, alternated in one
  process, an empty torch op for scale, transformers' eager layer and `torch.compile` of it;
- one training step (train mode, dropout 0.1, backward of a fixed gradient, gradients set to None): bertembed's
  module with each id_checks, transformers' eager layer and `torch.compile` of it.
`--profile` adds torch.profiler's table (host and device time per op) of bertembed's training step at (1, 11), and
cProfile's (Python time per function) of 200 such steps.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import time

import torch

from bertembed.bench.candidates import _hf_module, _torch_call, make_workload
from bertembed.bench.cases import Case
from bertembed.embeddings import BertEmbeddings
from bertembed.kernels import lean_gpu
from bertembed.kernels import triton as triton_kernels


def per_call_us(fn, calls: int = 1000) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for _ in range(20):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def alternate_training_steps(variants: dict, shapes=((1, 11), (32, 128)), rounds: int = 7,
                             device: str = "cuda") -> None:
    """Before and after for one change, alternated in one process: `variants` maps a name to a function that puts
    that version in place. The training step (H 768; on a GPU with `id_checks` "device", on the CPU with the cpu
    backend and its 2 threads) at each shape, medians of `rounds` rounds of 200 steps (20 on the CPU at (32, 128)),
    us a step."""
    for shape in shapes:
        work = make_workload(Case(768, *shape, "fwdbwd", device=device))
        if device == "cuda":
            layer = _ours(work, "device")
        else:
            torch.set_num_threads(2)
            layer = BertEmbeddings(work.config, backend="cpu")
            layer.load_state_dict(work.state_dict)
        step = _torch_call(layer, work)
        calls = 200 if device == "cuda" or shape[0] * shape[1] < 1000 else 20
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, put_in_place in variants.items():
                put_in_place()
                times[name].append(per_call_us(step, calls=calls))
        print(shape, {name: round(sorted(t)[len(t) // 2], 1) for name, t in times.items()})


def _ours(work, id_checks: str) -> BertEmbeddings:
    layer = BertEmbeddings(work.config, backend="triton")
    layer.load_state_dict(work.state_dict)
    layer.id_checks = id_checks
    return layer.cuda()


def launches(work) -> dict[str, float]:
    """The short path's steps, down to the kernel's launch through bertembed's Launcher and through Triton's
    `kernel[grid](...)`, alternated in rounds (medians of 5)."""
    ours = _ours(work, "device").eval()
    tables = [t.weight for t in (ours.word_embeddings, ours.token_type_embeddings, ours.position_embeddings)]
    ln, flat, types = ours.LayerNorm, work.input_ids.view(-1), work.token_type_ids.view(-1)
    out = torch.empty(flat.numel(), tables[0].shape[1], device="cuda")
    n, h = out.shape
    args = dict(ids=flat, tts=types, pids=flat, word=tables[0], seg=tables[1], pos=tables[2], gamma=ln.weight,
                beta=ln.bias, out=out, mean=out, rstd=out, bad=flat, N=n, H=h, V=tables[0].shape[0],
                T=tables[1].shape[0], P=tables[2].shape[0], L=work.case.length, past=0, eps=ln.eps, p=0.0, seed=0,
                HAS_POS=True, POS_IDS=False, HAS_TT=True, ROUND=False, DROPOUT=False, STATS=False, COUNT=False,
                EVICT=True, R=1, BLOCK=triton_kernels._block(h))
    warps = max(triton_kernels._block(h) * 4 // 1024, 1)
    ids, length = work.input_ids, work.case.length
    runs = {"lean_gpu.try_infer": lambda: lean_gpu.try_infer(ours, ids, work.token_type_ids, None, None, 0),
            "run_forward": lambda: triton_kernels.run_forward(flat, types, None, *tables, ln.weight, ln.bias, ln.eps,
                                                              0.0, 0, out=out, stats=False, length=length),
            "launch, bertembed Launcher": lambda: triton_kernels._launch_forward(n, warps, **args),
            "launch, triton kernel[grid]": lambda: triton_kernels._forward_kernel[(n,)](**args, num_warps=warps)}
    times = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(5):
            for name, fn in runs.items():
                times[name].append(per_call_us(fn))
    return {name: sorted(t)[2] for name, t in times.items()}


def forward_rows(work) -> dict[str, float]:
    ids, tts = work.input_ids, work.token_type_ids
    hf = _hf_module(work).cuda().eval()
    compiled = torch.compile(hf, dynamic=False)
    rows = {}
    with torch.no_grad():
        for checks in ("device", "host"):
            rows[f"module, id_checks {checks}"] = per_call_us(functools.partial(_ours(work, checks).eval(), ids, tts))
        rows["torch.empty"] = per_call_us(lambda: torch.empty(1, device="cuda"))
        rows["hf eager"] = per_call_us(lambda: hf(ids, tts))
        compiled(ids, tts)
        rows["hf torch.compile"] = per_call_us(lambda: compiled(ids, tts))
    return rows | launches(work)


def training_rows(work) -> dict[str, float]:
    rows = {}
    for checks in ("device", "host"):
        rows[f"module, id_checks {checks}"] = per_call_us(_torch_call(_ours(work, checks), work), calls=200)
    hf = _hf_module(work).cuda()
    rows["hf eager"] = per_call_us(_torch_call(hf, work), calls=200)
    compiled = torch.compile(hf, dynamic=False)
    rows["hf torch.compile"] = per_call_us(_torch_call(compiled, work), calls=200)
    return rows


def profile_training(work) -> None:
    step = _torch_call(_ours(work, "device"), work)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(50):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
    # Python's own profile of the same steps: which functions the host time goes to (torch.profiler sees ops only)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(200):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of a training step at (1, 11)")
    options = parser.parse_args()
    print(f"host time per call ({torch.cuda.get_device_name(0)}, torch {torch.__version__}):")
    for batch, length in ((1, 11), (32, 128)):
        forward = forward_rows(make_workload(Case(768, batch, length, device="cuda")))
        training = training_rows(make_workload(Case(768, batch, length, "fwdbwd", device="cuda")))
        for kind, rows in (("forward", forward), ("training step", training)):
            print(f"  H 768, ({batch}, {length}), {kind}:")
            for name, us in rows.items():
                print(f"    {name:<30} {us:8.1f} us")
    if options.profile:
        profile_training(make_workload(Case(768, 1, 11, "fwdbwd", device="cuda")))


if __name__ == "__main__":
    main()
