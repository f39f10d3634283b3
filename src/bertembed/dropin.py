"""The drop-in: bertembed's fused layer in place of the embedding layer of a transformers model of BERT's family
(`patch`, `unpatch`). It shares the old layer's submodules under their names, so parameters, tied weights, state-dict
keys and optimizer state stay as they were, and takes its hooks. (Not named `patch`: it would shadow the function.)"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn

from bertembed.config import EmbeddingConfig, implied_facts
from bertembed.embeddings import SUBMODULES, BertEmbeddings, checked_backend
from bertembed.family import MEMBERS, module_names

log = logging.getLogger(__name__)

# The layer's own hooks move with it, as the dicts themselves: their handles still remove them.
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook")
# transformers' embeddings class of each member ("<package under transformers.models>.<class>") -> model_type
_HF_LAYERS = {member.hf_layer: model_type for model_type, member in MEMBERS.items() if member.hf_layer is not None}


def _member(module: nn.Module) -> str | None:
    """The member whose transformers embeddings layer `module` is exactly (look-alikes and subclasses: None)."""
    kind = type(module)
    if not kind.__module__.startswith("transformers.models."):
        return None
    return _HF_LAYERS.get(f"{kind.__module__.split('.')[2]}.{kind.__name__}")


def _base(module: nn.Module | None) -> nn.Module | None:
    """The module a peft wrapper wraps (`get_base_layer()`, `original_module`), or the module itself."""
    if hasattr(module, "get_base_layer"):
        return module.get_base_layer()
    original = getattr(module, "original_module", None)
    return original if isinstance(original, nn.Module) else module


def _config_of(hf: nn.Module, member: str) -> EmbeddingConfig:
    """The layer's sizes and constants, read from its own tables (a LoRA's, from the table it wraps), and the member's
    facts. (transformers 4's DeBERTa's dropout: StableDropout, whose rate is drop_prob.)"""
    names = module_names(member)
    word, positions, segments, norm, projection, dropout = (_base(getattr(hf, names.get(n, n), None)) for n in (
        "word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "projection", "dropout"))
    vocab, width = word.weight.shape
    hidden = width if projection is None else projection.weight.shape[0]
    kind = "absolute" if positions is not None else "none"
    pad = getattr(hf, "padding_idx", None)  # (RoBERTa's positions count from the layer's own; MPNet's is 1)
    return EmbeddingConfig(**{
        "model_type": member, "vocab_size": vocab, "embedding_size": width, "hidden_size": hidden,
        "max_position_embeddings": positions.weight.shape[0] if positions is not None else
        getattr(hf, "position_ids", torch.empty(1, 512)).shape[-1],
        "type_vocab_size": 0 if segments is None else segments.weight.shape[0],
        "layer_norm_eps": getattr(norm, "eps", getattr(norm, "variance_epsilon", None)),
        "hidden_dropout_prob": getattr(dropout, "p", getattr(dropout, "drop_prob", 0.0)),
        "pad_token_id": word.padding_idx if pad is None else pad, "position_embedding_type": kind,
        "norm_bias": getattr(norm, "bias", None) is not None,  # (ModernBERT's own; the facts fix the others')
        **implied_facts(member, None if width == hidden else width, kind)})


# The keywords of the transformers layer that bertembed's forward understands (the cache offset under 4's and 5's names)
_UNDERSTOOD = frozenset(("input_ids", "token_type_ids", "position_ids", "inputs_embeds", "past_key_values_length",
                         "cache_length", "mask"))
_RENAMED = {"input_embeds": "inputs_embeds"}  # DistilBERT's name for it before transformers 4.47
_warned: set = set()  # (kind, the unknown arguments) already logged


class PatchedBertEmbeddings(BertEmbeddings):
    """bertembed's layer in place of a transformers embeddings layer, taking exactly the arguments of its `forward`; an
    argument bertembed does not know, not at its default, runs transformers' own layer on these tables (a warning).
    bertembed's names reach the submodules the member names otherwise (ModernBERT's `tok_embeddings`)."""

    _hf_params: tuple[str, ...] = ()  # its parameters after self, in order
    _hf_defaults: dict = {}
    _hf_kwargs = False  # whether it takes **kwargs (MPNet's)

    def __getattr__(self, name: str):
        modules, stored = self.__dict__["_modules"], self.__dict__.get("_stored_as", {})
        return modules.get(stored[name]) if name in stored and name not in modules else super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:  # (an assignment under bertembed's name reaches the stored one)
        super().__setattr__(self.__dict__.get("_stored_as", {}).get(name, name), value)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        given = _bind(self._hf_params, self._hf_kwargs, args, kwargs, type(self._bertembed_original).__name__)
        foreign = [k for k, v in given.items()
                   if _RENAMED.get(k, k) not in _UNDERSTOOD and not _is_default(v, self._hf_defaults.get(k, None))]
        if foreign:
            kind = type(self._bertembed_original)
            if (kind, tuple(foreign)) not in _warned:
                _warned.add((kind, tuple(foreign)))
                log.warning("bertembed.patch: %s.forward's argument(s) %s are unknown to bertembed: transformers' own "
                            "forward runs those calls (exact, not fused)", kind.__name__, ", ".join(foreign))
            return _synced_original(self).forward(**given)
        # (no walrus here: it makes a cell variable, which torch.compile cannot read; an argument its forward only
        # swallows in **kwargs, as MPNet's a cache offset, it ignores: so does this)
        return super().forward(**{_RENAMED.get(k, k): v for k, v in given.items()
                                  if _RENAMED.get(k, k) in _UNDERSTOOD and k in self._hf_params})


def _bind(params: tuple[str, ...], takes_kwargs: bool, args: tuple, kwargs: dict, owner: str) -> dict:
    """The arguments by name, with Python's errors (`inspect.Signature.bind`, written out for torch.compile)."""
    if len(args) > len(params):
        raise TypeError(f"{owner}.forward() takes {len(params) + 1} positional arguments but {len(args) + 1} were "
                        f"given")
    given = dict(zip(params, args, strict=False))  # (the first len(args) names)
    for name, value in kwargs.items():
        if name not in params and not takes_kwargs:
            raise TypeError(f"{owner}.forward() got an unexpected keyword argument {name!r}")
        if name in given:
            raise TypeError(f"{owner}.forward() got multiple values for argument {name!r}")
        given[name] = value
    return given


