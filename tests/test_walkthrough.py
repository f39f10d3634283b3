"""The layer rebuilt by hand (`bertembed walkthrough`, `bertembed notebook`): each step against the member's own
transformers module (or, without transformers, the numpy reference), on the bundled BERT and on other members; the
notebook run top to bottom in a real Jupyter kernel."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from typer.testing import CliRunner

from bertembed import BertEmbeddings, Tokenizer
from bertembed.cli import app
from bertembed.explain.walkthrough import check_walkthrough, walkthrough
from conftest import FAMILY, write_member_tokenizer

runner = CliRunner()


def _firsts(step, columns: int = 4) -> list[list[float]]:
    """Every token's first values as a step shows them."""
    return [[row[f"[{j}]"] for j in range(columns)] for row in step.preview]


def test_every_step_on_the_bundled_model_matches_transformers_own_module(bundled_hf_embeddings):
    result = walkthrough("The quick brown fox", "It was not amused.")
    assert result.reference.startswith("transformers' BertEmbeddings")
    assert [s.title[:2] for s in result.steps] == ["1.", "2.", "3a", "3b", "4.", "5.", "6.", "7."]
    by = {s.title[:2]: s for s in result.steps}
    for key in ("2.", "3a", "3b", "4.", "7."):  # the same operations as transformers': bit for bit
        assert by[key].max_abs_diff == 0, by[key].check
    assert 0 <= by["6."].max_abs_diff < 1e-5  # LayerNorm's kernel computes its statistics its own way
    assert by["5."].max_abs_diff is None and "inside its kernel" in by["5."].check
    assert by["1."].shape == [1, 12] and by["2."].shape == [1, 12, 384]
    assert any("[SEP] at 5 and 11" in note for note in by["2."].notes)
    assert not check_walkthrough(result)
    # every token's rows, as transformers' own module of the checkpoint (loaded by transformers) gives them
    enc = Tokenizer.from_pretrained()("The quick brown fox", "It was not amused.", return_tensors="pt")
    with torch.no_grad():
        word = bundled_hf_embeddings.word_embeddings(enc.input_ids)
        output = bundled_hf_embeddings(input_ids=enc.input_ids, token_type_ids=enc.token_type_ids)
    assert [row["token"] for row in by["2."].preview] == result.tokens and len(result.tokens) == 12
    assert _firsts(by["2."]) == word[0, :, :4].tolist() and _firsts(by["7."]) == output[0, :, :4].tolist()


def test_a_bug_in_bertembeds_layer_fails_the_walkthrough(monkeypatch):
    """The layer's output is checked against transformers, not against the layer's own intermediates, which share
    its code (and its bugs)."""
    normalised = BertEmbeddings._normalised

    def shifted(self, *rows):
        total, out = normalised(self, *rows)
        return total, out + 1e-3

    monkeypatch.setattr(BertEmbeddings, "_normalised", shifted)
    assert check_walkthrough(walkthrough("The quick brown fox")) == ["7. The layer's own output"]


def test_without_transformers_the_numpy_reference_checks_each_step_and_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # (import transformers: ImportError)
    result = walkthrough("The quick brown fox", "It was not amused.")
    assert result.reference.startswith("the numpy reference") and not check_walkthrough(result)
    by = {s.title[:2]: s for s in result.steps}
    for key in ("2.", "3a", "3b", "4."):
        assert by[key].max_abs_diff == 0, by[key].check
    for key in ("5.", "6.", "7."):  # (the numpy reference computes LayerNorm's statistics in float64)
        assert by[key].max_abs_diff < 1e-5
    done = runner.invoke(app, ["walkthrough", "The quick brown fox"])
    assert done.exit_code == 0 and "checked against the numpy reference" in " ".join(done.output.split())


