"""The command line as users run it: a fresh process, the bundled model, exit codes and output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from bertembed import BertEmbeddings, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "The quick brown fox jumps over the lazy dog"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bertembed", *args], capture_output=True, text=True, timeout=300)


def test_explain_table():
    done = run("explain", SENTENCE)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # rich wraps lines at the terminal's width
    assert "sentence-transformers/all-MiniLM-L6-v2" in out and "bundled" in out
    assert "--model bert-base-uncased" in out  # how to pick BERT itself
    for token in ("[CLS]", "quick", "jumps", "lazy", "[SEP]", "14523"):
        assert token in out
    diff = float(re.search(r"max \|diff\| = ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-5 and "is equal" in out


def test_explain_json_pair_matches_the_torch_layer():
    done = run("explain", "Who wrote it?", "Sinan did.", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["model"] == "sentence-transformers/all-MiniLM-L6-v2" and data["max_abs_diff"] < 1e-5
    tokens = data["tokens"]
    assert [t["token"] for t in tokens] == ["[CLS]", "who", "wrote", "it", "?", "[SEP]", "sin", "##an", "did", ".",
                                           "[SEP]"]
    assert [t["segment"] for t in tokens] == [0] * 6 + [1] * 5
    assert [t["position"] for t in tokens] == list(range(11))
    # independent check of the printed norms: the torch layer's output for the same ids
    enc = Tokenizer.from_pretrained()("Who wrote it?", "Sinan did.", return_tensors="pt")
    with torch.no_grad():
        out = BertEmbeddings.from_pretrained().eval()(enc.input_ids, enc.token_type_ids)[0]
    assert [t["id"] for t in tokens] == enc.input_ids[0].tolist()
    torch.testing.assert_close(torch.tensor([t["output_norm"] for t in tokens]), out.double().norm(dim=-1).float())


def test_explain_with_the_torch_engine():
    done = run("explain", SENTENCE, "--torch", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["engine"] == "torch"


def test_explain_does_not_import_torch():
    code = ("import sys; from bertembed.cli import main; sys.argv = ['bertembed', 'explain', 'hello', '--json'];\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_bad_input_exits_2_without_traceback(tmp_path):
    for args, message in [
        (["explain", ""], "TEXT is empty"),
        (["explain", "word " * 600], "positions"),
        (["explain", "hi", "--model", str(tmp_path / "missing")], "neither an existing file"),
        (["explain", "hi", "--model", str(tmp_path)], "has neither tokenizer.json nor vocab.txt"),
    ]:
        done = run(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr


def test_help_keeps_square_brackets():
    """rich reads help text as markup, where "[viz]" is a style tag and vanishes unless escaped."""
    for args, text in ((("inspect", "positions", "--help"), ".[viz]"),
                       (("inspect", "onehot", "--help"), "W[ids]")):
        done = run(*args)
        assert done.returncode == 0, done.stderr
        assert text in done.stdout, args


def test_each_warning_prints_once():
    """bertembed's warnings reach stderr; a library's that has its own handler (huggingface_hub's retries) is not
    printed a second time through a root handler of ours."""
    code = """import logging
from bertembed.cli.app import user_errors
library = logging.getLogger("library")
library.addHandler(logging.StreamHandler())
with user_errors():
    library.warning("retrying")
    logging.getLogger("bertembed.fast").warning("fell back")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("retrying") == 1 and done.stderr.count("fell back") == 1, done.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"Install the development extras and run the tests:\n\n```bash\n(.+)\n```", readme).group(1)
    assert command in ci.splitlines(), "the README's test command and .ci/run differ"


def test_an_unsupported_checkpoint_is_refused_in_one_line(tmp_path):
    """A member bertembed does not read (Longformer, say) is refused in one line, with the supported ones named."""
    import shutil

    from transformers import BertConfig, BertModel

    from bertembed.sources import bundled_folder

    BertModel(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=37)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "longformer", "architectures": None}))
    shutil.copy(bundled_folder() / "vocab.txt", tmp_path)  # a tokenizer, so only the weights can be refused
    for args in (("explain", "hello world"), ("explain", "hello world", "--torch"), ("inspect", "positions")):
        done = run(*args, "--model", str(tmp_path))
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "longformer" in done.stderr and "supported: bert, roberta" in done.stderr


def test_version_and_the_commands_in_the_order_of_a_first_tour():
    """--version prints pyproject's version; --help lists the commands as the README tours them (explain first, bench
    last), not in the order their modules registered them (bench was first)."""
    import typer
    from typer.testing import CliRunner

    from bertembed.cli import app

    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    done = CliRunner().invoke(app, ["--version"])
    assert done.exit_code == 0 and done.output == f"bertembed {version}\n", done.output
    listed = re.findall(r"^│ ([a-z][a-z-]*) ", CliRunner().invoke(app, ["--help"]).output, re.M)
    assert listed == ["explain", "walkthrough", "notebook", "inspect", "drift", "finetune-demo", "export", "surgery",
                      "bench"]
    assert set(listed) == set(typer.main.get_command(app).commands)  # every command, each once
