"""The issue's targets, computed from one condition's results, and the markdown report for BENCHMARKS.md."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bertembed.bench.cases import Case

FUSED = "bertembed-fused"
FUSED_DEV = "bertembed-fused-device-checks"
_H768 = "cpu H=768 B=32 L=128 fwd float32"
_H768_BWD = "cpu H=768 B=32 L=128 fwdbwd float32"
_ONE = "cpu H=768 B=1 L=11 fwd float32"
_BIG = "cpu H=768 B=64 L=512 fwd float32"
_BIG_BF16 = "cpu H=768 B=64 L=512 fwd bfloat16"
_GPU = "cuda H=1024 B=64 L=512 fwd float32"

# A quantity of one result: (field, case key, candidate); "bound_s" and "output_bytes" take any candidate's record.
Quantity = tuple[str, str, str]


@dataclass(frozen=True)
class Target:
    """goal: numerator / denominator `op` threshold."""

    name: str
    numerator: Quantity
    denominator: Quantity
    op: str  # ">=" or "<=" or ">"
    threshold: float


TARGETS: tuple[Target, ...] = (
    Target("forward vs transformers eager (H768 B32 L128)", ("median_s", _H768, "hf-eager"),
           ("median_s", _H768, FUSED), ">=", 5.0),
    Target("forward vs torch.compile (H768 B32 L128)", ("median_s", _H768, "hf-compile"),
           ("median_s", _H768, FUSED), ">=", 3.0),
    Target("forward vs ONNX Runtime (H768 B32 L128)", ("median_s", _H768, "ort-fused"),
           ("median_s", _H768, FUSED), ">=", 4.0),
    Target("forward time / bandwidth bound at its footprint (H768 B32 L128)", ("median_s", _H768, FUSED),
           ("bound_s", _H768, FUSED), "<=", 1.5),
    Target("fwd+bwd vs transformers eager (H768 B32 L128)", ("median_s", _H768_BWD, "hf-eager"),
           ("median_s", _H768_BWD, FUSED), ">=", 3.0),
    Target("B=1 L=11 latency vs transformers eager (H768)", ("median_s", _ONE, "hf-eager"),
           ("median_s", _ONE, FUSED), ">=", 5.0),
    Target("bfloat16 vs float32 fused forward (H768 B64 L512)", ("median_s", _BIG, FUSED),
           ("median_s", _BIG_BF16, FUSED), ">=", 1.6),
    Target("peak memory / output size, fused forward (H768 B64 L512)", ("peak_bytes", _BIG, FUSED),
           ("output_bytes", _BIG, FUSED), "<=", 1.2),
    Target("GPU: fraction of copy bandwidth, Triton forward (H1024 B64 L512)", ("bound_s", _GPU, FUSED),
           ("median_s", _GPU, FUSED), ">=", 0.8),
    Target("GPU: Triton forward vs torch.compile (H1024 B64 L512)", ("median_s", _GPU, "hf-compile"),
           ("median_s", _GPU, FUSED), ">", 1.0),
    Target("GPU: fraction of copy bandwidth, id checks on the device (H1024 B64 L512)", ("bound_s", _GPU, FUSED_DEV),
           ("median_s", _GPU, FUSED_DEV), ">=", 0.8),
    Target("GPU: Triton forward, id checks on the device, vs torch.compile (H1024 B64 L512)",
           ("median_s", _GPU, "hf-compile"), ("median_s", _GPU, FUSED_DEV), ">", 1.0),
)
_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le, ">": operator.gt}


def _lookup(results: list[dict[str, Any]], quantity: Quantity) -> tuple[float | None, str]:
    """The value of `quantity`, or None and the reason it is missing."""
    field, key, candidate = quantity
    records = [r for r in results if r["key"] == key and r["candidate"] == candidate]
    if not records:
        return None, f"{key} not measured in this run"
    record = records[0]
    if record.get("status") != "ok":
        return None, f"{candidate} {record.get('status')}"  # the case's table carries the full note
    if record.get(field) is None:
        return None, f"{candidate} has no {field}"
    return float(record[field]), ""


def evaluate_targets(condition: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target's measured ratio and "pass" / "miss" / "not measured" (with the reason) for one condition."""
    rows = []
    for target in TARGETS:
        num, why_num = _lookup(condition["results"], target.numerator)
        den, why_den = _lookup(condition["results"], target.denominator)
        row: dict[str, Any] = {"target": target.name, "goal": f"{target.op} {target.threshold:g}"}
        if num is None or den is None or den == 0:
            row.update(value=None, result="not measured", why=why_num or why_den or "zero denominator")
        else:
            value = num / den
            passed = _OPS[target.op](value, target.threshold)
            row.update(value=value, result="pass" if passed else "miss", why="", shown=_shown(value, target, passed))
        rows.append(row)
    return rows


def _shown(value: float, target: Target, passed: bool) -> str:
    """`value` with two decimals, or as many more (up to six) as it takes for the text to tell the verdict: a miss of
    4.997 against ">= 5" reads 4.997, not 5.00."""
    for digits in range(2, 7):
        text = f"{value:.{digits}f}"
        if _OPS[target.op](float(text), target.threshold) == passed:
            return text
    return text


