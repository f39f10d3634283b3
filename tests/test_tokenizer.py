"""The tokenizer against transformers' BertTokenizerFast (same files) and the pure-Python BertTokenizer (vocab.txt)."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil

import pytest
import torch

from bertembed import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog",
    "I am Sinan",
    "Café naïve résumé, Ångström!",
    "北京欢迎你 and 東京",
    "emoji 🙂🚀 and symbols ™ © ½",
    "",
    "   spaces\tand\nnewlines  ",
    "unaffable supercalifragilisticexpialidocious",
    "a [MASK] b [CLS] c [SEP] d [PAD] [UNK] e x[MASK]y [mask]",
]
PAIRS = [("Who wrote it?", "Sinan wrote it."), ("", "only B"), ("Ça va?", "北京")]
LONG = "word " * 700 + "end"


@pytest.fixture(scope="module")
def fast_reference(bundled_path):
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(bundled_path)


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_pretrained()


def _same(enc, ref) -> None:
    assert enc.input_ids == ref["input_ids"]
    assert enc.token_type_ids == ref["token_type_ids"]
    assert enc.attention_mask == ref["attention_mask"]


@pytest.mark.parametrize("text", TEXTS + [LONG])
def test_single_texts_match(ours, fast_reference, text):
    enc = ours(text)
    ref = fast_reference(text, truncation=True, max_length=512, return_offsets_mapping=True)
    _same(enc, ref)
    assert enc.offsets == [tuple(o) for o in ref["offset_mapping"]]
    assert enc.tokens == fast_reference.convert_ids_to_tokens(ref["input_ids"])


def test_known_ids_from_the_seeds(ours):
    assert ours("The quick brown fox jumps over the lazy dog").input_ids == \
        [101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 102]
    assert ours("I am Sinan").input_ids == [101, 1045, 2572, 8254, 2319, 102]
    assert ours("this is a test sentence").input_ids == [101, 2023, 2003, 1037, 3231, 6251, 102]


@pytest.mark.parametrize("pair", PAIRS + [(LONG, "short question"), ("short", LONG)])
def test_pairs_match(ours, fast_reference, pair):
    enc = ours(*pair)
    _same(enc, fast_reference(*pair, truncation=True, max_length=512))
    first_sep = enc.tokens.index("[SEP]")
    assert set(enc.token_type_ids[: first_sep + 1]) == {0} and set(enc.token_type_ids[first_sep + 1:]) <= {1}


def test_batches_with_padding_and_tensors(ours, fast_reference):
    texts = TEXTS[:4]
    _same(ours(texts), fast_reference(texts, padding=True, truncation=True, max_length=512))
    pairs_a, pairs_b = zip(*PAIRS, strict=True)
    _same(ours(list(pairs_a), list(pairs_b)), fast_reference(list(pairs_a), list(pairs_b), padding=True))
    _same(ours(list(PAIRS)), fast_reference(list(pairs_a), list(pairs_b), padding=True))
    fixed = ours(texts, padding="max_length", max_length=32, return_tensors="pt")
    ref = fast_reference(texts, padding="max_length", max_length=32, truncation=True, return_tensors="pt")
    assert fixed.input_ids.shape == (4, 32) and fixed.input_ids.dtype == torch.long
    assert torch.equal(fixed.input_ids, ref["input_ids"]) and torch.equal(fixed.attention_mask, ref["attention_mask"])
    single = ours("one text", return_tensors="pt")
    assert single.input_ids.shape == (1, 4)


def test_a_vocab_txt_alone_is_refused_for_a_member_with_its_own_framing(tmp_path, bundled_path):
    """MPNet's vocab.txt holds BERT's whole vocabulary, [CLS] and [SEP] included, but its tokenizer frames texts as
    <s> A </s></s> B </s>: read alone, the file would give BERT's framing silently."""
    shutil.copy(bundled_path / "vocab.txt", tmp_path)
    config = json.loads((bundled_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mpnet", "architectures": None}))
    with pytest.raises(ValueError, match=r"has a vocab.txt and no tokenizer.json: read alone it frames texts as "
                                         r"BERT's \[CLS\] A \[SEP\], but this model's tokenizer uses its own"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"cls_token": "<s>", "sep_token": "</s>"}))
    with pytest.raises(ValueError, match=r"uses its own \(<s> ...\)"):
        Tokenizer.from_pretrained(tmp_path)


def test_truncation_off_keeps_everything(ours):
    assert len(ours(LONG, truncation=False).input_ids) == 703
    assert len(ours(LONG).input_ids) == 512  # the model's position limit


