"""Vocabulary surgery on whole checkpoints (docs/surgery.md): tokens added, or the vocabulary pruned to a corpus's, in
tokenizer.json (with `tokenizers`) and in every tensor indexed by token. V vocabulary rows, E table width."""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
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
    unk = _unk_id(tokenizer, data["model"])
    if init == "pieces" and (bare := [t for t, p in zip(fresh, pieces, strict=True) if not set(p) - {unk}]):
        raise ValueError(f"the tokenizer spells {bare} with no piece but the unknown token (or none): the mean of "
                         f"their pieces would be no token's row; use --init mean")
    tokenizer.add_tokens([AddedToken(t, normalized=True, special=False) for t in fresh])
    ids = [tokenizer.token_to_id(t) for t in fresh]
    added = dict(zip(fresh, ids, strict=True))
    before = whole.layer.config.vocab_size
    rows = max(before, max(ids) + 1)
    resized = _indexed_by_token(whole, before)
    done: list[tuple[torch.Tensor, torch.Tensor]] = []  # (before, after): a tied head (twice in a .bin) stays tied
    for key, value in resized.items():
        after = next((b.clone() for a, b in done if a.shape == value.shape and torch.equal(a, value)), None)
        whole.tensors[key] = after if after is not None else \
            _with_rows(value, ids, rows, pieces, init, whole.layer.config.initializer_range)
        done.append((value, whole.tensors[key]))
    whole.files["tokenizer.json"] = json.dumps(dict(json.loads(tokenizer.to_str()), padding=data["padding"],
                                                    truncation=data["truncation"]), ensure_ascii=False)
    whole.set_json("config.json", dict(whole.config, vocab_size=rows))
    entry = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False, "special": False}
    _update_added_decoder(whole, lambda decoder: decoder | {str(i): dict(entry, content=t) for t, i in added.items()},
                          lambda legacy: legacy | added)
    return {"added": added, "already_present": present, "pieces": dict(zip(fresh, pieces, strict=True)),
            "rows_before": before, "rows_after": rows, "init": init, "resized": sorted(resized)} | write_whole(whole)


def text_files(paths: str | Path | list[str | Path], what: str, layout: str) -> list[Path]:
    """The files named: files as given, folders as every file under them (hidden ones left out), in order."""
    files = []
    for path in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        if not path.exists():
            raise FileNotFoundError(f"{what} {path} does not exist; pass a text file, {layout}, or a folder of them")
        found = sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts)) if path.is_dir() else [path]
        if not found:
            raise ValueError(f"{what} {path} is a folder without files; pass a text file, {layout}, or a folder")
        files += found
    return files


def text_batches(paths, what: str, layout: str, progress=None, size: int = 1 << 21):
    """The lines that are not blank of the UTF-8 text files `paths` names (`text_files`), read as a stream in batches
    of about `size` bytes; `progress(bytes read, bytes in all)` after each. ValueError naming `what` and the file it
    cannot read."""
    files = text_files(paths, what, layout)
    total, done, batch, start = sum(f.stat().st_size for f in files), 0, [], 0
    progress = progress or (lambda done, total: None)
    for path in files:
        try:
            with open(path, "rb") as stream:
                for number, raw in enumerate(stream):
                    done += len(raw)  # (a byte-order mark, as Notepad writes, is no text: "utf-8-sig" drops it)
                    if (line := raw.decode("utf-8-sig" if number == 0 else "utf-8").rstrip("\r\n")).strip():
                        batch.append(line)
                    if done - start >= size:
                        yield batch
                        batch, start = [], done
                        progress(done, total)
        except (OSError, UnicodeError) as err:
            why = getattr(err, "strerror", None) or "not UTF-8 text"
            raise ValueError(f"cannot read {what} {path} ({why}); pass a UTF-8 text file, {layout}") from err
    yield batch
    progress(done, total)


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
    """The word table [V, E] and, outside the layer, every [V, E] table (an MLM decoder) and [V] vector (its bias)."""
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
    else:
        grown[ids] = torch.stack([value[p].double().mean(0) for p in pieces]).to(value.dtype)
    return grown


