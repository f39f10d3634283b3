"""The embedding layer's configuration: BERT's defaults, read from and written to Hugging Face's config.json."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from bertembed.family import MEMBERS, SUPPORTED

log = logging.getLogger(__name__)

PositionType = Literal["absolute", "sinusoidal", "none"]
POSITION_TYPES: tuple[str, ...] = get_args(PositionType)
_CHOICES = {"position_embedding_type": POSITION_TYPES, "projection": ("none", "output", "before_norm"),
            "sum_order": ("type_first", "position_first")}

# what a member implies (BERT's value unless its row says otherwise): never written to config.json nor contradicted
_FACTS = ("positions_from_padding", "sum_order", "norm_bias", "norm_in_float32", "projection", "mask_output")


def implied_facts(model_type: str, embedding_size: int | None, position_embedding_type: str) -> dict[str, Any]:
    """The `_FACTS` that `model_type` fixes: its row's `facts` over BERT's (save those its config.json holds), its
    `factorised` projection only where E != H, and no position counting without a position table."""
    member = MEMBERS[model_type]
    facts = {**{name: getattr(EmbeddingConfig, name) for name in _FACTS if name not in member.defaults}, **member.facts}
    if member.factorised is not None:
        facts["projection"] = "none" if embedding_size is None else member.factorised
    if position_embedding_type == "none" and "position_embedding_type" not in member.facts:
        facts["positions_from_padding"] = False
    return facts


@dataclass(frozen=True)
class EmbeddingConfig:
    """Sizes and constants of the embedding layer of BERT or one of its family (`MEMBERS`, docs/family.md): BERT's
    config.json keys, then the facts in which the family differs, which every engine reads."""

    vocab_size: int = 30522  # WordPiece vocabulary of bert-base-uncased
    hidden_size: int = 768  # H: the width the encoder takes
    max_position_embeddings: int = 512  # rows of the position table ([CLS] and [SEP] included; RoBERTa's 2 reserved)
    type_vocab_size: int = 2  # segments A and B; 0: no segment table (DistilBERT, MPNet, ModernBERT, DeBERTa v3)
    layer_norm_eps: float = 1e-12  # BERT's TensorFlow value, not PyTorch's default 1e-5: it changes outputs
    hidden_dropout_prob: float = 0.1
    initializer_range: float = 0.02  # std of the normal init of fresh tables, as BERT's
    pad_token_id: int | None = 0  # row 0 of the word table is [PAD]; nn.Embedding keeps its gradient at zero
    #                                 (None, as a config.json's null: no padding row, every row trained)
    # "absolute": a learned table. "sinusoidal": the fixed sin/cos table of "Attention Is All You Need" (a buffer,
    # never trained). "none": no position vector is added here (relative, rotary or ALiBi positions, in attention).
    position_embedding_type: PositionType = "absolute"
    model_type: str = "bert"  # which member: the key layout of its checkpoints and the keys of its config.json
    embedding_size: int | None = None  # E, the tables' width, where it differs from H (ALBERT, ELECTRA, DeBERTa)
    positions_from_padding: bool = False  # RoBERTa, MPNet: positions count from pad_token_id + 1, pads get pad's row
    sum_order: str = "type_first"  # (word + type) + position; DeBERTa: "position_first", (word + position) + type
    norm_bias: bool = True  # ModernBERT's LayerNorm has none
    norm_in_float32: bool = False  # DeBERTa v1's LayerNorm computes in float32 whatever the input's dtype
    # a Linear E -> H: "output" after the layer (ALBERT, ELECTRA: `layer.project`), "before_norm" (DeBERTa)
    projection: str = "none"
    mask_output: bool = False  # DeBERTa multiplies the output by the attention mask
    # the rest of the checkpoint's config.json (layers, heads, ...), written back by save_pretrained; not compared
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        """Every field's type and range, for every path alike; numpy's integers and reals are stored as Python's."""
        if self.embedding_size == self.hidden_size:
            object.__setattr__(self, "embedding_size", None)
        for name in ("vocab_size", "hidden_size", "max_position_embeddings", "type_vocab_size",
                     *(["pad_token_id"] if self.pad_token_id is not None or self.positions_from_padding else []),
                     *(["embedding_size"] if self.embedding_size is not None else [])):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"EmbeddingConfig.{name} must be an integer, got {_shown(value)}")
            object.__setattr__(self, name, int(value))
            if value < (least := 0 if name in ("pad_token_id", "type_vocab_size") else 1):
                raise ValueError(f"EmbeddingConfig.{name} must be an integer >= {least}, got {value}")
        for name in ("layer_norm_eps", "hidden_dropout_prob", "initializer_range"):
            value, real = getattr(self, name), math.nan
            with contextlib.suppress(OverflowError):  # an integer past float's range
                real = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else real
            if not math.isfinite(real):
                raise ValueError(f"EmbeddingConfig.{name} must be a finite real number, got {_shown(value)}")
            object.__setattr__(self, name, real)
        for name in ("positions_from_padding", "norm_bias", "norm_in_float32", "mask_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EmbeddingConfig.{name} must be True or False, got {_shown(getattr(self, name))}")
        if not isinstance(self.model_type, str) or self.model_type not in MEMBERS:
            raise ValueError(f"model_type={_shown(self.model_type)} is not a member bertembed reads; {SUPPORTED}")
        for name, choices in _CHOICES.items():
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                raise ValueError(f"{name}={_shown(getattr(self, name))} is not one of {choices}")
        for name, ok, limit in (
                ("pad_token_id", self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size,
                 f"lie in [0, vocab_size={self.vocab_size})"),
                ("hidden_dropout_prob", 0 <= self.hidden_dropout_prob < 1, "lie in [0, 1)"),
                ("layer_norm_eps", self.layer_norm_eps > 0, "be positive"),
                ("initializer_range", self.initializer_range >= 0, "be >= 0 (a standard deviation)")):
            if not ok:
                raise ValueError(f"EmbeddingConfig.{name} must {limit}, got {getattr(self, name)}")
        if self.position_embedding_type == "sinusoidal" and self.table_width % 2:
            raise ValueError(f"a sinusoidal position table needs an even width, got {self.table_width}")
        if self.positions_from_padding and self.position_embedding_type == "none":
            raise ValueError("positions_from_padding needs a position table; position_embedding_type is 'none'")
        if not isinstance(self.extra, dict):
            raise ValueError(f"EmbeddingConfig.extra must be a dict of config.json keys, got {_shown(self.extra)}")
        facts = implied_facts(self.model_type, self.embedding_size, self.position_embedding_type)
        if wrong := {k: v for k, v in facts.items() if getattr(self, k) != v}:
            raise ValueError(f"model_type={self.model_type!r} implies {wrong} (transformers computes it so); build "
                             f"the config with EmbeddingConfig.for_member({self.model_type!r}, ...)")

    @property
    def table_width(self) -> int:
        """E: the width of the tables and of the layer's sum (H unless `embedding_size` says otherwise)."""
        return self.embedding_size or self.hidden_size

    @property
    def output_width(self) -> int:
        """The width of the layer's output: H after a projection inside the layer (DeBERTa), else E."""
        return self.hidden_size if self.projection == "before_norm" else self.table_width

    @property
    def first_position(self) -> int:
        """The first position row a token uses: pad_token_id + 1 where positions count from the padding, else 0."""
        return self.pad_token_id + 1 if self.positions_from_padding else 0

    @classmethod
    def bert_base(cls, **overrides: Any) -> EmbeddingConfig:
        """bert-base-uncased: hidden size 768."""
        return cls(**overrides)

    @classmethod
    def bert_large(cls, **overrides: Any) -> EmbeddingConfig:
        """bert-large-uncased: hidden size 1024."""
        return cls(**{"hidden_size": 1024, **overrides})

    @classmethod
    def for_member(cls, model_type: str, **keys: Any) -> EmbeddingConfig:
        """A config of `model_type` with its facts applied, from its config.json `keys` (or this class's field names),
        the rest its defaults: `for_member("roberta", vocab_size=100)`."""
        return cls.from_hf_config({**keys, "model_type": model_type})

    @classmethod
    def from_hf_config(cls, source: dict[str, Any] | str | Path) -> EmbeddingConfig:
        """Build from a Hugging Face config of any member of `MEMBERS`: a dict, a config.json path, or a folder. Keys
        the layer does not use are kept in `extra`, omitted keys take the member's defaults; relative, rotary and
        ALiBi positions (in attention, not in this layer) read as "none"."""
        where = "the config dict"
        if not isinstance(source, dict):
            path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}; pass a folder that holds one, or a dict")
            source, where = read_json(path, "an object of config keys"), str(path)
        model_type = check_config_family(source, where)
        member = MEMBERS[model_type]
        given = {**member.defaults, **{k: v for k, v in source.items() if v is not None or k == "pad_token_id"}}
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name != "extra"}
        renamed = {member.renames.get(k, k): v for k, v in given.items()}
        kwargs = defaults | {k: v for k, v in renamed.items() if k in defaults}
        kwargs["extra"] = {k: v for k, v in source.items() if k not in defaults and k not in member.renames}
        kind = kwargs["position_embedding_type"]
        if isinstance(kind, str) and kind not in POSITION_TYPES:
            log.info("position_embedding_type=%r adds no position vector in this layer: using 'none'", kind)
            kwargs["position_embedding_type"] = "none"
        if member.position_switch is not None and given.get(member.position_switch) is False:
            kwargs["position_embedding_type"] = "none"
        try:
            if kwargs["embedding_size"] == kwargs["hidden_size"]:
                kwargs["embedding_size"] = None
            kwargs |= implied_facts(model_type, kwargs["embedding_size"], kwargs["position_embedding_type"])
            return cls(**kwargs)
        except ValueError as err:
            raise ValueError(f"{where}: {err}; fix the config") from err

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers' config class of the member reads back, as `from_hf_config` does."""
        member = MEMBERS[self.model_type]
        back = {v: k for k, v in member.renames.items()}
        implied = implied_facts(self.model_type, self.embedding_size, self.position_embedding_type)
        ours = {back.get(f.name, f.name): getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("extra", "model_type", "embedding_size", *implied)}
        if "embedding_size" in member.defaults or self.embedding_size is not None:  # (ALBERT's, ELECTRA's: always)
            ours["embedding_size"] = self.table_width
        if member.position_switch is not None:
            ours[member.position_switch] = self.position_embedding_type != "none"
        return {"model_type": self.model_type, **self.extra, **ours}

    def replace(self, **changes: Any) -> EmbeddingConfig:
        return dataclasses.replace(self, **changes)


class NotInThisMember(ValueError):
    """An analysis asked for a table this member of the family does not have (a fact to report, not an error)."""


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


def check_config_family(config: dict[str, Any], where: str) -> str:
    """The member (`MEMBERS`) a config.json dict describes, from `model_type` ("bert" when absent); ValueError naming
    the supported members for any other, or for `architectures` (when given) that are not that member's classes."""
    model_type = config.get("model_type", "bert")
    if not isinstance(model_type, str) or model_type not in MEMBERS:
        raise ValueError(f"{where} has model_type {str(model_type)[:60]!r}, which bertembed does not read; {SUPPORTED}")
    architectures = [] if config.get("architectures") is None else config["architectures"]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ValueError(f"{where}: 'architectures' must be a list of class names, got {str(architectures)[:80]}; "
                         f"fix the file")
    stem = MEMBERS[model_type].architectures
    if foreign := [a for a in architectures if not re.fullmatch(rf"(TF|Flax)?{stem}\w*", a, re.IGNORECASE)]:
        raise ValueError(f"{where} says model_type {model_type!r} but names architecture {foreign[0]!r}, not one of "
                         f"its classes: the config is inconsistent; fix it")
    return model_type