def by_case(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records grouped by case (in the order cases first appear), candidates in their run order within a case."""
    keys = {k: i for i, k in enumerate(dict.fromkeys(r["key"] for r in results))}
    return sorted(results, key=lambda r: keys[r["key"]])  # stable: keeps the candidates' order


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f}"


def _result_row(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"| {r['candidate']} | {r.get('status')} | | | | | | | {r.get('note', '')} |"
    gbs = r.get("achieved_bytes_per_s")
    peak = r.get("peak_bytes")
    peak_text = "" if peak is None else f"{peak / 1e6:.1f} ({peak / r['output_bytes']:.2f}x)"
    bound, dram = r.get("bound_s"), r.get("bound_dram_s")
    of_bound = "" if bound is None else f"{r['median_s'] / bound:.2f}x"
    of_dram = "" if dram is None else f"{r['median_s'] / dram:.2f}x"
    diff = r.get("max_abs_diff")
    diff_text = "" if diff is None else f"{diff:.1e}"
    return (f"| {r['candidate']} | {_ms(r['median_s'])} | {_ms(r['iqr_s'])} | "
            f"{'' if gbs is None else f'{gbs / 1e9:.1f}'} | {of_bound} | {of_dram} | {peak_text} | {diff_text} | "
            f"{r.get('note', '')} |")


def results_table(condition: dict[str, Any]) -> list[str]:
    """One markdown table per case: candidates as rows."""
    lines: list[str] = []
    keys = list(dict.fromkeys(r["key"] for r in condition["results"]))
    for key in keys:
        records = [r for r in condition["results"] if r["key"] == key]
        case = Case.from_dict(records[0]["case"])
        copy = next((r["copy_bytes_per_s"] for r in records if r.get("copy_bytes_per_s")), None)
        bound = next((r["bound_s"] for r in records if r.get("bound_s")), None)
        extra = "" if copy is None else f"; copy {copy / 1e9:.1f} GB/s at this footprint, bound {bound * 1e3:.3f} ms"
        lines += ["", f"#### {key} (output {case.output_bytes / 1e6:.1f} MB{extra})", "",
                  "| candidate | median ms | IQR ms | GB/s | time / bound | time / DRAM bound | peak MB (x output) "
                  "| max abs diff | note |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        lines += [_result_row(r) for r in condition["results"] if r["key"] == key]
    return lines


def targets_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | measured | goal | result |", "|---|---:|---:|---|"]
    for row in rows:
        value = "" if row["value"] is None else row["shown"]
        result = row["result"] + (f" ({row['why']})" if row["why"] else "")
        lines.append(f"| {row['target']} | {value} | {row['goal']} | {result} |")
    return lines


def _header(report: dict[str, Any]) -> list[str]:
    m, v = report["machine"], report["versions"]
    started, revision = report.get("started"), report.get("revision")
    lines = [f"- run: started {started or 'at an unrecorded time'}; bertembed "
             + (f"at git {revision}" if revision else "not from a git checkout")
             + (f"; STOPPED EARLY ({report['stopped']}): the results below are those measured before"
                if report.get("stopped") else ""),
             f"- machine: {m['cpu']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable), "
             f"{m['threads']} threads; {m['os']}; {m['libc']}; Python {m['python']}"
             + (f"; GPU {m['gpu']}" if "gpu" in m else ""),
             "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
             f"- mode: {'--quick' if report['quick'] else 'full'}; timer: {report['timer']}",
             f"- peak memory (CPU): {report['peak_memory_method']['cpu']}",
             "- least traffic of a forward = (B*L*3*H + 2*H + B*L*H) * itemsize bytes (gathered word, position and "
             "segment rows, gamma and beta, the output); GB/s column = those bytes / median",
             "- bound = that traffic / the copy bandwidth measured at the case's own footprint (a `copy_` moving "
             "as many bytes, read + write; 'copy GB/s' in each case's heading); 'time / DRAM bound' uses the 1 GiB "
             "copy bandwidth instead"]
    return lines


def markdown(report: dict[str, Any], title: str = "bertembed bench") -> str:
    """The whole report as markdown: conditions, machine, per-case tables and the targets per condition."""
    lines = [f"### {title}", "", *_header(report)]
    for name, condition in report["conditions"].items():
        meta = condition["meta"]
        env = ", ".join(f"{k}={v}" for k, v in report["steady_env"].items())
        what = f"glibc malloc held steady ({env}, and mallopt in-process)" if name == "steady" else "glibc defaults"
        bw = ", ".join(f"{d} {b / 1e9:.1f} GB/s" for d, b in meta.get("bandwidth_bytes_per_s", {}).items())
        how = "one process per candidate" if condition.get("isolated") else "all candidates in one process"
        rounds = condition.get("rounds", 1)
        rounds_text = (f"; {rounds} rounds, the order rotated each round: each median is the median round's, each "
                       f"IQR that of the rounds' medians" if rounds > 1 else "")
        load = "/".join(f"{x:.2f}" for x in meta.get("load_average", ()))
        lines += ["", f"### Allocator: {name} ({what})", "",
                  f"Measured copy bandwidth, 1 GiB buffers: {bw}; {how}, threads {meta.get('threads')}{rounds_text}; "
                  f"load average (1/5/15 min) when the first worker started: {load}"]
        lines += results_table(condition)
        lines += ["", f"#### Targets, allocator {name}", "", *targets_table(report["targets"][name])]
    return "\n".join(lines) + "\n"
