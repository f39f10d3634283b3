"""The bench worker measures each forward case's copy bandwidth once, and keeps the libraries' objects out of the
collector's walk while it runs (`worker.libraries_frozen`), giving them back at the end."""

from __future__ import annotations

import gc

import pytest

from bertembed.bench import candidates as cands
from bertembed.bench import worker
from bertembed.bench.cases import CANDIDATES, Case
from bertembed.bench.measure import Timing


def test_each_forward_case_measures_its_bandwidth_once_for_all_candidates(monkeypatch):
    measured = []

    def case_bandwidth(case, spec, dram):
        measured.append(case)
        return {"working_set": 1e9 * len(measured), "dram": dram}

    monkeypatch.setattr(worker, "case_bandwidth", case_bandwidth)
    monkeypatch.setattr(worker, "time_call", lambda *args: Timing(median=1e-3, iqr=1e-4, runs=5))
    spec = {"condition": "steady", "threads": 1, "min_run_time": 0.01, "warmup": 1, "vocab_size": 50,
            "candidates": ["bertembed-reference", "hf-eager"],
            "cases": [Case(16, 1, 3).to_dict(), Case(16, 2, 4, "fwdbwd").to_dict(), Case(24, 2, 5).to_dict()]}
    records = list(worker.run_cases(spec, {"cpu": 1e10}))
    assert [r["status"] for r in records] == ["ok"] * 6
    assert measured == [Case(16, 1, 3), Case(24, 2, 5)]  # forward cases only, each once
    forward = [r for r in records if r["case"]["mode"] == "fwd"]
    for key in {r["key"] for r in forward}:
        assert len({r["bound_s"] for r in forward if r["key"] == key}) == 1  # one bound per case, every candidate


def test_the_libraries_are_frozen_only_while_the_cases_run(monkeypatch):
    monkeypatch.setitem(cands.IMPORTS, "hf-eager", ("json", "no_such_module_for_bertembed"))
    assert gc.get_freeze_count() == 0
    with worker.libraries_frozen(("hf-eager",)):
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), worker.libraries_frozen(("hf-eager",)):
        raise RuntimeError("a failing case")
    assert gc.get_freeze_count() == 0  # given back on failure too


def test_every_candidate_names_what_it_imports():
    assert set(cands.IMPORTS) == set(CANDIDATES)
