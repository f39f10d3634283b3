"""`bertembed bench --rounds N`: every worker runs N times, the order rotated each round, and each (case,
candidate) is reported as its median round. The workers here are stand-ins that report times chosen by the test."""

from __future__ import annotations

import pytest

from bertembed.bench import runner
from bertembed.bench.cases import Case
from bertembed.bench.report import markdown
from bertembed.bench.runner import BenchOptions, combine_rounds, count_steps, run_bench

CASE = Case(16, 2, 3, "fwd")


def _record(candidate: str, median: float, round_: int, status: str = "ok", **extra) -> dict:
    return {"type": "result", "condition": "steady", "case": CASE.to_dict(), "key": CASE.key,
            "candidate": candidate, "status": status, "median_s": median, "iqr_s": 0.0, "round": round_, **extra}


def test_the_median_round_is_reported_with_its_own_columns_and_the_spread_across_rounds():
    results = [_record("hf-eager", m, r, bound_s=m / 10) for r, m in enumerate([3.0, 1.0, 2.0])]
    (combined,) = combine_rounds(results)
    assert combined["median_s"] == 2.0 and combined["bound_s"] == 0.2  # the round with 2.0, all of it
    assert combined["round_medians_s"] == [3.0, 1.0, 2.0] and combined["rounds"] == 3
    assert combined["iqr_s"] == pytest.approx(2.0)  # quartiles of (1, 2, 3), exclusive method: 1 and 3


def test_an_even_count_takes_the_lower_middle_round_and_failed_rounds_are_noted():
    results = [_record("hf-eager", m, r) for r, m in enumerate([4.0, 1.0, 3.0, 2.0])]
    results.append(_record("hf-eager", 0.0, 4, status="error", note="RuntimeError: boom"))
    results.append(_record("ort-fused", 0.0, 0, status="not available", note="no onnxruntime"))
    eager, ort = combine_rounds(results)
    assert eager["median_s"] == 2.0 and eager["rounds"] == 4
    assert "1 of 5 rounds error: RuntimeError: boom" in eager["note"]
    assert ort["status"] == "not available" and ort["note"] == "no onnxruntime"


def test_rounds_rotate_the_workers_and_report_one_record_per_case_and_candidate(monkeypatch):
    order = []
    times = {"hf-eager": [5.0, 9.0, 7.0], "bertembed-reference": [1.0, 3.0, 2.0]}

    def worker(spec, env, on_record, out):
        (name,) = spec["candidates"]
        order.append(name)
        record = _record(name, times[name][spec["round"]], spec["round"])
        out["results"].append(record)
        on_record(record)

    monkeypatch.setattr(runner, "_run_worker", worker)
    options = BenchOptions(threads=1, allocator="steady", candidates=("hf-eager", "bertembed-reference"),
                           cases=[CASE], isolate=True, rounds=3)
    seen = []
    report = run_bench(options, seen.append)
    assert order == ["hf-eager", "bertembed-reference", "bertembed-reference", "hf-eager", "hf-eager",
                     "bertembed-reference"]
    assert len(seen) == count_steps(options, [CASE]) == 6
    condition = report["conditions"]["steady"]
    assert [(r["candidate"], r["median_s"]) for r in condition["results"]] == [("hf-eager", 7.0),
                                                                               ("bertembed-reference", 2.0)]
    condition["meta"] = {"threads": 1}
    report["quick"], report["timer"] = False, "stand-in"
    report["machine"] = {"cpu": "x", "logical_cores": 2, "usable_cores": 2, "threads": 1, "os": "linux",
                         "libc": "glibc", "python": "3.11"}
    assert "3 rounds, the order rotated each round" in markdown(report)


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="--rounds"):
        BenchOptions(rounds=0)


def test_cli_rejects_rounds_below_one_before_running():
    from typer.testing import CliRunner

    from bertembed.cli import app

    result = CliRunner().invoke(app, ["bench", "--quick", "--rounds", "0"])
    assert result.exit_code == 2 and "--rounds" in result.output


def test_a_real_run_of_two_rounds_keeps_each_rounds_median_and_checks_every_output():
    options = BenchOptions(threads=1, allocator="steady", vocab_size=100, warmup=1, min_run_time=0.01,
                           bandwidth_bytes=4 << 20, candidates=("hf-eager", "bertembed-reference"), cases=[CASE],
                           isolate=False, rounds=2)
    report = run_bench(options)
    results = report["conditions"]["steady"]["results"]
    assert [r["candidate"] for r in results] == ["hf-eager", "bertembed-reference"]
    for r in results:
        assert r["status"] == "ok" and r["max_abs_diff"] == 0.0 and r["rounds"] == 2
        assert min(r["round_medians_s"]) == r["median_s"]  # two rounds: the lower middle one
    assert "2 rounds, the order rotated each round" in markdown(report)
