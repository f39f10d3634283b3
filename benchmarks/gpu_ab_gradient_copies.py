"""Before and after for one change: a GPU training step's LayerNorm weight and bias gradients as views of the
backward's one buffer (after) or as copies (before: the sixth round's storage fix copied them in every call; now only
the custom op does, under `torch.compile`).

    PYTHONPATH=src:benchmarks python benchmarks/gpu_ab_gradient_copies.py

The training step of `gpu_host_overhead.py` (id_checks "device"), H 768, at (1, 11) and (32, 128); "before" wraps
the Triton `run_backward` to clone the two rows, as it did. Alternated in one process, medians of 7 rounds of 200
steps, us a step.
"""

from gpu_host_overhead import _ours, per_call_us

from bertembed.bench.candidates import _torch_call, make_workload
from bertembed.bench.cases import Case
from bertembed.kernels import triton as tk

new = tk.run_backward


def old(*args, **kwargs):
    g = new(*args, **kwargs)
    return g[:3] + (g[3].clone(), g[4].clone())


for shape in ((1, 11), (32, 128)):
    work = make_workload(Case(768, *shape, "fwdbwd", device="cuda"))
    step = _torch_call(_ours(work, "device"), work)
    times = {"before (copies)": [], "after (views)": []}
    for _ in range(7):
        for name, fn in (("before (copies)", old), ("after (views)", new)):
            tk.run_backward = fn
            times[name].append(per_call_us(step, calls=200))
    print(shape, {k: round(sorted(v)[3], 1) for k, v in times.items()})
