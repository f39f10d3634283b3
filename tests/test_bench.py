"""`bertembed bench`: the candidates compute the same layer, a tiny run in this process writes well-formed JSON and
markdown whose ratios and guards follow from its recorded times, a missing package is named, and bad options are
refused before anything runs.

No timing is asserted: these tests check that the tool measures the right thing and reports it faithfully.
"""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from bertembed.bench import candidates as cands
from bertembed.bench import measure
from bertembed.bench.candidates import Case
from bertembed.cli import app

TINY = [Case(32, 1, 5, "fwd"), Case(32, 2, 8, "fwdbwd")]
QUICK = ("hf-eager", "bertembed-reference", "bertembed-fused")  # (torch.compile takes seconds a case to compile)


def _run(cases=TINY, **kwargs) -> dict:
    """A tiny run in this process, its report through a JSON round trip."""
    options = {"threads": 1, "repeat": 2, "quick": True, "reference": True, "candidates": QUICK, **kwargs}
    return json.loads(json.dumps(measure.run(cases, **options)))


def test_sweep_and_who_runs_what():
    full = cands.plan(quick=False)
    assert len(full) == 3 * 4 * 2 + 3 * 4 + 3 * 3  # float32 forward and training step, bfloat16 forward, members
    assert {c.mode for c in full if c.dtype == "bfloat16"} == {"fwd"}
    quick = cands.plan(quick=True)
    assert {(c.hidden, c.dtype) for c in quick} == {(768, "float32")}
    assert {c.member for c in quick} == {"bert", *cands.MEMBERS}
    assert {g[1] for g in measure.GUARDS} <= {c.key for c in quick}  # --quick runs the three guards' cases
    assert len(cands.plan(True, (384,), ((2, 3),), ("bfloat16",), "cpu")) == 1
    assert {c.device for c in cands.plan(True, device="cuda")} == {"cuda"}
    assert not cands.runs("ort-fused", Case(768, 64, 512, dtype="bfloat16"))
    assert not cands.runs("ort-fused", Case(768, 64, 512, "fwdbwd"))
    assert not cands.runs("ort-fused", Case(768, 64, 512, device="cuda"))
    assert not cands.runs("ort-fused", Case(768, 32, 128, member="roberta"))  # ONNX Runtime's fused node is BERT's
    assert not cands.runs("hf-compile", Case(768, 64, 512, dtype="bfloat16"))
    assert not cands.runs("bertembed-fused", Case(768, 8, 8, dtype="float16"))  # it would time the reference
    assert cands.runs("bertembed-fused", Case(768, 8, 8, dtype="float16", device="cuda"))


@pytest.mark.parametrize("hidden", [48, 100])  # 100: not a power of two
def test_ort_embed_layernorm_equals_reference(hidden):
    pytest.importorskip("onnxruntime")
    expected, make = cands.prepare(Case(hidden, 3, 17), vocab=200, seed=1)
    out = torch.from_numpy(make("ort-fused")())
    assert out.shape == (3, 17, hidden)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("member", ["roberta", "distilbert", "modernbert"])
