"""Scaling out on PyTorch's own engines (docs/distributed.md): `shard_vocab` shards the word tables by rows (tensor
parallel), `rank_reader` reads a rank's rows of a checkpoint. B batch, L length, V vocabulary, E table width.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from bertembed.family import MEMBERS, module_names
from bertembed.validation import check_id_ranges

log = logging.getLogger(__name__)

# what a transformers embeddings layer of the family calls its word table (ModernBERT's "tok_embeddings")
WORD_NAMES = tuple(sorted({module_names(member).get("word_embeddings", "word_embeddings") for member in MEMBERS}))


def shard_vocab(module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Shard every word table [V, E] in `module` (a bertembed layer, a transformers model of BERT's family, patched or
    not, or an `nn.Embedding`) by rows over the 1-D `device_mesh`, in place; returns `module`. Every rank passes the
    same ids [B, L] and gets the same rows [B, L, E]. Pass the whole model, not its base, so that a table tied to a
    head is seen (and refused).
    """
    if device_mesh.ndim != 1:
        raise ValueError(f"shard_vocab takes a 1-D device mesh, got {device_mesh.ndim}-D ({device_mesh.mesh_dim_names}"
                         f"); pass the tensor-parallel dimension, mesh['tp'] say")
    tables = word_tables(module)
    if not tables:
        raise ValueError(f"no word table in {type(module).__name__}: shard_vocab shards bertembed's layers, "
                         f"transformers models of BERT's family ({', '.join(MEMBERS)}) and nn.Embedding modules")
    for name, table in tables.items():
        if isinstance(table.weight, DTensor):
            continue  # sharded before: a second call changes nothing
        tied = [n for n, p in module.named_parameters(remove_duplicate=False)
                if p is table.weight and n != f"{name}.weight".lstrip(".")]
        if tied:
            raise ValueError(f"{name}.weight is tied to {', '.join(tied)}: sharding the word table would untie them "
                             f"(the tied module would keep a whole copy). Train this model with FSDP2's fully_shard "
                             f"instead, or untie the weights (config.tie_word_embeddings=False) first")
        parallelize_module(table, device_mesh, RowwiseParallel(input_layouts=Replicate()))
        table.register_forward_pre_hook(_before_lookup, prepend=True)  # (before torch's hook makes ids a DTensor)
        if "." in name or name in WORD_NAMES:  # (the layer that holds the table, which checks ids before its lookup)
            layer = module.get_submodule(name.rpartition(".")[0])
            layer.register_forward_pre_hook(_before_layer)
            layer.register_forward_hook(_after_layer, always_call=True)
    log.info("bertembed.shard_vocab: %s sharded by rows over %d ranks", ", ".join(tables), device_mesh.size())
    return module


def word_tables(module: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> word table of every embeddings layer of BERT's family in `module` (bertembed's or
    transformers'), or `module` itself where it is an nn.Embedding."""
    if isinstance(module, nn.Embedding):
        return {"": module}
    found = {}
    for prefix, layer in module.named_modules():
        kind = type(layer)  # bertembed's layer (a patched one keeps the member's names) or transformers'
        family = (callable(getattr(layer, "submodules", None)) and hasattr(layer, "_stored_as")
                  or kind.__module__.startswith("transformers.models.") and kind.__name__.endswith("Embeddings"))
        attribute = _word_name(layer)
        if not family or attribute is None:
            continue
        name, table = f"{prefix}.{attribute}".lstrip("."), getattr(layer, attribute)
        if type(table) is not nn.Embedding:
            raise ValueError(f"{name} is a {type(table).__name__}, not an nn.Embedding: torch's RowwiseParallel shards "
                             f"nn.Embedding tables only; shard before wrapping it (LoRA), or merge the wrapper first")
        found[name] = table
    return found


def _before_lookup(table: nn.Embedding, args: tuple) -> None:
    """Forward pre-hook: a ValueError on every rank where any rank has an id outside all V rows (a rank left alone
    would wait in the lookup's all-reduce); and the gradient kept sharded, hooked on the parameter of the moment
    (`.to()` may replace it)."""
    ids = args[0]
    if isinstance(ids, DTensor):  # (given as a DTensor already: its values are the same on every rank)
        ids = ids.to_local()
    try:
        check_id_ranges(ids, None, None, (table.num_embeddings, None, None))
    except ValueError:
        _any_rank(table, True)
        raise
    if _any_rank(table, False):
        raise ValueError(f"input_ids of another rank hold an id outside the word table's {table.num_embeddings} rows "
                         f"(that rank's error names it): every rank raises; fix the ids on that rank")
    weight = table.weight
    if isinstance(weight, DTensor) and not getattr(weight, "_bertembed_resharded", False):
        weight.register_post_accumulate_grad_hook(_resharded)
        weight._bertembed_resharded = True


def _any_rank(table: nn.Embedding, failed: bool) -> bool:
    """Whether any rank of the table's mesh `failed` before its lookup: one all-reduce of a flag a forward, in the
    table's pre-hook or, where the layer raised before its lookup, in `_after_layer`."""
    table._bertembed_flagged = True
    weight = table.weight
    if not isinstance(weight, DTensor) or torch.compiler.is_compiling():
        return failed
    flag = torch.tensor([failed], dtype=torch.int32, device=weight.device_mesh.device_type)
    torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX, group=weight.device_mesh.get_group())
    return bool(flag.item())


def _before_layer(layer: nn.Module, args: tuple) -> None:
    layer._modules[_word_name(layer)]._bertembed_flagged = False


def _after_layer(layer: nn.Module, args: tuple, output) -> None:
    """Forward hook, run even where the layer raised: one that raised before its lookup still sends its flag."""
    table = layer._modules[_word_name(layer)]
    if output is None and not table._bertembed_flagged:
        _any_rank(table, True)


def _word_name(layer: nn.Module) -> str | None:
    return next((n for n in WORD_NAMES if isinstance(layer._modules.get(n), nn.Module)), None)


def _resharded(weight: DTensor) -> None:
    """Keep the table's gradient as sharded as the table (torch's sharded lookup computes it whole)."""
    if weight.grad is not None and weight.grad.placements != weight.placements:
        weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)


def rank_reader(device_mesh: DeviceMesh) -> Callable[[Any], DTensor]:
    """A reader for `load_checkpoint(word_reader=...)`: from safetensors' slice of the word table, this rank's rows
    alone, as the DTensor [V, E] that `shard_vocab` makes (torch's split: ceil(V / world) rows each)."""

    def read(sliced) -> DTensor:
        rows, width = sliced.get_shape()
        chunk = -(-rows // device_mesh.size())
        start = min(device_mesh.get_local_rank() * chunk, rows)
        return DTensor.from_local(sliced[start:min(start + chunk, rows)], device_mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size((rows, width)), stride=(width, 1))

    return read
