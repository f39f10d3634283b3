"""Vocabulary surgery on whole checkpoints: tokens added to the tokenizer and rows to the word table, or the
vocabulary pruned to what a corpus uses. The tokenizer is the checkpoint's tokenizer.json, edited with `tokenizers`
(WordPiece, BPE, Unigram and WordLevel models); tensors indexed by token (a tied or untied MLM decoder, its bias)
change with the word table. SRC is only read; DST is written whole (`bertembed.checkpoint_surgery`).

Dimension letters: V vocabulary rows, E table width.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bertembed.checkpoint_surgery import WholeCheckpoint, check_destination, read_whole, write_whole
from bertembed.sources import resolve
from bertembed.surgery import grown_embedding

INITS = ("pieces", "mean", "normal")
_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "unk_token_id",
            "mask_token_id", "decoder_start_token_id")


def add_tokens_checkpoint(src: str | Path | None, dst: str | Path, tokens: list[str], init: str = "pieces") -> dict:
    """Write checkpoint `src` to `dst` with `tokens` added to its tokenizer (new ids after the tokenizer's last, as
    `tokenizers` assigns them) and rows for them in the word table and every tensor indexed by token.

    A new row starts as the mean of the rows of the pieces the old tokenizer split the token into (`init="pieces"`),
    or as transformers' `resize_token_embeddings` draws rows (`"mean"`, `"normal"`); a new token's MLM bias is 0.
    Tokens the tokenizer already has are reported, not added. Returns what changed, for the report."""
    from tokenizers import AddedToken

    if init not in INITS:
        raise ValueError(f"init={init!r} is not one of {INITS}")
    tokens = list(dict.fromkeys(tokens))
    if not tokens or any(not isinstance(t, str) or not t.strip() for t in tokens):
        raise ValueError(f"tokens={tokens!r}: give at least one token, none of them blank")
    source = resolve(src)
    target = check_destination(dst, source.folder)
    whole = read_whole(source)
    tokenizer, stored = _tokenizer(whole)
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
    for key, value in _indexed_by_token(whole, before).items():
        whole.tensors[key] = _with_rows(value, ids, rows, pieces, init, _std(whole))
    _retokenized(whole, json.dumps(json.loads(tokenizer.to_str()) | stored, ensure_ascii=False), rows)
    entry = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False, "special": False}
    _update_added_decoder(whole, lambda decoder: decoder | {str(i): dict(entry, content=t) for t, i in added.items()},
                          lambda legacy: legacy | added)
    write_whole(whole, target)
    return {"added": added, "already_present": present, "pieces": dict(zip(fresh, pieces, strict=True)),
            "rows_before": before, "rows_after": rows, "init": init, "destination": str(target),
            "resized": sorted(_indexed_by_token(whole, rows)), "dropped_files": sorted(whole.dropped)}


def _tokenizer(whole: WholeCheckpoint):
    """SRC's tokenizer.json loaded, its stored padding and truncation off (they would pad or cut what is encoded
    here), and those settings, for DST's file."""
    from tokenizers import Tokenizer

    path = whole.folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{whole.folder} has no tokenizer.json; vocabulary surgery edits the fast tokenizer's "
                                f"file: save the tokenizer with transformers (use_fast=True) into the folder first")
    tokenizer = Tokenizer.from_file(str(path))
    stored = {k: v for k, v in json.loads(tokenizer.to_str()).items() if k in ("padding", "truncation")}
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer, stored


def _std(whole: WholeCheckpoint) -> float:
    return float(whole.config.get("initializer_range", whole.layer.config.initializer_range))


def _indexed_by_token(whole: WholeCheckpoint, rows: int) -> dict[str, torch.Tensor]:
    """The tensors indexed by token: the word table ([V, E]) and, outside the embedding layer, every [V, E] table (an
    MLM decoder) and [V] vector (its bias) of the checkpoint."""
    word_key = whole.keys["word_embeddings.weight"]
    width = whole.tensors[word_key].shape[1]
    embedding = set(whole.keys.values())
    found = {word_key: whole.tensors[word_key]}
    for key, value in whole.tensors.items():
        if key not in embedding and value.is_floating_point() and value.shape[:1] == (rows,) and \
                (value.dim() == 1 or value.dim() == 2 and value.shape[1] == width):
            found[key] = value
    return found


