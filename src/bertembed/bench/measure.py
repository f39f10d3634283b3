"""How `bertembed bench` measures and reports: in one process, each case's candidates checked against the float32
reference, then timed in interleaved rounds with `torch.utils.benchmark`; the layer's guards; the markdown report."""

from __future__ import annotations

import os
import platform
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch.utils import benchmark

from bertembed.bench import candidates as cands

VERSIONED = ("bertembed", "torch", "transformers", "onnx", "onnxruntime", "numba", "triton", "numpy")
# The fused layer against transformers' eager one, float32 on the CPU: (guard, case key, least ratio of the medians).
# "No slower" allows 5%, about what separate runs of the same code differ by on a shared machine.
GUARDS = (("forward (32, 128), H 768", "cpu H=768 B=32 L=128 fwd float32", 2.0),
          ("training step (32, 128), H 768, dropout 0.1", "cpu H=768 B=32 L=128 fwdbwd float32", 2.0),
          ("sentence (1, 11), H 768, no slower", "cpu H=768 B=1 L=11 fwd float32", 0.95))
COLUMNS = ("case", "candidate", "median ms", "IQR ms", "vs eager", "max abs diff")


def run(cases: list[cands.Case], threads: int = 2, repeat: int = 3, quick: bool = False, reference: bool = False,
        candidates=cands.CANDIDATES, progress: Callable[[str], Any] = lambda line: None) -> dict[str, Any]:
    """The report of `cases`: how and where the run was made, a record per case and candidate that takes part (the
    reference only with `reference`), and the guards; `repeat` rounds of 0.3 s (0.05 s `quick`) per candidate."""
    started, about = time.perf_counter(), header(threads, repeat, quick)
    torch.set_num_threads(threads)  # (numba's too: bertembed's CPU kernels follow torch's count)
    results = []
    for i, case in enumerate(cases):
        progress(f"bench {i + 1}/{len(cases)}: {case.key}")
        names = [n for n in candidates if cands.runs(n, case) and (reference or "reference" not in n)]
        results += measure_case(case, names, threads, repeat, 0.05 if quick else 0.3)
    return {**about, "wall_seconds": time.perf_counter() - started, "results": results, "guards": guards(results)}


def measure_case(case: cands.Case, names: list[str], threads: int, repeat: int, seconds: float) -> list[dict[str, Any]]:
    """One record per candidate of `names`: built, warmed up, checked against the float32 reference (forward), then
    timed in `repeat` rounds of one `blocked_autorange` of `seconds` each, the order rotated by one each round."""
    expected, make = cands.prepare(case)
    records = {n: {"case": asdict(case), "key": case.key, "candidate": n} for n in names}
    calls = {}
    for name in names:
        try:
            fn = make(name)
            for _ in range(3):  # (warm-up)
                fn()
            if expected is not None:
                diff = records[name]["max_abs_diff"] = float((torch.as_tensor(fn()).double() - expected).abs().max())
                if not diff <= cands.TOLERANCE[case.dtype]:  # (NaN included)
                    records[name]["note"] = f"OUTPUT DIFFERS from the reference by up to {diff:.2e}"
            calls[name] = fn
        except ImportError as err:  # (a package that is not installed, named)
            records[name].update(status="not available", note=str(err))
        except Exception as err:  # noqa: BLE001  (a failing candidate is reported, the run goes on)
            records[name].update(status="error", note=f"{type(err).__name__}: {str(err)[:300]}")
    rounds: dict[str, list[benchmark.Measurement]] = {n: [] for n in calls}
    order = deque(calls)
    for _ in range(repeat):
        for name in order:
            timer = benchmark.Timer("fn()", globals={"fn": calls[name]}, num_threads=threads)
            rounds[name].append(timer.blocked_autorange(min_run_time=seconds))
            time.sleep(0.01)  # another library's thread pool stops spinning before the next candidate starts
        order.rotate(-1)
    merged = {name: benchmark.Measurement.merge(measured)[0] for name, measured in rounds.items()}  # every block
    for name, every in merged.items():
        records[name].update(status="ok", median_s=every.median, iqr_s=every.iqr, runs=len(every.times),
                             round_medians_s=[m.median for m in rounds[name]],
                             vs_eager=merged["hf-eager"].median / every.median if "hf-eager" in merged else None)
    return list(records.values())


