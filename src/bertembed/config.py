"""The embedding layer's configuration: BERT's defaults, read from and written to Hugging Face's config.json."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

SUPPORTED = "only BERT checkpoints (model_type 'bert') are supported for now"
_BERT_CLASS = re.compile(r"(TF|Flax)?Bert[A-Z]\w*")  # BertModel, BertForMaskedLM, TFBertForPreTraining, ...
PositionType = Literal["absolute", "sinusoidal", "none"]
POSITION_TYPES: tuple[str, ...] = ("absolute", "sinusoidal", "none")


@dataclass(frozen=True)
class EmbeddingConfig:
    """Sizes and constants of BERT's embedding layer.

    Field names are Hugging Face's config.json keys, so a config moves between the two without a table of renames.
    """

    vocab_size: int = 30522  # WordPiece vocabulary of bert-base-uncased
    hidden_size: int = 768
    max_position_embeddings: int = 512  # longest sequence, [CLS] and [SEP] included
    type_vocab_size: int = 2  # segments A and B
    layer_norm_eps: float = 1e-12  # BERT's TensorFlow value, not PyTorch's default 1e-5: it changes outputs
    hidden_dropout_prob: float = 0.1
    initializer_range: float = 0.02  # std of the normal init of fresh tables, as BERT's
    pad_token_id: int = 0  # row 0 of the word table is [PAD]; nn.Embedding keeps its gradient at zero
    # "absolute": BERT's learned table. "sinusoidal": the fixed sin/cos table of "Attention Is All You Need"
    # (a buffer, never trained). "none": no position vector is added (checkpoints with relative positions).
    position_embedding_type: PositionType = "absolute"
    # The rest of the checkpoint's config.json (layers, heads, ...), written back by save_pretrained so transformers
    # can still build the whole model from a saved folder. Not part of equality.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        """Every field's type and range, checked here so that every path (a config.json, the torch layer, the numpy
        copy, the kernels) gets the same checks; integers and reals from numpy are stored as Python's."""
        for name in ("vocab_size", "hidden_size", "max_position_embeddings", "type_vocab_size", "pad_token_id"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"EmbeddingConfig.{name} must be an integer, got {_shown(value)}")
            object.__setattr__(self, name, int(value))
            if name != "pad_token_id" and value < 1:
                raise ValueError(f"EmbeddingConfig.{name} must be a positive integer, got {value}")
        for name in ("layer_norm_eps", "hidden_dropout_prob", "initializer_range"):
            value = getattr(self, name)
            real = math.nan
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                try:
                    real = float(value)
                except OverflowError:  # an integer past float's range
                    pass
            if not math.isfinite(real):
                raise ValueError(f"EmbeddingConfig.{name} must be a finite real number, got {_shown(value)}")
            object.__setattr__(self, name, real)
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"EmbeddingConfig.pad_token_id={self.pad_token_id} must lie in [0, vocab_size={self.vocab_size})"
            )
        if not 0.0 <= self.hidden_dropout_prob < 1.0:
            raise ValueError(f"EmbeddingConfig.hidden_dropout_prob must lie in [0, 1), got {self.hidden_dropout_prob}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"EmbeddingConfig.layer_norm_eps must be positive, got {self.layer_norm_eps}")
        if self.initializer_range < 0:
            raise ValueError(f"EmbeddingConfig.initializer_range is a standard deviation, >= 0; got "
                             f"{self.initializer_range}")
        if not isinstance(self.position_embedding_type, str) or self.position_embedding_type not in POSITION_TYPES:
            raise ValueError(
                f"position_embedding_type={_shown(self.position_embedding_type)} is not one of {POSITION_TYPES}"
            )
        if self.position_embedding_type == "sinusoidal" and self.hidden_size % 2:
            raise ValueError(f"a sinusoidal position table needs an even hidden_size, got {self.hidden_size}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"EmbeddingConfig.extra must be a dict of config.json keys, got {_shown(self.extra)}")

    @classmethod
    def bert_base(cls, **overrides: Any) -> EmbeddingConfig:
        """bert-base-uncased: hidden size 768."""
        return cls(**overrides)

    @classmethod
    def bert_large(cls, **overrides: Any) -> EmbeddingConfig:
        """bert-large-uncased: hidden size 1024."""
        return cls(**{"hidden_size": 1024, **overrides})

    @classmethod
    def from_hf_config(cls, source: dict[str, Any] | str | Path) -> EmbeddingConfig:
        """Build from a Hugging Face config: a dict, a config.json path, or a folder holding one.

        Keys the embedding layer does not use (layer counts, heads, ...) are ignored. Relative position types
        ("relative_key", "relative_key_query") put positions into attention, not into this layer, so they map to "none".
        """
        where = "the config dict"
        if not isinstance(source, dict):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}; pass a folder that holds one, or a dict")
            source, where = read_json(path, "an object of config keys"), str(path)
        check_config_family(source, where)  # never a RoBERTa read as if it were BERT
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: source[k] for k in names if source.get(k) is not None}
        kwargs["extra"] = {k: v for k, v in source.items() if k not in names}
        kind = kwargs.get("position_embedding_type", "absolute")
        if isinstance(kind, str) and kind.startswith("relative"):
            log.info("position_embedding_type=%r adds no position vector in this layer: using 'none'", kind)
            kwargs["position_embedding_type"] = "none"
        try:
            return cls(**kwargs)
        except ValueError as err:
            raise ValueError(f"{where}: {err}; fix the config") from err

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers' BertConfig reads back (the encoder keys keep their defaults)."""
        ours = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}  # (no deep copy)
        return {"model_type": "bert", "architectures": ["BertModel"], **self.extra, **ours}

    def replace(self, **changes: Any) -> EmbeddingConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _shown(value: Any) -> str:
    """A value and its type for an error message, cut short (a config.json may hold a long or deep one)."""
    text = repr(value) if not isinstance(value, (list, dict)) else f"a {type(value).__name__}"
    return f"{text[:60]} ({type(value).__name__})"


def read_json(path: str | Path, what: str = "an object") -> dict:
    """A JSON object from a checkpoint's file; ValueError naming the file when it is broken or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, PermissionError):
        raise  # (their messages name the file)
    except OSError as err:  # a folder under the file's name, an I/O error
        raise ValueError(f"cannot read {path} ({err.strerror or err}); re-download or fix the file") from err
    except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, a number too long to convert, nesting too deep
        raise ValueError(f"{path} is not valid JSON ({str(err)[:200]}); re-download or fix the file") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, expected {what}")
    return data


def check_config_family(config: dict[str, Any], where: str) -> None:
    """ValueError unless a config.json dict describes BERT: `model_type` "bert" or absent, and `architectures`
    (when given) all BERT classes."""
    model_type = config.get("model_type")
    if model_type is not None and model_type != "bert":
        raise ValueError(f"{where} has model_type {model_type!r}: {SUPPORTED}")
    architectures = config.get("architectures")
    if architectures is None:
        return
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ValueError(f"{where}: 'architectures' must be a list of class names, got {str(architectures)[:80]}; "
                         f"fix the file")
    foreign = [a for a in architectures if not _BERT_CLASS.fullmatch(a)]
    if foreign:
        raise ValueError(f"{where} names architecture {foreign[0]!r}, not a BERT class: {SUPPORTED}")
