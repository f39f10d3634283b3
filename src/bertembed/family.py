"""Where each member of BERT's family keeps its embedding tensors (the layer's names are BERT's; a checkpoint's are
its member's, after a model prefix such as "bert."), and which tensors betray another member (docs/family.md).
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from bertembed.config import SUPPORTED

NAMES = ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
         "LayerNorm.weight", "LayerNorm.bias", "projection.weight", "projection.bias")
LEGACY = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}  # TF-era checkpoints
_BERT = {name: "embeddings." + name for name in NAMES[:5]}
_PROJECTIONS = {"albert": "encoder.embedding_hidden_mapping_in", "electra": "embeddings_project",
                "deberta": "embeddings.embed_proj", "deberta-v2": "embeddings.embed_proj"}
_RENAMED = {
    "modernbert": {"word_embeddings.weight": "embeddings.tok_embeddings.weight",
                   "LayerNorm.weight": "embeddings.norm.weight", "LayerNorm.bias": "embeddings.norm.bias"},
    "nomic_bert": {"LayerNorm.weight": "emb_ln.weight", "LayerNorm.bias": "emb_ln.bias"},
}
# the model prefixes of heads (BertForMaskedLM: "bert."), most specific first; "" is a base model's
PREFIXES = {"xlm-roberta": ("roberta.", "xlm_roberta."), "camembert": ("roberta.", "camembert."),
            "deberta-v2": ("deberta.",), "modernbert": ("model.",)}

# parts of tensor names, and the members whose checkpoints use them
NAME_PARTS = {
    "roberta": ("roberta", "xlm-roberta", "camembert"), "xlm_roberta": ("xlm-roberta",), "camembert": ("camembert",),
    "distilbert": ("distilbert",), "q_lin": ("distilbert",), "albert": ("albert",),
    "embedding_hidden_mapping_in": ("albert",), "electra": ("electra",), "embeddings_project": ("electra",),
    "deberta": ("deberta", "deberta-v2"), "rel_embeddings": ("deberta", "deberta-v2"),
    "embed_proj": ("deberta", "deberta-v2"), "mpnet": ("mpnet",), "relative_attention_bias": ("mpnet",),
    "tok_embeddings": ("modernbert",), "emb_ln": ("nomic_bert",),
}


def layout(model_type: str) -> dict[str, str]:
    """The layer's state-dict name -> the key (after the model prefix) of a `model_type` checkpoint."""
    keys = {**_BERT, **_RENAMED.get(model_type, {})}
    if model_type in _PROJECTIONS:
        keys.update({f"projection.{p}": f"{_PROJECTIONS[model_type]}.{p}" for p in ("weight", "bias")})
    return keys


def module_names(model_type: str) -> dict[str, str]:
    """The submodules of the member's transformers embeddings module that it names otherwise than BERT: bertembed's
    name -> transformers' (ModernBERT's `tok_embeddings`, `norm`, `drop`; DeBERTa's `embed_proj`)."""
    names = {"dropout": "drop"} if model_type == "modernbert" else {}
    for ours, key in layout(model_type).items():
        if key.startswith("embeddings.") and key.count(".") == 2 and ours.split(".")[0] != key.split(".")[1]:
            names[ours.split(".")[0]] = key.split(".")[1]
    return names


def prefixes(model_type: str) -> tuple[str, ...]:
    """Model prefixes to try, in order: the member's heads', BERT's for sentence-transformers folders, none."""
    stem = model_type.replace("-", "_")
    return (*PREFIXES.get(model_type, (stem + ".",)), "")


def check_key_family(keys: Iterable[str], where: str, model_type: str = "bert") -> None:
    """ValueError if a tensor name belongs to other members' layouts only (`NAME_PARTS`), not `model_type`'s."""
    for key in keys:
        for part in key.split("."):
            members = NAME_PARTS.get(part)
            if members is not None and model_type not in members:
                raise ValueError(f"{where} holds {key!r}, a tensor of {'/'.join(members)} checkpoints, but its "
                                 f"config says {model_type!r} (or there is no config.json, and the tensors alone "
                                 f"read as BERT's): give the folder with the checkpoint's own config.json; {SUPPORTED}")


def padding_row(positions) -> int | None:
    """The index of an all-zero row of a [P, H] position table (numpy or torch) that has nonzero rows after it: the
    padding row of a RoBERTa-style table, which BERT's never has. Zero rows only at the end (a table extended with
    zeros) or throughout mark no layout: None."""
    rows = (positions == 0).all(1).tolist()
    first = rows.index(True) if True in rows else None
    return first if first is not None and not all(rows[first:]) else None