def header(threads: int, repeat: int, quick: bool) -> dict[str, Any]:
    """When, where and with what a run was made."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor() or "unknown")
    machine = {"cpu": cpu, "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "os": platform.platform(), "python": platform.python_version()}
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
            "load_average": os.getloadavg(), "versions": versions, "quick": quick, "threads": threads, "repeat": repeat,
            "timer": f"torch.utils.benchmark.Timer.blocked_autorange, min_run_time {0.05 if quick else 0.3} s for each "
            f"candidate a round, rounds: {repeat}, the order rotated each round; median and IQR over every block"}


def guards(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each guard's target, measured ratio (the fused layer's `vs_eager`) and "pass" or "fail"; or "not measured"."""
    ratios = {r["key"]: r["vs_eager"] for r in results if r["candidate"] == "bertembed-fused" and r["status"] == "ok"}
    rows = []
    for name, key, target in GUARDS:
        ratio = ratios.get(key)
        row = {"guard": name, "case": key, "target": target, "measured": ratio, "result": "not measured"}
        if ratio is not None:
            passed = ratio >= target
            shown = next((f"{ratio:.{d}f}" for d in range(2, 7) if (float(f"{ratio:.{d}f}") >= target) == passed),
                         f"{ratio:.6f}")  # as many digits as the verdict needs: 1.997 is no 2.00
            row.update(shown=f"{shown}x", result="pass" if passed else "fail")
        rows.append(row)
    return rows


def _cells(r: dict[str, Any]) -> list[str]:
    if r["status"] != "ok":
        return [r["key"], r["candidate"], r["status"], "", "", ""]
    diff = "" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.1e}"
    vs_eager = "" if r["vs_eager"] is None else f"{r['vs_eager']:.2f}x"
    return [r["key"], r["candidate"], f"{r['median_s'] * 1e3:.3f}", f"{r['iqr_s'] * 1e3:.3f}", vs_eager, diff]


def _table(head: tuple[str, ...], rows: list[list[str]], align: str) -> list[str]:
    """A markdown table whose columns line up as plain text too; `align`: "l" or "r" per column."""
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    rule = ["-" * w if a == "l" else "-" * (w - 1) + ":" for a, w in zip(align, widths, strict=True)]
    padded = ([c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align, strict=True)]
              for row in (head, rule, *rows))
    return ["| " + " | ".join(cells) + " |" for cells in padded]


def markdown(report: dict[str, Any]) -> str:
    """The whole report: the run, the guards, every result, then the notes."""
    m, load = report["machine"], report["load_average"]
    guard_rows = [[g["guard"], f">= {g['target']:g}x", g.get("shown", ""), g["result"]] for g in report["guards"]]
    lines = ["### bertembed bench", "",
             f"- run: started {report['started']}, {report['wall_seconds']:.0f} s",
             f"- machine: {m['cpu']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable), "
             f"{report['threads']} threads; {m['os']}; Python {m['python']}" + (f"; GPU {m['gpu']}" if m["gpu"] else "")
             + f"; load average (1/5/15 min) at the start {'/'.join(f'{x:.2f}' for x in load)}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
             f"- mode: {'--quick' if report['quick'] else 'full'}; timer: {report['timer']}; all candidates in one "
             "process; vs eager = transformers eager's median / this median, both from this run", "",
             *_table(("guard: bertembed-fused vs hf-eager", "target", "measured", "result"), guard_rows, "lrrl"), "",
             *_table(COLUMNS, [_cells(r) for r in report["results"]], "llrrrr")]
    notes = [f"- {r['candidate']} on {r['key']}: {r['note']}" for r in report["results"] if r.get("note")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
