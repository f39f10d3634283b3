"""The explain, inspect, finetune-demo and drift commands: output, JSON, files written, and bad input (a message and
exit status 2, no traceback, no half-written file)."""

from __future__ import annotations

import json
import os
import re

import matplotlib.image as mpimg
import pytest
from typer.testing import CliRunner

import conftest_explain as helpers
from bertembed import Tokenizer
from bertembed.cli import app

tiny = helpers.tiny  # shared fixture
tiny_b = helpers.tiny_b  # shared fixture

runner = CliRunner()
LATIN1 = os.fsdecode(b"caf\xe9")  # "café" in Latin-1, as Python decodes it from a command line: "caf\udce9"
UTF8 = r"^error: %s is not valid UTF-8: byte 0xE9 at character 3; give UTF-8 text"


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, pattern: str) -> None:
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and re.search(pattern, text), text
    assert isinstance(result.exception, SystemExit)


def test_inspect_positions_json(tiny):
    result = invoke("inspect", "positions", "--model", tiny, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)["summary"]
    assert summary["positions"] == 16 and summary["verdict"]


def test_inspect_tokens_table_and_plot(tiny, tmp_path):
    result = invoke("inspect", "tokens", "king", "--model", tiny, "-k", "3", "--plot", tmp_path / "t.png")
    assert result.exit_code == 0, result.output
    assert "verdict" not in result.output and "[PAD]" in result.output
    image = mpimg.imread(tmp_path / "t.png")
    assert image.shape[0] > 400 and image.std() > 0.05  # two figures stacked, not blank


def test_inspect_segments_and_onehot(tiny):
    result = invoke("inspect", "segments", "the cat sat", "--model", tiny)
    assert result.exit_code == 0 and "not zeros and ones" in " ".join(result.output.split())
    data = json.loads(invoke("inspect", "onehot", "the cat sat", "--model", tiny, "--json").output)
    assert data["summary"]["equal"] is True and data["summary"]["max_abs_diff"] == 0.0


def test_inspect_segments_prints_a_pair_whose_tokens_look_like_markup():
    """`[ cat ]` gives the tokens [/A cat/A ]/A: escaped one by one, rich read the span as a closing tag and failed."""
    result = invoke("inspect", "segments", "the [ cat ] sat", "--text-b", "down")
    assert result.exit_code == 0, result.output
    assert "[CLS]/A the/A [/A cat/A ]/A sat/A [SEP]/A down/B [SEP]/B" in result.output


def test_finetune_demo_and_drift(tiny, tmp_path):
    result = invoke("finetune-demo", "--model", tiny, "--steps", "2", "--json", "--save", tmp_path / "ft")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    assert {(r["run"], r["table"]) for r in rows if r["moved"] == r["rows"]} >= {
        ("AdamW, weight decay 0.01", "position"), ("AdamW, weight decay 0.01", "segment")}
    assert all(r["moved"] == r["expected"] for r in rows)
    drift = json.loads(invoke("drift", tiny, tmp_path / "ft", "--json").output)
    by_table = {r["table"]: r for r in drift["rows"]}
    assert by_table["word"]["rows_changed"] == next(r["moved"] for r in rows if r["table"] == "word")


def test_drift_table_output(tiny, tiny_b):
    result = invoke("drift", tiny, tiny_b[0])
    assert result.exit_code == 0, result.output
    assert "cat (7)" in result.output and "pos 3" in result.output
    # one line per tensor in 120 columns (the lists of most-changed rows wrapped every row into many), then the lists
    table = result.output.split("drift per tensor")[1].split("└")[0]
    body = [line for line in table.splitlines() if line.startswith("│")]
    assert [line.split("│")[1].strip() for line in body] == ["word", "position", "segment", "LayerNorm.weight",
                                                             "LayerNorm.bias"]
    assert max(len(line) for line in result.output.splitlines()) <= 120
    assert "word, most changed rows: cat (7)" in " ".join(result.output.split())


