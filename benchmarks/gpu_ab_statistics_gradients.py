"""Before and after for one change: autograd no longer fills a zero gradient for the layer's mean and 1/std
outputs, which backward never reads (`ctx.set_materialize_grads(False)` in `function._setup_context`). Before, each
training step launched two fill kernels for them.

    PYTHONPATH=src:benchmarks python benchmarks/gpu_ab_statistics_gradients.py [--device cpu]

The training step of `gpu_host_overhead.py` (id_checks "device"; or the cpu backend), H 768, at (1, 11) and
(32, 128); "before" turns materialisation back on. Alternated in one process, medians of 7 rounds, us a step.
"""

import argparse

from gpu_host_overhead import alternate_training_steps

from bertembed.kernels import function

new = function._setup_context


def old(ctx, inputs, output):
    new(ctx, inputs, output)
    ctx.set_materialize_grads(True)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
alternate_training_steps({"before (zero fills)": lambda: setattr(function, "_setup_context", old),
                          "after (none)": lambda: setattr(function, "_setup_context", new)},
                         device=parser.parse_args().device)
