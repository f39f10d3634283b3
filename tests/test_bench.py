"""`bertembed bench`: the candidates compute the same layer, a tiny real run writes well-formed JSON and markdown whose
ratios follow from its recorded times, and bad options are refused before anything runs.

No timing is asserted: these tests check that the tool measures the right thing and reports it faithfully.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from typer.testing import CliRunner

from bertembed.bench import candidates as cands
from bertembed.bench import measure, report
from bertembed.bench.candidates import Case
from bertembed.cli import app
from bertembed.cli.bench import shapes


@pytest.fixture(autouse=True)
def _default_allocator(monkeypatch):
    """This process counts as started in glibc's default condition: a tiny run of that condition runs in it (where
    monkeypatches hold), a steady one in a child process."""
    for name in measure.STEADY_ENV:
        monkeypatch.delenv(name, raising=False)


def _tiny(**kwargs) -> measure.Options:
    defaults = dict(quick=True, threads=1, allocator="default", vocab=100, warmup=1, min_run_time=0.005,
                    bandwidth_bytes=4 << 20, repeat=2, cases=[Case(32, 1, 5, "fwd"), Case(32, 2, 8, "fwdbwd")],
                    candidates=("hf-eager", "bertembed-reference", "bertembed-fused"))
    return measure.Options(**{**defaults, **kwargs})


@pytest.mark.parametrize("hidden", [48, 100])  # 100: not a power of two
def test_ort_embed_layernorm_equals_reference(hidden):
    pytest.importorskip("onnxruntime")
    built = cands.modules(hidden, "cpu", "float32", seed=1, vocab=200)
    case = Case(hidden, 3, 17)
    ids, types, grad = cands.inputs(case, vocab=200)
    out = torch.from_numpy(cands.call("ort-fused", built, case, ids, types, grad)())
    with torch.no_grad():
        expected = built["reference32"].eval()(ids, types)
    assert out.shape == (3, 17, hidden)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(built["state"]["LayerNorm.weight"], torch.ones(hidden))  # a missing scale would show


def test_bound_bytes_by_hand():
    # bert-base, B=32, L=128, float32: 4096 tokens x 3 rows x 768 x 4 bytes in, gamma and beta, the output out
    assert cands.bound_bytes(Case(768, 32, 128)) == 4096 * 3 * 768 * 4 + 2 * 768 * 4 + 4096 * 768 * 4 == 50_337_792
    assert cands.bound_bytes(Case(768, 32, 128, dtype="bfloat16")) == 50_337_792 // 2
    assert Case(768, 64, 512, dtype="bfloat16").output_bytes == 64 * 512 * 768 * 2


def test_sweep_and_who_runs_what():
    full = cands.plan(quick=False)
    assert len(full) == 3 * 4 * 2 + 3 * 4 + 3 * 3  # float32 forward and training step, bfloat16 forward
    assert {c.mode for c in full if c.dtype == "bfloat16"} == {"fwd"}
    assert {(c.hidden, c.dtype) for c in cands.plan(quick=True)} == {(768, "float32")}
    assert len(cands.plan(True, (384,), ((2, 3),), ("bfloat16",), ("cpu", "cuda"))) == 2
    assert not cands.runs("ort-fused", Case(768, 64, 512, dtype="bfloat16"))
    assert not cands.runs("ort-fused", Case(768, 64, 512, "fwdbwd"))
    assert not cands.runs("ort-fused", Case(768, 64, 512, device="cuda"))
    assert not cands.runs("hf-compile", Case(768, 64, 512, dtype="bfloat16"))
    assert cands.runs("bertembed-fused-device-checks", Case(768, 8, 8, device="cuda"))
    assert not cands.runs("bertembed-fused-device-checks", Case(768, 8, 8))
    with pytest.raises(ValueError, match="mode"):
        Case(768, 1, 1, mode="backward")


def test_options_refuse_bad_values_with_the_option_named():
    assert shapes(["64x512", "1X11"]) == ((64, 512), (1, 11)) and shapes(None) is None
    with pytest.raises(ValueError, match="--shape takes BxL"):
        shapes(["64by512"])
    bad = {"--shape must be positive": dict(shapes=((0, 5),)), "--shape lengths stop at 512": dict(shapes=((1, 513),)),
           "--device": dict(device="gpu"), "--hidden": dict(hiddens=(0,)), "--allocator": dict(allocator="sometimes"),
           "--repeat": dict(repeat=0), "--threads": dict(threads=0), "--dtype": dict(dtypes=("float64",))}
    for message, kwargs in bad.items():
        with pytest.raises(ValueError, match=message):
            measure.Options(**kwargs)
    assert measure.Options(quick=True).allocator == "steady" and measure.Options().allocator == "both"


def test_the_condition_this_process_is_in_comes_from_its_environment(monkeypatch):
    for name in measure.STEADY_ENV:
        monkeypatch.delenv(name, raising=False)
    assert measure.current_condition() == "default"
    for name, value in measure.STEADY_ENV.items():
        monkeypatch.setenv(name, value)
    assert measure.current_condition() == "steady"
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "7")
    assert measure.current_condition() is None  # some other setting: both conditions run in a child


def _fake(case: Case, candidate: str, **fields) -> dict:
    return {"key": case.key, "case": case.to_dict(), "candidate": candidate, "status": "ok",
            "output_bytes": case.output_bytes, **fields}


def test_targets_pass_miss_and_missing():
    case = Case(768, 32, 128)
    results = [_fake(case, "hf-eager", median_s=6e-3), _fake(case, "hf-compile", median_s=3e-3),
               _fake(case, "ort-fused", median_s=5e-3), _fake(case, "bertembed-fused", median_s=1e-3, bound_s=0.5e-3)]
    rows = {r["target"].split(" (")[0]: r for r in report.evaluate_targets(results)}
    assert rows["forward vs transformers eager"]["result"] == "pass"  # 6x >= 3
    assert rows["forward vs torch.compile"]["result"] == "pass" and rows["forward vs torch.compile"]["shown"] == "3.00"
    assert rows["forward vs ONNX Runtime"]["result"] == "pass"  # 5x >= 4
    assert rows["forward time / bandwidth bound at its footprint"]["value"] == pytest.approx(2.0)
    assert rows["forward time / bandwidth bound at its footprint"]["result"] == "miss"  # 2x > 1.5
    assert rows["fwd+bwd vs transformers eager"]["result"] == "not measured"
    assert "not measured in this run" in rows["fwd+bwd vs transformers eager"]["why"]


@pytest.mark.parametrize("eager_ms,shown,result", [(2.997, "2.997", "miss"), (2.99996, "2.99996", "miss"),
                                                   (3.004, "3.00", "pass"), (2.96, "2.96", "miss")])
def test_a_ratio_is_shown_with_the_digits_its_verdict_needs(eager_ms, shown, result):
    case = Case(768, 32, 128)
    row = report.evaluate_targets([_fake(case, "hf-eager", median_s=eager_ms * 1e-3),
                                   _fake(case, "bertembed-fused", median_s=1e-3)])[0]
    assert (row["shown"], row["result"]) == (shown, result)


def test_tiny_run_writes_wellformed_json_and_markdown_whose_ratios_follow_from_its_times():
    pytest.importorskip("onnxruntime")
    options = _tiny(allocator="both", reference=True, candidates=("hf-eager", "ort-fused", "bertembed-reference",
                                                                   "bertembed-fused"))
    done = json.loads(json.dumps(report.finish(measure.run(options))))  # JSON round trip
    assert set(done["conditions"]) == {"steady", "default"}
    assert done["conditions"]["default"]["in_process"] and not done["conditions"]["steady"]["in_process"]
    assert done["threads"] == 1 and done["repeat"] == 2 and done["versions"]["torch"].split("+")[0] == \
        torch.__version__.split("+")[0]
    assert done["started"] and "cpu" in done["machine"] and "revision" in done
    for condition in done["conditions"].values():
        dram = condition["meta"]["bandwidth_bytes_per_s"]["cpu"]
        assert dram > 0 and len(condition["meta"]["load_average"]) == 3
        by_name = {(r["case"]["mode"], r["candidate"]): r for r in condition["results"]}
        assert ("fwdbwd", "ort-fused") not in by_name and by_name[("fwd", "ort-fused")]["status"] == "ok"
        for mode in ("fwd", "fwdbwd"):
            eager = by_name[(mode, "hf-eager")]
            for r in condition["results"]:
                if r["case"]["mode"] != mode or r["status"] != "ok":
                    continue
                assert r["vs_eager"] == pytest.approx(eager["median_s"] / r["median_s"])
                assert len(r["round_medians_s"]) == 2 and r["iqr_s"] >= 0
                assert min(r["round_medians_s"]) <= r["median_s"] <= max(r["round_medians_s"])
                if mode == "fwd":
                    traffic = cands.bound_bytes(Case(**r["case"]))
                    assert r["achieved_bytes_per_s"] == pytest.approx(traffic / r["median_s"])
                    assert r["bound_s"] == pytest.approx(traffic / r["copy_bytes_per_s"])
                    assert r["bound_dram_s"] == pytest.approx(traffic / dram)
                    assert r["max_abs_diff"] < 1e-5
        assert by_name[("fwd", "hf-eager")]["max_abs_diff"] == 0.0  # the same operations as the reference
        assert by_name[("fwd", "hf-eager")]["peak_bytes"] >= by_name[("fwd", "hf-eager")]["output_bytes"]
    text = report.markdown(done)
    assert f"- run: started {done['started']}; bertembed " in text
    assert "### Allocator: steady" in text and "### Allocator: default" in text and "#### Targets" in text
    for block in text.split("\n\n"):  # every row of a table has its header's number of cells
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert all(row.endswith("|") for row in rows)
        assert len({len(row.strip("|").split("|")) for row in rows}) <= 1, block
    for condition in done["conditions"].values():
        for r in condition["results"]:
            if r["status"] == "ok":
                assert f"| {r['key']} | {r['candidate']} | {r['median_s'] * 1e3:.3f} | {r['iqr_s'] * 1e3:.3f} | " \
                       f"{r['vs_eager']:.2f}x |" in text


def test_a_wrong_candidate_is_flagged_not_hidden(monkeypatch):
    real = cands.call

    def off_by_a_little(name, built, case, ids, types, grad):
        fn = real(name, built, case, ids, types, grad)
        return (lambda: fn() + 1e-3) if name == "bertembed-reference" else fn

    monkeypatch.setattr(cands, "call", off_by_a_little)
    records = measure.run(_tiny(reference=True, cases=[Case(16, 2, 3)]))["conditions"]["default"]["results"]
    wrong = next(r for r in records if r["candidate"] == "bertembed-reference")
    assert wrong["status"] == "ok" and wrong["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert "OUTPUT DIFFERS" in wrong["note"]


def test_a_fused_layer_that_falls_back_to_the_reference_is_not_timed_as_fused():
    def falls_back():
        logging.getLogger("bertembed.kernels").info(
            "bertembed: running the reference layer instead of the fused kernel: %s", "a reason")

    with pytest.raises(cands.NotAvailable, match="fell back to the reference: .*a reason"):
        cands._logging_fallbacks(falls_back)
    assert not any(isinstance(h, cands._Fallbacks) for h in logging.getLogger("bertembed").handlers)


def test_cli_runs_and_writes_json_and_markdown(tmp_path, monkeypatch):
    real = measure.run
    monkeypatch.setattr(measure, "run", lambda options: real(_tiny(cases=[Case(16, 1, 3)])))
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    result = CliRunner().invoke(app, ["bench", "--quick", "--json-out", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["wall_seconds"] > 0 and saved["targets"]["default"] and md.read_text().startswith("### bertembed")
    for r in saved["conditions"]["default"]["results"]:
        assert f"{r['median_s'] * 1e3:.3f}" in result.output and "…" not in result.output


@pytest.mark.parametrize("args,message", [(["--allocator", "sometimes"], "--allocator"),
                                          (["--threads", "0"], "--threads"), (["--repeat", "0"], "--repeat"),
                                          (["--shape", "64by512"], "--shape"), (["--shape", "1x513"], "512"),
                                          (["--dtype", "float64"], "--dtype"), (["--device", "gpu"], "--device")])
def test_cli_refuses_bad_options_before_running(args, message, monkeypatch):
    monkeypatch.setattr(measure, "run", lambda *a: pytest.fail("ran with a bad option"))
    result = CliRunner().invoke(app, ["bench", "--quick", *args])
    assert result.exit_code == 2 and message in result.output


def test_cli_refuses_an_output_it_cannot_write_before_running(tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "run", lambda *a: pytest.fail("ran before checking the output paths"))
    for flag in ("--json-out", "--markdown"):
        result = CliRunner().invoke(app, ["bench", "--quick", flag, str(tmp_path / "missing" / "out")])
        assert result.exit_code == 2 and "does not exist" in result.output
    result = CliRunner().invoke(app, ["bench", "--quick", "--json-out", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in result.output


def test_a_run_warns_of_what_disturbs_its_timings():
    assert measure.disturbances(2, 0.1, 2) == []
    oversubscribed, busy = measure.disturbances(4, 0.9, 2)
    assert "--threads 4 is more than the 2 CPUs" in oversubscribed and "load average 0.90" in busy


def test_repeat_rotates_the_order_and_keeps_each_rounds_median(monkeypatch):
    order = []
    real = cands.call

    def recording(name, built, case, ids, types, grad):
        fn = real(name, built, case, ids, types, grad)
        return lambda: (order.append(name[10:13] if name.startswith("bertembed") else "eag"), fn())[1]

    monkeypatch.setattr(cands, "call", recording)
    records = measure.run(_tiny(repeat=3, warmup=0, reference=True, cases=[Case(16, 1, 3)]))
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    # the output check, three rounds each in an order rotated by one, the peak-memory call
    assert runs == ["eag", "ref", "fus"] + ["eag", "ref", "fus", "ref", "fus", "eag", "fus", "eag", "ref"] + \
        ["eag", "ref", "fus"]
    assert all(len(r["round_medians_s"]) == 3 for r in records["conditions"]["default"]["results"])


@pytest.mark.parametrize("member", ["roberta", "distilbert", "modernbert"])
def test_member_cases_compare_against_the_members_own_transformers_layer(member):
    from bertembed.bench import candidates as cands

    assert any(c.member == member for c in cands.plan(quick=True))
    case = cands.Case(32, 2, 7, member=member)
    built = cands.modules(32, "cpu", "float32", vocab=100, member=member)
    ids, types, grad = cands.inputs(case, vocab=100)
    expected = built["reference32"].eval()(**cands.arguments(built, ids, types))
    for name in ("hf-eager", "bertembed-fused"):
        torch.testing.assert_close(cands.call(name, built, case, ids, types, grad)(), expected, rtol=0, atol=1e-5)
    assert type(built["hf-eager"]).__module__.startswith(f"transformers.models.{member}.")


def test_the_run_prints_no_profiler_lines_nor_config_warnings(capfd):
    """torch's profiler (the peak memory) printed two USDT lines per call on stderr, and building ModernBERT's
    transformers layer warned of four special ids past the benchmark's vocabulary."""
    assert measure.peak_bytes(lambda: torch.ones(1000) + 1, "cpu") >= 4000
    built = cands.modules(32, "cpu", "float32", member="modernbert")
    assert type(built["hf-eager"]).__name__ == "ModernBertEmbeddings"
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == "", printed


def test_no_command_speaks_of_the_issue_or_of_files_that_do_not_ship():
    """Words meant for the maintainers (the issue's targets, FAMILY.md in the steering repository) are not in the
    help or the messages users read."""
    from bertembed.cli.app import app as root

    helps = [CliRunner().invoke(root, [*command, "--help"]).output for command in
             ([], ["bench"], ["inspect"], ["export"], ["surgery"])]
    member = cands.Case(32, 1, 3, member="roberta")
    with pytest.raises(cands.NotAvailable) as refused:
        cands.call("ort-fused", cands.modules(32, "cpu", "float32", vocab=100, member="roberta"), member, *[None] * 3)
    for text in (*helps, str(refused.value)):
        assert "issue" not in text and "FAMILY.md" not in text, text
