"""Surgery on whole checkpoints (`bertembed surgery ...`), checked against transformers: DST loads with
`from_pretrained` with no missing or unexpected keys, gives the original model's outputs where it should, and
transformers' own `resize_token_embeddings` draws the same rows. Every failure leaves SRC as it was and no DST."""

from __future__ import annotations

import errno
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bertembed.config import EmbeddingConfig
from conftest import hub_cache, make_member, member_or_skip, write_member_tokenizer

transformers = pytest.importorskip("transformers", reason="the surgery's results are checked with transformers")


def _loaded(folder: Path, head: str = "AutoModel"):
    model, info = getattr(transformers, head).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _source(tmp_path: Path, name: str, head: str = "AutoModel", shard: str | None = None):
    """A member's checkpoint written by transformers (sharded with `shard`), with a tokenizer in its style."""
    model = member_or_skip(name, head=head)
    folder = tmp_path / f"src-{name}"
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    write_member_tokenizer(folder, EmbeddingConfig.from_hf_config(folder / "config.json"))
    return folder, model


def _run(*args: str):
    from typer.testing import CliRunner

    from bertembed.cli import app

    return CliRunner().invoke(app, ["surgery", *map(str, args)])


@pytest.mark.parametrize("name", ["bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "mpnet",
                                  "deberta-v2-factorised"])