def _is_default(value, default) -> bool:
    return value is default or (type(value) in (int, float, bool, str) and type(default) is type(value)
                                and value == default)


@functools.cache
def _patched_class(hf_class: type) -> type:
    """`PatchedBertEmbeddings` that is also an `hf_class`, for transformers' checks by type (`_init_weights`, ties)."""
    return type(f"Patched{hf_class.__name__}", (PatchedBertEmbeddings, hf_class), {
        "__module__": __name__,  # (made at run time: pickled and deep-copied through `_unpickled`)
        "__reduce_ex__": lambda self, protocol: (_unpickled, (hf_class,), self.__getstate__())})


def _unpickled(hf_class: type) -> nn.Module:
    return nn.Module.__new__(_patched_class(hf_class))


def fused_from(hf: nn.Module, backend: str = "auto") -> BertEmbeddings:
    """A bertembed layer that uses `hf`'s own submodules and buffers (nothing copied, nothing allocated): the same
    submodules, buffers (names and persistence) and class ancestry as `hf`, and nothing more."""
    member = _member(hf) or "bert"  # (a subclass of BERT's layer, called directly)
    config = _config_of(hf, member)  # a wrapper may build its weight when read (peft's)
    kind = type(hf)
    params = list(inspect.signature(kind.forward).parameters.values())[1:]  # (after self; *args refused)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ValueError(f"{kind.__module__}.{kind.__name__}.forward takes *args; bertembed.patch cannot tell which "
                         f"arguments it passes on. Use an older transformers, or bertembed's layer directly")
    named = [p for p in params if p.kind is not p.VAR_KEYWORD]
    missing = {"input_ids", "inputs_embeds"} - {_RENAMED.get(p.name, p.name) for p in named}
    if missing:
        raise ValueError(f"{kind.__module__}.{kind.__name__}.forward has no argument(s) {sorted(missing)}: this "
                         f"transformers release changed the layer's arguments, which bertembed.patch does not know")
    layer = _unpickled(kind)  # (no __init__: every table and buffer is hf's own; none is allocated)
    nn.Module.__init__(layer)
    layer.config, layer.backend, layer._stored_as = config, checked_backend(backend), module_names(member)
    layer._hf_params, layer._hf_defaults = tuple(p.name for p in named), {p.name: p.default for p in named}
    layer._hf_kwargs = len(named) < len(params)  # (it takes **kwargs)
    # transformers' submodules under their own names, in their order (state-dict keys unchanged)
    theirs = [layer._stored_as.get(name, name) for name in SUBMODULES]
    layer._modules.update({k: m for k, m in hf._modules.items() if k in theirs})
    layer._modules.update({k: None for k in theirs if k not in layer._modules})
    layer._buffers.update(hf._buffers)
    layer._non_persistent_buffers_set.update(hf._non_persistent_buffers_set)
    _move_state(hf, layer)
    object.__setattr__(layer, "_bertembed_original", hf)  # not a submodule: stays out of state_dict and .to()
    return layer