def test_member_cases_compare_against_the_members_own_transformers_layer(member, monkeypatch):
    built, real = [], cands.transformers_layer
    monkeypatch.setattr(cands, "transformers_layer", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    expected, make = cands.prepare(Case(32, 2, 7, member=member), vocab=100)
    for name in ("hf-eager", "bertembed-reference", "bertembed-fused"):
        torch.testing.assert_close(make(name)().double(), expected, rtol=0, atol=1e-5)
    assert type(built[0]).__module__.startswith(f"transformers.models.{member}.")


def test_the_layers_are_built_from_the_same_weights_with_layernorm_off_the_identity():
    expected, make = cands.prepare(Case(16, 2, 3), vocab=100)
    plain = torch.nn.functional.layer_norm(expected, (16,))  # what an identity gamma and zero beta would give
    assert not torch.allclose(expected, plain)  # a missing scale or shift would show
    torch.testing.assert_close(make("hf-eager")().double(), expected, rtol=0, atol=0)  # the same operations


def test_tiny_run_writes_wellformed_json_and_markdown_whose_ratios_follow_from_its_times():
    pytest.importorskip("onnxruntime")
    done = _run(candidates=(*QUICK, "ort-fused"))
    assert done["threads"] == 1 and done["repeat"] == 2 and done["quick"] is True
    assert done["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert done["started"] and done["machine"]["cpu"] and len(done["load_average"]) == 3 and done["wall_seconds"] > 0
    by_name = {(r["case"]["mode"], r["candidate"]): r for r in done["results"]}
    assert set(by_name) == {(m, c) for m in ("fwd", "fwdbwd") for c in QUICK} | {("fwd", "ort-fused")}
    for (mode, _), r in by_name.items():
        assert r["status"] == "ok", r
        assert r["vs_eager"] == pytest.approx(by_name[(mode, "hf-eager")]["median_s"] / r["median_s"])
        assert len(r["round_medians_s"]) == 2 and r["iqr_s"] >= 0
        assert min(r["round_medians_s"]) <= r["median_s"] <= max(r["round_medians_s"])
        assert (r["max_abs_diff"] < 1e-5) if mode == "fwd" else ("max_abs_diff" not in r)
    assert by_name[("fwd", "hf-eager")]["max_abs_diff"] == 0.0  # the same operations as the reference
    assert [g["result"] for g in done["guards"]] == ["not measured"] * 3  # (not the guards' cases)
    text = measure.markdown(done)
    assert text.startswith("### bertembed bench\n") and f"- run: started {done['started']}" in text
    for block in text.split("\n\n"):  # every row of a table has its header's number of cells
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert all(row.endswith("|") for row in rows)
        assert len({len(row.strip("|").split("|")) for row in rows}) <= 1, block
    for r in done["results"]:
        cells = [c.strip() for c in next(line for line in text.splitlines()
                                         if f"| {r['key']} " in line and f" {r['candidate']} " in line).split("|")]
        assert cells[3:6] == [f"{r['median_s'] * 1e3:.3f}", f"{r['iqr_s'] * 1e3:.3f}", f"{r['vs_eager']:.2f}x"]


@pytest.mark.parametrize("error", [1e-3, float("nan")])
def test_a_wrong_candidate_is_flagged_not_hidden(monkeypatch, tmp_path, error):
    """Off by a little, or a NaN (which no comparison with the tolerance caught): flagged; the JSON stays strict."""
    real = cands.prepare

    def off(case, **kwargs):
        expected, make = real(case, **kwargs)

        def made(name):
            fn = make(name)
            return (lambda: fn().index_fill(-1, torch.tensor([0]), error) if error != error else fn() + error) \
                if name == "bertembed-reference" else fn
        return expected, made

    monkeypatch.setattr(cands, "prepare", off)
    wrong = next(r for r in _run([Case(16, 2, 3)])["results"] if r["candidate"] == "bertembed-reference")
    assert wrong["status"] == "ok" and "OUTPUT DIFFERS" in wrong["note"]
    if error == error:
        assert wrong["max_abs_diff"] == pytest.approx(error, rel=1e-3)
        return
    monkeypatch.setattr(cands, "plan", lambda *args: [Case(16, 2, 3)])
    monkeypatch.setattr(measure, "run", functools.partial(measure.run, candidates=["bertembed-reference"]))
    result = CliRunner().invoke(app, ["bench", "--quick", "--reference", "--json-out", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "b.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert saved["results"][0]["max_abs_diff"] is None


def test_a_missing_optional_package_is_named_and_the_run_goes_on(monkeypatch):
    from bertembed import fast

    for package in ("numba", "onnxruntime"):
        monkeypatch.setitem(sys.modules, package, None)  # `import package` fails, as where it is not installed
    monkeypatch.setattr(fast, "_found", {}, raising=False)  # (the fused layer asks for numba once a process)
    records = {r["candidate"]: r for r in _run([Case(16, 2, 3)], candidates=(*QUICK, "ort-fused"))["results"]}
    assert records["bertembed-fused"]["status"] == records["ort-fused"]["status"] == "not available"
    assert "numba" in records["bertembed-fused"]["note"]
    assert "onnxruntime" in records["ort-fused"]["note"] and '".[bench]"' in records["ort-fused"]["note"]
    assert records["hf-eager"]["status"] == records["bertembed-reference"]["status"] == "ok"
    text = measure.markdown({**_run([]), "results": list(records.values())})
    assert "| not available |" in text and "- ort-fused on cpu H=16 B=2 L=3 fwd float32: " in text


def _fake(key: str, candidate: str, vs_eager: float | None) -> dict:
    return {"key": key, "candidate": candidate, "status": "ok", "vs_eager": vs_eager}


def test_guards_pass_fail_and_not_measured():
    (_, forward, _), (_, step, _), (_, sentence, _) = measure.GUARDS
    rows = measure.guards([_fake(forward, "hf-eager", 1.0), _fake(forward, "bertembed-fused", 2.5),
                           _fake(step, "bertembed-fused", 1.5), _fake(sentence, "hf-compile", 3.0)])
    assert [(r["result"], r["target"]) for r in rows] == [("pass", 2.0), ("fail", 2.0), ("not measured", 0.95)]
    assert rows[0]["measured"] == 2.5 and rows[0]["shown"] == "2.50x" and rows[0]["case"] == forward
    assert [g["guard"] for g in rows] == [g[0] for g in measure.GUARDS]


@pytest.mark.parametrize("ratio,shown,result", [(1.997, "1.997x", "fail"), (1.99996, "1.99996x", "fail"),
                                                (2.004, "2.00x", "pass"), (1.96, "1.96x", "fail")])
def test_a_ratio_is_shown_with_the_digits_its_verdict_needs(ratio, shown, result):
    row = measure.guards([_fake(measure.GUARDS[0][1], "bertembed-fused", ratio)])[0]
    assert (row["shown"], row["result"]) == (shown, result)


def test_repeat_rotates_the_order_and_keeps_each_rounds_median(monkeypatch):
    order = []
    real = cands.prepare

    def recording(case, **kwargs):
        expected, make = real(case, **kwargs)

        def made(name):
            fn = make(name)
            return lambda: (order.append(name[10:13] if name.startswith("bertembed") else "eag"), fn())[1]
        return expected, made

    monkeypatch.setattr(cands, "prepare", recording)
    done = _run([Case(16, 1, 3)], repeat=3)
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    # warm-up and the output check, then three rounds each in an order rotated by one
    assert runs == ["eag", "ref", "fus"] + ["eag", "ref", "fus", "ref", "fus", "eag", "fus", "eag", "ref"]
    assert all(len(r["round_medians_s"]) == 3 for r in done["results"])


def test_cli_runs_and_writes_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(cands, "plan", lambda *args: [Case(16, 1, 3)])
    monkeypatch.setattr(measure, "run", functools.partial(measure.run, candidates=QUICK))
    monkeypatch.setattr("os.getloadavg", lambda: (0.9, 0.9, 0.9))
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    result = CliRunner().invoke(app, ["bench", "--quick", "--json-out", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    assert "warning: load average 0.90 before starting" in result.stderr and f"wrote {out}" in result.stderr
    saved = json.loads(out.read_text())
    assert saved["quick"] and [g["result"] for g in saved["guards"]] == ["not measured"] * 3
    assert md.read_text() == measure.markdown(saved) == result.stdout.rstrip("\n") + "\n"  # (the report alone)
    for r in saved["results"]:
        assert f"{r['median_s'] * 1e3:.3f}" in result.output and "…" not in result.output


@pytest.mark.parametrize("args,message", [(["--threads", "0"], "--threads"), (["--repeat", "0"], "--repeat"),
                                          (["--hidden", "0"], "--hidden"), (["--shape", "64by512"], "--shape"),
                                          (["--shape", "1x513"], "512"), (["--shape", "0x5"], "--shape"),
                                          (["--dtype", "float64"], "--dtype"), (["--device", "gpu"], "--device")])
def test_cli_refuses_bad_options_before_running(args, message, monkeypatch):
    monkeypatch.setattr(measure, "run", lambda *a, **k: pytest.fail("ran with a bad option"))
    result = CliRunner().invoke(app, ["bench", "--quick", *args])
    assert result.exit_code == 2 and message in result.output


def test_cli_refuses_an_output_it_cannot_write_or_a_device_it_lacks_before_running(tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "run", lambda *a, **k: pytest.fail("ran before checking its options"))
    for flag in ("--json-out", "--markdown"):
        result = CliRunner().invoke(app, ["bench", "--quick", flag, str(tmp_path / "missing" / "out")])
        assert result.exit_code == 2 and "does not exist" in result.output
    result = CliRunner().invoke(app, ["bench", "--quick", "--json-out", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in result.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["bench", "--device", "cuda"])
    assert result.exit_code == 2 and "--device cuda asked for, but torch sees no CUDA device" in result.output


def test_building_the_members_layers_prints_nothing(capfd):
    """Building ModernBERT's transformers layer warned of four special ids past the benchmark's vocabulary."""
    expected, make = cands.prepare(Case(32, 1, 3, member="modernbert"))
    assert make("hf-eager")().shape == expected.shape
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == "", printed


def test_no_command_speaks_of_the_issue_or_of_files_that_do_not_ship():
    """Words meant for the maintainers (the issue's targets, FAMILY.md in the steering repository) are not in the
    help users read."""
    from bertembed.cli.app import app as root

    for command in ([], ["bench"], ["inspect"], ["export"], ["surgery"]):
        text = CliRunner().invoke(root, [*command, "--help"]).output
        assert "issue" not in text and "FAMILY.md" not in text, text
