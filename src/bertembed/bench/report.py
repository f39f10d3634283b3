"""What `bertembed bench` writes: machine, commit and versions, the issue's targets, markdown and a terminal table."""

from __future__ import annotations

import operator
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

VERSIONED = ("bertembed", "torch", "transformers", "onnx", "onnxruntime", "numba", "triton", "numpy")
PEAK_METHOD = ("CPU: torch.profiler(profile_memory=True), the running sum of the allocator's events during one call "
               "above the level before it (torch tensors only); CUDA: torch.cuda.max_memory_allocated()")
FUSED, FUSED_DEV = "bertembed-fused", "bertembed-fused-device-checks"
_H768, _ONE = "cpu H=768 B=32 L=128 fwd float32", "cpu H=768 B=1 L=11 fwd float32"
_BWD, _BIG = "cpu H=768 B=32 L=128 fwdbwd float32", "cpu H=768 B=64 L=512 fwd {}"
_GPU = "cuda H=1024 B=64 L=512 fwd float32"


def _vs(name: str, key: str, other: str, goal: float, op: str = ">=", fused: str = FUSED) -> tuple:
    return name, ("median_s", key, other), ("median_s", key, fused), op, goal


# (name, (field, case key, candidate) over (field, case key, candidate), op, goal)
TARGETS = (
    _vs("forward vs transformers eager (H768 B32 L128)", _H768, "hf-eager", 3.0),
    _vs("forward vs torch.compile (H768 B32 L128)", _H768, "hf-compile", 3.0),
    _vs("forward vs ONNX Runtime (H768 B32 L128)", _H768, "ort-fused", 4.0),
    ("forward time / bandwidth bound at its footprint (H768 B32 L128)", ("median_s", _H768, FUSED),
     ("bound_s", _H768, FUSED), "<=", 1.5),
    _vs("fwd+bwd vs transformers eager (H768 B32 L128)", _BWD, "hf-eager", 2.5),
    _vs("B=1 L=11 latency vs transformers eager (H768)", _ONE, "hf-eager", 1.0),
    *(_vs(f"{m} forward vs transformers eager (H768 B32 L128)", _H768.replace("H=", f"{m} H="), "hf-eager", 1.0, ">")
      for m in ("roberta", "distilbert", "modernbert")),
    ("bfloat16 vs float32 fused forward (H768 B64 L512)", ("median_s", _BIG.format("float32"), FUSED),
     ("median_s", _BIG.format("bfloat16"), FUSED), ">=", 1.6),
    ("peak memory / output size, fused forward (H768 B64 L512)", ("peak_bytes", _BIG.format("float32"), FUSED),
     ("output_bytes", _BIG.format("float32"), FUSED), "<=", 1.2),
    ("GPU: fraction of copy bandwidth, Triton forward (H1024 B64 L512)", ("bound_s", _GPU, FUSED),
     ("median_s", _GPU, FUSED), ">=", 0.8),
    _vs("GPU: Triton forward vs torch.compile (H1024 B64 L512)", _GPU, "hf-compile", 1.0, ">"),
    ("GPU: fraction of copy bandwidth, id checks on the device (H1024 B64 L512)", ("bound_s", _GPU, FUSED_DEV),
     ("median_s", _GPU, FUSED_DEV), ">=", 0.8),
    _vs("GPU: Triton forward, id checks on the device, vs torch.compile (H1024 B64 L512)", _GPU, "hf-compile", 1.0,
        ">", FUSED_DEV),
)
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt}


def header(options) -> dict[str, Any]:
    """When, where and with what a run was made."""
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                 platform.processor() or "unknown")
    machine = {"cpu": model, "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
               "os": platform.platform(), "libc": " ".join(platform.libc_ver()), "python": platform.python_version()}
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
    return {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "revision": revision(),
            "machine": machine, "versions": {name: _version(name) for name in VERSIONED}, "quick": options.quick,
            "threads": options.threads, "repeat": options.repeat,
            "timer": f"torch.utils.benchmark.Timer.blocked_autorange, min_run_time {options.min_run_time} s a round "
            f"for each candidate, {options.repeat} rounds in rotated order; median and IQR over every block of every "
            "round", "peak_memory_method": PEAK_METHOD}


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def revision() -> str | None:
    """The git commit bertembed runs from ("+modified" with uncommitted changes); None outside a git checkout."""
    root = Path(__file__).resolve().parents[3]
    try:
        top, head = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                                   capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return head + ("+modified" if dirty else "") if Path(top).resolve() == root else None


