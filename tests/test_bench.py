"""The benchmark harness: ORT's fused op against the reference, the bandwidth-bound arithmetic, and a tiny run.

No timing is asserted: these tests check that the harness measures the right thing and writes well-formed reports.
"""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from bertembed.bench import candidates as cands
from bertembed.bench.cases import Case, bound_bytes, bound_seconds, candidates_for, default_cases
from bertembed.bench.report import evaluate_targets, markdown, targets_table
from bertembed.bench.runner import BenchOptions, count_steps, finish_partial, run_bench


@pytest.mark.parametrize("hidden", [48, 100])  # 100: not a power of two
def test_ort_embed_layernorm_equals_reference(hidden):
    pytest.importorskip("onnxruntime")
    from bertembed.bench.onnx_graph import embed_layernorm_model, ort_forward, ort_session

    work = cands.make_workload(Case(hidden, 3, 17), seed=1, vocab_size=200)
    model = embed_layernorm_model(work.state_dict, work.config.layer_norm_eps)
    run = ort_forward(ort_session(model, threads=1), work.input_ids, work.token_type_ids)
    out = torch.from_numpy(run())
    reference = cands.reference_output(work)
    assert out.shape == (3, 17, hidden)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    # gamma and beta are not the identity, so a missing scale or shift would show
    assert not torch.allclose(work.state_dict["LayerNorm.weight"], torch.ones(hidden))


def test_bound_bytes_by_hand():
    # bert-base, B=32, L=128, float32: 4096 tokens x 3 rows x 768 x 4 bytes in, gamma and beta, the output out
    rows = 4096 * 3 * 768 * 4
    assert rows == 37_748_736
    assert bound_bytes(32, 128, 768, 4) == 37_748_736 + 2 * 768 * 4 + 4096 * 768 * 4 == 50_337_792
    assert bound_bytes(32, 128, 768, 2) == 50_337_792 // 2
    assert bound_bytes(1, 11, 384, 4) == 11 * 3 * 384 * 4 + 2 * 384 * 4 + 11 * 384 * 4
    assert bound_seconds(Case(768, 32, 128), 1e10) == pytest.approx(50_337_792 / 1e10)
    assert Case(768, 64, 512, dtype="bfloat16").output_bytes == 64 * 512 * 768 * 2


def test_sweep_and_candidates():
    full = default_cases()
    assert len(full) == 3 * 4 * 2 + 3  # hiddens x shapes x {fwd, fwdbwd}, plus bf16 forward at (64, 512)
    assert {(c.batch, c.length) for c in full} == {(1, 11), (32, 128), (8, 512), (64, 512)}
    assert all(c.hidden == 768 and c.dtype == "float32" for c in default_cases(quick=True))
    assert "ort-fused" not in candidates_for(Case(768, 64, 512, dtype="bfloat16"))
    assert "ort-fused" not in candidates_for(Case(768, 64, 512, device="cuda"))
    with pytest.raises(ValueError, match="mode"):
        Case(768, 1, 1, mode="backward")


def test_sweep_narrowed_by_device_hidden_and_shape(monkeypatch):
    from bertembed.bench import runner
    from bertembed.cli.bench import _shapes

    monkeypatch.setattr(runner, "_cuda_available", lambda: True)
    opts = BenchOptions(device="cuda", hiddens=(1024,), shapes=_shapes(["64x512", "1X11"]))
    cases = runner.plan_cases(opts)
    assert opts.allocator == "steady"  # glibc's settings do not touch GPU memory: one condition
    assert {c.device for c in cases} == {"cuda"} and {c.hidden for c in cases} == {1024}
    assert {(c.batch, c.length, c.mode, c.dtype) for c in cases} == {
        (64, 512, "fwd", "float32"), (64, 512, "fwdbwd", "float32"), (1, 11, "fwd", "float32"),
        (1, 11, "fwdbwd", "float32"), (64, 512, "fwd", "bfloat16")}
    assert {c.device for c in runner.plan_cases(BenchOptions(device="auto", quick=True))} == {"cpu", "cuda"}
    assert {c.device for c in runner.plan_cases(BenchOptions(device="cpu", quick=True))} == {"cpu"}
    assert "bertembed-fused-device-checks" in candidates_for(cases[0])
    assert "bertembed-fused-device-checks" not in candidates_for(Case(768, 32, 128))
    assert BenchOptions(shapes=_shapes(["1x512"])).shapes == ((1, 512),)
    for bad in (["64by512"], ["0x5"], ["1x513"]):  # 513: past the position table, which the worker would find late
        with pytest.raises(ValueError, match="--shape"):
            BenchOptions(shapes=_shapes(bad))
    with pytest.raises(ValueError, match="--device"):
        BenchOptions(device="gpu")
    with pytest.raises(ValueError, match="--hidden"):
        BenchOptions(hiddens=(0,))


