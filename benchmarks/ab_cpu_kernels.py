"""Before/after of a change to the CPU kernels: this tree's `bertembed.kernels.cpu` (with its glue, `cpu_run`) against
the same files at a git revision, timed alternately in one process, so both see the same machine state (this VM's
memory speed drifts between periods, which makes separate runs incomparable).

    MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_MMAP_MAX_=0 python benchmarks/ab_cpu_kernels.py --against 321d5bc

Cases: the kernels' torch glue (`run_forward`, `run_forward` + `run_backward` with dropout 0.1), hidden 768,
random BERT-sized tables shared by both sides, 2 threads. Calls alternate one by one, and each pair's ratio is kept:
prints the median ratio and its interquartile range. Against its own revision it reads 0.99-1.03x in every case
(blocks of calls alternated on tables of each side's own read up to 1.13x); see BENCHMARKS.md, "How to A/B a change".
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bertembed.kernels import cpu_run as current

CASES = [  # name, batch, length, dtype, mode
    ("forward float32 (32, 128)", 32, 128, torch.float32, "fwd"),
    ("forward float32 (64, 512)", 64, 512, torch.float32, "fwd"),
    ("forward bfloat16 (64, 512)", 64, 512, torch.bfloat16, "fwd"),
    ("forward bfloat16 (8, 128)", 8, 128, torch.bfloat16, "fwd"),
    ("fwd+bwd float32 (32, 128)", 32, 128, torch.float32, "fwdbwd"),
    ("fwd+bwd float32 (1, 11)", 1, 11, torch.float32, "fwdbwd"),
]


def load_revision(rev: str):
    """`src/bertembed/kernels/cpu.py` as it was at `rev`, imported as a module of its own, with the `cpu_elements.py`
    and `cpu_rows.py` of the same revision where it has them (imported under their own names too, so the working
    tree's stay out). Returns the module with `run_forward` and `run_backward`: that revision's `cpu_run.py` where it
    has one (its glue moved there from `cpu.py` at 2026-11-22), else its `cpu.py`."""
    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp())

    def source(name: str) -> str | None:
        shown = subprocess.run(["git", "show", f"{rev}:src/bertembed/kernels/{name}.py"], cwd=root,
                               capture_output=True, text=True)
        return shown.stdout if shown.returncode == 0 else None

    def load(name: str, text: str):
        path = folder / f"{name}_at_revision.py"  # a file of its own: numba's cache is keyed on it
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module

    text = source("cpu")
    if text is None:
        raise SystemExit(f"{rev} has no src/bertembed/kernels/cpu.py")
    loaded = []  # helper modules of that revision, each imported under its own name

    def renamed(code: str) -> str:
        for name in loaded:
            code = code.replace(f"from bertembed.kernels.{name} import", f"from {name}_at_revision import")
        return code

    for helper in ("cpu_elements", "cpu_rows"):
        if (helper_text := source(helper)) is not None:
            load(helper, renamed(helper_text))
            loaded.append(helper)
    kernels = load("cpu", renamed(text))
    glue = source("cpu_run")
    if glue is None:
        return kernels
    for line in ("from bertembed.kernels import cpu, pages", "from bertembed.kernels import cpu, cpu_rows, pages"):
        imports = "import cpu_at_revision as cpu\n"
        if "cpu_rows" in line:
            imports += "import cpu_rows_at_revision as cpu_rows\n"
        glue = glue.replace(line, imports + "from bertembed.kernels import pages")
    return load("cpu_run", renamed(glue))


def make_inputs(batch: int, length: int, dtype: torch.dtype, hidden: int = 768) -> dict:
    """Random BERT-sized tables, ids and an output gradient: one set, shared by both sides of a case (separate
    tables per side put each side's rows on other pages, which alone moved a case by up to 13% here)."""
    gen = torch.Generator().manual_seed(0)
    word, seg, pos = (torch.randn(rows, hidden, generator=gen).mul(0.05).to(dtype) for rows in (30522, 2, 512))
    n = batch * length
    return {"tables": (word, seg, pos), "gamma": torch.rand(hidden, generator=gen) + 0.5,
            "beta": torch.randn(hidden, generator=gen) * 0.1, "ids": torch.randint(0, 30522, (n,), generator=gen),
            "tts": torch.randint(0, 2, (n,), generator=gen), "pids": torch.arange(length).repeat(batch),
            "grad": torch.randn(n, hidden, generator=gen).to(dtype)}


def make_step(kernels, inputs: dict, mode: str):
    ids, tts, pids, tables = inputs["ids"], inputs["tts"], inputs["pids"], inputs["tables"]
    gamma, beta = inputs["gamma"], inputs["beta"]
    if mode == "fwd":
        return lambda: kernels.run_forward(ids, tts, pids, *tables, gamma, beta, 1e-12, 0.0, 0)

    def step():
        _, mean, rstd = kernels.run_forward(ids, tts, pids, *tables, gamma, beta, 1e-12, 0.1, 7)
        return kernels.run_backward(inputs["grad"], ids, tts, pids, *tables, gamma, mean, rstd, 0.1, 7, 0)
    return step


def interleaved(steps, pairs: int) -> tuple[float, float, np.ndarray]:
    """Median ms of each side and the before/after ratio of each pair of calls, the two calls of a pair back to back
    and their order swapped every pair (so neither side always runs first, after the other has filled the caches)."""
    times = np.empty((pairs, 2))
    for k in range(pairs):
        for side in ((0, 1) if k % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            steps[side]()
            times[k, side] = time.perf_counter() - start
    return float(np.median(times[:, 0])) * 1e3, float(np.median(times[:, 1])) * 1e3, times[:, 0] / times[:, 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="git revision whose kernels/cpu.py is the 'before'")
    parser.add_argument("--pairs", type=int, default=40, help="pairs of calls per case (more for small cases)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    before = load_revision(args.against)
    before.threads(), current.threads()
    print(f"before = {args.against}, after = working tree; torch threads {torch.get_num_threads()}")
    for name, batch, length, dtype, mode in CASES:
        inputs = make_inputs(batch, length, dtype)
        steps = [make_step(k, inputs, mode) for k in (before, current)]
        for step in steps:  # compile and settle
            step(), step()
        pairs = args.pairs * (8 if batch * length <= 4096 else 1)
        old, new, ratios = interleaved(steps, pairs)
        low, mid, high = np.percentile(ratios, [25, 50, 75])
        print(f"{name:28s} before {old:8.3f} ms  after {new:8.3f} ms  before/after {mid:5.2f}x "
              f"(IQR {low:.2f}-{high:.2f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