@pytest.mark.parametrize("args, title", [
    (["inspect", "positions"], "Why don't the learned positions look like sin/cos?"),
    (["inspect", "segments"], "What are segment embeddings: zeros and ones?"),
    (["inspect", "tokens", "king"], "What is in the word table?"),
    (["inspect", "onehot", "the cat"], "Is nn.Embedding a one-hot matrix product?"),
])
def test_tables_are_titled_with_the_question_they_answer_not_a_class_name(tiny, args, title):
    output = invoke(*args, "--model", tiny).output
    assert title in " ".join(output.split()) and "Report" not in output, output


def test_explain_report_and_plots(tiny, tmp_path):
    report, plots = tmp_path / "r.html", tmp_path / "figs"
    result = invoke("explain", "the cat sat", "a dog", "--model", tiny, "--report", report, "--plots", plots,
                    "--finetune")
    assert result.exit_code == 0, result.output
    from plotly.offline import get_plotlyjs

    page = report.read_text()
    assert page.count(get_plotlyjs()) == 1  # inlined once; the rest of the page is ours:
    page = page.replace(get_plotlyjs(), "")
    assert page.count("<img") == len(re.findall(r'<img alt="[^"]*" src="data:image/png;base64,', page))
    assert page.count("<img") + page.count('class="plotly-graph-div"') == 13
    assert not re.search(r"(src|href)=\"(https?:|//)", page) and "<link" not in page and "<script src" not in page
    assert "@import" not in page and "url(" not in page
    assert "<th>word norm</th>" in page and not re.findall(r"<th>[^<]*_[^<]*</th>", page)  # headers as people read
    assert len(list(plots.glob("*.png"))) == 13
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs", "r.html"]  # no temporary files left


