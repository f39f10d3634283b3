"""Runs `bertembed bench`: one worker process per allocator condition, results gathered as they come.

The glibc settings of the steady condition must hold from a process's first allocation, so each condition runs in
a fresh `python -m bertembed.bench.worker` with its environment set before start (`measure.allocator_env`).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from bertembed.bench.cases import CANDIDATES, PREFIX, Case, candidates_for, default_cases
from bertembed.bench.measure import PEAK_METHOD_CPU, PEAK_METHOD_CUDA, STEADY_ENV, allocator_env
from bertembed.config import EmbeddingConfig

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
CONDITIONS = {"steady": ("steady",), "default": ("default",), "both": ("steady", "default")}
VERSIONED = ("bertembed", "torch", "transformers", "onnx", "onnxruntime", "numba", "triton", "numpy")


@dataclass
class BenchOptions:
    """What to run. `cases` overrides the sweep (tests use a tiny one); `device`: "auto" (the CPU sweep, plus the same
    sweep on CUDA when a GPU is visible), "cpu", or "cuda" (the CUDA sweep alone); `hiddens` narrows the sweep."""

    quick: bool = False
    threads: int = 2
    allocator: str | None = None  # None: "steady" for --quick (the targets' condition), "both" for the full run
    candidates: tuple[str, ...] = CANDIDATES
    cases: list[Case] | None = None
    device: str = "auto"
    hiddens: tuple[int, ...] | None = None  # None: the sweep's (384, 768, 1024; 768 with --quick)
    shapes: tuple[tuple[int, int], ...] | None = None  # (B, L); None: the sweep's
    min_run_time: float | None = None  # seconds per timer; default 0.1 quick, 1.0 full
    bandwidth_bytes: int = 1 << 30  # copy buffer: above the last-level cache
    vocab_size: int = 30522
    warmup: int = 3
    # One process per (condition, candidate): no candidate's thread pool (torch's OpenMP, ORT's, numba's, inductor's
    # kernels) is alive while another is timed. None: on for the full run, off for --quick (process start-up costs).
    isolate: bool | None = None
    # Times every (case, candidate) this many times, the workers' order rotated each round (`run_condition`): on a
    # machine whose speed drifts from minute to minute, a slow period then falls on each candidate alike.
    rounds: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.allocator is None:  # glibc's settings do not touch CUDA memory: a CUDA-only run needs one condition
            self.allocator = "steady" if self.quick or self.device == "cuda" else "both"
        if self.allocator not in CONDITIONS:
            raise ValueError(f"--allocator must be one of {tuple(CONDITIONS)}, got {self.allocator!r}")
        if self.hiddens is not None and (not self.hiddens or min(self.hiddens) < 1):
            raise ValueError(f"--hidden must be positive sizes, got {self.hiddens}")
        if self.shapes is not None and (not self.shapes or min(min(s) for s in self.shapes) < 1):
            raise ValueError(f"--shape must be positive BxL, got {self.shapes}")
        positions = EmbeddingConfig().max_position_embeddings
        if self.shapes is not None and max(length for _, length in self.shapes) > positions:
            raise ValueError(f"--shape lengths stop at {positions}, the rows of BERT's position table; got "
                             f"{self.shapes}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {self.rounds}")
        if self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        unknown = [c for c in self.candidates if c not in CANDIDATES]
        if unknown:
            raise ValueError(f"unknown candidates {unknown}; choose from {CANDIDATES}")


def plan_cases(options: BenchOptions) -> list[Case]:
    """The cases to run: `options.cases`, or the sweep on the CPU, on CUDA, or on both (`options.device`)."""
    if options.cases is not None:
        return list(options.cases)
    if options.device == "cuda" and not _cuda_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "auto": ["cpu"] + (["cuda"] if _cuda_available() else [])}
    return [case for device in devices[options.device]
            for case in default_cases(options.quick, options.hiddens, device=device, shapes=options.shapes)]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def worker_spec(options: BenchOptions, condition: str, cases: list[Case]) -> dict[str, Any]:
    return {
        "condition": condition, "threads": options.threads, "cases": [c.to_dict() for c in cases],
        "candidates": list(options.candidates), "min_run_time": options.min_run_time or (0.1 if options.quick else 1.0),
        "bandwidth_bytes": options.bandwidth_bytes, "bandwidth_min_run_time": 0.2 if options.quick else 1.0,
        "vocab_size": options.vocab_size, "warmup": options.warmup,
        "prewarm_kernels": "bertembed-fused" in options.candidates,
        "compile_ahead": options.quick,  # `worker.compile_ahead`: its few graphs, while the kernels compile
    }


def count_steps(options: BenchOptions, cases: list[Case]) -> int:
    """Number of (condition, case, candidate) records the run will produce: the progress bar's total."""
    per_condition = sum(len(candidates_for(c, options.candidates)) for c in cases)
    return per_condition * len(CONDITIONS[options.allocator]) * options.rounds


def _worker_env(options: BenchOptions, condition: str) -> dict[str, str]:
    env = allocator_env(condition)
    threads = str(options.threads)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, NUMBA_NUM_THREADS=threads)
    src = str(Path(__file__).resolve().parents[2])  # the folder holding the bertembed package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.update(options.extra_env)
    return env