def _move_state(old: nn.Module, new: nn.Module) -> None:
    """Give `new` the hooks and training flag of `old` (not by `train()`, which would set the shared submodules)."""
    for name in _HOOKS:
        if name in old.__dict__:
            object.__setattr__(new, name, old.__dict__[name])
    new.training = old.training


def patch(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Replace every transformers embeddings layer of BERT's family in `model` (BertModel, ..., ModernBertModel, their
    heads, sentence-transformers models built on them) with bertembed's fused layer, in place, keeping the weights;
    returns `model`. A model patched before keeps its fused layers, now running `backend`. transformers 4's layers
    with relative position types (no position rows) are left as they are, with a warning."""
    swapped, left = [], []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            where = f"{parent_name}.{name}".lstrip(".")
            if _member(child) is not None:
                # transformers 4's "relative_key" and "relative_key_query" add no position rows; 5 has no such type
                if (kind := getattr(child, "position_embedding_type", "absolute")) != "absolute":
                    left.append(f"{where} (position_embedding_type={kind!r})")
                    continue
                setattr(parent, name, fused_from(child, backend))
            elif isinstance(child, PatchedBertEmbeddings):
                child.backend = checked_backend(backend)
            else:
                continue
            swapped.append(where)
    if left:
        log.warning("bertembed.patch: left transformers' layer at %s: it adds no position rows there (the positions "
                    "enter the attention), and the fused layer always adds them", ", ".join(left))
    if not swapped:
        found = f"only layers it cannot replace: {', '.join(left)}" if left else "no embeddings layer of BERT's family"
        raise ValueError(f"{found} in {type(model).__name__}: bertembed.patch works on transformers models of "
                         f"{', '.join(sorted(set(_HF_LAYERS.values())))} (and their heads, and sentence-transformers "
                         f"models built on them)")
    log.info("bertembed.patch: fused embeddings (backend=%r) at %s", backend, ", ".join(swapped))
    return model


def _synced_original(layer: nn.Module) -> nn.Module:
    """The layer that `layer` replaced, given `layer`'s current submodules and buffers (`.to()` may replace them)."""
    original = layer._bertembed_original
    original._modules.update({name: layer._modules[name] for name in original._modules})
    original._buffers.update({name: layer._buffers[name] for name in original._buffers})
    return original


def unpatch(model: nn.Module) -> nn.Module:
    """Put back the transformers layers that `patch` replaced (current weights and buffers). Returns `model`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            original = getattr(child, "_bertembed_original", None)
            if original is not None:
                _synced_original(child)
                _move_state(child, original)
                setattr(parent, name, original)
    return model
