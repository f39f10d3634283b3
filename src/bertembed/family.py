"""BERT's family in one table, `MEMBERS` (docs/family.md): adding a member is adding a row. No torch: the cold start
reads this."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

NAMES = ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
         "LayerNorm.weight", "LayerNorm.bias", "projection.weight", "projection.bias")
LEGACY = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}  # TF-era checkpoints


@dataclass(frozen=True, kw_only=True)
class Member:
    """One member, as transformers' modeling and configuration files have it. Submodules are named as bertembed
    names them (BERT's names); paths and keys are those after the model prefix ("bert.")."""

    architectures: str  # the stem of its transformers class names, a regex (BertModel, BertForMaskedLM, ...)
    hf_layer: str | None  # transformers' embeddings class: "<package under transformers.models>.<class>"
    prefixes: tuple[str, ...]  # the model prefixes of its heads' keys (BertForMaskedLM: "bert."), most specific first
    defaults: dict[str, Any] = field(default_factory=dict)  # its config class's defaults that differ from BERT's
    renames: dict[str, str] = field(default_factory=dict)  # its config.json keys -> EmbeddingConfig's names
    facts: dict[str, Any] = field(default_factory=dict)  # EmbeddingConfig's fields that all its checkpoints share
    factorised: str | None = None  # where E != H, its projection E -> H: "output" (after the layer) or "before_norm"
    position_switch: str | None = None  # a config.json key whose False means no position table
    modules: dict[str, str] = field(default_factory=dict)  # submodule -> its path, where not "embeddings.<name>"
    marks: tuple[str, ...] = ()  # parts of tensor names that only its checkpoints (and its relatives') hold
    token_types_input: bool = True  # optimum's ONNX config gives it a `token_type_ids` input
    bench: dict[str, Any] | None = None  # the config keys of `bertembed bench`'s case of it (None: no case)


MEMBERS: dict[str, Member] = {
    "bert": Member(architectures="(Jina)?Bert", hf_layer="bert.BertEmbeddings", prefixes=("bert.",)),
    "roberta": Member(
        architectures="Roberta", hf_layer="roberta.RobertaEmbeddings", prefixes=("roberta.",), marks=("roberta",),
        defaults={"vocab_size": 50265, "pad_token_id": 1}, facts={"positions_from_padding": True},
        token_types_input=False, bench={"type_vocab_size": 1, "max_position_embeddings": 514, "layer_norm_eps": 1e-5}),
    "xlm-roberta": Member(
        architectures="XLMRoberta", hf_layer="xlm_roberta.XLMRobertaEmbeddings", prefixes=("roberta.", "xlm_roberta."),
        marks=("roberta", "xlm_roberta"), defaults={"pad_token_id": 1}, facts={"positions_from_padding": True},
        token_types_input=False),
    "camembert": Member(
        architectures="Camembert", hf_layer="camembert.CamembertEmbeddings", prefixes=("roberta.", "camembert."),
        marks=("roberta", "camembert"), defaults={"pad_token_id": 1}, facts={"positions_from_padding": True},
        token_types_input=False),
    "distilbert": Member(
        architectures="DistilBert", hf_layer="distilbert.Embeddings", prefixes=("distilbert.",),
        marks=("distilbert", "q_lin"), defaults={"dim": 768, "dropout": 0.1},
        renames={"dim": "hidden_size", "dropout": "hidden_dropout_prob"},
        facts={"type_vocab_size": 0, "layer_norm_eps": 1e-12},  # eps fixed in its code
        token_types_input=False, bench={}),
    "albert": Member(
        architectures="Albert", hf_layer="albert.AlbertEmbeddings", prefixes=("albert.",),
        marks=("albert", "embedding_hidden_mapping_in"), modules={"projection": "encoder.embedding_hidden_mapping_in"},
        defaults={"vocab_size": 30000, "hidden_size": 4096, "embedding_size": 128, "hidden_dropout_prob": 0.0},
        facts={"projection": "output"}),  # (always: its encoder maps E -> H even where E = H)
    "electra": Member(
        architectures="Electra", hf_layer="electra.ElectraEmbeddings", prefixes=("electra.",),
        marks=("electra", "embeddings_project"), modules={"projection": "embeddings_project"},
        defaults={"hidden_size": 256, "embedding_size": 128}, factorised="output"),
    "deberta": Member(
        architectures="Deberta", hf_layer="deberta.DebertaEmbeddings", prefixes=("deberta.",),
        marks=("deberta", "rel_embeddings", "embed_proj"), modules={"projection": "embeddings.embed_proj"},
        defaults={"vocab_size": 50265, "type_vocab_size": 0, "layer_norm_eps": 1e-7, "position_biased_input": True},
        facts={"sum_order": "position_first", "mask_output": True, "norm_in_float32": True},
        factorised="before_norm", position_switch="position_biased_input"),
    "deberta-v2": Member(
        architectures="DebertaV2", hf_layer="deberta_v2.DebertaV2Embeddings", prefixes=("deberta.",),
        marks=("deberta", "rel_embeddings", "embed_proj"), modules={"projection": "embeddings.embed_proj"},
        defaults={"vocab_size": 128100, "hidden_size": 1536, "type_vocab_size": 0, "layer_norm_eps": 1e-7,
                  "position_biased_input": True}, facts={"sum_order": "position_first", "mask_output": True},
        factorised="before_norm", position_switch="position_biased_input"),
    "mpnet": Member(
        architectures="MPNet", hf_layer="mpnet.MPNetEmbeddings", prefixes=("mpnet.",),
        marks=("mpnet", "relative_attention_bias"), defaults={"vocab_size": 30527}, token_types_input=False,
        facts={"positions_from_padding": True, "pad_token_id": 1, "type_vocab_size": 0}),  # padding index fixed at 1
    "modernbert": Member(
        architectures="ModernBert", hf_layer="modernbert.ModernBertEmbeddings", prefixes=("model.",),
        marks=("tok_embeddings",), modules={"word_embeddings": "embeddings.tok_embeddings",
                                            "LayerNorm": "embeddings.norm", "dropout": "embeddings.drop"},
        defaults={"vocab_size": 50368, "max_position_embeddings": 8192, "norm_eps": 1e-5, "norm_bias": False,
                  "embedding_dropout": 0.0, "pad_token_id": 50283},
        renames={"norm_eps": "layer_norm_eps", "embedding_dropout": "hidden_dropout_prob"},
        facts={"position_embedding_type": "none", "type_vocab_size": 0},  # rotary positions, in attention
        token_types_input=False, bench={"pad_token_id": 0}),  # (its own pad id, 50283, lies past the bench's vocab)
    "nomic_bert": Member(  # (remote code: no transformers class)
        architectures="NomicBert", hf_layer=None, prefixes=("nomic_bert.",), marks=("emb_ln",),
        modules={"LayerNorm": "emb_ln"}, facts={"position_embedding_type": "none"},  # rotary positions, in attention
        defaults={"vocab_size": 50257, "n_embd": 768, "n_positions": 1024, "layer_norm_epsilon": 1e-5,
                  "embd_pdrop": 0.1},
        renames={"n_embd": "hidden_size", "n_positions": "max_position_embeddings",
                 "layer_norm_epsilon": "layer_norm_eps", "embd_pdrop": "hidden_dropout_prob"}),
}
SUPPORTED = "supported: " + ", ".join(MEMBERS)


def layout(model_type: str) -> dict[str, str]:
    """The layer's state-dict name -> the key (after the model prefix) of a `model_type` checkpoint."""
    modules = MEMBERS[model_type].modules
    return {f"{module}.{param}": f"{modules.get(module, 'embeddings.' + module)}.{param}"
            for module, param in (name.split(".") for name in NAMES) if module != "projection" or module in modules}


def transformers_layer(config, state: dict[str, Any], **settings: Any) -> Any:
    """transformers' own embeddings module of `config`'s member (`hf_layer`), built from `config` with `settings` on
    top, holding `state`'s tables; ValueError where the member has no such module, RuntimeError where tables differ."""
    import importlib

    import transformers

    if MEMBERS[config.model_type].hf_layer is None:
        raise ValueError(f"transformers has no embeddings module of {config.model_type}'s own")
    package, name = MEMBERS[config.model_type].hf_layer.split(".")
    kind = getattr(importlib.import_module(f"transformers.models.{package}.modeling_{package}"), name)
    module = kind(transformers.AutoConfig.for_model(**{**config.to_hf_config(), **settings}))
    keys = layout(config.model_type)
    module.load_state_dict({keys[k].removeprefix("embeddings."): v for k, v in state.items()
                            if keys.get(k, "").startswith("embeddings.")})
    return module


def module_names(model_type: str) -> dict[str, str]:
    """bertembed's name -> transformers' of the embeddings' submodules named otherwise (ModernBERT's tok_embeddings)."""
    return {ours: path.removeprefix("embeddings.") for ours, path in MEMBERS[model_type].modules.items()
            if path.startswith("embeddings.") and path.count(".") == 1}


def check_key_family(keys: Iterable[str], where: str, model_type: str = "bert") -> None:
    """ValueError if a tensor name belongs to other members' layouts only (their `marks`), not `model_type`'s."""
    for key in keys:
        for part in key.split("."):
            members = [name for name, member in MEMBERS.items() if part in member.marks]
            if members and model_type not in members:
                raise ValueError(f"{where} holds {key!r}, a tensor of {'/'.join(members)} checkpoints, but its "
                                 f"config says {model_type!r} (or there is no config.json, and the tensors alone "
                                 f"read as BERT's): give the folder with the checkpoint's own config.json; {SUPPORTED}")