def test_vocab_txt_only_matches_the_python_tokenizer(tmp_path, bundled_path):
    """Without tokenizer.json the pipeline is built from vocab.txt and tokenizer_config.json."""
    from transformers import BertTokenizer

    for name in ("vocab.txt", "config.json"):
        shutil.copy(bundled_path / name, tmp_path)
    for lower, accents in ((True, None), (False, False)):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": lower, "strip_accents": accents}))
        ours = Tokenizer.from_pretrained(tmp_path)
        slow = BertTokenizer(str(tmp_path / "vocab.txt"), do_lower_case=lower, strip_accents=accents)
        for text in TEXTS:
            assert ours(text).input_ids == slow(text)["input_ids"], (lower, accents, text)
        assert ours(*PAIRS[0]).token_type_ids == slow(*PAIRS[0])["token_type_ids"]


def test_bad_arguments(ours):
    with pytest.raises(ValueError, match="padding"):
        ours("x", padding="sideways")
    with pytest.raises(ValueError, match="return_tensors"):
        ours("x", return_tensors="tf")
    with pytest.raises(ValueError, match="as long as text"):
        ours(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="padding=True"):
        ours(["a", "b c d"], padding=False, return_tensors="pt")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained("/no/such/folder")
    with pytest.raises(FileNotFoundError, match="the model name is empty"):  # (not the working folder)
        Tokenizer.from_pretrained("")
    for bad in (0, -1, "8", 2.5, True):
        with pytest.raises(ValueError, match=f"max_length={bad!r} must be a positive int"):
            ours("x", max_length=bad)
    with pytest.raises(ValueError, match="truncation='do_not_pad'"):
        ours("x", truncation="do_not_pad")
    import numpy as np  # (numpy's ints and bools, as lengths taken from arrays come, pass as transformers takes them)

    assert ours(LONG, max_length=np.int64(8), truncation=np.bool_(True)).input_ids == ours(LONG, max_length=8).input_ids
    assert len(ours(LONG, truncation="do_not_truncate").input_ids) == 703


@pytest.mark.parametrize("strategy, pairs", [
    ("only_first", [("a b c d e f g h", "i j"), ("a b c d", "e f g h i")]),  # (the second: longest first cuts both)
    ("only_second", [("a b", "c d e f g h i j"), ("a b c d e", "f g h i")]),
    ("longest_first", [("a b c d e f", "g h i j k l"), ("a b", "c d e f g h i j"), ("a b c d e f g h i", "j")])])
def test_truncation_strategies_match_transformers(ours, fast_reference, strategy, pairs):
    """transformers' strategies by name: "only_second" cuts the second text alone (it was taken for True)."""
    for first, second in pairs:
        expected = fast_reference(first, second, max_length=9, truncation=strategy)["input_ids"]
        assert ours(first, second, max_length=9, truncation=strategy).input_ids == expected, (first, second)


def test_a_stride_past_a_pairs_window_is_a_value_error(ours):
    """tokenizers panics (a BaseException from Rust) where a pair's window leaves less room than the stride."""
    with pytest.raises(ValueError, match="cannot tokenize with max_length=8, stride=3: `stride` must be strictly"):
        ours("a b c d e f g h i j k l", "m n o p q r s t", max_length=8, stride=3, return_overflowing_tokens=True)
    assert ours("a b c", max_length=8).input_ids == [101, 1037, 1038, 1039, 102]  # (still usable)


def test_threads_sharing_a_tokenizer_keep_their_own_truncation(ours):
    """Truncation is state of the `tokenizers` backend: a call from another thread between one call's setting and its
    encoding would cut (or not cut) that call's text. Made to happen by construction: the first call's encoding
    starts the second call on another thread and gives it time to run."""
    import threading

    real = ours.backend

    class Meddled:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode_batch(self, items):
            if not started:
                started.append(threading.Thread(target=lambda: found.append(len(ours(LONG, truncation=False)
                                                                                    .input_ids))))
                started[0].start()
                started[0].join(0.5)  # (with the lock it waits for this call to finish; without, it runs now)
            return real.encode_batch(items)

    started, found = [], []
    ours.backend = Meddled()
    try:
        assert len(ours(LONG, max_length=8).input_ids) == 8
        started[0].join()
    finally:
        ours.backend = real
    assert found == [703]
    for copied in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours)):  # (the lock is made anew, not copied)
        assert copied("hello", max_length=8).input_ids == ours("hello").input_ids and copied._lock is not ours._lock


