"""Before/after of a change to the CPU kernels: this tree's `bertembed.kernels.cpu` (with its glue, `cpu_run`) against
the same files at a git revision, timed alternately in one process, so both see the same machine state (this VM's
memory speed drifts between periods, which makes separate runs incomparable).

    MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_MMAP_MAX_=0 python benchmarks/ab_cpu_kernels.py --against 321d5bc

Cases: the kernels' torch glue (`run_forward`, `run_forward` + `run_backward` with dropout 0.1), hidden 768,
random BERT-sized tables, 2 threads. Prints the median of several alternating blocks per side.
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


def make_step(kernels, batch: int, length: int, dtype: torch.dtype, mode: str, hidden: int = 768):
    gen = torch.Generator().manual_seed(0)
    word, seg, pos = (torch.randn(rows, hidden, generator=gen).mul(0.05).to(dtype) for rows in (30522, 2, 512))
    gamma, beta = torch.rand(hidden, generator=gen) + 0.5, torch.randn(hidden, generator=gen) * 0.1
    n = batch * length
    ids, tts = torch.randint(0, 30522, (n,), generator=gen), torch.randint(0, 2, (n,), generator=gen)
    pids = torch.arange(length).repeat(batch)
    grad = torch.randn(n, hidden, generator=gen).to(dtype)
    tables = (word, seg, pos)
    if mode == "fwd":
        return lambda: kernels.run_forward(ids, tts, pids, *tables, gamma, beta, 1e-12, 0.0, 0)

    def step():
        _, mean, rstd = kernels.run_forward(ids, tts, pids, *tables, gamma, beta, 1e-12, 0.1, 7)
        return kernels.run_backward(grad, ids, tts, pids, *tables, gamma, mean, rstd, 0.1, 7, 0)
    return step


def block_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="git revision whose kernels/cpu.py is the 'before'")
    parser.add_argument("--blocks", type=int, default=4, help="alternating blocks per side")
    args = parser.parse_args()
    torch.set_num_threads(2)
    before = load_revision(args.against)
    before.threads(), current.threads()
    print(f"before = {args.against}, after = working tree; torch threads {torch.get_num_threads()}")
    for name, batch, length, dtype, mode in CASES:
        steps = [make_step(k, batch, length, dtype, mode) for k in (before, current)]
        for step in steps:  # compile and settle
            step(), step()
        calls = 30 if batch * length <= 4096 else 8
        blocks = [[], []]
        for _ in range(args.blocks):
            for side, step in enumerate(steps):
                blocks[side].append(block_ms(step, calls))
        old, new = (float(np.median(b)) for b in blocks)
        print(f"{name:28s} before {old:8.3f} ms  after {new:8.3f} ms  before/after {old / new:5.2f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