@pytest.mark.parametrize("name", ["roberta", "distilbert", "albert", "deberta-v2-factorised", "modernbert"])
def test_the_walkthrough_follows_each_members_recipe(member_checkpoint, name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(member_checkpoint(name)[0], folder)
    config = BertEmbeddings.from_pretrained(folder).config
    write_member_tokenizer(folder, config)
    result = walkthrough("the quick brown fox", "hello world", folder)
    assert result.member == FAMILY[name][0] and not check_walkthrough(result)
    hf = member_checkpoint(name)[1].embeddings.eval()
    assert result.reference.startswith(f"transformers' {type(hf).__name__}")
    by = {s.title[:2]: s for s in result.steps}
    has = {"3a": config.position_embedding_type != "none", "3b": config.type_vocab_size > 0}
    for key in ("2.", "3a", "3b", "4."):  # every table the member has, and their sum, checked: bit for bit
        assert by[key].max_abs_diff == (0 if has.get(key, True) else None), by[key].check
    # E != H (DeBERTa): the rows and their sum at E, then the projection to H, checked and shown
    assert by["2."].shape[-1] == by["4."].shape[-1] == config.table_width
    assert ("4b" in by) == (config.projection == "before_norm")
    enc = Tokenizer.from_pretrained(folder)("the quick brown fox", "hello world", return_tensors="pt")
    types = {"token_type_ids": enc.token_type_ids} if config.type_vocab_size else {}
    with torch.no_grad():  # transformers' own module, as its model holds it
        output = hf(input_ids=enc.input_ids, **types)
    torch.testing.assert_close(torch.tensor(_firsts(by["7."])), output[0, :, :4], rtol=0, atol=1e-6)
    if "4b" in by:
        with torch.no_grad():
            total = hf.word_embeddings(enc.input_ids) + hf.position_embeddings(torch.arange(len(enc.tokens))[None])
            total = total + hf.token_type_embeddings(enc.token_type_ids)
        torch.testing.assert_close(torch.tensor(_firsts(by["4."])), total[0, :, :4], rtol=0, atol=1e-7)
        assert by["4b"].shape[-1] == config.hidden_size and by["4b"].max_abs_diff < 1e-6
    code = "\n".join(s.code for s in result.steps)
    assert ("cumsum" in code) == config.positions_from_padding
    assert ("no position table" in code) == (config.position_embedding_type == "none")
    assert ("no segment table" in code) == (config.type_vocab_size == 0)
    assert ("(word + position) + segment" in code) == (config.sum_order == "position_first")
    # each step's words true of the member (they were BERT's: two segment rows, a position table, a bias, H wide)
    assert ("No position table" in by["3a"].why) == (config.position_embedding_type == "none")
    assert ("0 for text A, 1 for text B" in by["3b"].why) == (config.type_vocab_size == 2)
    assert f"over its {config.output_width} features" in by["5."].why
    assert ("beta are learned" in by["6."].why) == config.norm_bias
    assert ("`layer.project`" in by["7."].why) == (config.projection == "output")


def test_the_command_prints_each_step_and_its_check():
    done = runner.invoke(app, ["walkthrough", "The quick brown fox"])
    assert done.exit_code == 0, done.output
    for title in ("1. The ids and the tokens", "4. Their sum", "7. The layer's own output"):
        assert title in done.output
    assert done.output.count("bit for bit") >= 5 and "to float32 rounding" in done.output
    assert "checked against transformers' BertEmbeddings" in " ".join(done.output.split())
    as_json = json.loads(runner.invoke(app, ["walkthrough", "The quick brown fox", "--json"]).output)
    assert len(as_json["steps"]) == 8 and as_json["member"] == "bert"
    bad = runner.invoke(app, ["walkthrough", "   "])
    assert bad.exit_code == 2 and "empty" in bad.output


def test_the_command_shows_every_tokens_rows_or_rows_n():
    """The seeds' sentence is 11 tokens: each of the 8 steps' tables shows them all, down to "dog" and [SEP]."""
    def rows_of(token: str, *args: str) -> int:
        done = runner.invoke(app, ["walkthrough", "The quick brown fox jumps over the lazy dog", *args])
        assert done.exit_code == 0, done.output
        return sum(line.startswith(f"│ {token} ") for line in done.output.splitlines())

    assert rows_of("dog") == 8 and rows_of("[SEP]") == 8
    assert rows_of("dog", "--rows", "3") == 0 and rows_of("quick", "--rows", "3") == 8


def test_the_walkthrough_warns_on_a_literal_separator():
    text = "Who wrote it? [SEP] Sinan did."
    result = walkthrough(text)
    assert "[SEP]" in result.tokens[1:-1] and {row["type"] for row in result.steps[0].preview} == {0}
    assert "literal [SEP]" in result.warning and "segment A" in result.warning
    assert walkthrough("Who wrote it?", "Sinan did.").warning is None
    done = runner.invoke(app, ["walkthrough", text])
    assert "warning: text A holds a literal [SEP]" in " ".join(done.output.split())


def test_the_notebook_runs_top_to_bottom_in_a_jupyter_kernel(tmp_path):
    why = "the notebook is written with nbformat and run with nbclient in an ipykernel (the dev extra)"
    nbformat = pytest.importorskip("nbformat", reason=why)
    nbclient = pytest.importorskip("nbclient", reason=why)
    pytest.importorskip("ipykernel", reason=why)
    path = tmp_path / "walkthrough.ipynb"
    done = runner.invoke(app, ["notebook", str(path), "--text", "Who wrote it?", "--text-b", "Sinan did."])
    assert done.exit_code == 0, done.output
    book = nbformat.read(path, as_version=4)
    assert "text, text_b = 'Who wrote it?', 'Sinan did.'" in book.cells[1].source
    assert sum(c.cell_type == "code" and "assert " in c.source for c in book.cells) >= 6
    nbclient.NotebookClient(book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                            ).execute()
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("text/html" in o.get("data", {}) for o in outputs)  # the figures' view
    assert any("transformers' BertEmbeddings" in o.get("text", "") for o in outputs)  # what it was checked against


def test_a_notebook_names_a_relative_model_folder_absolutely(tmp_path, monkeypatch):
    """Jupyter runs a notebook from the notebook's folder: a folder given relative to the shell's would not be found
    there (it became a hub id, and failed offline)."""
    nbformat = pytest.importorskip("nbformat", reason="the notebook is written with nbformat (the dev extra)")
    from bertembed.sources import bundled_folder

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    relative = os.path.relpath(bundled_folder(), tmp_path / "work")
    done = runner.invoke(app, ["notebook", str(tmp_path / "n.ipynb"), "--model", relative])
    assert done.exit_code == 0, done.output
    setup = nbformat.read(tmp_path / "n.ipynb", as_version=4).cells[1].source
    assert f"MODEL = {str(bundled_folder().resolve())!r}" in setup