def _update_added_decoder(whole: WholeCheckpoint, change, change_legacy) -> None:
    """`change` tokenizer_config.json's added_tokens_decoder (id -> token), `change_legacy` added_tokens.json's."""
    config = whole.json_file("tokenizer_config.json") or {}
    if isinstance(decoder := config.get("added_tokens_decoder"), dict):
        whole.set_json("tokenizer_config.json", dict(config, added_tokens_decoder=change(decoder)))
    if (legacy := whole.json_file("added_tokens.json")) is not None:
        whole.set_json("added_tokens.json", change_legacy(legacy))


def prune_vocab_checkpoint(src: str | Path | None, dst: str | Path, corpus: str | Path | list[str | Path], *,
                           target_size: int | None = None, min_frequency: int = 1,
                           held_out: str | Path | list[str | Path] | None = None, progress=None) -> dict:
    """Write checkpoint `src` to `dst` keeping the special tokens and the tokens that `corpus` (text files, one text a
    line, or folders of them; read as a stream, `progress(bytes read, bytes in all)`) tokenizes into at least
    `min_frequency` times, the `target_size` most frequent of them if given, renumbered in their old order everywhere.
    Checks that corpus lines (of the first 4 MB) and `held_out` lines made of kept tokens tokenize as before, and
    measures the share of `held_out`'s tokens that are unknown. Returns the sizes."""
    from tokenizers import Tokenizer

    for name, value in (("target_size", target_size), ("min_frequency", min_frequency)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer")
    files = text_files(corpus, "corpus", "one text a line")
    held_files = text_files(held_out, "held-out text", "one text a line") if held_out is not None else []
    if held_files and not any(any(batch) for batch in text_batches(held_files, "held-out text", "one text a line")):
        raise ValueError(f"held-out text {', '.join(map(str, held_files))} has no text: nothing to measure the "
                         f"unknown share on")
    whole = read_whole(src, dst)
    tokenizer, data = _tokenizer(whole)
    before = whole.layer.config.vocab_size
    counts = np.zeros(max(before, tokenizer.get_vocab_size()), dtype=np.int64)
    lines, checked = 0, []
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # (no offsets: 1.25x; tokenizers 0.20)
    for batch in text_batches(files, "corpus", "one text a line", progress):
        ids = [e.ids for e in encode(batch, add_special_tokens=False)]  # (on every core)
        found = np.bincount(np.fromiter(chain.from_iterable(ids), dtype=np.int64))
        counts[:found.size] += found
        lines += len(batch)
        if len(checked) < 2:  # (the first 4 MB, to check)
            checked.append(batch)
    if not lines:
        raise ValueError(f"corpus {', '.join(map(str, files))} has no text: nothing tells which tokens to keep")
    total, unk = int(counts.sum()), _unk_id(tokenizer, data["model"])
    counts[_kept_ids(whole, data, tokenizer, set())] = 0  # (the specials: kept, and not among the target size)
    used = np.flatnonzero(counts >= min_frequency)
    if target_size is not None:
        used = used[np.argsort(-counts[used], kind="stable")[:target_size]]
    keep = _kept_ids(whole, data, tokenizer, set(used.tolist()))
    new_id = {old: new for new, old in enumerate(keep)}
    if keep[-1] >= before:
        raise ValueError(f"the tokenizer gives id {keep[-1]}, outside the {before}-row word table: fix the checkpoint")
    _renumber_tokenizer(data, new_id)
    pruned = Tokenizer.from_str(json.dumps(dict(data, padding=None, truncation=None)))
    _retokenized(checked, tokenizer, pruned, new_id, unk)
    unknown = {}
    if held_files:  # (no share without an unknown token: byte-level BPE loses the characters instead)
        n = _retokenized(text_batches(held_files, "held-out text", "one text a line"), tokenizer, pruned, new_id, unk)
        shares = [None if unk is None else n[2 + i] / max(n[i], 1) for i in (0, 1)]
        unknown = {"held_out_tokens": n[1], "held_out_unknown_before": shares[0], "held_out_unknown_after": shares[1]}
    size_before = _size(whole.tensors)
    for key, value in _indexed_by_token(whole, before).items():
        whole.tensors[key] = value[keep]  # (a copy: indexed by a list)
    whole.files["tokenizer.json"] = json.dumps(data, ensure_ascii=False)
    renumbered = {k: new_id[whole.config[k]] for k in _ID_KEYS if whole.config.get(k) in new_id}
    whole.set_json("config.json", whole.config | renumbered | {"vocab_size": len(keep)})
    _update_added_decoder(whole, lambda d: {str(new_id[int(k)]): v for k, v in d.items() if int(k) in new_id},
                          lambda legacy: {t: new_id[i] for t, i in legacy.items() if i in new_id})
    _slow_files(whole, data, [tokenizer.id_to_token(i) for i in keep])
    (params, size), (params_after, size_after) = size_before, _size(whole.tensors)
    return {"rows_before": before, "rows_after": len(keep), "parameters_before": params,
            "parameters_after": params_after, "bytes_before": size, "bytes_after": size_after,
            "bytes_saved": size - size_after, "corpus_lines": lines, "corpus_tokens": total,
            "target_size": target_size, "min_frequency": min_frequency} | unknown | write_whole(whole)


def _size(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """The parameters (floating-point numbers) and the bytes of `tensors`."""
    return sum(t.numel() for t in tensors.values() if t.is_floating_point()), sum(t.nbytes for t in tensors.values())


def _retokenized(batches, tokenizer, pruned, new_id: dict[int, int], unk: int | None) -> list[int]:
    """Check that lines of kept tokens tokenize as before; the tokens before and after, and the unknown ones of each."""
    counts = np.zeros(4, dtype=np.int64)
    for batch in batches:
        for line, old, new in zip(batch, tokenizer.encode_batch(batch, add_special_tokens=False),
                                  pruned.encode_batch(batch, add_special_tokens=False), strict=True):
            if all(i in new_id for i in old.ids) and [new_id[i] for i in old.ids] != new.ids:
                raise ValueError(f"pruning would change how {line[:60]!r} tokenizes; nothing was written (please "
                                 f"report it with the tokenizer)")
            counts += len(old.ids), len(new.ids), old.ids.count(unk), new.ids.count(new_id.get(unk))
    return counts.tolist()


def _kept_ids(whole: WholeCheckpoint, data: dict[str, Any], tokenizer, used: set[int]) -> list[int]:
    """The ids to keep, in order: `used`, the special and unknown ones, config.json's, for BPE the merges' parts."""
    model = data["model"]
    kept = used | {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    kept |= {unk} if isinstance(unk := _unk_id(tokenizer, model), int) else set()
    _renumber_processor(data.get("post_processor"), lambda i: kept.add(i) or i)
    config = whole.layer.config
    kept |= {i for k in _ID_KEYS if isinstance(i := whole.config.get(k), int) and 0 <= i < config.vocab_size}
    if config.positions_from_padding:  # (positions count from the pad's id: a pad renumbered shifts every position)
        kept |= set(range(config.pad_token_id + 1))
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


def _unk_id(tokenizer, model: dict[str, Any]) -> int | None:
    return tokenizer.token_to_id(model["unk_token"]) if model.get("unk_token") else model.get("unk_id")


def _renumber_tokenizer(data: dict[str, Any], new_id: dict[int, int]) -> None:
    """tokenizer.json's data with only the kept ids, renumbered (vocabulary, merges, added tokens, specials, pad)."""
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
