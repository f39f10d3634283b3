"""Before and after for one change: the Triton backward's word and position gradients as views of one zeroed buffer
(after: one fill launch a training step) or as two zeroed tensors (before).

    PYTHONPATH=src:benchmarks python benchmarks/gpu_ab_dense_gradients.py

The training step of `gpu_host_overhead.py` (id_checks "device"), H 768, at (1, 11) and (32, 128); "before" puts the
two `torch.zeros` back in place of `triton._dense_gradients`. Alternated in one process, medians of 7 rounds of 200
steps, us a step.
"""

import torch
from gpu_host_overhead import alternate_training_steps

from bertembed.kernels import triton as tk

new = tk._dense_gradients


def old(word_rows, pos_rows, hidden, device):
    return (torch.zeros(word_rows, hidden, device=device), torch.zeros(pos_rows, hidden, device=device))


alternate_training_steps({"before (two fills)": lambda: setattr(tk, "_dense_gradients", old),
                          "after (one)": lambda: setattr(tk, "_dense_gradients", new)})