def test_the_reader_chooses_the_word_and_asks_for_the_projector(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("BERTEMBED_CACHE", str(tmp_path / "cache"))
    report = tmp_path / "r.html"
    result = invoke("explain", "the cat sat", "--model", tiny, "--report", report, "--token", "king", "--projector")
    assert result.exit_code == 0, result.output
    page = report.read_text()
    assert "&#x27;king&#x27; is row 19" in page and page.count('id="word_map_search"') == 1
    assert len(list((tmp_path / "cache").glob("neighbours-*.npz"))) == 1
    for flag in (["--token", "king"], ["--projector"]):
        assert_user_error(invoke("explain", "the cat", "--model", tiny, *flag), f"{flag[0]} adds")


def test_the_fine_tune_runs_only_when_asked(tiny, tmp_path):
    """--report without --finetune leaves the seconds-long demo out (its two figures with it)."""
    report = tmp_path / "r.html"
    result = invoke("explain", "the cat sat", "--model", tiny, "--report", report)
    assert result.exit_code == 0, result.output
    page = report.read_text()
    assert page.count("<img") + page.count('class="plotly-graph-div"') == 11
    assert "Fine-tuning moves the tables" not in page
    assert_user_error(invoke("explain", "the cat", "--model", tiny, "--finetune"), "--finetune adds the fine-tune")


@pytest.mark.parametrize("args, pattern", [
    (["explain", "   "], "TEXT is empty"),
    (["explain", "the cat " * 10], "positions"),  # 22 tokens, the tiny table has 16 rows
    (["inspect", "onehot", ""], "empty"),
    (["inspect", "segments", ""], "empty"),
    (["explain", "\x00\x01"], r"TEXT has no tokens.*U\+0000, U\+0001.*\[CLS\] \[SEP\] alone"),
    (["explain", "\ufeff"], r"TEXT has no tokens.*U\+FEFF"),
    (["explain", "the cat", " \u200b\u200c\u2060 "], r"TEXT_B has no tokens.*U\+200B, U\+200C, U\+2060"),
    (["inspect", "segments", "\u200b \x00"], "the text has no tokens"),
    (["inspect", "onehot", "\t\u2060\x7f"], "the text has no tokens"),
    (["inspect", "tokens", "\u200b"], "not in the vocabulary"),
    (["inspect", "tokens", "cat zebra"], r"not in the vocabulary: the tokenizer gives \['cat', '\[UNK\]'\]"),
    (["walkthrough", "the cat", "\u200b"], r"text_b has no tokens.*U\+200B"),
    # a Latin-1 argument, as Python hands it over (os.fsdecode): one message from every command, never a TypeError
    (["explain", LATIN1], UTF8 % "TEXT"),
    (["explain", "the cat", LATIN1], UTF8 % "TEXT_B"),
    (["inspect", "segments", LATIN1], UTF8 % "the text"),
    (["inspect", "segments", "the cat", "--text-b", LATIN1], UTF8 % "text_b"),
    (["inspect", "onehot", LATIN1], UTF8 % "the text"),
    (["inspect", "tokens", LATIN1], UTF8 % "the token"),
    (["walkthrough", LATIN1], UTF8 % "the text"),
    # longer than the 16 positions: refused, not cut to fit (walkthrough truncated; segments took the pair whole)
    (["walkthrough", "the cat " * 10], "22 tokens with its special tokens, but the model has 16 positions"),
    (["walkthrough", "the cat", "sat " * 14], "19 tokens with its special tokens, but the model has 16 positions"),
    (["inspect", "segments", "the cat", "--text-b", "sat " * 14], "19 tokens .* 16 positions"),
])
def test_bad_text_is_a_clear_error(tiny, args, pattern):
    assert_user_error(invoke(*args, "--model", tiny), pattern)


@pytest.mark.parametrize("text, pattern", [(LATIN1, UTF8 % "the text"), ("\u200b\x00", "the text has no tokens"),
                                           ("the cat " * 10, "22 tokens .* 16 positions")])
def test_notebook_refuses_a_text_the_layer_cannot_take_before_writing(tiny, tmp_path, text, pattern):
    """As every other command does: the notebook's cells would fail, or cut the text, where these are written."""
    assert_user_error(invoke("notebook", tmp_path / "n.ipynb", "--text", text, "--model", tiny), pattern)
    assert list(tmp_path.iterdir()) == []


def test_inspect_tokens_refuses_a_text_of_many_pieces_before_any_search(tiny, monkeypatch):
    """The bound is on the pieces the tokenizer gives (each one a search of the whole word table); the message names
    the count, the limit and why, and no neighbour search starts."""
    from bertembed.explain import tokens

    def searched(*args):
        raise AssertionError("a neighbour search started")

    monkeypatch.setattr(tokens, "row_norms", searched)  # (the search's first step: the word table's norms)
    text = "the cat sat " * 6  # 18 pieces of the tiny vocabulary
    assert len(Tokenizer.from_pretrained(tiny)(text, truncation=False).input_ids) == 18 + 2
    assert_user_error(invoke("inspect", "tokens", text, "--model", tiny),
                      r"splits into 18 tokens, over the limit of 16 \(MAX_PIECES\): each token's neighbours are a "
                      r"search of the whole word table")
    monkeypatch.undo()
    assert len(tokens.analyze_tokens("the cat sat", tiny).pieces) == 3  # (a few words still pass)


@pytest.mark.parametrize("target, pattern", [
    ("missing/r.html", "does not exist"),
    (".", "is a folder"),
    ("afile/r.html", "afile is a file, not a folder"),
])
def test_bad_report_path_fails_before_any_work(tiny, tmp_path, target, pattern):
    (tmp_path / "afile").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_user_error(invoke("explain", "the cat", "--model", tiny, "--report", tmp_path / target), pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_report_that_cannot_be_saved_leaves_no_figures_behind(tiny, tmp_path, monkeypatch):
    """A full disk (or root's /proc, past the early check) fails the report's save: --plots is written after it."""
    import os

    from bertembed import atomic

    def full(tmp, target):
        if str(target).endswith(".html"):
            raise OSError(28, os.strerror(28), str(target))
        return replace(tmp, target)

    replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", full)
    result = invoke("explain", "the cat", "--model", tiny, "--plots", tmp_path / "p", "--report", tmp_path / "r.html")
    assert result.exit_code == 2 and "cannot save to" in result.output and "No space left" in result.output
    assert not (tmp_path / "p").exists() and not (tmp_path / "r.html").exists()


def test_too_long_text_leaves_no_report_and_no_plots_folder(tiny, tmp_path):
    assert_user_error(invoke("explain", "the cat " * 10, "--model", tiny, "--report", tmp_path / "r.html", "--plots",
                             tmp_path / "figs" / "new"), "16 positions")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target, pattern", [("afile", "afile: that is a file"),
                                             ("afile/figs", "afile/figs: .*afile is a file")])
