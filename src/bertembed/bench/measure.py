"""How `bertembed bench` measures: every candidate of a case in one process, timed in interleaved rounds. glibc's
allocator settings hold from a process's start: a condition this process is not in runs in a child process."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import benchmark

from bertembed.bench import candidates as cands
from bertembed.bench.candidates import CANDIDATES, DTYPES, Case

STEADY_ENV = {"MALLOC_TRIM_THRESHOLD_": "1099511627776", "MALLOC_MMAP_MAX_": "0"}  # glibc keeps freed memory
CONDITIONS = {"steady": ("steady",), "default": ("default",), "both": ("steady", "default")}
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class Options:
    """What to run; `cases` (tests, the child process) replaces the planned sweep."""

    quick: bool = False
    threads: int = 2
    allocator: str | None = None  # None: "steady" (where the targets are judged) for --quick and CUDA, else "both"
    device: str = "auto"
    hiddens: tuple[int, ...] | None = None
    shapes: tuple[tuple[int, int], ...] | None = None
    dtypes: tuple[str, ...] | None = None
    repeat: int = 3  # rounds per case, the candidates' order rotated each round
    reference: bool = False  # time bertembed's reference layer too
    candidates: tuple[str, ...] = CANDIDATES
    cases: list[Case] | None = None
    min_run_time: float | None = None  # seconds per candidate and round; None: 0.05 quick, 0.3 full
    bandwidth_bytes: int = 1 << 30
    vocab: int = cands.VOCAB
    warmup: int = 3

    def __post_init__(self) -> None:
        self.allocator = self.allocator or ("steady" if self.quick or self.device == "cuda" else "both")
        self.min_run_time = self.min_run_time or (0.05 if self.quick else 0.3)
        checks = [(self.allocator in CONDITIONS,
                   f"--allocator must be one of {tuple(CONDITIONS)}, got {self.allocator!r}"),
                  (self.device in DEVICES, f"--device must be one of {DEVICES}, got {self.device!r}"),
                  (self.threads >= 1, f"--threads must be at least 1, got {self.threads}"),
                  (self.repeat >= 1, f"--repeat must be at least 1, got {self.repeat}"),
                  (not self.hiddens or min(self.hiddens) >= 1, f"--hidden must be positive, got {self.hiddens}"),
                  (not self.shapes or min(min(s) for s in self.shapes) >= 1,
                   f"--shape must be positive BxL, got {self.shapes}"),
                  (not self.shapes or max(n for _, n in self.shapes) <= 512,
                   f"--shape lengths stop at 512, the rows of BERT's position table; got {self.shapes}"),
                  (set(self.dtypes or ()) <= set(DTYPES), f"--dtype must be among {tuple(DTYPES)}, got {self.dtypes}"),
                  (set(self.candidates) <= set(CANDIDATES), f"candidates must be among {CANDIDATES}"),
                  (self.device != "cuda" or torch.cuda.is_available(),
                   "--device cuda asked for, but torch sees no CUDA device")]
        if bad := next((message for ok, message in checks if not ok), None):
            raise ValueError(bad)


def current_condition() -> str | None:
    """The allocator condition this process started in, from its environment; None for another glibc setting."""
    if all(os.environ.get(k) == v for k, v in STEADY_ENV.items()):
        return "steady"
    return None if any(k in os.environ for k in STEADY_ENV) else "default"


def run(options: Options) -> dict[str, Any]:
    """Every condition of `options.allocator`, in this process where it started in it; the report without targets."""
    from bertembed.bench.report import header

    gpu = ("cuda",) if torch.cuda.is_available() else ()
    devices = {"cpu": ("cpu",), "cuda": ("cuda",)}.get(options.device, ("cpu", *gpu))
    cases = options.cases
    if cases is None:
        cases = cands.plan(options.quick, options.hiddens, options.shapes, options.dtypes, devices)
    report = {**header(options), "steady_env": STEADY_ENV, "conditions": {}}
    for condition in CONDITIONS[options.allocator]:
        here = current_condition() == condition
        done = measure_all(options, cases, condition) if here else _child(options, cases, condition)
        report["conditions"][condition] = {**done, "in_process": here}
    return report


def _child(options: Options, cases: list[Case], condition: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in STEADY_ENV} | (STEADY_ENV if condition == "steady" else {})
    env.update({k: str(options.threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(__file__).parents[2]), env.get("PYTHONPATH"))))
    with tempfile.TemporaryDirectory(prefix="bertembed-bench-") as folder:
        out = Path(folder) / "condition.json"
        spec = json.dumps({**asdict(options), "cases": [c.to_dict() for c in cases], "condition": condition})
        done = subprocess.run([sys.executable, "-m", "bertembed.bench.measure", spec, str(out)], env=env)
        if done.returncode != 0:
            raise RuntimeError(f"the {condition} allocator condition's process exited with status {done.returncode}")
        return json.loads(out.read_text())


def measure_all(options: Options, cases: list[Case], condition: str) -> dict[str, Any]:
    torch.set_num_threads(options.threads)
    try:
        import numba

        numba.set_num_threads(min(options.threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    meta = {"condition": condition, "threads": options.threads, "load_average": os.getloadavg(),
            "bandwidth_bytes_per_s": {d: copy_bandwidth(d, options.bandwidth_bytes, options.threads,
                                                        0.2 if options.quick else 1.0)
                                      for d in sorted({c.device for c in cases})}}
    results, group, built = [], None, {}
    for i, case in enumerate(cases):
        print(f"bench ({condition}) {i + 1}/{len(cases)}: {case.key}", file=sys.stderr, flush=True)
        if group != (case.device, case.hidden, case.dtype, case.member):
            group, built = (case.device, case.hidden, case.dtype, case.member), {}  # (the last group's tables freed)
            built = cands.modules(case.hidden, case.device, case.dtype, vocab=options.vocab, member=case.member)
        results += measure_case(case, built, options, meta["bandwidth_bytes_per_s"][case.device])
    return {"meta": meta, "results": results}


def measure_case(case: Case, built: dict[str, Any], options: Options, dram: float) -> list[dict[str, Any]]:
    """One record per candidate: built, warmed up, checked against the float32 reference (forward), then timed in
    `options.repeat` rounds of one `blocked_autorange` each, the order rotated by one each round."""
    names = [n for n in options.candidates if cands.runs(n, case) and (options.reference or "reference" not in n)]
    ids, types, grad = cands.inputs(case, vocab=options.vocab)
    records = {n: {"case": case.to_dict(), "key": case.key, "output_bytes": case.output_bytes, "candidate": n}
               for n in names}
    if case.mode == "fwd":
        with torch.no_grad():
            expected = built["reference32"].eval()(**cands.arguments(built, ids, types)).double()
    calls = {}
    for name in names:
        try:
            fn = cands.call(name, built, case, ids, types, grad)
            for _ in range(options.warmup):
                fn()
            if case.mode == "fwd":
                diff = float((torch.as_tensor(fn()).to(expected.device).double() - expected).abs().max())
                records[name]["max_abs_diff"] = diff
                if diff > cands.TOLERANCE[case.dtype]:
                    records[name]["note"] = f"OUTPUT DIFFERS from the reference by up to {diff:.2e}"
            calls[name] = fn
        except cands.NotAvailable as err:
            records[name].update(status="not available", note=str(err))
        except Exception as err:  # noqa: BLE001  (a failing candidate is reported, the run goes on)
            records[name].update(status="error", note=f"{type(err).__name__}: {str(err)[:300]}")
    rounds: dict[str, list[benchmark.Measurement]] = {n: [] for n in calls}
    order = deque(calls)
    for _ in range(options.repeat):
        for name in order:
            timer = benchmark.Timer("fn()", globals={"fn": calls[name]}, num_threads=options.threads)
            rounds[name].append(timer.blocked_autorange(min_run_time=options.min_run_time))
            time.sleep(0.01)  # another library's thread pool stops spinning before the next candidate starts
        order.rotate(-1)
    for name, fn in calls.items():
        every = benchmark.Measurement.merge(rounds[name])[0]  # every block of every round
        records[name].update(status="ok", median_s=every.median, iqr_s=every.iqr, runs=len(every.times),
                             round_medians_s=[m.median for m in rounds[name]])
        if name != "ort-fused":  # (ORT's buffers are outside torch's allocator)
            peak = peak_bytes(fn, case.device)
            if case.mode != "fwd" or peak >= case.output_bytes:
                records[name]["peak_bytes"] = peak
            else:  # (an output allocated outside torch's allocator, or missed by the profiler)
                note = f"peak memory not measured: torch's allocator saw {peak} bytes, less than the output"
                records[name]["note"] = "; ".join(filter(None, (records[name].get("note"), note)))
    eager = records.get("hf-eager", {}).get("median_s")
    traffic = cands.bound_bytes(case)
    copy = copy_bandwidth(case.device, max(traffic // 2, 4096), options.threads, 0.05) if case.mode == "fwd" else 0
    for record in (r for r in records.values() if r.get("status") == "ok"):
        record["vs_eager"] = eager / record["median_s"] if eager else None
        if case.mode == "fwd":
            record.update(bound_s=traffic / copy, bound_dram_s=traffic / dram, copy_bytes_per_s=copy,
                          achieved_bytes_per_s=traffic / record["median_s"])
    return list(records.values())


def peak_bytes(fn, device: str) -> int:
    """Peak bytes torch's allocator held during one call of `fn` above the level before it (CPU: from the profiler)."""
    if device != "cpu":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # (read at its first use: below 6 it prints 2 USDT lines a call)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    return max(itertools.accumulate((e.nbytes() for e in events), initial=0))


def copy_bandwidth(device: str, nbytes: int, threads: int, min_run_time: float) -> float:
    """Bytes/s of `dst.copy_(src)`, read + write, in its best block."""
    src = torch.ones(nbytes // 4, device=device)
    timer = benchmark.Timer("dst.copy_(src)", globals={"dst": torch.empty_like(src), "src": src}, num_threads=threads)
    return 2 * src.nbytes / min(timer.blocked_autorange(min_run_time=min_run_time).times)


def disturbances(threads: int, load: float, cpus: int) -> list[str]:
    """Why a run's timings would not be the machine's own: more threads than CPUs, or other processes running."""
    found = [f"--threads {threads} is more than the {cpus} CPUs this process may use"] if threads > cpus else []
    if load > 0.3:
        found.append(f"load average {load:.2f} before starting: other processes are running, so the timings will "
                     f"be disturbed")
    return found


if __name__ == "__main__":  # the child of `_child`: SPEC_JSON OUT
    spec = json.loads(sys.argv[1])
    condition, spec["cases"] = spec.pop("condition"), [Case(**c) for c in spec["cases"]]
    Path(sys.argv[2]).write_text(json.dumps(measure_all(Options(**spec), spec["cases"], condition)))
