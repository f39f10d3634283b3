"""Whether the fused kernel may stand in for a layer's submodules, and the tables it reads from them.

The reference layer calls its five submodules (`word_embeddings`, `token_type_embeddings`, `position_embeddings`,
`LayerNorm`, `dropout`); the fused kernel reads their tables and calls none of them. That computes the same thing only
while each submodule runs its type's own forward (not a subclass's, or a wrapper's such as a LoRA adapter), with no
hooks (captum's layer attributions, activation capture, a global module hook) and no `nn.Embedding` option the kernels
do not have. Otherwise the reference layer runs, with the reason logged once.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from bertembed.embeddings import SUBMODULE_VERDICT, SinusoidalPositions

_FORWARDS = {"word_embeddings": (nn.Embedding.forward,), "token_type_embeddings": (nn.Embedding.forward,),
             "position_embeddings": (nn.Embedding.forward, SinusoidalPositions.forward),
             "LayerNorm": (nn.LayerNorm.forward,), "dropout": (nn.Dropout.forward,)}
_GLOBAL_HOOKS = (_torch_module._global_forward_hooks, _torch_module._global_forward_pre_hooks,
                 _torch_module._global_backward_hooks, _torch_module._global_backward_pre_hooks)
_TABLES = ("word_embeddings", "token_type_embeddings", "position_embeddings")


def _own_forward_reason(layer) -> str | None:
    """Why a submodule's own forward must run (its type, its hooks, hooks on every module), or None. (Modules are read
    through their dicts: see `short_path_tables`.)"""
    if any(_GLOBAL_HOOKS):
        return "module hooks are registered globally (torch.nn.modules.module.register_module_forward_hook and the " \
               "like), and they run only where a submodule's own forward does"
    modules = layer.__dict__["_modules"]
    for name, forwards in _FORWARDS.items():
        module = modules.get(name)
        if module is None and name == "position_embeddings":  # position_embedding_type="none"
            continue
        kind = type(module)
        if getattr(kind, "forward", None) not in forwards:
            return f"{name} is a {kind.__module__}.{kind.__qualname__}, whose own forward the fused kernel does not " \
                   "compute"
        state = module.__dict__
        if "forward" in state:
            return f"{name} has a forward of its own set on it (as accelerate's hooks set one), which must run"
        if state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"] \
                or state["_backward_pre_hooks"]:
            return f"{name} has hooks, which run only when its own forward does"
    norm = modules["LayerNorm"]
    params = norm.__dict__["_parameters"]  # (`norm.weight` goes through `nn.Module.__getattr__`: 400 ns)
    if (params.get("weight") is None or params.get("bias") is None) and (norm.weight is None or norm.bias is None):
        return "LayerNorm has no weight or no bias (elementwise_affine=False or bias=False)"
    if norm.eps != layer.config.layer_norm_eps:
        return f"LayerNorm.eps={norm.eps} differs from config.layer_norm_eps={layer.config.layer_norm_eps}"
    return None


def lookup_reason(layer, autograd: bool) -> str | None:
    """Why an `nn.Embedding` option of the layer's tables needs the reference, or None: `max_norm` (rows renormalised
    in place as they are read), and under autograd `scale_grad_by_freq` and `sparse` (the kernels write dense,
    unscaled gradients)."""
    modules = layer.__dict__["_modules"]
    for name in _TABLES:
        table = modules.get(name)
        if not isinstance(table, nn.Embedding):
            continue
        options = table.__dict__
        if options["max_norm"] is not None:
            return f"{name} has max_norm={table.max_norm} (rows renormalised as they are read)"
        if autograd and (options["sparse"] or options["scale_grad_by_freq"]):
            option = "sparse=True" if table.sparse else "scale_grad_by_freq=True"
            return f"{name} has {option} (the kernels write dense, unscaled gradients)"
    return None


def submodule_reason(layer, autograd: bool) -> str | None:
    """Why the layer's submodules must run themselves (the reference layer), or None when the fused kernel computes
    what they would; `autograd`: whether gradients will be taken."""
    return _own_forward_reason(layer) or lookup_reason(layer, autograd)


def short_path_tables(layer, state: dict) -> tuple[tuple[Tensor, ...], float] | None:
    """((word, segment, position, LayerNorm weight, bias), LayerNorm eps) for the short paths (no autograd, no
    dropout), or None when the fused kernel may not stand in for the submodules (`submodule_reason`), the positions
    are not an `nn.Embedding`, or the dropout module is in training mode with p > 0 (its own flag, not the layer's:
    Monte Carlo dropout switches on the dropouts alone) or has a p outside [0, 1]. `state`: the layer's `__dict__`.

    A sentence's latency is mostly Python, and on an `nn.Module` (which has `__getattr__`) each attribute read costs
    about 50 ns, a dict read 15: so the modules are read through their dicts. Asking `submodule_reason` costs about
    1.5 us, a fifth of a sentence, so a "yes" is kept on the layer, with the submodules' dicts, while the submodules
    are the same objects and no hook has been registered anywhere since (`RemovableHandle.next_id` counts every
    registration). `max_norm`, `eps`, the dropout's flag and p, and a forward set on a submodule itself are looked up on
    every call, and a weight that left `_parameters` (`torch.nn.utils.parametrize` moves it, and changes the module's
    class, which `next_id` does not see) sends the call on."""
    modules = state["_modules"]
    word, types, positions, norm, dropout = (modules["word_embeddings"], modules["token_type_embeddings"],
                                              modules.get("position_embeddings"), modules["LayerNorm"],
                                              modules["dropout"])  # (position_embedding_type="none": no module)
    key = (word, types, positions, norm, dropout, RemovableHandle.next_id)
    verdict = state.get(SUBMODULE_VERDICT)
    if verdict is None or verdict[0] != key:  # (exact types: a parametrized weight is a property, not a parameter)
        if type(word) is not nn.Embedding or type(types) is not nn.Embedding or type(positions) is not nn.Embedding \
                or type(norm) is not nn.LayerNorm or _own_forward_reason(layer) is not None:
            return None  # asked again next call: a hook's removal does not move `next_id`
        verdict = state[SUBMODULE_VERDICT] = (key, word.__dict__, types.__dict__, positions.__dict__, norm.__dict__,
                                              dropout.__dict__)
    _, word, types, positions, norm, dropout = verdict
    # ("forward" in a module's dict: a forward set on the instance, as accelerate's hooks set it)
    if word["max_norm"] is not None or types["max_norm"] is not None or positions["max_norm"] is not None \
            or "forward" in word or "forward" in types or "forward" in positions or "forward" in norm \
            or "forward" in dropout or not 0.0 <= dropout["p"] <= (0.0 if dropout["training"] else 1.0):
        return None  # (p outside [0, 1], NaN included, in eval mode too: the general path raises, as nn.Dropout does)
    weight = norm["_parameters"]
    try:  # (free unless raised)
        return (word["_parameters"]["weight"], types["_parameters"]["weight"], positions["_parameters"]["weight"],
                weight["weight"], weight["bias"]), norm["eps"]
    except KeyError:  # parametrized since the verdict: the general path reads the computed weight
        return None
