"""The Triton forward of this tree against another version of `kernels/triton.py`, alternated in one process.

    python benchmarks/gpu_ab_forward.py OLD_TRITON_PY [MORE_TRITON_PY ...]

Each OLD_TRITON_PY is a copy of `src/bertembed/kernels/triton.py` from the revision to compare with (for example
`git show REV:src/bertembed/kernels/triton.py > old/triton.py`). Both `run_forward`s run as the short inference path
calls them, beside `torch.compile` of transformers' layer, over the id streams of `gpu_cache_hints.py` (same ids,
fresh uniform ids, Zipf ids), back to back, medians of 7 rounds of 100 calls, us a call, then each one's GPU time
from the profiler (`gpu_cache_hints.time_forwards`).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
import triton
from gpu_cache_hints import time_forwards

from bertembed.bench.cases import Case
from bertembed.kernels import triton as new_kernels


def load(path: str):
    spec = importlib.util.spec_from_file_location("old_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", nargs="+", help="copies of kernels/triton.py from the revisions to compare with")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    forwards = {Path(path).stem: load(path).run_forward for path in args.old} | {"this tree": new_kernels.run_forward}
    for case in (Case(1024, 64, 512, device="cuda"), Case(1024, 64, 512, dtype="bfloat16", device="cuda"),
                 Case(768, 64, 512, device="cuda")):
        time_forwards(case, forwards)


if __name__ == "__main__":
    main()