def _with_rows(value: torch.Tensor, ids: list[int], rows: int, pieces: list[list[int]], init: str, std: float):
    """`value` ([V] or [V, E]) grown to `rows`, the entries of the new `ids` set: 0 for a bias (as transformers pads
    one), else by `init`."""
    if value.dim() == 1:
        grown = torch.cat([value, value.new_zeros(rows - value.shape[0])])
        grown[ids] = 0
        return grown
    count = value.shape[0]
    if init != "pieces":  # transformers' draws; then the rows of ids inside the table (a tokenizer smaller than it)
        grown = grown_embedding(value, rows, init, std).weight.detach()
        inside = [i for i in ids if i < count]
        if inside:
            grown[inside] = grown_embedding(value, count + len(inside), init, std).weight.detach()[count:]
        return grown
    empty = [i for i, p in zip(ids, pieces, strict=True) if not p]
    if empty:
        raise ValueError(f"the tokenizer splits the new token(s) with id {empty} into no pieces; use --init mean")
    grown = torch.cat([value, value.new_zeros(rows - count, value.shape[1])])
    grown[ids] = torch.stack([value[p].double().mean(0) for p in pieces]).to(value.dtype)
    return grown


def _retokenized(whole: WholeCheckpoint, tokenizer_json: str, rows: int) -> None:
    """Record DST's tokenizer.json and the vocabulary size in config.json."""
    whole.files["tokenizer.json"] = tokenizer_json
    whole.set_json("config.json", dict(whole.config, vocab_size=rows))


def _update_added_decoder(whole: WholeCheckpoint, change, change_legacy) -> None:
    """Apply `change` to tokenizer_config.json's `added_tokens_decoder` (id -> token), and `change_legacy` to the slow
    tokenizers' added_tokens.json (token -> id), where SRC has them."""
    config = whole.json_file("tokenizer_config.json")
    decoder = None if config is None else config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        whole.set_json("tokenizer_config.json", dict(config, added_tokens_decoder=change(decoder)))
    legacy = whole.json_file("added_tokens.json")
    if legacy is not None:
        whole.set_json("added_tokens.json", change_legacy(legacy))


def prune_vocab_checkpoint(src: str | Path | None, dst: str | Path, corpus: str | Path) -> dict:
    """Write checkpoint `src` to `dst` keeping only the special tokens and the tokens that `corpus` (a text file, one
    text a line) tokenizes into, in their old order; the ids are renumbered in the tokenizer, config.json and every
    tensor indexed by token. Every line of the corpus tokenizes to the same tokens as before, which is checked, so
    outputs on the corpus are unchanged; other text may meet the unknown token. Returns the sizes, for the report."""
    from tokenizers import Tokenizer

    source = resolve(src)
    target = check_destination(dst, source.folder)
    lines = _corpus(corpus)
    whole = read_whole(source)
    tokenizer, stored = _tokenizer(whole)
    data = json.loads(tokenizer.to_str()) | stored
    used = {i for e in tokenizer.encode_batch(lines) for i in e.ids}
    keep = sorted(used | _always_kept(whole, data))
    keep = sorted(set(keep) | _merge_closure(data, {tokenizer.id_to_token(i) for i in keep}, tokenizer))
    new_id = {old: new for new, old in enumerate(keep)}
    before = whole.layer.config.vocab_size
    if keep[-1] >= before:
        raise ValueError(f"the tokenizer gives id {keep[-1]}, outside the {before}-row word table: fix the checkpoint")
    _renumber_tokenizer(data, new_id)
    pruned = Tokenizer.from_str(json.dumps(data))
    pruned.no_truncation()
    pruned.no_padding()
    for line, old, new in zip(lines, tokenizer.encode_batch(lines), pruned.encode_batch(lines), strict=True):
        if [new_id[i] for i in old.ids] != new.ids:
            raise ValueError(f"pruning would change how {line[:60]!r} tokenizes; nothing was written (please report "
                             f"it with the tokenizer)")
    saved = 0
    for key, value in _indexed_by_token(whole, before).items():
        whole.tensors[key] = value[keep].clone()
        saved += (value.shape[0] - len(keep)) * value[0].numel() * value.element_size()
    _retokenized(whole, json.dumps(data, ensure_ascii=False), len(keep))
    whole.set_json("config.json", _renumbered_config(whole.json_file("config.json"), new_id))
    _update_added_decoder(whole, lambda d: {str(new_id[int(k)]): v for k, v in d.items() if int(k) in new_id},
                          lambda legacy: {t: new_id[i] for t, i in legacy.items() if i in new_id})
    _slow_files(whole, data, [tokenizer.id_to_token(i) for i in keep])
    write_whole(whole, target)
    return {"rows_before": before, "rows_after": len(keep), "bytes_saved": saved, "corpus_lines": len(lines),
            "dropped_files": sorted(whole.dropped), "destination": str(target)}


