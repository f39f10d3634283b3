"""Vocabulary surgery on whole checkpoints (docs/surgery.md): tokens added, or the vocabulary pruned to a corpus's,
in tokenizer.json (edited with `tokenizers`) and in every tensor indexed by token. V vocabulary rows, E table width.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bertembed.checkpoint_surgery import WholeCheckpoint, read_whole, write_whole
from bertembed.surgery import grown_rows

INITS = ("pieces", "mean", "normal")
_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "unk_token_id",
            "mask_token_id", "decoder_start_token_id")


def add_tokens_checkpoint(src: str | Path | None, dst: str | Path, tokens: list[str], init: str = "pieces") -> dict:
    """Write checkpoint `src` to `dst` with `tokens` added to its tokenizer (ids after its last) and rows for them in
    every tensor indexed by token: the mean of the rows of the pieces the old tokenizer split a token into
    (`init="pieces"`), or transformers' draws (`"mean"`, `"normal"`); 0 in an MLM bias. Returns what changed."""
    from tokenizers import AddedToken

    if init not in INITS:
        raise ValueError(f"init={init!r} is not one of {INITS}")
    tokens = list(dict.fromkeys(tokens))
    if not tokens or any(not isinstance(t, str) or not t.strip() for t in tokens):
        raise ValueError(f"tokens={tokens!r}: give at least one token, none of them blank")
    whole = read_whole(src, dst)
    tokenizer, data = _tokenizer(whole)
    present = [t for t in tokens if tokenizer.token_to_id(t) is not None]
    fresh = [t for t in tokens if t not in present]
    if not fresh:
        raise ValueError(f"the tokenizer has every token already ({', '.join(present)}): nothing to add")
    normalizer = tokenizer.normalizer
    unmatched = {t: n for t in fresh if normalizer is not None and (n := normalizer.normalize_str(t)) != t}
    if unmatched:  # (an added token is matched against the normalized text: this one would never be found)
        raise ValueError(f"the tokenizer normalizes {unmatched} before it looks for added tokens, so these would never "
                         f"match; add the normalized forms instead")
    pieces = [tokenizer.encode(t, add_special_tokens=False).ids for t in fresh]
    tokenizer.add_tokens([AddedToken(t, normalized=True, special=False) for t in fresh])
    ids = [tokenizer.token_to_id(t) for t in fresh]
    added = dict(zip(fresh, ids, strict=True))
    before = whole.layer.config.vocab_size
    rows = max(before, max(ids) + 1)
    resized = _indexed_by_token(whole, before)
    for key, value in resized.items():
        whole.tensors[key] = _with_rows(value, ids, rows, pieces, init, whole.layer.config.initializer_range)
    whole.files["tokenizer.json"] = json.dumps(dict(json.loads(tokenizer.to_str()), padding=data["padding"],
                                                    truncation=data["truncation"]), ensure_ascii=False)
    whole.set_json("config.json", dict(whole.config, vocab_size=rows))
    entry = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False, "special": False}
    _update_added_decoder(whole, lambda decoder: decoder | {str(i): dict(entry, content=t) for t, i in added.items()},
                          lambda legacy: legacy | added)
    return {"added": added, "already_present": present, "pieces": dict(zip(fresh, pieces, strict=True)),
            "rows_before": before, "rows_after": rows, "init": init, "resized": sorted(resized)} | write_whole(whole)


