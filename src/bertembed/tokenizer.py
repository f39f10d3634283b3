"""Text in, ids out: a checkpoint's own tokenizer (its tokenizer.json, or BERT's WordPiece from vocab.txt), a thin
wrapper around Hugging Face's `tokenizers`, which applies each member's pair layout: BERT's `[CLS] A [SEP]` is segment
0, `B [SEP]` segment 1; RoBERTa-style `<s> A </s></s> B </s>` is all segment 0. Torch is imported only for tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertembed.config import EmbeddingConfig, read_json
from bertembed.sources import Source, fetch_hint, resolve

_ID_FIELDS = ("input_ids", "token_type_ids", "attention_mask")
# transformers' truncation strategies (True: longest first, as there; "do_not_truncate": False)
TRUNCATIONS = (True, False, "longest_first", "only_first", "only_second", "do_not_truncate")


@dataclass
class Encoding:
    """Token ids and their companions: [B][L] lists, [B, L] tensors with return_tensors="pt", and for a single text
    (not a batch) flat lists, as transformers does."""

    input_ids: Any
    token_type_ids: Any
    attention_mask: Any
    tokens: list = field(default_factory=list)
    offsets: list = field(default_factory=list)  # (start, end) character spans; (0, 0) for special/padding tokens
    # with return_overflowing_tokens: the text each window comes from (windows of one text are consecutive)
    overflow_to_sample_mapping: list = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def keys(self) -> list[str]:
        return list(_ID_FIELDS)


class Tokenizer:
    """BERT's WordPiece tokenizer for one checkpoint; ids equal transformers' `BertTokenizerFast`."""

    def __init__(self, backend, max_length: int = 512, source: Source | None = None,
                 pad_token: str | None = None, one_segment: bool = False) -> None:
        self.backend = backend
        backend.no_padding()  # (a stored padding would pad every call; __call__ pads where asked)
        self.max_length = max_length
        self.source = source
        found = [t for t in (pad_token, "[PAD]", "<pad>") if t and backend.token_to_id(t) is not None]
        self.pad_token = found[0] if found else "[PAD]"
        self.pad_token_id = backend.token_to_id(self.pad_token) or 0
        self.one_segment = one_segment  # a member with fewer than two segment rows: every token is segment 0
        self._lock = threading.Lock()  # (truncation is the backend's state: set and used by one call at a time)

    def __getstate__(self) -> dict:  # (pickled, as DataLoader workers and copies take it: a lock is not)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path | None = None, *, revision: str | None = None,
                        local_files_only: bool = False) -> Tokenizer:
        """The tokenizer of a hub id, a local folder (or the folder of a weights file), or the bundled default."""
        from tokenizers import Tokenizer as Backend

        source = resolve(name_or_path, revision=revision, local_files_only=local_files_only)
        settings = _read_settings(source)
        path = source.file("tokenizer.json")
        if path is not None:
            try:
                backend = Backend.from_file(str(path))
            except Exception as err:  # tokenizers raises a bare Exception for broken JSON or a missing field
                raise ValueError(f"{path} is not a readable tokenizer ({err}); re-download or fix the file") from err
        elif (vocab := source.file("vocab.txt")) is not None:
            if settings.get("from_padding") or settings.get("cls_token", "[CLS]") != "[CLS]":
                raise ValueError(f"{source.describe()} has a vocab.txt and no tokenizer.json: read alone it frames "
                                 f"texts as BERT's [CLS] A [SEP], but this model's tokenizer uses its own "
                                 f"({settings.get('cls_token', '<s>')} ...). Save its fast tokenizer with transformers "
                                 f"(AutoTokenizer.from_pretrained(...).save_pretrained(folder)) into the folder")
            backend = _wordpiece_from_vocab(vocab, settings)
        else:
            hint = fetch_hint(source, "tokenizer.json", "vocab.txt")
            raise FileNotFoundError(f"{source.describe()} has neither tokenizer.json nor vocab.txt{hint}; pass the "
                                    f"folder of a checkpoint with its tokenizer")
        return cls(backend, settings["max_length"], source, settings.get("pad_token"),
                   settings.get("one_segment", False))

    def __call__(
        self,
        text: str | Sequence[str] | Sequence[tuple[str, str]],
        text_pair: str | Sequence[str] | None = None,
        *,
        padding: bool | str = True,
        truncation: bool = True,
        max_length: int | None = None,
        return_tensors: str | None = None,
        stride: int = 0,
        return_overflowing_tokens: bool = False,
    ) -> Encoding:
        """Tokenize a text, a pair (`text`, `text_pair`), or a batch of either (lists, or a list of pairs).

        padding: True pads a batch to its longest sequence, "max_length" to `max_length`, False not at all.
        truncation: cut to `max_length` (default: the model's position limit): True or "longest_first" cuts the longer
            text of a pair first, "only_first" / "only_second" one of them, as transformers' strategies do.
        return_tensors: None for lists, "pt" for [B, L] torch tensors.
        return_overflowing_tokens: a text longer than `max_length` becomes a batch of windows (transformers' sliding
            windows), each with its own specials, sharing `stride` tokens; `overflow_to_sample_mapping` names the text.
        """
        batched, items = _as_items(text, text_pair)
        for i, item in enumerate(items):
            for value in (item,) if isinstance(item, str) else item:
                check_text(value, f"text {i} of the batch" if batched else "the text")
        if max_length is not None and (not isinstance(max_length, numbers.Integral) or isinstance(max_length, bool)
                                       or max_length < 1):  # (numpy's ints too)
            raise ValueError(f"max_length={max_length!r} must be a positive int (None: the model's limit)")
        limit = self.max_length if max_length is None else int(max_length)
        if type(truncation).__name__ in ("bool", "bool_"):  # (numpy's bool too)
            truncation = "longest_first" if truncation else "do_not_truncate"
        elif truncation not in TRUNCATIONS[2:]:
            raise ValueError(f"truncation={truncation!r}: use one of {TRUNCATIONS}")
        truncate = truncation != "do_not_truncate"
        if padding not in (True, False, "longest", "max_length"):
            raise ValueError(f"padding={padding!r}: use True/'longest', 'max_length' or False")
        if return_tensors not in (None, "pt"):
            raise ValueError(f"return_tensors={return_tensors!r}: use None (lists) or 'pt' (torch tensors)")
        if type(stride) is not int or stride < 0 or return_overflowing_tokens and not truncate:  # (a bool: no)
            raise ValueError(f"stride={stride!r} must be a non-negative int, and windows need truncation=True")
        with self._lock:
            try:  # tokenizers raises a bare Exception (a stride past the window, max_length that cannot fit the
                # specials), or panics (a stride past the room a pair's window leaves: PanicException, a BaseException)
                if truncate:
                    self.backend.enable_truncation(limit, stride=stride, strategy=truncation)
                else:
                    self.backend.no_truncation()
                encodings = self.backend.encode_batch(items)
            except BaseException as err:
                if not isinstance(err, Exception) and type(err).__name__ != "PanicException":
                    raise
                raise ValueError(f"cannot tokenize with max_length={limit}, stride={stride}: "
                                 f"{str(err).splitlines()[0]}") from err
        mapping = []
        if return_overflowing_tokens:
            windows = [(i, w) for i, e in enumerate(encodings) for w in (e, *e.overflowing)]
            mapping, encodings = [i for i, _ in windows], [w for _, w in windows]
            batched = True
        if padding:  # (here, not by tokenizers, which would pad each text's windows on their own)
            longest = limit if padding == "max_length" else max((len(e.ids) for e in encodings), default=0)
            for e in encodings:
                e.pad(longest, pad_id=self.pad_token_id, pad_type_id=0, pad_token=self.pad_token)
        out = Encoding(*([getattr(e, name) for e in encodings] for name in ("ids", "type_ids", "attention_mask",
                                                                            "tokens", "offsets")), mapping)
        if self.one_segment:  # (a member with one segment row, or none: a pair is segment 0 throughout)
            out.token_type_ids = [[0] * len(ids) for ids in out.token_type_ids]
        if return_tensors == "pt":
            import torch

            lengths = sorted({len(ids) for ids in out.input_ids})
            if len(lengths) > 1:
                raise ValueError(f"sequences have different lengths {lengths}: tensors need padding=True")
            for name in _ID_FIELDS:
                setattr(out, name, torch.tensor(getattr(out, name), dtype=torch.long))
        if not batched:  # one text: flat lists (tensors stay [1, L], as transformers does)
            unbatch = {} if return_tensors else {name: getattr(out, name)[0] for name in _ID_FIELDS}
            out = dataclasses.replace(out, tokens=out.tokens[0], offsets=out.offsets[0], **unbatch)
        return out

    def require_tokens(self, text: str, name: str = "the text", text_b: str | None = None,
                       name_b: str = "text_b") -> None:
        """ValueError when `text` (or `text_b`) has no token of its own (empty, or only characters the normalizer
        drops: U+0000, U+200B, ...), so it would be embedded as `[CLS] [SEP]` alone; `__call__` accepts such texts."""
        for value, label in check_not_blank(text, name, text_b, name_b):
            if not self.pieces(value).ids:
                shown = ", ".join(f"U+{ord(c):04X}" for c in dict.fromkeys(value) if not c.isspace())
                shown = shown if len(shown) <= 60 else shown[:60] + "..."
                raise ValueError(f"{label} has no tokens: it holds only characters the tokenizer drops ({shown}: "
                                 f"control, zero-width or other invisible characters), so it would be embedded as "
                                 f"[CLS] [SEP] alone, as an empty text; give a sentence with words")

    def pieces(self, text: str):
        """`text`'s encoding (tokenizers' `Encoding`) without special tokens or truncation."""
        with self._lock:
            self.backend.no_truncation()  # (each __call__ sets it again)
            return self.backend.encode(text, add_special_tokens=False)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of some ids ("[UNK]"-free: every id in range has one)."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()


def check_not_blank(text: str, name: str = "the text", text_b: str | None = None,
                    name_b: str = "text_b") -> list[tuple[str, str]]:
    """Raise ValueError for an empty or all-whitespace `text` or `text_b` (when given), before any checkpoint is
    loaded (see `Tokenizer.require_tokens`); else each text given with its name."""
    named = [(text, name)] if text_b is None else [(text, name), (text_b, name_b)]
    for value, label in named:
        if not check_text(value, label).strip():
            raise ValueError(f'{label} is empty; give a sentence, e.g. "The quick brown fox"')
    return named


def check_text(value: str, name: str = "the text") -> str:
    """`value` if it is a string of valid Unicode, else ValueError: a command-line argument's bytes that are not UTF-8
    arrive as lone surrogates ("caf\\xe9", Latin-1, as "caf\\udce9"), which `tokenizers` refuses with a TypeError."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(value[err.start])
        what = f"byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise ValueError(f"{name} is not valid UTF-8: {what} at character {err.start}; give UTF-8 text (convert "
                         f"Latin-1 text with `iconv -f latin1 -t utf-8`)") from None
    return value


