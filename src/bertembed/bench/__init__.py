"""`bertembed bench`: the embedding layer against what users would pick instead, on the same weights and ids.

    cases.py       what is measured (shapes, modes, dtypes) and the bandwidth-bound byte count
    candidates.py  transformers eager, torch.compile, ONNX Runtime's fused op, bertembed reference and fused
    onnx_graph.py  the hand-built com.microsoft.EmbedLayerNormalization graph
    measure.py     timers, peak memory, copy bandwidth, glibc allocator settings
    worker.py      one allocator condition in its own process
    runner.py      the parent: conditions, machine and versions
    report.py      targets, markdown
"""

from __future__ import annotations

from bertembed.bench.cases import Case, bound_bytes, bound_seconds, default_cases
from bertembed.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "Case", "bound_bytes", "bound_seconds", "default_cases", "run_bench"]
