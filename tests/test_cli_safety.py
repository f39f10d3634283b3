"""The command line never ends in a traceback for bad input, and never leaves a half-written folder behind.

Each broken checkpoint is a copy of the bundled model's folder with one file broken; each command must end with one
line, `error: ...` naming the problem, and exit status 2.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import conftest_explain as helpers
from bertembed.cli import app
from bertembed.explain import finetune
from bertembed.sources import bundled_folder

tiny = helpers.tiny  # shared fixture

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, pattern: str) -> None:
    """Exit status 2 and exactly one line of output, `error: ...`, matching `pattern`; no traceback."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert re.search(pattern, lines[0]), lines[0]


def bundled_copy(folder: Path) -> Path:
    """The bundled checkpoint's folder, its small files copied and its 90 MB weights linked (never written to)."""
    folder.mkdir()
    for path in bundled_folder().iterdir():
        if path.name == "model.safetensors":
            (folder / path.name).symlink_to(path)
        elif path.is_file():
            shutil.copy(path, folder / path.name)
    return folder


def _broken_tokenizer_json(folder: Path) -> None:
    (folder / "tokenizer.json").write_text("{not json")


def _vocab_not_utf8(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()  # so vocab.txt is read
    (folder / "vocab.txt").write_bytes((bundled_folder() / "vocab.txt").read_bytes() + "café\n".encode("latin-1"))


def _string_layer_norm_eps(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["layer_norm_eps"] = "1e-12"
    (folder / "config.json").write_text(json.dumps(config))


def _index_without_embeddings(folder: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    (folder / "model.safetensors").unlink()
    shard = "model-00001-of-00001.safetensors"
    save_file({"encoder.layer.0.output.dense.weight": np.zeros((2, 2), np.float32)}, str(folder / shard))
    index = {"metadata": {}, "weight_map": {"encoder.layer.0.output.dense.weight": shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _bin_of_non_tensors(folder: Path) -> None:
    import torch

    (folder / "model.safetensors").unlink()
    names = ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
             "LayerNorm.weight", "LayerNorm.bias")
    torch.save({f"embeddings.{n}": [[0.5, 0.25]] for n in names}, folder / "pytorch_model.bin")


@pytest.mark.parametrize("breaks, pattern", [
    (_broken_tokenizer_json, r"tokenizer\.json is not a readable tokenizer"),
    (_vocab_not_utf8, r"vocab\.txt is not a readable vocabulary .*UTF-8"),
    (_string_layer_norm_eps, r"layer_norm_eps"),
    (_index_without_embeddings, r"model\.safetensors\.index\.json|embedding"),
    (_bin_of_non_tensors, r"pytorch_model\.bin"),
])
@pytest.mark.parametrize("command", [["explain", "the cat sat"], ["inspect", "segments", "the cat sat"]])
def test_broken_checkpoint_is_one_line(tmp_path, breaks, pattern, command):
    folder = bundled_copy(tmp_path / "model")
    breaks(folder)
    assert_one_line_error(invoke(*command, "--model", folder), pattern)


@pytest.mark.parametrize("name", ["a" * 300, "/tmp/" + "b" * 300, "./" + "c" * 256 + "/model.safetensors"])
def test_model_name_too_long_for_a_file_name(name):
    for command in (["explain", "the cat"], ["inspect", "positions"]):
        assert_one_line_error(invoke(*command, "--model", name), r"[Ff]ile name too long")
    assert_one_line_error(invoke("drift", name, name), r"too long")


# --- finetune-demo --save: checked first, written whole or not at all ------------------------------------------

@pytest.fixture
def demo_must_not_run(monkeypatch):
    """The fine-tune itself fails the test if it starts: a bad --save must be refused before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the demo ran before --save was checked")

    monkeypatch.setattr(finetune, "_run", refuse)


def test_save_onto_a_file_fails_first(tiny, tmp_path, demo_must_not_run):
    target = tmp_path / "afile"
    target.write_text("keep me")
    assert_one_line_error(invoke("finetune-demo", "--model", tiny, "--steps", "1", "--save", target),
                          r"cannot save to .*afile: it is a file")
    assert target.read_text() == "keep me"


def test_save_under_a_file_fails_first(tiny, tmp_path, demo_must_not_run):
    (tmp_path / "afile").write_text("x")
    assert_one_line_error(invoke("finetune-demo", "--model", tiny, "--save", tmp_path / "afile" / "ft"),
                          r"afile is not an existing folder")


def test_save_where_no_folder_can_be_made_fails_first(tiny, demo_must_not_run):
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc, where nothing can be created even as root")
    assert_one_line_error(invoke("finetune-demo", "--model", tiny, "--save", "/proc/bertembed-ft"),
                          r"cannot save to /proc/bertembed-ft: No such file or directory")


def test_save_into_a_folder_with_files_fails_first(tiny, tmp_path, demo_must_not_run):
    (tmp_path / "ft").mkdir()
    (tmp_path / "ft" / "notes.txt").write_text("mine")
    assert_one_line_error(invoke("finetune-demo", "--model", tiny, "--save", tmp_path / "ft"),
                          r"the folder is not empty")
    assert [p.name for p in (tmp_path / "ft").iterdir()] == ["notes.txt"]


def test_save_name_too_long_fails_first(tiny, tmp_path, demo_must_not_run):
    assert_one_line_error(invoke("finetune-demo", "--model", tiny, "--save", tmp_path / ("f" * 300)),
                          r"cannot save to .*File name too long")


def _interrupt_while_writing(monkeypatch):
    """Ctrl-C in the middle of writing the weights, after the folder was made and some bytes reached the disk."""
    import bertembed.checkpoint

    def half_then_interrupt(staging):
        (Path(staging) / "model.safetensors").write_bytes(b"\0" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(bertembed.checkpoint, "checkpoint_writer", lambda layer, folder: half_then_interrupt)


def test_ctrl_c_during_save_leaves_nothing(tiny, tmp_path, monkeypatch):
    _interrupt_while_writing(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        finetune.finetune_demo(tiny, steps=1, sentences=helpers.TINY_SENTENCES, save=tmp_path / "ft")
    assert list(tmp_path.iterdir()) == []  # no folder, no partial folder, no temporary one
    result = invoke("finetune-demo", "--model", tiny, "--steps", "1", "--json", "--save", tmp_path / "ft")
    assert result.exit_code == 130, result.output  # typer's answer to Ctrl-C: 128 + SIGINT
    assert list(tmp_path.iterdir()) == []


def test_failure_after_the_weights_leaves_nothing(tiny, tmp_path, monkeypatch):
    """The weights are written, then copying the tokenizer fails (a full disk): no folder without its vocab.txt."""
    def disk_full(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(finetune.shutil, "copyfile", disk_full)
    assert_one_line_error(invoke("finetune-demo", "--model", tiny, "--steps", "1", "--json", "--save",
                                 tmp_path / "ft"), r"cannot save to .*ft: No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_save_into_an_empty_folder_writes_it_whole(tiny, tmp_path):
    import os

    from bertembed.embeddings import BertEmbeddings

    (tmp_path / "ft").mkdir()
    result = invoke("finetune-demo", "--model", tiny, "--steps", "1", "--json", "--save", tmp_path / "ft")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ft"]  # no temporary folder beside it
    assert {"config.json", "model.safetensors", "vocab.txt"} <= {p.name for p in (tmp_path / "ft").iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "ft").stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it, not mkdtemp's 0700
    assert BertEmbeddings.from_pretrained(tmp_path / "ft").config.vocab_size == len(helpers.VOCAB)


# --- optional packages: a missing one is one line naming its extra, before any work --------------------------------

# (command, the package made missing, the extra the message names, the call in bertembed that is the command's first
# work)
MISSING = [
    (["explain", "the cat", "--report", "{tmp}/r.html"], "plotly", "viz", "explain.decompose.explain_text"),
    (["explain", "the cat", "--plots", "{tmp}/figures"], "matplotlib", "viz", "explain.decompose.explain_text"),
    (["inspect", "positions", "--plot", "{tmp}/p.png"], "matplotlib", "viz", "explain.positions.analyze_positions"),
    (["inspect", "tokens", "king", "--plot", "{tmp}/p.png"], "matplotlib", "viz", "explain.tokens.load_layer"),
    (["drift", "{tiny}", "{tiny}", "--plot", "{tmp}/p.png"], "matplotlib", "viz", "explain.drift.load_layer"),
    (["notebook", "{tmp}/n.ipynb"], "nbformat", "notebook", "explain.walkthrough.notebook_cells"),
    (["export", "onnx", "{tmp}/e.onnx"], "onnx", "onnx", "onnx_export.check_opset"),
    (["export", "onnx", "{tmp}/e.onnx"], "onnxscript", "onnx", "onnx_export.check_opset"),
    (["export", "onnx", "{tmp}/e.onnx", "--fused"], "onnxscript", "onnx", "onnx_export.check_opset"),
]


@pytest.mark.parametrize("args, package, extra, work", MISSING)
def test_a_missing_optional_package_is_one_line_naming_its_extra_before_any_work(tiny, tmp_path, monkeypatch, args,
                                                                                   package, extra, work):
    import importlib

    def started(*args, **kwargs):
        raise AssertionError(f"{work} ran before {package} was found missing")

    module, name = work.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(f"bertembed.{module}"), name, started)
    monkeypatch.setitem(sys.modules, package, None)  # `import package` fails, as where it is not installed
    args = [a.format(tmp=tmp_path, tiny=tiny) for a in args]
    assert_one_line_error(invoke(*args, *(["--model", tiny] if args[0] in ("explain", "inspect", "notebook",
                                                                             "export") else [])),
                          rf'needs {package}, not installed here: pip install -e "\.\[{extra}\]" \(the {extra} extra; '
                          rf'"\.\[cli\]" installs what every command needs\)')
    assert list(tmp_path.iterdir()) == []
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()  # the extra named installs it, as cli does
    for listed in (extra, "cli"):
        assert re.search(rf'^{listed} = \[[^]]*"{package}>=', pyproject, re.M), (listed, package)


@pytest.mark.parametrize("command", [("export", "onnx", "{out}.onnx"), ("surgery", "extend-positions", "{tiny}",
                                                                         "{out}", "--to", "80")])
def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing(tiny, tmp_path, monkeypatch, command):
    """The disk fills up as the output is made durable: an error line naming the target and the reason (after the
    model line export prints first), exit 2, no file or folder left, not a traceback."""
    import os

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    args = [a.format(tiny=tiny, out=tmp_path / "out") for a in command]
    result = invoke(*args, *(["--model", tiny] if command[0] == "export" else []))
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert re.fullmatch(r"error: cannot save to .*out.*: No space left on device", lines[-1]), lines
    assert list(tmp_path.iterdir()) == []


def test_an_import_error_of_bertembeds_own_code_is_not_shown_as_bad_input():
    """A broken import inside bertembed ("cannot import name") printed as a one-line user error, exit status 2."""
    from bertembed.cli.app import user_errors

    with pytest.raises(ImportError, match="cannot import name"), user_errors():
        raise ImportError("cannot import name 'gone' from 'bertembed.sources'", name="bertembed.sources")
    with pytest.raises(SystemExit) as stopped, user_errors():  # (a missing optional package: said, exit status 2)
        raise ImportError("numba is not installed: pip install 'bertembed[fast]'")
    assert stopped.value.code == 2
