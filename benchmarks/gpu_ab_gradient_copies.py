"""Before and after for one change: a GPU training step's LayerNorm weight and bias gradients as views of the
backward's one buffer (after) or as copies (before: the sixth round's storage fix copied them in every call; now only
the custom op does, under `torch.compile`).

    PYTHONPATH=src:benchmarks python benchmarks/gpu_ab_gradient_copies.py

The training step of `gpu_host_overhead.py` (id_checks "device"), H 768, at (1, 11) and (32, 128); "before" wraps
the Triton `run_backward` to clone the two rows, as it did. Alternated in one process, medians of 7 rounds of 200
steps, us a step.
"""

from gpu_host_overhead import alternate_training_steps

from bertembed.kernels import triton as tk

new = tk.run_backward


def old(*args, **kwargs):
    g = new(*args, **kwargs)
    return g[:3] + (g[3].clone(), g[4].clone())


alternate_training_steps({"before (copies)": lambda: setattr(tk, "run_backward", old),
                          "after (views)": lambda: setattr(tk, "run_backward", new)})
