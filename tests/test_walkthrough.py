"""The layer rebuilt by hand (`bertembed walkthrough`, `bertembed notebook`): each step against the layer's own
intermediates, on the bundled BERT and on other members; the notebook run top to bottom in a real Jupyter kernel."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from bertembed import BertEmbeddings
from bertembed.cli import app
from bertembed.explain.walkthrough import check_walkthrough, walkthrough
from conftest import FAMILY, write_member_tokenizer

runner = CliRunner()


def test_every_step_on_the_bundled_model_matches_the_layer_where_it_should():
    result = walkthrough("The quick brown fox", "It was not amused.")
    assert [s.title[:2] for s in result.steps] == ["1.", "2.", "3a", "3b", "4.", "5.", "6.", "7."]
    by = {s.title[:2]: s for s in result.steps}
    for key in ("2.", "3a", "3b", "4.", "7."):  # the same operations as the layer's: bit for bit
        assert by[key].max_abs_diff == 0, by[key].check
    for key in ("5.", "6."):  # LayerNorm's kernel computes its statistics its own way
        assert 0 <= by[key].max_abs_diff < 1e-5
    assert by["1."].shape == [1, 12] and by["2."].shape == [1, 12, 384]
    assert any("[SEP] at 5 and 11" in note for note in by["2."].notes)
    assert not check_walkthrough(result)


@pytest.mark.parametrize("name", ["roberta", "distilbert", "albert", "deberta-v2-factorised", "modernbert"])
def test_the_walkthrough_follows_each_members_recipe(member_checkpoint, name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(member_checkpoint(name)[0], folder)
    config = BertEmbeddings.from_pretrained(folder).config
    write_member_tokenizer(folder, config)
    result = walkthrough("the quick brown fox", "hello world", folder)
    assert result.member == FAMILY[name][0] and not check_walkthrough(result)
    code = "\n".join(s.code for s in result.steps)
    assert ("cumsum" in code) == config.positions_from_padding
    assert ("no position table" in code) == (config.position_embedding_type == "none")
    assert ("no segment table" in code) == (config.type_vocab_size == 0)
    assert ("(word + position) + segment" in code) == (config.sum_order == "position_first")


def test_the_command_prints_each_step_and_its_check():
    done = runner.invoke(app, ["walkthrough", "The quick brown fox"])
    assert done.exit_code == 0, done.output
    for title in ("1. The ids and the tokens", "4. Their sum", "7. The layer's own output"):
        assert title in done.output
    assert done.output.count("bit for bit") >= 5 and "to float32 rounding" in done.output
    as_json = json.loads(runner.invoke(app, ["walkthrough", "The quick brown fox", "--json"]).output)
    assert len(as_json["steps"]) == 8 and as_json["member"] == "bert"
    bad = runner.invoke(app, ["walkthrough", "   "])
    assert bad.exit_code == 2 and "empty" in bad.output


def test_the_notebook_runs_top_to_bottom_in_a_jupyter_kernel(tmp_path):
    why = "the notebook is written with nbformat and run with nbclient in an ipykernel (the dev extra)"
    nbformat = pytest.importorskip("nbformat", reason=why)
    nbclient = pytest.importorskip("nbclient", reason=why)
    pytest.importorskip("ipykernel", reason=why)
    path = tmp_path / "walkthrough.ipynb"
    done = runner.invoke(app, ["notebook", str(path), "--text", "Who wrote it?"])
    assert done.exit_code == 0, done.output
    book = nbformat.read(path, as_version=4)
    assert sum(c.cell_type == "code" and "assert " in c.source for c in book.cells) >= 6
    nbclient.NotebookClient(book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                            ).execute()
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("text/html" in o.get("data", {}) for o in outputs)  # the figures' view