# Texts the tokenizer turns into no token of their own: control characters, zero-width ones, the byte-order mark,
# the soft hyphen, a private-use character, mixed with whitespace. Each would be embedded as [CLS] [SEP] alone, as an
# empty text is.
NO_TOKEN_TEXTS = ["\x00\x01", "\u200b\u200c\u2060", "\ufeff", " \u200b \t\x00 ", "\u00ad\u200d", "\x7f\u2061",
                  "\ue000"]


@pytest.mark.parametrize("text", NO_TOKEN_TEXTS)
def test_texts_without_tokens_are_refused(ours, fast_reference, text):
    # the independent reference: transformers' tokenizer also gives nothing but [CLS] [SEP] for these texts
    assert fast_reference.convert_ids_to_tokens(fast_reference(text)["input_ids"]) == ["[CLS]", "[SEP]"]
    assert ours(text).tokens == ["[CLS]", "[SEP]"]  # __call__ still matches transformers
    with pytest.raises(ValueError, match=r"TEXT has no tokens: .*U\+[0-9A-F]{4}.*\[CLS\] \[SEP\] alone"):
        ours.require_tokens(text, "TEXT")


@pytest.mark.parametrize("text", ["", "   ", "\t\n"])
def test_empty_texts_are_refused(ours, text):
    with pytest.raises(ValueError, match="TEXT is empty"):
        ours.require_tokens(text, "TEXT")


@pytest.mark.parametrize("text", ["a\u200b", "\u200bking", "\u2603"])  # a word beside a zero-width one; [UNK]
def test_texts_with_a_token_pass(ours, fast_reference, text):
    ours.require_tokens(text)
    assert ours(text).input_ids == fast_reference(text)["input_ids"] and len(ours(text).input_ids) == 3


# b"caf\xe9" (Latin-1) as Python hands it over from a command line: os.fsdecode keeps the byte as a lone surrogate
LATIN1 = os.fsdecode(b"caf\xe9")


@pytest.mark.parametrize("call, name", [
    (lambda tok: tok(LATIN1), "the text"),
    (lambda tok: tok("fine", LATIN1), "the text"),  # (the pair's second text)
    (lambda tok: tok(["fine", LATIN1]), "text 1 of the batch"),
    (lambda tok: tok([("fine", LATIN1)], return_tensors="pt"), "text 0 of the batch"),
    (lambda tok: tok.require_tokens(LATIN1, "TEXT"), "TEXT"),
    (lambda tok: tok.require_tokens("fine", "TEXT", LATIN1, "TEXT_B"), "TEXT_B"),
])
def test_text_that_is_not_utf8_is_a_value_error_naming_the_byte(ours, call, name):
    assert LATIN1 == "caf\udce9"  # (`tokenizers` refuses it with a TypeError in new releases)
    with pytest.raises(ValueError, match=rf"^{name} is not valid UTF-8: byte 0xE9 at character 3; give UTF-8 text"):
        call(ours)


def test_a_lone_surrogate_that_is_no_byte_is_named_by_its_code_point(ours):
    with pytest.raises(ValueError, match=r"the text is not valid UTF-8: lone surrogate U\+D800 at character 1"):
        ours("a\ud800b")


def test_unreadable_tokenizer_files_are_value_errors(tmp_path, bundled_path):
    for name in ("config.json", "vocab.txt", "tokenizer.json"):
        shutil.copy(bundled_path / name, tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a readable tokenizer .*re-download or fix"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "vocab.txt").write_bytes(b"[PAD]\n[CLS]\n[SEP]\ncaf" + "é\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"vocab\.txt is not a readable vocabulary .*UTF-8"):
        Tokenizer.from_pretrained(tmp_path)


_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Héllo wörld, naïve café!", "Paris is in France."] * 20


def _roberta_style(folder):
    """A RoBERTa-style byte-level BPE tokenizer.json, trained by `tokenizers` (as RoBERTa's own was)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    bpe = Backend(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=[
        "<s>", "<pad>", "</s>", "<unk>", "<mask>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    bpe.save(str(folder / "tokenizer.json"))
    from transformers import RobertaTokenizerFast

    return RobertaTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))


def _xlmr_style(folder):
    """An XLM-R-style tokenizer.json: a SentencePiece-like Unigram model with Metaspace, as converted ones are."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    uni = Backend(models.Unigram())
    uni.normalizer = normalizers.NFKC()
    uni.pre_tokenizer, uni.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    uni.train_from_iterator(_CORPUS, trainers.UnigramTrainer(vocab_size=120, unk_token="<unk>", special_tokens=[
        "<s>", "<pad>", "</s>", "<unk>"]))
    uni.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    uni.save(str(folder / "tokenizer.json"))
    from transformers import XLMRobertaTokenizerFast

    return XLMRobertaTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))