def _fake(key_case: Case, candidate: str, **fields) -> dict:
    return {"key": key_case.key, "case": key_case.to_dict(), "candidate": candidate, "status": "ok",
            "output_bytes": key_case.output_bytes, **fields}


def test_targets_pass_miss_and_missing():
    case = Case(768, 32, 128)
    results = [_fake(case, "hf-eager", median_s=6e-3), _fake(case, "hf-compile", median_s=3e-3),
               _fake(case, "ort-fused", median_s=5e-3), _fake(case, "bertembed-fused", median_s=1e-3, bound_s=0.5e-3)]
    rows = {r["target"].split(" (")[0]: r for r in evaluate_targets({"results": results})}
    assert rows["forward vs transformers eager"]["result"] == "pass"  # 6x >= 5
    assert rows["forward vs torch.compile"]["result"] == "pass"  # 3x >= 3
    assert rows["forward vs ONNX Runtime"]["result"] == "pass"  # 5x >= 4
    assert rows["forward time / bandwidth bound at its footprint"]["result"] == "miss"  # 2x > 1.5
    assert rows["forward time / bandwidth bound at its footprint"]["value"] == pytest.approx(2.0)
    assert rows["fwd+bwd vs transformers eager"]["result"] == "not measured"
    assert rows["forward vs torch.compile"]["shown"] == "3.00"


@pytest.mark.parametrize("eager_ms,shown,result", [(4.997, "4.997", "miss"), (4.99996, "4.99996", "miss"),
                                                   (5.004, "5.00", "pass"), (4.96, "4.96", "miss")])
def test_a_ratio_is_shown_with_the_digits_its_verdict_needs(eager_ms, shown, result):
    case = Case(768, 32, 128)
    results = [_fake(case, "hf-eager", median_s=eager_ms * 1e-3), _fake(case, "bertembed-fused", median_s=1e-3)]
    row = evaluate_targets({"results": results})[0]
    assert (row["shown"], row["result"]) == (shown, result)
    assert f"| {shown} | >= 5 | {result} |" in "\n".join(targets_table([row]))