def test_a_plots_folder_under_a_file_is_refused_before_any_work(tiny, tmp_path, target, pattern):
    (tmp_path / "afile").write_text("x")
    assert_user_error(invoke("explain", "the cat", "--model", tiny, "--plots", tmp_path / target), pattern)
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_a_plots_folder_through_a_dangling_link_is_refused(tiny, tmp_path):
    """A link to nothing, named or on the way: a message and exit 2, not a traceback after the work."""
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert_user_error(invoke("explain", "the cat", "--model", tiny, "--plots", tmp_path / "link"),
                      r"link: a link to .*nowhere, which does not exist")
    assert_user_error(invoke("explain", "the cat", "--model", tiny, "--plots", tmp_path / "link" / "figs"),
                      r"link/figs: cannot create the folder \(File exists\)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_a_plot_of_a_table_the_member_lacks_says_nothing_was_written(member_checkpoint, tmp_path):
    """ModernBERT has no position table (transformers' module has none): the command succeeds, and says that the
    PNG it was asked for is not written, in text and in JSON."""
    folder, model = member_checkpoint("modernbert")
    assert getattr(model.embeddings, "position_embeddings", None) is None
    for extra in ((), ("--json",)):
        result = invoke("inspect", "positions", "--model", folder, "--plot", tmp_path / "p.png", *extra)
        assert result.exit_code == 0, result.output
        assert f"nothing written to {tmp_path / 'p.png'}" in "".join(result.output.split("\n"))
        assert not (tmp_path / "p.png").exists()


def test_failure_while_rendering_leaves_no_report(tiny, tmp_path, monkeypatch):
    from bertembed.explain import report

    def broken(figure, interactive=False):
        raise ValueError("figure failed on purpose")

    monkeypatch.setattr(report, "figure_html", broken)
    assert_user_error(invoke("explain", "the cat", "--model", tiny, "--report", tmp_path / "r.html"),
                      "on purpose")
    assert list(tmp_path.iterdir()) == []


def test_bad_checkpoints_for_drift(tiny, tmp_path):
    from bertembed.config import EmbeddingConfig
    from bertembed.embeddings import BertEmbeddings

    BertEmbeddings(EmbeddingConfig(vocab_size=29, hidden_size=12, max_position_embeddings=16)).save_pretrained(
        tmp_path / "wide")
    assert_user_error(invoke("drift", tiny, tmp_path / "wide"), r"different shapes")
    assert_user_error(invoke("drift", tiny, tmp_path / "nowhere"), r"neither an existing file or folder")
    assert_user_error(invoke("inspect", "positions", "--model", tiny, "--plot", tmp_path / "no" / "p.png"),
                      "does not exist")


def test_bracketed_tokens_survive_rich_markup():
    result = invoke("inspect", "tokens", "king", "-k", "3")
    assert result.exit_code == 0, result.output
    assert "[unusedN]" in result.output and "[MASK] (id 103)" in " ".join(result.output.split())


@pytest.mark.parametrize("args", [
    ["inspect", "positions", "--k", "0"], ["inspect", "positions", "-k", "-1"],
    ["inspect", "tokens", "king", "--k", "0"], ["inspect", "tokens", "king", "--k", "-1"],
    ["finetune-demo", "--steps", "0"], ["finetune-demo", "--steps", "-1"],
])
def test_counts_below_one_are_usage_errors(tiny, args):
    result = invoke(*args, "--model", tiny, "--json")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert re.search(r"greater than or equal to 1|not in the range x>=1", " ".join(result.output.split())), \
        result.output


def test_drift_top_below_zero_is_a_usage_error(tiny):
    result = invoke("drift", tiny, tiny, "--top", "-1")
    assert result.exit_code == 2, result.output
    assert re.search(r"greater than or equal to 0|not in the range x>=0", " ".join(result.output.split()))
    assert invoke("drift", tiny, tiny, "--top", "0", "--json").exit_code == 0  # listing no rows is a fair request


def _with_non_finite(tiny, folder):
    """A copy of the tiny checkpoint with NaN in word row 7 ("cat") and inf in LayerNorm.bias[2]."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["embeddings.word_embeddings.weight"][7, 3] = float("nan")
    tensors["embeddings.LayerNorm.bias"][2] = float("inf")
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_drift_json_is_strict_json_and_the_table_warns(tiny, tmp_path):
    broken = _with_non_finite(tiny, tmp_path / "nan")
    result = invoke("drift", tiny, broken, "--json")
    assert result.exit_code == 0, result.output
    data = _strict_json(result.output)
    rows = {r["table"]: r for r in data["rows"]}
    assert rows["word"]["relative_change"] is None and rows["LayerNorm.bias"]["max_abs_change"] is None
    assert rows["position"]["relative_change"] == 0.0
    assert "word of B" in data["summary"]["warning"]
    table = " ".join(invoke("drift", tiny, broken).output.split())
    assert re.search(r"warning: NaN or inf values in word of B \(.*\) at row\(s\) 7 of 29", table), table


def test_explain_json_is_strict_json_when_the_tables_hold_nan(tiny, tmp_path):
    result = invoke("explain", "the cat", "--model", _with_non_finite(tiny, tmp_path / "nan"), "--json")
    assert result.exit_code == 0, result.output
    data = _strict_json(result.output)
    cat = next(t for t in data["tokens"] if t["token"] == "cat")
    assert cat["word_norm"] is None and data["max_abs_diff"] is None
    the = next(t for t in data["tokens"] if t["token"] == "the")
    assert the["word_norm"] > 0  # a row without NaN keeps its number


def test_onehot_of_a_text_longer_than_the_positions_is_refused_at_once():
    result = invoke("inspect", "onehot", "word " * 600)  # the bundled model: 602 tokens, 512 positions
    assert_user_error(result, r"602 tokens with its special tokens, but the model has 512 positions")


def test_the_report_says_what_it_measured_and_which_questions_it_answers(tmp_path):
    """On the bundled model: the title names it and says it is not bert-base-uncased, an introduction lists the
    questions, every section carries its claim's tag, measures read as words, and the page carries no test code."""
    report = tmp_path / "r.html"
    result = invoke("explain", "The quick brown fox", "--report", report)
    assert result.exit_code == 0, result.output
    page = report.read_text()
    title = re.search(r"<h1>(.*?)</h1>", page).group(1)
    assert "all-MiniLM-L6-v2" in title and "not bert-base-uncased" in title
    assert "Each section below answers one question" in page
    for question in ("Why don&#x27;t the learned positions look like sin/cos?", "Is nn.Embedding a one-hot matrix "
                     "product?", "What are segment embeddings: zeros and ones?"):
        assert page.count(question) == 2  # in the list of questions and as its section's title
    assert page.count('class="tag"') == 5 and "holds for every checkpoint of this architecture" in page
    assert "image-check" not in page and "data-test" not in page
    tables = "".join(re.findall(r"<table>.*?</table>", page))
    assert "mean adjacent cosine" in tables and "mean_adjacent_cosine" not in tables


@pytest.mark.parametrize("args", [("inspect", "positions"), ("inspect", "segments"), ("inspect", "tokens", "king"),
                                  ("inspect", "onehot", "I am Sinan"), ("walkthrough", "The fox")])
def test_every_command_names_the_checkpoint_it_measured(args):
    output = " ".join(invoke(*args).output.split())
    assert "all-MiniLM-L6-v2" in output and "not bert-base-uncased" in output


@pytest.mark.parametrize("name, recipe", [
    ("bert", "LayerNorm(word + segment + position)"),
    ("distilbert", "LayerNorm(word + position)"),
    ("deberta-v3", "LayerNorm(word)"),
    ("deberta-v2-factorised", "LayerNorm((word + position + segment) @ projection)"),
])
def test_the_explain_table_is_the_members_own(member_checkpoint, tmp_path, name, recipe):
    """Title and check line name the member's recipe; a part whose table the member lacks has no column (no |s| of
    zeros for DeBERTa v3), in the table and in --json. The reference: which tables transformers' own module has."""
    import shutil

    from bertembed import BertEmbeddings
    from conftest import write_member_tokenizer

    folder, model = member_checkpoint(name)
    shutil.copytree(folder, tmp_path / name)
    write_member_tokenizer(tmp_path / name, BertEmbeddings.from_pretrained(folder).config)
    has = [part for part, table in (("position", "position_embeddings"), ("segment", "token_type_embeddings"))
           if getattr(model.embeddings, table, None) is not None]
    output = invoke("explain", "the quick fox", "--model", tmp_path / name).output
    header = next(line for line in output.splitlines() if "token" in line and "|out|" in line)
    assert f"{recipe}, one row per token" in output and f"check: {recipe} by hand" in " ".join(output.split())
    assert [h.strip() for h in header.split("┃")[1:-1]] == ["pos", "token", "id", *["seg"] * ("segment" in has), "|w|",
                                                          *(f"|{part[0]}|" for part in has), "mean", "std", "|out|"]
    token = json.loads(invoke("explain", "the quick fox", "--model", tmp_path / name, "--json").output)["tokens"][1]
    assert {k for k in token if k.endswith(("_norm", "_share")) and k != "output_norm"} == {
        f"{part}_{kind}" for part in ("word", *has) for kind in ("norm", "share")}


def test_explain_warns_on_a_literal_separator_in_the_table_the_json_and_the_report():
    """Seed 000's misconception: a literal [SEP] becomes the separator token, but the text stays one segment."""
    from bertembed.explain.report import report_html, run_analyses

    text = "Who wrote it? [SEP] Sinan did."
    output = " ".join(invoke("explain", text).output.split())
    assert "warning: text A holds a literal [SEP]" in output and "stays in segment A" in output
    data = json.loads(invoke("explain", text, "--json").output)
    tokens = [row["token"] for row in data["tokens"]]
    assert "[SEP]" in tokens[1:-1] and {row["segment"] for row in data["tokens"]} == {0}  # what the warning says
    assert "literal [SEP]" in data["warning"]
    assert json.loads(invoke("explain", "Who wrote it?", "Sinan did.", "--json").output)["warning"] is None
    results = run_analyses(text)
    page = report_html(results)
    assert page.count("<b>warning:</b> text A holds a literal [SEP]") == 2  # the decomposition's and the segments'


@pytest.mark.parametrize("args, tag", [
    (["inspect", "onehot", "the cat"], "holds for every checkpoint of this architecture"),
    (["inspect", "positions"], "measured on this checkpoint"),
    (["inspect", "tokens", "king"], "measured on this checkpoint"),
    (["explain", "the cat"], "holds for every checkpoint of this architecture"),
])
def test_each_answer_says_whether_it_holds_for_every_bert_or_this_checkpoint(tiny, args, tag):
    assert f"({tag})" in " ".join(invoke(*args, "--model", tiny).output.split())


def test_drift_refuses_two_members_of_equal_shapes(tmp_path):
    """DeBERTa v1 and v2 tables of the same shapes: drift compared them as one architecture's."""
    from conftest import member_or_skip

    for name, model_type in (("a", "deberta"), ("b", "deberta-v2")):
        member_or_skip("deberta" if name == "a" else "deberta-v3").save_pretrained(tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["model_type"] == model_type
    assert_user_error(invoke("drift", tmp_path / "a", tmp_path / "b"), "a deberta checkpoint and .* a deberta-v2 one")


def test_a_narrow_terminal_folds_the_token_table_rather_than_cutting_it(monkeypatch):
    """At 60 columns the token column had no width and numbers were cut to "1.…"."""
    from bertembed.cli.app import console

    monkeypatch.setattr(console, "width", 60)  # (the console is made at import; COLUMNS=60 in a terminal)
    result = invoke("explain", "internationalization")
    assert result.exit_code == 0 and "…" not in result.output, result.output
    folded = "".join(line.split("│")[2].strip() for line in result.output.splitlines() if line.count("│") > 3)
    assert "##ization" in folded or "ization" in folded, result.output
