"""Is the bfloat16 forward at (64, 512), hidden 768, on the short path, and what does a call cost on the host?

    PYTHONPATH=src:benchmarks python benchmarks/gpu_dtype_host.py

For float32 and bfloat16 layers with `id_checks = "device"`: whether `lean_gpu.try_infer` takes the call, the host
time a call in a back-to-back loop (`gpu_host_overhead.per_call_us`), and the GPU time a call from the profiler.
"""

import torch
from gpu_cache_hints import gpu_us
from gpu_host_overhead import _ours, per_call_us

from bertembed.bench.candidates import make_workload
from bertembed.bench.cases import Case
from bertembed.kernels import lean_gpu


def measure(dtype: str) -> None:
    work = make_workload(Case(768, 64, 512, dtype=dtype, device="cuda"))
    layer = _ours(work, "device").to(getattr(torch, dtype)).eval()
    ids, types = work.input_ids, work.token_type_ids
    with torch.no_grad():
        short = lean_gpu.try_infer(layer, ids, types, None, None, 0) is not None
        host = per_call_us(lambda: layer(ids, types), calls=500)
        gpu = gpu_us(lambda i: layer(i, types), ids)
    print(f"{dtype}: short path {short}, {host:.1f} us a call back to back, GPU {gpu:.1f} us a call")


for dtype in ("float32", "bfloat16", "float32", "bfloat16"):
    measure(dtype)