def test_tiny_run_writes_wellformed_json_and_markdown(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    options = BenchOptions(
        quick=True, threads=1, allocator="both", vocab_size=100, warmup=1, min_run_time=0.01,
        bandwidth_bytes=4 << 20, candidates=("hf-eager", "ort-fused", "bertembed-reference", "bertembed-fused"),
        cases=[Case(32, 1, 5, "fwd"), Case(32, 2, 8, "fwdbwd")],
    )
    seen = []
    report = run_bench(options, seen.append)
    assert len(seen) == count_steps(options, options.cases) == 2 * (4 + 4)
    report = json.loads(json.dumps(report))  # JSON round trip
    assert set(report["conditions"]) == {"steady", "default"}
    assert report["conditions"]["steady"]["meta"]["mallopt_applied"] in (True, False)
    for condition in report["conditions"].values():
        assert condition["meta"]["bandwidth_bytes_per_s"]["cpu"] > 0
        assert len(condition["meta"]["load_average"]) == 3
        by_name = {(r["case"]["mode"], r["candidate"]): r for r in condition["results"]}
        fwd = by_name[("fwd", "hf-eager")]
        assert fwd["status"] == "ok" and fwd["median_s"] > 0 and fwd["iqr_s"] >= 0
        assert fwd["max_abs_diff"] == 0.0  # same weights, same operations as the reference
        assert fwd["peak_bytes"] >= fwd["output_bytes"] and fwd["achieved_bytes_per_s"] > 0
        traffic = bound_bytes(1, 5, 32, 4)
        assert fwd["bound_s"] == pytest.approx(traffic / fwd["copy_bytes_per_s"])
        assert fwd["bound_dram_s"] == pytest.approx(traffic / condition["meta"]["bandwidth_bytes_per_s"]["cpu"])
        assert fwd["achieved_bytes_per_s"] == pytest.approx(traffic / fwd["median_s"])
        assert by_name[("fwd", "ort-fused")]["max_abs_diff"] < 1e-5
        assert by_name[("fwdbwd", "ort-fused")]["status"] == "not available"
        assert by_name[("fwd", "bertembed-fused")]["status"] in ("ok", "not available")
    assert report["machine"]["threads"] == 1
    started = datetime.fromisoformat(report["started"])
    assert started.tzinfo is not None and abs((datetime.now(timezone.utc) - started).total_seconds()) < 600
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    assert report["revision"] is None or report["revision"].split("+")[0] == commit  # None: not a checkout
    assert report["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    text = markdown(report)
    (tmp_path / "bench.md").write_text(text)
    assert f"- run: started {report['started']}; bertembed " in text
    assert "### Allocator: steady" in text and "### Allocator: default" in text and "#### Targets" in text
    table_lines = [line for line in text.splitlines() if line.startswith("| candidate |") or line.startswith("| ")]
    for line in table_lines:
        assert line.endswith("|")
    for block in text.split("\n\n"):  # every row of a table has its header's number of cells
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({len(row.strip("|").split("|")) for row in rows}) <= 1, block
    tables = [line for line in text.splitlines() if line.startswith("| candidate |")]
    assert len(tables) == 2 * 2  # two cases x two conditions
    check_summary_keeps_its_numbers_in_a_log(report, monkeypatch)


def check_summary_keeps_its_numbers_in_a_log(report, monkeypatch):
    """The terminal summary written to a pipe (CI, `| tee`), where rich assumes 80 columns: every number whole."""
    import io

    from bertembed.cli import bench as cli_bench
    from bertembed.cli.app import make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    log = io.StringIO()
    monkeypatch.setattr(cli_bench, "console", make_console(file=log))  # as the command's console is made
    cli_bench._print_summary({**report, "wall_seconds": 1.0})  # the command adds its wall time
    shown = log.getvalue()
    assert "…" not in shown
    for condition in report["conditions"].values():
        for r in condition["results"]:
            if r["status"] == "ok":
                assert f"{r['median_s'] * 1e3:.3f}" in shown and f"{r['iqr_s'] * 1e3:.3f}" in shown
    for rows in report["targets"].values():
        for row in rows:
            assert f"{row['target']}: " in shown


def test_isolated_run_one_process_per_candidate():
    options = BenchOptions(threads=1, allocator="steady", vocab_size=100, warmup=1, min_run_time=0.01,
                           bandwidth_bytes=4 << 20, candidates=("hf-eager", "bertembed-reference"),
                           cases=[Case(16, 2, 3, "fwd")], isolate=True)
    report = run_bench(options)
    condition = report["conditions"]["steady"]
    assert condition["isolated"] is True
    assert [r["candidate"] for r in condition["results"]] == ["hf-eager", "bertembed-reference"]
    assert all(r["status"] == "ok" and r["max_abs_diff"] == 0.0 for r in condition["results"])
    assert "one process per candidate" in markdown(report)


def test_cli_rejects_bad_options_before_running():
    from typer.testing import CliRunner

    from bertembed.cli import app

    result = CliRunner().invoke(app, ["bench", "--quick", "--allocator", "sometimes"])
    assert result.exit_code == 2
    assert "steady" in result.output and "sometimes" in result.output
    result = CliRunner().invoke(app, ["bench", "--quick", "--threads", "0"])
    assert result.exit_code == 2 and "--threads" in result.output


def _tiny(**kwargs) -> BenchOptions:
    return BenchOptions(quick=True, threads=1, allocator="steady", vocab_size=100, warmup=1, min_run_time=0.01,
                        bandwidth_bytes=4 << 20, candidates=("hf-eager", "bertembed-reference"), **kwargs)


def test_a_stopped_run_keeps_what_it_measured():
    seen = []

    def stop_at_the_second(record):
        seen.append(record)
        if len(seen) == 2:
            raise KeyboardInterrupt

    report: dict = {}
    with pytest.raises(KeyboardInterrupt):  # the worker is killed, the interrupt goes on
        run_bench(_tiny(cases=[Case(16, 1, 3, "fwd"), Case(16, 2, 4, "fwd")]), stop_at_the_second, report)
    finish_partial(report, "interrupted (Ctrl-C)")
    results = report["conditions"]["steady"]["results"]
    assert results == seen and len(results) == 2 and all(r["status"] == "ok" for r in results)
    assert all(row["result"] == "not measured" for row in report["targets"]["steady"])
    assert "STOPPED EARLY (interrupted (Ctrl-C))" in markdown(json.loads(json.dumps(report)))


def test_cli_writes_what_it_measured_when_interrupted(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from bertembed.bench import runner
    from bertembed.cli import app

    real = runner.run_bench

    def interrupted(options, on_record, report):  # the CLI's sweep replaced by a tiny one, stopped at its first record
        def stop(record):
            on_record(record)
            raise KeyboardInterrupt
        real(_tiny(cases=[Case(16, 1, 3, "fwd")]), stop, report)

    monkeypatch.setattr(runner, "run_bench", interrupted)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--quick", "--json-out", str(out), "--markdown", str(tmp_path / "b.md")])
    assert result.exit_code == 130, result.output
    saved = json.loads(out.read_text())
    assert saved["stopped"] == "interrupted (Ctrl-C)" and len(saved["conditions"]["steady"]["results"]) == 1
    assert "STOPPED EARLY" in (tmp_path / "b.md").read_text() and "measured before it" in result.output


def test_cli_refuses_an_output_it_cannot_write_before_running(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from bertembed.bench import runner
    from bertembed.cli import app

    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("ran before checking the output paths"))
    for flag in ("--json-out", "--markdown"):
        result = CliRunner().invoke(app, ["bench", "--quick", flag, str(tmp_path / "missing" / "out")])
        assert result.exit_code == 2 and "does not exist" in result.output
    result = CliRunner().invoke(app, ["bench", "--quick", "--json-out", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in result.output


def test_a_report_that_cannot_be_written_after_the_run_is_kept(tmp_path, monkeypatch, capsys):
    from bertembed.cli import bench as cli_bench

    report = {"conditions": {}, "wall_seconds": 1.0}
    monkeypatch.setattr("bertembed.bench.report.markdown", lambda report: "# bench\n")
    monkeypatch.setattr(cli_bench.tempfile, "tempdir", str(tmp_path / "spare"))
    (tmp_path / "spare").mkdir()
    gone = tmp_path / "gone"  # the folder existed when the run started, and is gone when it ends
    assert cli_bench._save(report, gone / "full.json", tmp_path / "full.md") is False
    spare = list((tmp_path / "spare").glob("bertembed-bench-*.json"))
    assert len(spare) == 1 and json.loads(spare[0].read_text()) == report
    assert (tmp_path / "full.md").read_text().startswith("#") and str(spare[0]) in capsys.readouterr().err.replace(
        "\n", "")


def test_a_wrong_candidate_is_flagged_not_hidden(monkeypatch):
    from bertembed.bench import worker

    work = cands.make_workload(Case(16, 2, 3), vocab_size=50)
    reference = cands.reference_output(work)
    monkeypatch.setattr(cands, "build", lambda name, w: cands.Candidate(name, lambda: reference + 1e-3))
    spec = {"condition": "steady", "threads": 1, "min_run_time": 0.01, "warmup": 1}
    record = worker.measure_one("bertembed-fused", work, reference, spec, {"working_set": 1e10, "dram": 1e10})
    assert record["status"] == "ok" and record["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert "OUTPUT DIFFERS" in record["note"]


def test_modules_are_built_without_drawing_weights_and_init_comes_back():
    """The bench skips the random fill of tables `load_state_dict` replaces; every weight is the workload's, and
    `torch.nn.init` is whole again afterwards, also after a failure inside."""
    fills = (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.trunc_normal_)
    work = cands.make_workload(Case(16, 1, 3), vocab_size=50)
    module = cands._reference_module(work)
    for name, value in module.state_dict().items():
        if name in work.state_dict:
            assert torch.equal(value, work.state_dict[name]), name
    with pytest.raises(RuntimeError), cands._no_random_init():
        assert torch.nn.init.normal_(torch.zeros(3)).eq(0).all()  # a no-op inside
        raise RuntimeError
    assert (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.trunc_normal_) == fills


def test_a_run_warns_of_what_disturbs_its_timings():
    from bertembed.cli.bench import disturbances

    assert disturbances(2, 0.1, 2) == []
    oversubscribed, busy = disturbances(4, 0.9, 2)
    assert "--threads 4 is more than the 2 CPUs" in oversubscribed
    assert "load average 0.90" in busy