def _as_items(text, text_pair) -> tuple[bool, list]:
    if isinstance(text, str):
        if text_pair is not None and not isinstance(text_pair, str):
            raise ValueError("text is one string, so text_pair must be one string too")
        return False, [text if text_pair is None else (text, text_pair)]
    if not isinstance(text, Sequence) or any(not isinstance(t, (str, tuple, list)) for t in text):
        raise ValueError(f"text must be a string, a list of strings, or a list of (A, B) pairs; got {type(text)}")
    if text_pair is not None and (isinstance(text_pair, str) or len(text_pair) != len(text)):
        raise ValueError(f"text_pair must be a list as long as text ({len(text)} items)")
    pairs = text if text_pair is None else zip(text, text_pair, strict=True)
    items = [t if isinstance(t, str) else tuple(t) for t in pairs]
    for item in items:
        if not isinstance(item, str) and (len(item) != 2 or not all(isinstance(t, str) for t in item)):
            raise ValueError(f"a pair must be two strings, got {item!r}")
    return True, items


def _read_settings(source: Source) -> dict[str, Any]:
    """Normalizer settings, padding token, segments and length limit (less reserved position rows) from the configs."""
    settings: dict[str, Any] = {"do_lower_case": True, "strip_accents": None, "tokenize_chinese_chars": True}
    limits = []
    for name in ("tokenizer_config.json", "config.json"):
        if (path := source.file(name)) is None:
            continue
        data = read_json(path)
        settings.update({k: data[k] for k in ("do_lower_case", "strip_accents", "tokenize_chinese_chars") if k in data})
        for key in ("pad_token", "cls_token"):
            value = data.get(key)
            if isinstance(value, (str, dict)) and name == "tokenizer_config.json":
                settings[key] = value if isinstance(value, str) else value.get("content")
        reserved = 0
        if name == "config.json":  # a config that cannot be read reserves no rows and has segments, as BERT's
            with contextlib.suppress(ValueError):
                read = EmbeddingConfig.from_hf_config(data)
                reserved, settings["one_segment"] = read.first_position, read.type_vocab_size < 2
                settings["from_padding"] = read.positions_from_padding  # (RoBERTa's, MPNet's: <s> A </s></s> B </s>)
        for key in ("model_max_length", "max_position_embeddings"):
            value = data.get(key)
            if isinstance(value, int) and 0 < value < 1_000_000:  # transformers writes 1e30 for "no limit"
                limits.append(value - (reserved if key == "max_position_embeddings" else 0))
    settings["max_length"] = min(limits, default=512)
    return settings


def _wordpiece_from_vocab(vocab: Path, settings: dict[str, Any]):
    """`tokenizers`' BertWordPiece pipeline, transformers' BertTokenizerFast, built from a vocab.txt."""
    from tokenizers.implementations import BertWordPieceTokenizer

    try:
        return BertWordPieceTokenizer(str(vocab), handle_chinese_chars=settings["tokenize_chinese_chars"],
                                      strip_accents=settings["strip_accents"], lowercase=settings["do_lower_case"])
    except TypeError as err:  # (its error for a vocabulary without [CLS] or [SEP])
        raise ValueError(f"{vocab} has no [CLS] or [SEP] token; is it a BERT vocabulary?") from err
    except Exception as err:  # tokenizers raises a bare Exception, e.g. for a file that is not UTF-8
        raise ValueError(f"{vocab} is not a readable vocabulary ({err}); it must be UTF-8 text, one token a line: "
                         f"re-download or fix the file") from err
