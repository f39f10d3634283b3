"""The command line: the bundled model, exit codes and output, in process (typer's CliRunner); a fresh process only
where the process is what is tested: the cold start, and the exit status a shell sees."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

from bertembed import BertEmbeddings, Tokenizer
from bertembed.cli import app

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "The quick brown fox jumps over the lazy dog"


def run(*args: str):
    """The command line in this process: the result's exit_code, stdout and stderr, as a shell would see them."""
    return CliRunner().invoke(app, [str(a) for a in args])


def test_explain_table():
    done = run("explain", SENTENCE)
    assert done.exit_code == 0, done.output
    out = " ".join(done.stdout.split())  # rich wraps lines at the terminal's width
    assert "sentence-transformers/all-MiniLM-L6-v2" in out and "bundled" in out
    assert "--model bert-base-uncased" in out  # how to pick BERT itself
    for token in ("[CLS]", "quick", "jumps", "lazy", "[SEP]", "14523"):
        assert token in out
    diff = float(re.search(r"max \|diff\| = ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-5 and "is equal" in out


def test_explain_json_pair_matches_the_torch_layer():
    done = run("explain", "Who wrote it?", "Sinan did.", "--json")
    assert done.exit_code == 0, done.output
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
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["engine"] == "torch"


def test_a_cold_start_imports_neither_torch_nor_matplotlib():
    """In a fresh process: `import bertembed` loads its names and submodules (`bertembed.parallel`) on first use, and
    `bertembed explain`, table or JSON, runs the torch-free layer."""
    code = ("import sys\nimport bertembed\nprint('BARE', 'torch' in sys.modules)\nfrom bertembed.cli import main\n"
            "for args in (['The quick brown fox'], ['hello', '--json']):\n"
            "    sys.argv = ['bertembed', 'explain', *args]\n"
            "    try:\n        main()\n    except SystemExit as exit:\n        assert not exit.code, exit.code\n"
            "print('HEAVY', sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "BARE False" in done.stdout and "HEAVY []" in done.stdout and "[CLS]" in done.stdout, done.stdout


def test_bad_input_exits_2_without_traceback_in_a_shell():
    """`python -m bertembed` as a shell runs it: exit status 2 and the message on stderr, no traceback."""
    done = subprocess.run([sys.executable, "-m", "bertembed", "explain", ""], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "TEXT is empty" in done.stderr and "Traceback" not in done.stderr


def test_bad_input_exits_2_without_traceback(tmp_path):
    for args, message in [
        (["explain", ""], "TEXT is empty"),
        (["explain", "word " * 600], "positions"),
        (["explain", "hi", "--model", str(tmp_path / "missing")], "neither an existing file"),
        (["explain", "hi", "--model", str(tmp_path)], "has neither tokenizer.json nor vocab.txt"),
    ]:
        done = run(*args)
        assert done.exit_code == 2 and isinstance(done.exception, SystemExit), (args, done.output)
        assert message in done.stderr and "Traceback" not in done.output


def test_help_keeps_square_brackets():
    """rich reads help text as markup, where "[viz]" is a style tag and vanishes unless escaped."""
    for args, text in ((("inspect", "positions", "--help"), ".[viz]"),
                       (("inspect", "onehot", "--help"), "W[ids]")):
        done = run(*args)
        assert done.exit_code == 0, done.output
        assert text in done.stdout, args


def test_each_warning_prints_once(capsys, monkeypatch):
    """bertembed's warnings reach stderr; a library's that has its own handler (huggingface_hub's retries) is not
    printed a second time through a root handler of ours."""
    from bertembed.cli.app import user_errors

    monkeypatch.setattr(logging.getLogger("bertembed"), "handlers", [])  # (as in a fresh process: none of ours yet)
    library = logging.getLogger("library")
    monkeypatch.setattr(library, "handlers", [logging.StreamHandler()])  # (writes to this test's captured stderr)
    with user_errors():
        library.warning("retrying")
        logging.getLogger("bertembed.fast").warning("fell back")
    err = capsys.readouterr().err
    assert err.count("retrying") == 1 and err.count("fell back") == 1, err


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
        assert done.exit_code == 2, (args, done.output)
        assert "Traceback" not in done.output and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "longformer" in done.stderr and "supported: bert, roberta" in done.stderr


def test_version_and_the_commands_in_the_order_of_a_first_tour():
    """--version prints pyproject's version; --help lists the commands as the README tours them (explain first, bench
    last), not in the order their modules registered them (bench was first)."""
    import typer

    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    done = CliRunner().invoke(app, ["--version"])
    assert done.exit_code == 0 and done.output == f"bertembed {version}\n", done.output
    listed = re.findall(r"^│ ([a-z][a-z-]*) ", CliRunner().invoke(app, ["--help"]).output, re.M)
    assert listed == ["explain", "walkthrough", "notebook", "inspect", "drift", "finetune-demo", "export", "surgery",
                      "bench"]
    assert set(listed) == set(typer.main.get_command(app).commands)  # every command, each once