def run_condition(options: BenchOptions, condition: str, cases: list[Case],
                  on_record: Callable[[dict[str, Any]], None], out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one condition: one worker, or one per candidate when isolated, `options.rounds` times (the workers' order
    rotated by one each round). Fills and returns `out` (a new dict when None) as {"meta": ..., "results": [...]}
    (meta of the first worker), as results come, and calls `on_record` per result. With several rounds the results,
    each tagged with its round, become one record per (case, candidate) at the end (`combine_rounds`)."""
    isolate = (not options.quick) if options.isolate is None else options.isolate
    names = [n for n in options.candidates if any(n in candidates_for(c, options.candidates) for c in cases)]
    groups = [(name,) for name in names] if isolate else [tuple(names)]
    out = {} if out is None else out
    out.update(meta={}, results=[], isolated=isolate, rounds=options.rounds)
    for round_ in range(options.rounds):
        turn = round_ % len(groups)
        for group in groups[turn:] + groups[:turn]:
            spec = {**worker_spec(options, condition, cases), "candidates": list(group), "round": round_}
            _run_worker(spec, _worker_env(options, condition), on_record, out)
    return _combined(out)


def _combined(condition: dict[str, Any]) -> dict[str, Any]:
    """`condition` with its results combined across rounds, once (a run of one round is left as it is)."""
    if condition.get("rounds", 1) > 1 and not condition.get("combined"):
        condition["results"] = combine_rounds(condition["results"])
        condition["combined"] = True
    return condition


def combine_rounds(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (case, candidate), in the order they first came: the round whose median time is the median
    of the rounds' (the lower middle one for an even count), so its other columns (bandwidth, bound, memory) are
    that round's; `iqr_s` becomes the interquartile range of the rounds' medians, and `round_medians_s` lists them
    in round order. A candidate that failed in some rounds keeps a note saying how many; one that never ran ok
    keeps its first record."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in results:
        groups.setdefault((record["key"], record["candidate"]), []).append(record)
    combined = []
    for records in groups.values():
        ok = [r for r in records if r.get("status") == "ok"]
        if not ok:
            combined.append(records[0])
            continue
        medians = [r["median_s"] for r in ok]
        record = dict(sorted(ok, key=lambda r: r["median_s"])[(len(ok) - 1) // 2])
        quartiles = statistics.quantiles(medians, n=4) if len(ok) > 1 else [medians[0]] * 3
        record.update(iqr_s=quartiles[2] - quartiles[0], round_medians_s=medians, rounds=len(ok))
        if len(ok) < len(records):
            failed = next(r for r in records if r.get("status") != "ok")
            note = f"{len(records) - len(ok)} of {len(records)} rounds {failed.get('status')}: {failed.get('note')}"
            record["note"] = "; ".join(filter(None, (record.get("note"), note)))
        combined.append(record)
    return combined


def _run_worker(spec: dict[str, Any], env: dict[str, str], on_record: Callable[[dict[str, Any]], None],
                out: dict[str, Any]) -> None:
    """One worker process; its meta (when `out` has none yet) and results go into `out` as they arrive. The worker
    is killed if this stops early (an interrupt, a failed callback)."""
    condition = spec["condition"]
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "bertembed.bench.worker", json.dumps(spec)],
                                env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if not line.startswith(PREFIX):
                    continue
                record = json.loads(line[len(PREFIX):])
                if record["type"] == "meta":
                    out["meta"] = out["meta"] or record
                else:
                    record["round"] = spec.get("round", 0)
                    out["results"].append(record)
                    on_record(record)
        except BaseException:  # an interrupt, a failed callback: no worker outlives the run
            proc.kill()
            proc.wait()
            raise
        if proc.wait() != 0:
            stderr.seek(0)
            tail = stderr.read()[-3000:]
            raise RuntimeError(f"bench worker ({condition}) exited with status {proc.returncode}:\n{tail}")


def machine_info(threads: int) -> dict[str, Any]:
    """CPU model (/proc/cpuinfo), logical cores, usable cores, thread count, OS, libc, Python, GPU if any."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": model, "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "threads": threads, "os": platform.platform(), "libc": " ".join(platform.libc_ver()),
            "python": platform.python_version()}
    import torch

    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def source_revision() -> str | None:
    """The git commit bertembed runs from, with "+modified" when its checkout has uncommitted changes; None for an
    install that is not a git checkout (or without git)."""
    root = Path(__file__).resolve().parents[3]
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None  # some other repository holds the installed package
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+modified" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def run_bench(options: BenchOptions, on_record: Callable[[dict[str, Any]], None] = lambda r: None,
              report: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole benchmark: every allocator condition, then the issue's targets. Returns the JSON-able report. A
    `report` dict passed in is filled as results arrive, so a caller keeps what was measured if the run stops early
    (`finish_partial` makes it a report)."""
    cases = plan_cases(options)
    report = {} if report is None else report
    report.update({
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "revision": source_revision(),
        "machine": machine_info(options.threads), "versions": versions(), "quick": options.quick,
        "threads": options.threads, "timer": "torch.utils.benchmark.Timer.blocked_autorange: median and IQR of "
        f"block means, min_run_time {worker_spec(options, 'steady', [])['min_run_time']} s",
        "peak_memory_method": {"cpu": PEAK_METHOD_CPU, "cuda": PEAK_METHOD_CUDA},
        "steady_env": STEADY_ENV, "conditions": {},
    })
    for condition in CONDITIONS[options.allocator]:
        run_condition(options, condition, cases, on_record, report["conditions"].setdefault(condition, {}))
    return _with_targets(report)


def finish_partial(report: dict[str, Any], why: str) -> dict[str, Any]:
    """A run that stopped early, made a report of what it measured: targets over those results (the rest "not
    measured"), and `stopped` saying why. None of the run's results is dropped."""
    report["stopped"] = why
    for condition in report.get("conditions", {}).values():
        _combined(condition)
    return _with_targets(report)


def _with_targets(report: dict[str, Any]) -> dict[str, Any]:
    """`report` with each condition's targets evaluated over its results."""
    from bertembed.bench.report import evaluate_targets

    report["targets"] = {c: evaluate_targets(r) for c, r in report.get("conditions", {}).items()}
    return report
