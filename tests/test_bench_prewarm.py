"""`bertembed bench` compiles the fused kernels in the background while torch.compile compiles, and times nothing
until that is done (`--quick` builds every torch.compile candidate then, before timing any candidate); `--quick` runs
the steady allocator only unless asked for both."""

from __future__ import annotations

import json
import logging

import pytest

from bertembed.bench import candidates as cands
from bertembed.bench import worker
from bertembed.bench.cases import Case
from bertembed.bench.prewarm import Prewarm, kernel_cases
from bertembed.bench.runner import BenchOptions


def test_quick_defaults_to_the_steady_allocator_and_the_full_run_to_both():
    assert BenchOptions(quick=True).allocator == "steady"
    assert BenchOptions().allocator == "both"
    assert BenchOptions(quick=True, allocator="both").allocator == "both"


def test_one_kernel_case_per_dtype_mode_and_size_class_at_the_smallest_hidden():
    cases = [Case(h, b, length, mode) for h in (768, 384) for b, length in ((1, 11), (32, 128), (64, 512))
             for mode in ("fwd", "fwdbwd")]
    cases += [Case(1024, 64, 512, "fwd", "bfloat16"), Case(384, 64, 512, "fwd", "bfloat16"),
              Case(384, 1, 11, "fwd", "float32", "cuda")]
    chosen = kernel_cases(cases)
    assert {(c.dtype, c.mode, c.batch == 1) for c in chosen} == {
        ("float32", "fwd", True), ("float32", "fwd", False), ("float32", "fwdbwd", True),
        ("float32", "fwdbwd", False), ("bfloat16", "fwd", False)}
    assert all(c.hidden == 384 and c.device == "cpu" for c in chosen)
    assert len(chosen) == 5


class _Events(list):
    def prewarm(self, cases, vocab_size):
        self.append(("prewarm started", len(cases)))
        events = self

        class Fake:
            def wait(self):
                events.append("prewarm waited")
        return Fake()


def _run(monkeypatch, candidates, prewarm_kernels, compile_ahead=False, refuse=()):
    events = _Events()
    monkeypatch.setattr(worker, "Prewarm", events.prewarm)

    def build(name, work, **kwargs):
        events.append(("built", name, work.case.mode))
        if (name, work.case.mode) in refuse:
            raise cands.NotAvailable("refused")
        return cands.Candidate(name, lambda: cands.reference_output(work))

    real_time_call = worker.time_call

    def time_call(*args):
        events.append("timed")
        return real_time_call(lambda: None, 1, 0.001, "noop")

    monkeypatch.setattr(cands, "build", build)
    monkeypatch.setattr(worker, "time_call", time_call)
    spec = {"condition": "steady", "threads": 1, "min_run_time": 0.01, "warmup": 1, "vocab_size": 50,
            "candidates": list(candidates), "prewarm_kernels": prewarm_kernels, "compile_ahead": compile_ahead,
            "cases": [Case(16, 1, 3).to_dict(), Case(16, 2, 4, "fwdbwd").to_dict()]}
    records = list(worker.run_cases(spec, {"cpu": 1e10}))
    assert [(r["candidate"], r["case"]["mode"]) for r in records] == [
        (name, mode) for name in candidates for mode in ("fwd", "fwdbwd")]
    assert [(r["candidate"], r["case"]["mode"]) for r in records if r["status"] != "ok"] == list(refuse)
    return events


def test_the_worker_waits_for_the_prewarm_before_timing_the_first_compiled_case(monkeypatch):
    events = _run(monkeypatch, ("hf-eager", "hf-compile", "bertembed-fused"), True)
    start = events.index(("prewarm started", 2))
    assert events[start - 1] == "timed" and events[start - 2] == ("built", "hf-eager", "fwdbwd")  # eager: before
    assert events[start + 1] == ("built", "hf-compile", "fwd")  # the compile overlaps the prewarm
    assert events[start + 2] == "prewarm waited" and events[start + 3] == "timed"  # nothing timed before it is done
    assert events.count(("prewarm started", 2)) == 1


def test_quick_builds_every_compiled_case_while_the_kernels_compile_and_times_nothing_before(monkeypatch):
    events = _run(monkeypatch, ("hf-eager", "hf-compile", "bertembed-fused"), True, compile_ahead=True)
    assert events[:4] == [("prewarm started", 2), ("built", "hf-compile", "fwd"), ("built", "hf-compile", "fwdbwd"),
                          "prewarm waited"]
    assert "timed" not in events[:4] and events[4] == ("built", "hf-eager", "fwd")  # eager is still timed first
    assert events.count(("built", "hf-compile", "fwd")) == 1  # timed in its turn, not built again
    assert events.count("timed") == 6


def test_a_compiled_case_that_fails_ahead_is_reported_in_its_turn(monkeypatch):
    events = _run(monkeypatch, ("hf-eager", "hf-compile"), False, compile_ahead=True,
                  refuse=(("hf-compile", "fwdbwd"),))
    assert events[:2] == [("built", "hf-compile", "fwd"), ("built", "hf-compile", "fwdbwd")]
    assert events.count("timed") == 3


def test_no_prewarm_without_a_compiled_candidate_or_when_not_asked(monkeypatch):
    assert not [e for e in _run(monkeypatch, ("hf-eager", "bertembed-fused"), True) if "prewarm" in str(e)]
    assert not [e for e in _run(monkeypatch, ("hf-compile", "bertembed-fused"), False) if "prewarm" in str(e)]


def test_the_prewarm_process_runs_the_fused_path(caplog):
    pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")
    with caplog.at_level(logging.WARNING):
        warm = Prewarm([Case(16, 1, 3), Case(16, 2, 8, "fwdbwd"), Case(16, 1, 3, "fwd", "float32", "cuda")], 50)
        assert warm._proc is not None
        warm.wait()
        warm.wait()  # a second wait returns at once
    assert warm._proc.returncode == 0 and not caplog.records


def test_the_prewarm_is_quiet_when_the_fused_path_is_not_available(monkeypatch):
    from bertembed.bench import prewarm

    def refuse(name, work):
        raise cands.NotAvailable("numba is not installed")

    monkeypatch.setattr(cands, "build", refuse)
    prewarm.main(['{"cases": [' + json.dumps(Case(16, 1, 3).to_dict()) + '], "vocab_size": 50}'])  # no exception