def text_lines(path: str | Path, what: str, layout: str) -> list[str]:
    """The lines of a UTF-8 text file that are not blank; FileNotFoundError or ValueError naming `what` and the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{what} {path} does not exist; pass a text file, {layout}") from err
    except (OSError, UnicodeError) as err:
        why = getattr(err, "strerror", None) or "not UTF-8 text"
        raise ValueError(f"cannot read {what} {path} ({why}); pass a UTF-8 text file, {layout}") from err
    return [line for line in text.splitlines() if line.strip()]


def _tokenizer(whole: WholeCheckpoint):
    """SRC's tokenizer.json loaded with padding and truncation off, and the file's data as `tokenizers` writes it."""
    from tokenizers import Tokenizer

    path = whole.folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{whole.folder} has no tokenizer.json; vocabulary surgery edits the fast tokenizer's "
                                f"file: save the tokenizer with transformers (use_fast=True) into the folder first")
    data = json.loads(Tokenizer.from_file(str(path)).to_str())
    return Tokenizer.from_str(json.dumps(dict(data, padding=None, truncation=None))), data


def _indexed_by_token(whole: WholeCheckpoint, rows: int) -> dict[str, torch.Tensor]:
    """The tensors indexed by token: the word table [V, E] and, outside the layer, every [V, E] table (an MLM decoder)
    and [V] vector (its bias)."""
    word_key = whole.keys["word_embeddings.weight"]
    width = whole.tensors[word_key].shape[1]
    return {word_key: whole.tensors[word_key]} | {
        key: value for key, value in whole.tensors.items() if key not in whole.keys.values()
        and value.is_floating_point() and value.shape[:1] == (rows,) and value.shape[1:] in ((), (width,))}


def _with_rows(value: torch.Tensor, ids: list[int], rows: int, pieces: list[list[int]], init: str, std: float):
    """`value` ([V] or [V, E]) grown to `rows`, the entries of the new `ids` set: 0 for a bias, else by `init`."""
    count = value.shape[0]
    if value.dim() == 2 and init != "pieces":  # transformers' draws, then again for ids inside a padded table
        grown = grown_rows(value, rows, init, std)
        inside = [i for i in ids if i < count]
        if inside:
            grown[inside] = grown_rows(value, count + len(inside), init, std)[count:]
        return grown
    grown = torch.cat([value, value.new_zeros(rows - count, *value.shape[1:])])
    if value.dim() == 1:
        grown[ids] = 0
    elif empty := [i for i, p in zip(ids, pieces, strict=True) if not p]:
        raise ValueError(f"the tokenizer splits the new token(s) with id {empty} into no pieces; use --init mean")
    else:
        grown[ids] = torch.stack([value[p].double().mean(0) for p in pieces]).to(value.dtype)
    return grown


def _update_added_decoder(whole: WholeCheckpoint, change, change_legacy) -> None:
    """Apply `change` to tokenizer_config.json's `added_tokens_decoder` (id -> token), and `change_legacy` to the slow
    tokenizers' added_tokens.json (token -> id), where SRC has them."""
    config = whole.json_file("tokenizer_config.json") or {}
    if isinstance(decoder := config.get("added_tokens_decoder"), dict):
        whole.set_json("tokenizer_config.json", dict(config, added_tokens_decoder=change(decoder)))
    if (legacy := whole.json_file("added_tokens.json")) is not None:
        whole.set_json("added_tokens.json", change_legacy(legacy))


def prune_vocab_checkpoint(src: str | Path | None, dst: str | Path, corpus: str | Path) -> dict:
    """Write checkpoint `src` to `dst` keeping only the special tokens and the tokens that `corpus` (a text file, one
    text a line) tokenizes into, renumbered in their old order everywhere. Checks that every corpus line tokenizes
    as before (other text may meet the unknown token). Returns the sizes."""
    from tokenizers import Tokenizer

    lines = text_lines(corpus, "corpus", "one text a line")
    if not lines:
        raise ValueError(f"corpus {corpus} has no text: nothing tells which tokens to keep")
    whole = read_whole(src, dst)
    tokenizer, data = _tokenizer(whole)
    keep = _kept_ids(whole, data, tokenizer, {i for e in tokenizer.encode_batch(lines) for i in e.ids})
    new_id = {old: new for new, old in enumerate(keep)}
    before = whole.layer.config.vocab_size
    if keep[-1] >= before:
        raise ValueError(f"the tokenizer gives id {keep[-1]}, outside the {before}-row word table: fix the checkpoint")
    _renumber_tokenizer(data, new_id)
    pruned = Tokenizer.from_str(json.dumps(dict(data, padding=None, truncation=None)))
    for line, old, new in zip(lines, tokenizer.encode_batch(lines), pruned.encode_batch(lines), strict=True):
        if [new_id[i] for i in old.ids] != new.ids:
            raise ValueError(f"pruning would change how {line[:60]!r} tokenizes; nothing was written (please report "
                             f"it with the tokenizer)")
    saved = 0
    for key, value in _indexed_by_token(whole, before).items():
        whole.tensors[key] = value[keep]  # (a copy: indexed by a list)
        saved += (value.shape[0] - len(keep)) * value[0].numel() * value.element_size()
    whole.files["tokenizer.json"] = json.dumps(data, ensure_ascii=False)
    renumbered = {k: new_id[whole.config[k]] for k in _ID_KEYS if whole.config.get(k) in new_id}
    whole.set_json("config.json", whole.config | renumbered | {"vocab_size": len(keep)})
    _update_added_decoder(whole, lambda d: {str(new_id[int(k)]): v for k, v in d.items() if int(k) in new_id},
                          lambda legacy: {t: new_id[i] for t, i in legacy.items() if i in new_id})
    _slow_files(whole, data, [tokenizer.id_to_token(i) for i in keep])
    return {"rows_before": before, "rows_after": len(keep), "bytes_saved": saved,
            "corpus_lines": len(lines)} | write_whole(whole)


