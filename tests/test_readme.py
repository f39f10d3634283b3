"""README.md as written: every ```python snippet and every command of its code blocks and command tables runs, read
from the README itself. Names a snippet leaves undefined, and the placeholders of a command (SRC, TEXT, ...), are
small local stand-ins: a tiny checkpoint folder, a 1-rank gloo mesh, tmp paths. What cannot run here (installs, the
test suite itself, the minutes-long bench) is skipped with its reason. Also: every `bertembed.<name>` that README.md
and docs/*.md write resolves after a plain `import bertembed`.
"""

from __future__ import annotations

import ast
import builtins
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import bertembed
import conftest_explain as helpers
from bertembed.cli import app
from conftest import member_or_skip, write_member_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
tiny = helpers.tiny  # shared fixture
tiny_b = helpers.tiny_b  # shared fixture


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.M | re.S)


def commands() -> list[str]:
    """Each command the README writes, once: the `&&` steps of ```bash blocks, the `$ ` lines of ```text blocks, and
    the first column of its command tables (`\\|` unescaped)."""
    found = [step.strip() for block in blocks("bash") for line in block.splitlines() for step in line.split("&&")]
    found += [line[2:] for block in blocks("text") for line in block.splitlines() if line.startswith("$ ")]
    found += [c.replace("\\|", "|") for c in re.findall(r"^\| `(bertembed [^`]+)` \|", README, re.M)]
    return list(dict.fromkeys(found))


NOT_HERE = {  # first words -> why the command is not run here
    ("python3", "-m", "venv"): "makes a virtual environment: .ci/run runs the README's install line on a fresh machine",
    (".",): "activates that environment (.ci/run)", ("pip",): "installs from the package registry (.ci/run does)",
    ("python", "-m", "pytest"): "the test suite itself (.ci/run runs it)",
    ("bertembed", "bench"): "times transformers, torch.compile and ONNX Runtime for minutes; tests/test_bench.py runs "
                            "it on small shapes",
}
TEXTS = {"TEXT": "the cat sat", "TEXT_B": "a dog", "WORD": "king", "T": "the cat"}  # (words of the tiny vocabulary)
TAKES_MODEL = ("explain", "inspect", "finetune-demo", "walkthrough", "notebook")  # (given -m tiny, not the default)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A freshly initialised transformers BERT (every LayerNorm equal) saved with a tokenizer.json in BERT's style."""
    from bertembed.config import EmbeddingConfig

    model = member_or_skip("bert")
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.reset_parameters()
    folder = tmp_path_factory.mktemp("src")
    model.save_pretrained(folder)
    write_member_tokenizer(folder, EmbeddingConfig.from_hf_config(folder / "config.json"))
    return folder


def filled(command: str, tmp_path: Path, src: Path, tiny: Path, tiny_b: Path) -> tuple[list[str], list[Path]]:
    """(the arguments of `command` after `bertembed`: optional parts ([...]) given, the first of alternatives (a|b),
    placeholders replaced by stand-ins; the paths it should write)."""
    command = re.sub(r"([^|\s]+)(\|[^|\s]+)+", r"\1", re.sub(r"\[([^]]*)\]", r"\1", command))
    args = shlex.split(command)[1:]
    (tmp_path / "corpus.txt").write_text("the quick brown fox\nhello world\n")
    (tmp_path / "F").write_text("quick-fox\n")  # (new tokens the tokenizer spells in known pieces)
    outputs = {"DST": tmp_path / "dst", "DIR": tmp_path / "dir", "OUT": tmp_path / "model.onnx", "FILE": tmp_path /
               "report.html", "report.html": tmp_path / "report.html", "OUT.ipynb": tmp_path / "walkthrough.ipynb"}
    places = {"SRC": src, "M": src, "A": tiny, "B": tiny_b, "TOKEN...": "hello-world", "F": tmp_path / "F",
              "corpus.txt": tmp_path / "corpus.txt", **outputs, **TEXTS}
    if "--text-b" in args:  # (B: a text here, a checkpoint for drift)
        places["B"] = TEXTS["TEXT_B"]
    if args[0] in TAKES_MODEL and "-m" not in args:
        args += ["--model", str(tiny)]
    return [str(places.get(a, a)) for a in args], [outputs[a] for a in args if a in outputs]