def _corpus(corpus: str | Path) -> list[str]:
    path = Path(corpus)
    if not path.is_file():
        raise FileNotFoundError(f"corpus {path} is not a file; pass a text file, one text a line")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"corpus {path} has no text: nothing tells which tokens to keep")
    return lines


def _always_kept(whole: WholeCheckpoint, data: dict[str, Any]) -> set[int]:
    """Ids kept whatever the corpus: special tokens, the model's unknown token, the ids config.json names."""
    kept = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    unk = data["model"].get("unk_token") or data["model"].get("unk_id")
    if isinstance(unk, str):
        unk = data["model"]["vocab"].get(unk) if isinstance(data["model"].get("vocab"), dict) else None
    kept |= {unk} if isinstance(unk, int) else set()
    _renumber_processor(data.get("post_processor"), lambda i: kept.add(i) or i)
    rows = whole.layer.config.vocab_size
    return kept | {i for k in _ID_KEYS if isinstance(i := whole.config.get(k), int) and 0 <= i < rows}


def _merge_closure(data: dict[str, Any], tokens: set[str], tokenizer) -> set[int]:
    """For BPE: the ids of every token the merges build the kept ones from (a merge needs both its parts)."""
    if data["model"]["type"] != "BPE":
        return set()
    made: dict[str, list[tuple[str, ...]]] = {}
    for left, right in map(_pair, data["model"]["merges"]):
        made.setdefault(left + right, []).append((left, right))
    todo, seen = list(tokens), set(tokens)
    while todo:
        for pair in made.get(todo.pop(), []):
            for part in pair:
                if part not in seen:
                    seen.add(part)
                    todo.append(part)
    return {i for t in seen if (i := tokenizer.token_to_id(t)) is not None}


def _renumber_tokenizer(data: dict[str, Any], new_id: dict[int, int]) -> None:
    """tokenizer.json with only the kept ids, renumbered: the model's vocabulary (and BPE merges whose tokens are
    all kept), the added tokens, the post-processor's special tokens and the padding id."""
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


def _renumbered_config(config: dict[str, Any], new_id: dict[int, int]) -> dict[str, Any]:
    return config | {k: new_id[config[k]] for k in _ID_KEYS if config.get(k) in new_id}


def _slow_files(whole: WholeCheckpoint, data: dict[str, Any], tokens: list[str]) -> None:
    """The slow tokenizer's files follow the new vocabulary: vocab.txt (WordPiece) and vocab.json / merges.txt (BPE)
    rewritten; a sentencepiece model, which cannot be edited here, left out of DST (tokenizer.json stands)."""
    folder = whole.folder
    if (folder / "vocab.txt").is_file():
        whole.files["vocab.txt"] = "".join(t + "\n" for t in tokens)
    if (folder / "vocab.json").is_file() and data["model"]["type"] == "BPE":
        whole.set_json("vocab.json", data["model"]["vocab"])
    if (folder / "merges.txt").is_file() and data["model"]["type"] == "BPE":
        merges = "".join(" ".join(_pair(m)) + "\n" for m in data["model"]["merges"])
        whole.files["merges.txt"] = "#version: 0.2\n" + merges
    whole.dropped |= {p.name for p in folder.glob("*.model")}
