"""The fine-tune demo moves exactly the rows theory says: computed here from the tokenizer's output, not from the
demo's own bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import conftest_explain as helpers
from bertembed.explain.finetune import DEFAULT_RUNS, SENTENCES, RunSpec, finetune_demo
from bertembed.tokenizer import Tokenizer
from conftest_explain import TINY_SENTENCES, load_tables

tiny = helpers.tiny  # shared fixture


def theory(model, sentences) -> dict[str, set[int]]:
    """Rows with a non-zero gradient: what occurs at unpadded places, [PAD] (padding_idx) excluded."""
    enc = Tokenizer.from_pretrained(model)([s for s, _ in sentences])
    word, pos, seg = set(), set(), set()
    for ids, types, mask in zip(enc.input_ids, enc.token_type_ids, enc.attention_mask, strict=True):
        for p, (i, t, m) in enumerate(zip(ids, types, mask, strict=True)):
            if m:
                word.add(i)
                pos.add(p)
                seg.add(t)
    word.discard(0)
    return {"word": word, "position": pos, "segment": seg}


def moved(run) -> dict[str, set[int]]:
    return {t.table: set(t.moved_rows) for t in run.tables}


RUNS = (RunSpec("adam"), RunSpec("adamw", weight_decay=0.1), RunSpec("frozen", frozen=("word",)))


@pytest.fixture(scope="module")
def tiny_report(tiny):
    return finetune_demo(tiny, steps=4, lr=1e-2, runs=RUNS, sentences=TINY_SENTENCES)


def test_adam_moves_only_the_rows_that_occurred(tiny, tiny_report):
    expected = theory(tiny, TINY_SENTENCES)
    assert len(expected["position"]) < 16 and expected["segment"] == {0}  # some rows must stay put
    assert moved(tiny_report.runs[0]) == expected
    assert {k: set(v) for k, v in tiny_report.occurred.items()} == expected


def test_adamw_moves_every_nonzero_row(tiny, tiny_report):
    tables = load_tables(tiny)
    nonzero_words = set(np.flatnonzero((tables["word_embeddings.weight"] != 0).any(1).numpy()).tolist())
    assert 0 not in nonzero_words  # the tiny checkpoint's [PAD] row is zero: decay keeps it zero
    got = moved(tiny_report.runs[1])
    assert got["word"] == nonzero_words
    assert got["position"] == set(range(16)) and got["segment"] == {0, 1}


def test_frozen_table_does_not_move(tiny, tiny_report):
    expected = theory(tiny, TINY_SENTENCES)
    got = moved(tiny_report.runs[2])
    assert got["word"] == set()
    assert got["position"] == expected["position"] and got["segment"] == expected["segment"]
    assert all(t.moved == t.expected for run in tiny_report.runs for t in run.tables)


def test_demo_is_deterministic_and_learns(tiny, tiny_report):
    again = finetune_demo(tiny, steps=4, lr=1e-2, runs=RUNS, sentences=TINY_SENTENCES)
    for a, b in zip(tiny_report.runs, again.runs, strict=True):
        assert a.loss_last == b.loss_last
        assert all(np.array_equal(a.row_change[k], b.row_change[k]) for k in a.row_change)
    assert tiny_report.runs[0].loss_last < tiny_report.runs[0].loss_first
    assert all(p["requires_grad"] for p in tiny_report.trainable) and len(tiny_report.trainable) == 5


def test_bundled_demo_moves_the_rows_theory_says(tmp_path):
    calls = []
    report = finetune_demo(None, steps=2, progress=lambda run, step, steps: calls.append((run, step, steps)),
                           save=tmp_path / "ft")
    assert calls[-1] == (DEFAULT_RUNS[-1].name, 2, 2) and len(calls) == 2 * len(DEFAULT_RUNS)
    expected = theory(None, SENTENCES)
    adam, adamw, frozen = (moved(r) for r in report.runs)
    assert adam == expected and expected["segment"] == {0}
    assert adamw["word"] == set(range(30522))  # MiniLM's [PAD] row is not zero, so decay moves it too
    assert adamw["position"] == set(range(512)) and adamw["segment"] == {0, 1}
    assert frozen["word"] == set() and frozen["position"] == expected["position"]
    saved = load_tables(tmp_path / "ft")["word_embeddings.weight"]
    start = load_tables(Tokenizer.from_pretrained().source.folder)["word_embeddings.weight"]
    assert set(torch.nonzero((saved != start).any(1)).flatten().tolist()) == expected["word"]
    assert (tmp_path / "ft" / "vocab.txt").is_file()


@pytest.mark.parametrize("name", ["roberta", "modernbert"])
def test_the_positions_that_move_are_the_members_own(member_checkpoint, name, tmp_path):
    """RoBERTa counts positions from pad + 1: rows 2.. move, not 0.. (rows 9 and 10 moved past a line drawn at 8.5).
    ModernBERT has no position table: no figure of it, and no caption speaking of its positions or segments."""
    import shutil

    from bertembed import EmbeddingConfig
    from conftest import write_member_tokenizer

    folder = shutil.copytree(member_checkpoint(name)[0], tmp_path / name)
    config = EmbeddingConfig.from_hf_config(folder)
    write_member_tokenizer(folder, config)
    sentences = (("the quick brown fox jumps", 0), ("hello world", 1))
    report = finetune_demo(folder, steps=2, lr=1e-2, runs=RUNS[:1], sentences=sentences)
    figures = {f.name: f for f in report.figures()}
    if name == "modernbert":
        assert report.occurred["position"] == report.occurred["segment"] == [] and set(figures) == {"finetune_rows"}
        assert "positions" not in figures["finetune_rows"].caption
        return
    enc = Tokenizer.from_pretrained(folder)([s for s, _ in sentences])
    used = {config.pad_token_id + p for mask in enc.attention_mask for p in range(1, sum(mask) + 1)}
    assert min(used) == 2 and set(report.occurred["position"]) == used == moved(report.runs[0])["position"]
    assert f"position rows 2-{max(used)}" in figures["finetune_positions"].caption