def _kept_ids(whole: WholeCheckpoint, data: dict[str, Any], tokenizer, used: set[int]) -> list[int]:
    """The ids to keep, in order: those the corpus `used`, the special and unknown tokens, the ids config.json names,
    and for BPE every token the merges build the kept ones from."""
    model = data["model"]
    kept = used | {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    unk = tokenizer.token_to_id(model["unk_token"]) if model.get("unk_token") else model.get("unk_id")
    kept |= {unk} if isinstance(unk, int) else set()
    _renumber_processor(data.get("post_processor"), lambda i: kept.add(i) or i)
    rows = whole.layer.config.vocab_size
    kept |= {i for k in _ID_KEYS if isinstance(i := whole.config.get(k), int) and 0 <= i < rows}
    if model["type"] == "BPE":
        made: dict[str, set[str]] = {}
        for left, right in map(_pair, model["merges"]):
            made.setdefault(left + right, set()).update((left, right))
        todo = [tokenizer.id_to_token(i) for i in kept]
        seen = set(todo)
        while todo:
            parts = made.get(todo.pop(), set()) - seen
            seen |= parts
            todo += parts
        kept |= {i for t in seen if (i := tokenizer.token_to_id(t)) is not None}
    return sorted(kept)


def _renumber_tokenizer(data: dict[str, Any], new_id: dict[int, int]) -> None:
    """tokenizer.json's data with only the kept ids, renumbered (vocabulary, merges, added tokens, post-processor,
    padding)."""
    model = data["model"]
    if isinstance(model["vocab"], dict):  # WordPiece, WordLevel, BPE: token -> id
        model["vocab"] = {t: new_id[i] for t, i in model["vocab"].items() if i in new_id}
    else:  # Unigram: [token, score] at index id
        model["vocab"] = [entry for i, entry in enumerate(model["vocab"]) if i in new_id]
        if model.get("unk_id") is not None:
            model["unk_id"] = new_id[model["unk_id"]]
    if model["type"] == "BPE":
        model["merges"] = [m for m in model["merges"]
                           if all(t in model["vocab"] for t in (*_pair(m), "".join(_pair(m))))]
    data["added_tokens"] = [dict(t, id=new_id[t["id"]]) for t in data.get("added_tokens", []) if t["id"] in new_id]
    _renumber_processor(data.get("post_processor"), new_id.__getitem__)
    if data.get("padding") and data["padding"].get("pad_id") in new_id:
        data["padding"]["pad_id"] = new_id[data["padding"]["pad_id"]]


def _pair(merge: str | list[str]) -> tuple[str, ...]:
    """A BPE merge's two parts (tokenizers writes "a b" in older files, ["a", "b"] in newer ones)."""
    return tuple(merge.split(" ", 1) if isinstance(merge, str) else merge)


def _renumber_processor(processor: dict[str, Any] | None, change) -> None:
    """Replace every special token id in a post-processor by `change(id)`."""
    if not processor:
        return
    for inner in processor.get("processors", []):  # a Sequence
        _renumber_processor(inner, change)
    for key in ("sep", "cls"):  # BertProcessing, RobertaProcessing: [token, id]
        if isinstance(processor.get(key), list):
            processor[key][1] = change(processor[key][1])
    for special in (processor.get("special_tokens") or {}).values():  # TemplateProcessing
        special["ids"] = [change(i) for i in special["ids"]]


def _slow_files(whole: WholeCheckpoint, data: dict[str, Any], tokens: list[str]) -> None:
    """vocab.txt, vocab.json and merges.txt rewritten for the new vocabulary; a sentencepiece model left out of DST."""
    folder = whole.folder
    if (folder / "vocab.txt").is_file():
        whole.files["vocab.txt"] = "".join(t + "\n" for t in tokens)
    if (folder / "vocab.json").is_file() and data["model"]["type"] == "BPE":
        whole.set_json("vocab.json", data["model"]["vocab"])
    if (folder / "merges.txt").is_file() and data["model"]["type"] == "BPE":
        merges = "".join(" ".join(_pair(m)) + "\n" for m in data["model"]["merges"])
        whole.files["merges.txt"] = "#version: 0.2\n" + merges
    whole.dropped |= {p.name for p in folder.glob("*.model")}
