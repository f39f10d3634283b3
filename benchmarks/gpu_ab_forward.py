"""The Triton forward of this tree against another version of `kernels/triton.py`, alternated in one process.

    python benchmarks/gpu_ab_forward.py OLD_TRITON_PY

OLD_TRITON_PY is a copy of `src/bertembed/kernels/triton.py` from the revision to compare with (for example
`git show REV:src/bertembed/kernels/triton.py > old/triton.py`). Both `run_forward`s run as the short inference path
calls them (default positions, segment ids given, no statistics), beside `torch.compile` of transformers' layer, over
the id streams of `gpu_cache_hints.py` (same ids, fresh uniform ids, Zipf ids), back to back, medians of 7 rounds of
100 calls, us a call.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
import triton
from gpu_cache_hints import _compare, _print, _setup, id_streams

from bertembed.bench.cases import Case
from bertembed.kernels import triton as new_kernels


def load(path: str):
    spec = importlib.util.spec_from_file_location("old_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(case: Case, versions: dict) -> None:
    work, hf, tables, gamma, beta = _setup(case)
    tts = work.token_type_ids.view(-1)
    out = torch.empty(tts.numel(), case.hidden, device="cuda", dtype=tables[0].dtype)

    def call(kernels):
        return lambda ids: kernels.run_forward(ids.view(-1), tts, None, *tables, gamma, beta, 1e-12, 0.0, 0, out=out,
                                               stats=False, length=case.length)

    reference = hf(work.input_ids, work.token_type_ids).view(out.shape).float()
    for name, kernels in versions.items():
        out.fill_(float("nan"))
        call(kernels)(work.input_ids)
        print(f"{name}: max abs diff from transformers' layer {(out.float() - reference).abs().max().item():.1e}")
    compiled = torch.compile(hf, dynamic=False)
    candidates = {"torch.compile": lambda ids: compiled(ids, work.token_type_ids)}
    candidates |= {name: call(kernels) for name, kernels in versions.items()}
    streams = id_streams(work.config.vocab_size, (case.batch, case.length), "cuda")
    _print(f"{case}", _compare(candidates, streams), candidates, streams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="a copy of kernels/triton.py from the revision to compare with")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    versions = {"old": load(args.old), "this tree": new_kernels}
    for case in (Case(1024, 64, 512, device="cuda"), Case(1024, 64, 512, dtype="bfloat16", device="cuda"),
                 Case(768, 64, 512, device="cuda")):
        compare(case, versions)


if __name__ == "__main__":
    main()