@pytest.mark.parametrize("command", commands())
def test_readme_command(command, tmp_path, request):
    """The command exits 0 and writes the files it names, in process (CliRunner), on the stand-ins of `filled`."""
    words = tuple(command.split())
    reason = next((why for start, why in NOT_HERE.items() if words[:len(start)] == start), None)
    if reason:
        pytest.skip(f"not run here: {reason}")
    assert words[0] == "bertembed", f"a README command this test does not know how to run: {command}"
    src, tiny, (tiny_b, _) = (request.getfixturevalue(name) for name in ("src", "tiny", "tiny_b"))
    args, outputs = filled(command, tmp_path, src, tiny, tiny_b)
    done = CliRunner().invoke(app, args, env={"COLUMNS": "120", "BERTEMBED_CACHE": str(tmp_path / "cache")})
    assert done.exit_code == 0, (args, done.output)
    assert all(path.exists() for path in outputs), (args, done.output)


def test_readme_sample_output_is_what_explain_prints():
    """The ```text block's lines (all but those elided with ...) are in the output, numbers in e-notation aside."""
    block = blocks("text")[0]
    command, *shown = block.splitlines()
    done = CliRunner().invoke(app, shlex.split(command[2:])[1:], env={"COLUMNS": "120"})
    assert done.exit_code == 0, done.output

    def plain(text: str) -> str:
        return re.sub(r"\d\.\d+e-\d+", "N", " ".join(text.split()))

    for line in shown:
        assert "..." in line or plain(line) in plain(done.output), line


@pytest.fixture
def mesh(tmp_path):
    """A 1-rank gloo DeviceMesh, the process group destroyed afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def stand_ins(src: Path, tiny: Path, request) -> dict:
    """Name -> a maker of a small value, for the names README snippets leave undefined (made only where read)."""
    tables = ("word", "segment", "position", "ln_weight", "ln_bias")  # (the order of `BertEmbeddings.tables()`)
    return {"bertembed": lambda: bertembed, "path": lambda: src, "mesh": lambda: request.getfixturevalue("mesh"),
            "input_ids": lambda: torch.tensor([[2, 7, 9, 3], [2, 8, 3, 0]]),
            "layer": lambda: bertembed.BertEmbeddings.from_pretrained(tiny),
            "model": lambda: bertembed.patch(member_or_skip("bert")),
            **{name: lambda i=i: bertembed.BertEmbeddings.from_pretrained(tiny).tables()[i]
               for i, name in enumerate(tables)}}


def free_names(code: str) -> list[str]:
    """Names `code` reads but never binds (assignments, imports, definitions) and that are not builtins."""
    tree = ast.parse(code)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
              for a in n.names}
    read = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    return sorted({n for n in read if n not in bound and not hasattr(builtins, n)})


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_snippet(index, tmp_path, monkeypatch, src, tiny, request):
    code = blocks("python")[index]
    makers = stand_ins(src, tiny, request)
    unknown = [n for n in free_names(code) if n not in makers]
    assert not unknown, f"README snippet {index} reads {unknown}, which it does not define and this test has no " \
                        f"stand-in for"
    monkeypatch.chdir(tmp_path)  # (the snippets write files: my-embeddings/, embeddings.onnx)
    exec(compile(code, f"README.md python block {index}", "exec"), {n: makers[n]() for n in free_names(code)})


DOCUMENTED = sorted(set(re.findall(r"(?<![\w./])bertembed(?:\.\w+)+", " ".join(
    p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]))))


@pytest.mark.parametrize("dotted", DOCUMENTED)
def test_every_documented_name_resolves_after_a_plain_import(dotted, monkeypatch):
    """`bertembed.parallel.shard_vocab` and the like, as the docs write them: the package's attribute, not only after
    `import bertembed.parallel` (a submodule imported by an earlier test is taken off the package first)."""
    first, *rest = dotted.split(".")[1:]
    if f"bertembed.{first}" in sys.modules:
        monkeypatch.delattr(bertembed, first, raising=False)
    obj = getattr(bertembed, first)
    for part in rest:
        obj = getattr(obj, part)