def evaluate_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target's ratio and "pass" / "miss", or "not measured" with the reason, over one condition's results."""
    def lookup(field: str, key: str, candidate: str) -> tuple[float | None, str]:
        r = next((r for r in results if r["key"] == key and r["candidate"] == candidate), None)
        if r is None:
            return None, f"{key} not measured in this run"
        if r.get("status") != "ok":
            return None, f"{candidate} {r.get('status')}"
        if r.get(field) is None:
            return None, f"{candidate} has no {field}"
        return float(r[field]), ""

    rows = []
    for name, numerator, denominator, op, goal in TARGETS:
        (num, why_num), (den, why_den) = lookup(*numerator), lookup(*denominator)
        row: dict[str, Any] = {"target": name, "goal": f"{op} {goal:g}", "value": None, "why": why_num or why_den}
        if num is not None and den:
            value = num / den
            passed = _OPS[op](value, goal)
            shown = next((f"{value:.{d}f}" for d in range(2, 7) if _OPS[op](float(f"{value:.{d}f}"), goal) == passed),
                         f"{value:.6f}")  # as many digits as the verdict needs: 4.997 is no 5.00
            row.update(value=value, shown=shown, result="pass" if passed else "miss")
        else:
            row["result"] = "not measured"
        rows.append(row)
    return rows


def finish(report: dict[str, Any]) -> dict[str, Any]:
    report["targets"] = {c: evaluate_targets(r["results"]) for c, r in report["conditions"].items()}
    return report


def _cells(r: dict[str, Any]) -> list[str]:
    """A result's cells: case, candidate, median ms, IQR ms, vs eager, GB/s, time / bound, peak MB (x output), diff."""
    if r.get("status") != "ok":
        return [r["key"], r["candidate"], r.get("status", "?"), "", "", "", "", "", ""]
    peak, bound, gbs, diff = r.get("peak_bytes"), r.get("bound_s"), r.get("achieved_bytes_per_s"), r.get("max_abs_diff")
    return [r["key"], r["candidate"], f"{r['median_s'] * 1e3:.3f}", f"{r['iqr_s'] * 1e3:.3f}",
            "" if r.get("vs_eager") is None else f"{r['vs_eager']:.2f}x", "" if gbs is None else f"{gbs / 1e9:.1f}",
            "" if bound is None else f"{r['median_s'] / bound:.2f}x",
            "" if peak is None else f"{peak / 1e6:.1f} ({peak / r['output_bytes']:.2f}x)",
            "" if diff is None else f"{diff:.1e}"]


COLUMNS = ["case", "candidate", "median ms", "IQR ms", "vs eager", "GB/s", "time / bound", "peak MB (x output)",
           "max abs diff"]


def markdown(report: dict[str, Any]) -> str:
    """The whole report as markdown: the run, then per allocator condition the results and the targets."""
    m, started, rev = report["machine"], report["started"], report.get("revision")
    lines = ["### bertembed bench", "",
             f"- run: started {started}; bertembed " + (f"at git {rev}" if rev else "not from a git checkout"),
             f"- machine: {m['cpu']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable), "
             f"{report['threads']} threads; {m['os']}; {m['libc']}; Python {m['python']}"
             + (f"; GPU {m['gpu']}" if "gpu" in m else ""),
             "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
             f"- mode: {'--quick' if report['quick'] else 'full'}; timer: {report['timer']}; all candidates in one "
             "process; vs eager = transformers eager's median / this median, both from this run",
             f"- peak memory: {report['peak_memory_method']}",
             "- least traffic of a forward = (B*L*3*H + 2*H + B*L*H) * itemsize bytes; GB/s = that / median; bound = "
             "that / the copy bandwidth (read + write) measured at the case's footprint"]
    for name, condition in report["conditions"].items():
        meta = condition["meta"]
        env = " ".join(f"{k}={v}" for k, v in report["steady_env"].items())
        bw = ", ".join(f"{d} {b / 1e9:.1f} GB/s" for d, b in meta["bandwidth_bytes_per_s"].items())
        lines += ["", f"### Allocator: {name} ({env if name == 'steady' else 'glibc defaults'})", "",
                  f"1 GiB copy bandwidth {bw}; {'this' if condition.get('in_process') else 'a child'} process; "
                  f"load average (1/5/15 min) at its start {'/'.join(f'{x:.2f}' for x in meta['load_average'])}", "",
                  "| " + " | ".join(COLUMNS) + " | note |", "|---|---|" + "---:|" * (len(COLUMNS) - 2) + "---|"]
        lines += ["| " + " | ".join([*_cells(r), r.get("note", "")]) + " |" for r in condition["results"]]
        lines += ["", f"#### Targets, allocator {name}", "", "| target | measured | goal | result |",
                  "|---|---:|---:|---|"]
        lines += [f"| {t['target']} | {t.get('shown', '')} | {t['goal']} | {t['result']}"
                  + (f" ({t['why']})" if t["value"] is None else "") + " |" for t in report["targets"][name]]
    return "\n".join(lines) + "\n"


def summary(report: dict[str, Any]) -> list[str]:
    """Fixed-width lines for the terminal: every number whole, the notes below each table."""
    lines = []
    for name, condition in report["conditions"].items():
        rows = [COLUMNS] + [_cells(r) for r in condition["results"]]
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
        lines += ["", f"allocator {name}:"]
        just = [str.ljust, str.ljust] + [str.rjust] * (len(COLUMNS) - 2)  # (case and candidate to the left)
        lines += ["  ".join(j(c, w) for j, c, w in zip(just, row, widths, strict=True)) for row in rows]
        lines += [f"  {r['candidate']} on {r['key']}: {r['note']}" for r in condition["results"] if r.get("note")]
        lines += [f"target ({name}) {t['result']}: {t['target']}: {t.get('shown', '-')} (goal {t['goal']})"
                  + (f" ({t['why']})" if t["value"] is None else "") for t in report["targets"][name]]
    return lines