@pytest.mark.parametrize("style", [_roberta_style, _xlmr_style])
def test_family_tokenizers_match_transformers_with_their_pair_layout(tmp_path, style):
    theirs = style(tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    assert ours.pad_token == "<pad>" and ours.pad_token_id == 1
    texts = ["The quick brown fox", "Paris, naïve café!"]
    for args in ((texts[0],), (texts[0], texts[1]), (texts,), (texts, texts[::-1])):
        got, expected = ours(*args), theirs(*args, padding=True)
        assert got.input_ids == expected["input_ids"], args
        assert got.attention_mask == expected["attention_mask"], args
    pair = ours(texts[0], texts[1])
    first = pair.tokens.index("</s>")
    assert pair.tokens[0] == "<s>" and pair.tokens[first:first + 2] == ["</s>", "</s>"] and pair.tokens[-1] == "</s>"
    assert set(pair.token_type_ids) == {0}  # one segment for the whole pair, as RoBERTa's one token type row needs


def test_a_member_with_one_segment_row_gets_segment_zero_throughout(tmp_path):
    """A WordPiece tokenizer gives a pair's second text segment 1; a DistilBERT (no segment table) or RoBERTa (one
    row) checkpoint takes segment 0 everywhere, as its own tokenizer gives it."""
    from bertembed.sources import bundled_folder

    shutil.copy(bundled_folder() / "vocab.txt", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "distilbert", "vocab_size": 30522}))
    pair = Tokenizer.from_pretrained(tmp_path)("The fox", "It was not amused.")
    assert pair.tokens[-1] == "[SEP]" and set(pair.token_type_ids) == {0}
    assert set(Tokenizer.from_pretrained()("The fox", "It was not amused.").token_type_ids) == {0, 1}  # BERT


def test_sliding_windows_match_transformers_overflowing_tokens():
    """Long text without surgery: windows of max_length, each a full sequence, neighbours sharing `stride` tokens,
    as transformers' fast tokenizer gives them (single texts, batches, pairs), padded alike."""
    from transformers import BertTokenizerFast

    from bertembed.sources import bundled_folder

    theirs, ours = BertTokenizerFast.from_pretrained(bundled_folder()), Tokenizer.from_pretrained()
    long = " ".join(f"word{i % 7} and" for i in range(40))
    for args in ((long,), ([long, "short one", long[:60]],), (long, "a question?")):
        expected = theirs(*args, max_length=16, truncation=True, stride=4, return_overflowing_tokens=True,
                          padding=True)
        got = ours(*args, max_length=16, stride=4, return_overflowing_tokens=True)
        assert got.input_ids == expected["input_ids"] and got.attention_mask == expected["attention_mask"]
        assert got.overflow_to_sample_mapping == expected["overflow_to_sample_mapping"]
        assert all(w[0] == 101 and 102 in w for w in got.input_ids)
    for bad in (-1, True):  # (a bool is no stride, though Python counts True as 1)
        with pytest.raises(ValueError, match="stride"):
            ours(long, max_length=16, stride=bad, return_overflowing_tokens=True)


def test_explain_on_a_long_text_says_how_it_would_be_windowed():
    from bertembed.explain import explain_text

    with pytest.raises(ValueError, match=r"take it in windows: .*stride=128\) gives 3 windows of at most 512"):
        explain_text("word " * 1000)


def test_a_backend_with_padding_on_pads_only_when_asked(ours, fast_reference):
    """A `tokenizers` backend handed to the constructor with fixed padding switched on (as some tokenizer.json files
    store it) pads a call only when the call asks, as transformers does; a text without tokens is still found."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(ours.backend.to_str())
    backend.enable_padding(length=40)
    tok = Tokenizer(backend, ours.max_length, pad_token=ours.pad_token)
    batch = ["The quick brown fox jumps over the lazy dog", "I am Sinan"]
    _same(tok(batch, padding=False), fast_reference(batch, padding=False))
    _same(tok(batch, padding=True), fast_reference(batch, padding=True))
    with pytest.raises(ValueError, match="no token"):
        tok.require_tokens("\u200b")