def test_extend_positions_loads_in_transformers_and_keeps_short_outputs(tmp_path, name):
    from bertembed.checkpoint_surgery import extend_positions_checkpoint

    src, original = _source(tmp_path, name, shard="20KB")  # (several shards in, one file out)
    assert (src / "model.safetensors.index.json").is_file()
    before = _snapshot(src)
    reserved = 2 if name in ("roberta", "xlm-roberta", "mpnet") else 0
    usable = original.config.max_position_embeddings - reserved
    extend_positions_checkpoint(src, tmp_path / "dst", 2 * usable + 3)
    assert _snapshot(src) == before
    extended = _loaded(tmp_path / "dst")
    assert extended.config.max_position_embeddings == reserved + 2 * usable + 3  # transformers' count
    ids = torch.randint(5, 100, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(extended(ids)[0], original(ids)[0], rtol=0, atol=0)
        assert extended(torch.randint(5, 100, (1, 2 * usable + 3)))[0].shape[1] == 2 * usable + 3
    assert json.loads((tmp_path / "dst" / "tokenizer_config.json").read_text())["model_max_length"] == 2 * usable + 3


@pytest.mark.parametrize("method", ["copy", "interpolate", "repeat_last", "sinusoidal"])
def test_the_bundled_model_extended_to_1024_by_every_method(tmp_path, bundled_path, method):
    from bertembed import BertEmbeddings, Tokenizer

    result = _run("extend-positions", bundled_path, tmp_path / "long", "--to", "1024", "--method", method, "--json")
    assert result.exit_code == 0, result.output
    long = _loaded(tmp_path / "long")
    original = _loaded(bundled_path)
    expected = BertEmbeddings.from_pretrained(bundled_path).extend_positions(1024, method)  # the layer's surgery
    torch.testing.assert_close(long.embeddings.position_embeddings.weight, expected.position_embeddings.weight,
                               rtol=0, atol=0)
    ids = torch.randint(1000, 2000, (2, 16))
    with torch.no_grad():
        if method != "interpolate":  # (interpolate moves the old rows, by design)
            torch.testing.assert_close(long(ids).last_hidden_state, original(ids).last_hidden_state, rtol=0, atol=0)
        assert long(torch.randint(1000, 2000, (1, 1024))).last_hidden_state.shape == (1, 1024, 384)
    assert Tokenizer.from_pretrained(tmp_path / "long").max_length == 1024
    assert sorted(os.listdir(tmp_path / "long")) == sorted(os.listdir(bundled_path))  # every file carried


def test_add_tokens_matches_transformers_resize_and_the_tokenizer_gives_the_new_ids(tmp_path):
    src, original = _source(tmp_path, "bert", head="AutoModelForMaskedLM")
    assert original.config.tie_word_embeddings
    # transformers before 4.46 drew new rows from normal(0, initializer_range) only: compare that there
    mean = "mean_resizing" in inspect.signature(original.resize_token_embeddings).parameters
    result = _run("add-tokens", src, tmp_path / "dst", "newword", "another", "--init", "mean" if mean else "normal",
                  "--seed", "7")
    assert result.exit_code == 0, result.output
    grown = _loaded(tmp_path / "dst", "AutoModelForMaskedLM")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "dst")
    assert tokenizer("newword another the")["input_ids"][1:3] == [120, 121]  # ids after the old tokenizer's last
    torch.manual_seed(7)
    original.resize_token_embeddings(122)  # transformers' own resize: the same draws after the same manual_seed
    torch.testing.assert_close(grown.bert.embeddings.word_embeddings.weight,
                               original.bert.embeddings.word_embeddings.weight, rtol=0, atol=0)
    assert grown.cls.predictions.decoder.weight.data_ptr() == grown.bert.embeddings.word_embeddings.weight.data_ptr()
    torch.testing.assert_close(grown.cls.predictions.bias, original.cls.predictions.bias, rtol=0, atol=0)
    ids = torch.randint(5, 100, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(grown(ids).logits, original(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_add_tokens_starts_a_row_at_the_mean_of_its_pieces(tmp_path, tied):
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = make_member("bert", head="AutoModelForMaskedLM").config
    config.tie_word_embeddings = tied
    model = transformers.BertForMaskedLM(config).eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{f"p{i}": i for i in range(4, 120)}, "un": 50,
             "##break": 60, "##able": 70}
    vocab = {t: i for t, i in vocab.items() if not (t.startswith("p") and i in (50, 60, 70))}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.save(str(src / "tokenizer.json"))
    result = _run("add-tokens", src, tmp_path / "dst", "unbreakable", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["pieces"] == {"unbreakable": [50, 60, 70]}
    grown = _loaded(tmp_path / "dst", "AutoModelForMaskedLM")
    table = model.bert.embeddings.word_embeddings.weight.detach().double()
    torch.testing.assert_close(grown.bert.embeddings.word_embeddings.weight[120].double(),
                               table[[50, 60, 70]].mean(0), rtol=0, atol=1e-7)
    decoder = model.cls.predictions.decoder.weight.detach().double()
    torch.testing.assert_close(grown.cls.predictions.decoder.weight[120].double(), decoder[[50, 60, 70]].mean(0),
                               rtol=0, atol=1e-7)
    assert grown.cls.predictions.bias[120] == 0


def _trained_tokenizer(folder: Path, corpus: list[str], kind: str) -> None:
    """A tokenizer trained on `corpus` (byte-level BPE as RoBERTa's, or Unigram as XLM-R's), RoBERTa's specials at
    RoBERTa's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    if kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:40])
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=specials, unk_token="<unk>")
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("name", ["bert", "roberta", "xlm-roberta"])
def test_prune_vocab_keeps_the_corpus_outputs(tmp_path, name):
    corpus = ["the quick brown fox jumps", "over the lazy dog", "a sentence to embed", "quickly foxes jumped"]
    src, original = _source(tmp_path, name, head="AutoModelForMaskedLM")
    if name != "bert":  # a trained BPE (its merges must keep building the corpus' tokens) or Unigram
        _trained_tokenizer(src, corpus * 5, "bpe" if name == "roberta" else "unigram")
    (tmp_path / "corpus.txt").write_text("\n".join(corpus[:3]) + "\n")
    result = _run("prune-vocab", src, tmp_path / "dst", "--keep-from", tmp_path / "corpus.txt", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    pruned = _loaded(tmp_path / "dst", "AutoModelForMaskedLM")
    old_tok = transformers.AutoTokenizer.from_pretrained(src)
    new_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "dst")
    assert report["rows_after"] == pruned.config.vocab_size < report["rows_before"]
    for line in corpus[:3]:
        old, new = old_tok(line, return_tensors="pt"), new_tok(line, return_tensors="pt")
        assert old_tok.convert_ids_to_tokens(old.input_ids[0]) == new_tok.convert_ids_to_tokens(new.input_ids[0])
        kept = [old_tok.convert_tokens_to_ids(t) for t in new_tok.convert_ids_to_tokens(range(report["rows_after"]))]
        with torch.no_grad():
            after, before = pruned(**new, output_hidden_states=True), original(**old, output_hidden_states=True)
        torch.testing.assert_close(after.hidden_states[-1], before.hidden_states[-1], rtol=0, atol=0)
        # (the decoder's matmul over fewer rows may block its sums otherwise: float32 rounding)
        torch.testing.assert_close(after.logits, before.logits[..., kept], rtol=1e-6, atol=1e-6)


def test_prune_vocab_to_a_target_size_from_several_files_and_a_folder(tmp_path):
    """--target-size keeps the N tokens the corpus uses most (counted here with transformers' tokenizer of SRC) among
    those used --min-frequency times, from every file of a folder and a file; DST gives SRC's outputs on the texts
    made only of kept tokens; the held-out text's unknown shares are those transformers' tokenizers give."""
    from collections import Counter

    corpus = ["the dog and the fox", "the lazy dog", "a quick brown fox", "the fox jumps over the dog", "the dog"]
    held = ["the dog and the fox jumps", "a zebra quietly yawns", "the lazy fox", "the fox of the dog"]
    src, original = _source(tmp_path, "xlm-roberta", head="AutoModelForMaskedLM")
    _trained_tokenizer(src, (corpus + held) * 5, "unigram")
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("\n".join(corpus[:2]) + "\n\n")
    (tmp_path / "corpus" / "sub" / "b.txt").write_text("\r\n".join(corpus[2:4]) + "\r\n")
    (tmp_path / "corpus" / ".notes").write_text("quietly yawns\n" * 9)  # (hidden: not read)
    (tmp_path / "more.txt").write_text(corpus[4])
    (tmp_path / "held.txt").write_text("\n".join(held) + "\n")
    result = _run("prune-vocab", src, tmp_path / "dst", "--keep-from", tmp_path / "corpus", "--keep-from",
                  tmp_path / "more.txt", "--target-size", "9", "--min-frequency", "2", "--held-out",
                  tmp_path / "held.txt", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    old_tok = transformers.AutoTokenizer.from_pretrained(src)
    new_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "dst")
    specials = set(old_tok.all_special_ids)
    counts = Counter(i for line in corpus for i in old_tok(line, add_special_tokens=False).input_ids)
    often = sorted((i for i, n in counts.items() if n >= 2 and i not in specials), key=lambda i: (-counts[i], i))
    kept = [old_tok.convert_tokens_to_ids(t) for t in new_tok.convert_ids_to_tokens(range(report["rows_after"]))]
    assert kept == sorted(specials | set(often[:9])) and len(often) > 9 and len(counts) > len(often)
    assert report["corpus_lines"] == 5 and report["corpus_tokens"] == sum(counts.values())
    from safetensors.torch import load_file

    written = load_file(tmp_path / "dst" / "model.safetensors").values()
    assert report["parameters_after"] == sum(t.numel() for t in written if t.is_floating_point())
    assert report["bytes_after"] == sum(t.nbytes for t in written) < report["bytes_before"]
    pruned = _loaded(tmp_path / "dst", "AutoModelForMaskedLM")
    only_kept = [line for line in corpus + held if set(old_tok(line).input_ids) <= set(kept)]
    assert len(only_kept) >= 2, only_kept
    for line in only_kept:
        old, new = old_tok(line, return_tensors="pt"), new_tok(line, return_tensors="pt")
        with torch.no_grad():
            after, before = pruned(**new, output_hidden_states=True), original(**old, output_hidden_states=True)
        torch.testing.assert_close(after.hidden_states[-1], before.hidden_states[-1], rtol=0, atol=0)
        torch.testing.assert_close(after.logits, before.logits[..., kept], rtol=1e-6, atol=1e-6)
    for tok, when in ((old_tok, "before"), (new_tok, "after")):
        ids = [i for line in held for i in tok(line, add_special_tokens=False).input_ids]
        assert report[f"held_out_unknown_{when}"] == ids.count(tok.unk_token_id) / len(ids)
    assert report["held_out_unknown_before"] == 0 < report["held_out_unknown_after"]


def test_a_corpus_is_read_as_a_stream_of_batches(tmp_path):
    from bertembed.vocab_surgery import text_batches, text_files

    (tmp_path / "a.txt").write_text("one\n\ntwo\nthree\n")
    (tmp_path / "b.txt").write_text("four\nfive")
    seen = []
    batches = list(text_batches(text_files(tmp_path, "corpus", ""), "corpus", "", lambda *a: seen.append(a), size=8))
    assert batches == [["one", "two"], ["three", "four"], ["five"]]
    assert seen == [(9, 24), (20, 24), (24, 24)]  # (bytes read, of 15 + 9)


def test_prune_vocab_of_the_bundled_model(tmp_path, bundled_path):
    (tmp_path / "corpus.txt").write_text("The quick brown fox jumps over the lazy dog\nUnbelievable, isn't it?\n")
    from bertembed.vocab_surgery import prune_vocab_checkpoint

    report = prune_vocab_checkpoint(bundled_path, tmp_path / "dst", tmp_path / "corpus.txt")
    assert report["rows_before"] == 30522 and report["rows_after"] < 40
    assert report["bytes_saved"] == (30522 - report["rows_after"]) * 384 * 4
    original, pruned = _loaded(bundled_path), _loaded(tmp_path / "dst")
    old_tok = transformers.AutoTokenizer.from_pretrained(bundled_path)
    new_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "dst")
    for line in ("Unbelievable, isn't it?", "the lazy fox"):
        with torch.no_grad():
            torch.testing.assert_close(pruned(**new_tok(line, return_tensors="pt")).last_hidden_state,
                                       original(**old_tok(line, return_tensors="pt")).last_hidden_state,
                                       rtol=0, atol=0)


def test_bad_input_is_refused_clearly_and_src_is_untouched(tmp_path, bundled_path):
    src, _ = _source(tmp_path, "bert")
    before = _snapshot(src)
    (tmp_path / "exists").mkdir()
    (tmp_path / "corpus.txt").write_text("the dog\n")
    (tmp_path / "link").symlink_to(src)
    cases = {
        ("extend-positions", src, tmp_path / "a", "--to", "20"): "must be an integer above the 40 positions",
        ("extend-positions", src, tmp_path / "a", "--to", "100", "--method", "interpolate"): "whole multiple",
        ("extend-positions", src, tmp_path / "a", "--to", "80", "--method", "spline"): "not one of",
        ("extend-positions", src, tmp_path / "exists", "--to", "80"): "already exists",
        ("extend-positions", src, src / "inner", "--to", "80"): "inside the source checkpoint",
        ("extend-positions", src, tmp_path / "link" / "inner", "--to", "80"): "inside the source checkpoint",
        ("extend-positions", src / "model.safetensors", tmp_path / "a", "--to", "80"): "single weights file",
        ("add-tokens", src, tmp_path / "a", "the"): "has every token already",
        ("add-tokens", src, tmp_path / "a"): "no tokens given",
        ("add-tokens", src, tmp_path / "a", "x", "--init", "zeros"): "not one of",
        ("add-tokens", src, tmp_path / "a", "Newword"): "normalizes {'Newword': 'newword'}",
        ("prune-vocab", src, tmp_path / "a", "--keep-from", tmp_path / "nope.txt"): "corpus",
        ("prune-vocab", src, tmp_path / "a", "--keep-from", src, "--target-size", "0"): "--target-size",
    }
    for args, message in cases.items():
        result = _run(*args)
        assert result.exit_code == 2 and message in " ".join(result.output.split()), (args, result.output)
    modernbert = make_member("modernbert")
    if modernbert is not None:
        modernbert.save_pretrained(tmp_path / "modernbert")
        result = _run("extend-positions", tmp_path / "modernbert", tmp_path / "a", "--to", "80")
        assert result.exit_code == 2 and "no position table" in result.output
    assert _snapshot(src) == before and not (tmp_path / "a").exists()


@pytest.mark.parametrize("init", ["mean", "normal"])
def test_add_tokens_draws_the_same_rows_on_every_run_and_seed_chooses_them(tmp_path, init):
    """The command drew other rows on each run; --seed (0 by default) seeds them (the rows transformers draws after
    torch.manual_seed(seed): test_add_tokens_matches_transformers_resize_and_the_tokenizer_gives_the_new_ids)."""
    src, _ = _source(tmp_path, "bert")
    runs = {}
    for name, seed in [("first", []), ("again", []), ("seed 0", ["--seed", "0"]), ("seed 5", ["--seed", "5"])]:
        result = _run("add-tokens", src, tmp_path / name, "newword", "--init", init, *seed)
        assert result.exit_code == 0, result.output
        runs[name] = _snapshot(tmp_path / name)
    assert runs["first"] == runs["again"] == runs["seed 0"] != runs["seed 5"]


@pytest.mark.parametrize("bad", ["missing", "a folder", "a link to nothing", "latin-1"])
def test_a_token_or_corpus_file_that_cannot_be_read_is_named(tmp_path, bad):
    """A missing --file printed a bare `[Errno 2]`, a file in Latin-1 only the codec's complaint."""
    src, _ = _source(tmp_path, "bert")
    path = tmp_path / "tokens.txt"
    if bad == "a folder":
        path.mkdir()
    elif bad == "a link to nothing":
        path.symlink_to("nothing.txt")
    elif bad == "latin-1":
        path.write_bytes("caf\u00e9\n".encode("latin-1"))
    for args, what in ((["add-tokens", "--file"], "--file"), (["prune-vocab", "--keep-from"], "corpus")):
        result = _run(args[0], src, tmp_path / "dst", args[1], path)
        message = " ".join(result.output.split())
        assert result.exit_code == 2 and f"{what} {path}" in message and "[Errno" not in message, message
        assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("broken", ["special_tokens_map.json", "tokenizer.json"])
def test_a_src_file_that_links_to_nothing_is_refused_by_name(tmp_path, broken):
    """A hub snapshot whose blob was deleted: the copy of SRC's files ended in a traceback."""
    src, _ = _source(tmp_path, "bert")
    (src / broken).unlink(missing_ok=True)
    (src / broken).symlink_to(f"../blobs/{broken}")
    result = _run("extend-positions", src, tmp_path / "dst", "--to", "80")
    assert result.exit_code == 2 and f"{broken} is a link to ../blobs/{broken}, which does not exist" in \
        " ".join(result.output.split()), result.output
    assert not (tmp_path / "dst").exists()


def test_a_dst_under_a_file_is_refused_before_any_work(tmp_path, monkeypatch):
    src, _ = _source(tmp_path, "bert")
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr("bertembed.checkpoint_surgery.BertEmbeddings", None)  # (reading SRC would fail the test)
    result = _run("extend-positions", src, tmp_path / "afile" / "dst", "--to", "80")
    assert result.exit_code == 2 and f"{tmp_path / 'afile'} is a file, not a folder" in \
        " ".join(result.output.split()), result.output


def test_a_dst_that_cannot_be_written_leaves_nothing(tmp_path, monkeypatch):
    src, _ = _source(tmp_path, "bert")
    before = _snapshot(src)
    original_mkdir = Path.mkdir

    def read_only_parent(self, *args, **kwargs):
        if self.name.startswith(".dst.tmp-"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return original_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only_parent)
    result = _run("extend-positions", src, tmp_path / "dst", "--to", "80")
    assert result.exit_code == 2 and f"{tmp_path} refuses new files" in " ".join(result.output.split())
    assert _snapshot(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src-bert"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_parent_is_refused_before_any_work(tmp_path):
    src, _ = _source(tmp_path, "bert")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    result = _run("extend-positions", src, locked / "dst", "--to", "80")
    assert result.exit_code == 2 and "is not writable" in result.output


def test_a_hub_id_from_the_cache_offline(tmp_path, bundled_path, hub_home):
    """SRC as a hub id: its whole snapshot is read from huggingface_hub's cache, offline."""
    hub_cache(tmp_path / "home", "acme/mini-bert", bundled_path)
    hub_home(tmp_path / "home")
    result = _run("extend-positions", "acme/mini-bert", tmp_path / "long", "--to", "1024")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path / "long")) == sorted(os.listdir(bundled_path))
    assert _loaded(tmp_path / "long").config.max_position_embeddings == 1024


def test_a_tied_bin_checkpoint_keeps_its_word_table(tmp_path):
    """A `.bin` whose MLM decoder shares the word table's memory (older saves): DST has both tensors, and transformers
    loads it whole (the save would otherwise keep one name of the two, the decoder's)."""
    model = member_or_skip("roberta", head="AutoModelForMaskedLM")
    src = tmp_path / "src"
    model.save_pretrained(src)
    (src / "model.safetensors").unlink()
    state = model.state_dict()
    assert state["lm_head.decoder.weight"].data_ptr() == state["roberta.embeddings.word_embeddings.weight"].data_ptr()
    torch.save(state, src / "pytorch_model.bin")
    result = _run("extend-positions", src, tmp_path / "dst", "--to", "80")
    assert result.exit_code == 0, result.output
    from safetensors import safe_open

    with safe_open(str(tmp_path / "dst" / "model.safetensors"), "pt") as written:
        assert {"roberta.embeddings.word_embeddings.weight", "lm_head.decoder.weight"} <= set(written.keys())
    ids = torch.randint(5, 100, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(_loaded(tmp_path / "dst", "AutoModelForMaskedLM")(ids).logits, model(ids).logits,
                                   rtol=0, atol=0)


def test_copies_in_other_formats_are_left_out_and_added_tokens_json_follows(tmp_path):
    src, _ = _source(tmp_path, "bert")
    (src / "onnx").mkdir()
    (src / "onnx" / "model.onnx").write_bytes(b"old tables")
    (src / "tf_model.h5").write_bytes(b"old tables")
    (src / "added_tokens.json").write_text(json.dumps({"extra": 119}))
    (tmp_path / "corpus.txt").write_text("the dog\n")
    result = _run("add-tokens", src, tmp_path / "grown", "newword", "--init", "mean", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["dropped_files"] == ["onnx", "tf_model.h5"]
    assert not (tmp_path / "grown" / "onnx").exists() and not (tmp_path / "grown" / "tf_model.h5").exists()
    assert json.loads((tmp_path / "grown" / "added_tokens.json").read_text()) == {"extra": 119, "newword": 120}
    result = _run("prune-vocab", src, tmp_path / "pruned", "--keep-from", tmp_path / "corpus.txt")
    assert result.exit_code == 0 and "left out of DST" in result.output and "tf_model.h5" in result.output
    assert json.loads((tmp_path / "pruned" / "added_tokens.json").read_text()) == {}  # (119 is not in the corpus)


def test_the_commands_import_only_what_they_need(tmp_path, bundled_path):
    """Each command took 18-30 s on a busy machine, most of it imports no surgery needs: the layer built on the meta
    device drew random tables there (importing torch._dynamo and sympy), and the save imported torch.distributed."""
    (tmp_path / "corpus.txt").write_text("the lazy dog\n")
    runs = [["extend-positions", bundled_path, tmp_path / "a", "--to", "1024"],
            ["add-tokens", bundled_path, tmp_path / "b", "newword"],
            ["prune-vocab", bundled_path, tmp_path / "c", "--keep-from", tmp_path / "corpus.txt"]]
    code = ("import sys\nfrom bertembed.cli import main\n"
            f"for args in {[['surgery', *map(str, run)] for run in runs]!r}:\n"
            "    sys.argv = ['bertembed', *args]\n"
            "    try:\n        main()\n    except SystemExit as exit:\n        assert not exit.code, exit.code\n"
            "print('HEAVY', sorted(m for m in ('torch._dynamo', 'sympy', 'torch.distributed.tensor', 'transformers')"
            " if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout and all((tmp_path / name).is_dir() for name in "abc"), done.stdout


def test_new_rows_drawn_for_a_tied_bin_checkpoint_stay_tied(tmp_path):
    """--init mean draws the new rows at random: a `.bin` holding the tied decoder under its own name gets the same
    rows in both, so transformers (4 or 5) loads the model tied (5 unties two tensors that differ)."""
    src, model = _source(tmp_path, "roberta", head="AutoModelForMaskedLM")
    (src / "model.safetensors").unlink()
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    result = _run("add-tokens", src, tmp_path / "dst", "quokka", "--init", "mean")
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    written = load_file(tmp_path / "dst" / "model.safetensors")
    word, decoder = written["roberta.embeddings.word_embeddings.weight"], written["lm_head.decoder.weight"]
    assert word.shape[0] == model.config.vocab_size + 1 and torch.equal(word, decoder)
    grown = _loaded(tmp_path / "dst", "AutoModelForMaskedLM")
    assert grown.get_output_embeddings().weight.data_ptr() == grown.get_input_embeddings().weight.data_ptr()


def test_pruning_keeps_the_ids_below_a_roberta_pad(tmp_path):
    """RoBERTa's positions count from the pad's id: an unused id below it pruned would renumber the pad and shift
    every position of every text. The ids up to the pad stay, and the hidden states are the source's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    model = member_or_skip("roberta", head="AutoModelForMaskedLM", pad_token_id=4)
    src = tmp_path / "src"
    model.save_pretrained(src)
    words = ["<s>", "</s>", "<unk>", "unused", "<pad>", *(f"w{i}" for i in range(5, model.config.vocab_size))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.RobertaProcessing(("</s>", 1), ("<s>", 0))
    backend.add_special_tokens(["<s>", "</s>", "<unk>", "<pad>"])
    backend.save(str(src / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("w7 w9 w11\nw9 w20\n")
    result = _run("prune-vocab", src, tmp_path / "dst", "--keep-from", tmp_path / "corpus.txt", "--json")
    assert result.exit_code == 0, result.output
    pruned = _loaded(tmp_path / "dst", "AutoModelForMaskedLM")
    assert pruned.config.pad_token_id == 4 and json.loads(result.output)["rows_after"] == 5 + 4
    new = Tokenizer.from_file(str(tmp_path / "dst" / "tokenizer.json"))
    text = "w7 w9 w11 w20"
    ids, new_ids = backend.encode(text).ids, new.encode(text).ids
    with torch.no_grad():
        before = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        after = pruned(torch.tensor([new_ids]), output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_the_other_formats_weight_shards_are_left_out_and_named(tmp_path):
    """A hub repo with sharded safetensors and sharded .bin: the .bin shards (the old tables) were copied, unnamed."""
    src, model = _source(tmp_path, "bert", shard="20KB")
    state = {k: v.clone() for k, v in model.state_dict().items()}  # (transformers 5 writes no .bin: written here)
    bins = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json"]
    halves = [dict(list(state.items())[:5]), dict(list(state.items())[5:])]
    for name, half in zip(bins, halves, strict=False):  # (the third: the index)
        torch.save(half, src / name)
    (src / bins[2]).write_text(json.dumps({"weight_map": {k: bins[i] for i in (0, 1) for k in halves[i]}}))
    result = _run("extend-positions", src, tmp_path / "dst", "--to", "80", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["dropped_files"] == [n for n in bins if n != "pytorch_model.bin.index.json"]
    assert not list((tmp_path / "dst").glob("pytorch_model*"))
    _loaded(tmp_path / "dst")


def test_a_byte_order_mark_is_not_part_of_the_first_token(tmp_path):
    src, _ = _source(tmp_path, "bert")
    (tmp_path / "tokens.txt").write_bytes("\ufeffnewword\nother\n".encode())  # (as Windows Notepad saves UTF-8)
    result = _run("add-tokens", src, tmp_path / "dst", "--file", tmp_path / "tokens.txt", "--init", "mean", "--json")
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(result.output)["added"]) == ["newword", "other"]


def test_an_empty_held_out_text_is_refused_before_the_corpus_is_read(tmp_path):
    src, _ = _source(tmp_path, "bert")
    (tmp_path / "corpus.txt").write_text("the dog\n")
    (tmp_path / "held.txt").write_text("\n  \n")
    result = _run("prune-vocab", src, tmp_path / "dst", "--keep-from", tmp_path / "corpus.txt", "--held-out",
                  tmp_path / "held.txt")
    assert result.exit_code == 2 and "has no text: nothing to measure" in " ".join(result.output.split())
    assert not (tmp_path / "dst").exists()


def test_a_link_to_nothing_in_a_subfolder_is_refused_by_name(tmp_path):
    """sentence-transformers' 1_Pooling/config.json, its blob deleted: the error listed the staging folder."""
    src, _ = _source(tmp_path, "bert")
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").symlink_to("../../blobs/pooling")
    result = _run("extend-positions", src, tmp_path / "dst", "--to", "80")
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "config.json is a link to ../../blobs/pooling, which does not exist" in message
    assert ".tmp-" not in message and not (tmp_path / "dst").exists()


def test_a_sinusoidal_table_is_extended_by_its_formula_only(tmp_path):
    from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings

    src, _ = _source(tmp_path, "distilbert-sinusoidal")
    result = _run("extend-positions", src, tmp_path / "copied", "--to", "80")
    assert result.exit_code == 2 and "use method 'sinusoidal'" in " ".join(result.output.split())
    assert _run("extend-positions", src, tmp_path / "dst", "--to", "80", "--method", "sinusoidal").exit_code == 0
    expected = torch.empty(80, 30)
    create_sinusoidal_embeddings(80, 30, expected)
    table = _loaded(tmp_path / "dst").embeddings.position_embeddings.weight
    torch.testing.assert_close(table, expected, rtol=0, atol=1e-6)


def test_new_rows_are_not_the_unknown_tokens_row(tmp_path):
    """A token the old tokenizer spells only as [UNK]: `--init pieces` copied [UNK]'s row."""
    src, _ = _source(tmp_path, "bert")
    result = _run("add-tokens", src, tmp_path / "dst", "\u2603\u2603", "--init", "pieces")
    assert result.exit_code == 2 and "no piece but the unknown token" in " ".join(result.output.split())
    assert not (tmp_path / "dst").exists()


def test_deberta_log_buckets_keep_short_outputs_after_extension(tmp_path):
    """DeBERTa v2 with a position table and log buckets reads max_relative_positions (-1: the position count)."""
    from bertembed.checkpoint_surgery import extend_positions_checkpoint

    model = member_or_skip("deberta-v2-factorised", relative_attention=True, position_buckets=8,
                           max_relative_positions=-1, pos_att_type=["p2c", "c2p"])
    model.save_pretrained(tmp_path / "src")
    write_member_tokenizer(tmp_path / "src", EmbeddingConfig.from_hf_config(tmp_path / "src" / "config.json"))
    extend_positions_checkpoint(tmp_path / "src", tmp_path / "dst", 80)
    ids = torch.randint(5, 100, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(_loaded(tmp_path / "dst")(ids)[0], model(ids)[0], rtol=0, atol=0)
