"""Scaling out on PyTorch's own engines: the word table sharded by rows (tensor parallel), loaded by rank.

    mesh = init_device_mesh("cpu", (world,))              # or "cuda"; after torch.distributed.init_process_group
    shard_vocab(model, mesh)                              # every word table in `model`: V / world rows per rank
    layer = BertEmbeddings.from_pretrained(path, device_mesh=mesh)  # each rank reads its own rows, nothing more

Every piece is torch's: `parallelize_module` with `RowwiseParallel(input_layouts=Replicate())` shards each word
table's rows (`Shard(0)`, torch's uneven split); the lookup is torch's sharded one (each rank reads the ids in its rows,
then an all-reduce), since a DTensor is nothing a numba or Triton kernel can read; the fused kernel then adds the
position and segment rows and normalises (`bertembed.fast.gathered_rows`). Position and segment tables, LayerNorm and
the rest of the model stay whole on every rank: their inputs and upstream gradients are the same everywhere, and so are
their gradients. FSDP2 (`torch.distributed.fsdp.fully_shard`) and `torch.distributed.checkpoint` need nothing from
here: they work on bertembed's layer and on patched models as they are (docs/distributed.md).

Dimension letters: B batch, L length, V vocabulary, E table width.
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

from bertembed.config import MEMBERS
from bertembed.family import module_names
from bertembed.validation import check_id_ranges

log = logging.getLogger(__name__)

# what a transformers embeddings layer of the family calls its word table ("word_embeddings"; ModernBERT's
# "tok_embeddings")
WORD_NAMES = tuple(sorted({module_names(member).get("word_embeddings", "word_embeddings") for member in MEMBERS}))


def shard_vocab(module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Shard every word table [V, E] in `module` by rows over the 1-D `device_mesh`, in place; returns `module`.

    `module`: a bertembed layer, a transformers model of BERT's family (patched by `bertembed.patch` or not), or an
    `nn.Embedding`. Each table becomes a DTensor (`Shard(0)`: rank r holds torch's r-th chunk of ceil(V / world)
    rows); every rank passes the same ids [B, L] and gets the same rows [B, L, E]. Before each lookup the ids are
    checked against all V rows, with the same ValueError on every rank (all ranks raise before the lookup's all-reduce
    and none waits in it): torch's sharded lookup would give a bad id a row of zeros, silently. Nothing else is
    sharded (module docstring). A table may be on the meta device (`to_empty` then gives each rank its own rows alone).

    A word table tied to another module of `module` (a masked-LM head's decoder) is refused: sharding it would untie
    them. Train such a model with FSDP2 (`fully_shard`), which keeps ties. Only `module` is searched: pass the whole
    model (`BertForMaskedLM`), not its base (`model.bert`), or a head outside it keeps an untied copy.
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
    log.info("bertembed.shard_vocab: %s sharded by rows over %d ranks", ", ".join(tables), device_mesh.size())
    return module


def word_tables(module: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> word table of every embeddings layer of BERT's family in `module`: bertembed's own (its
    `submodules()`; patched ones keep the member's names), transformers' (`WORD_NAMES`), or `module` itself where it
    is an nn.Embedding. ValueError for a word table that is not a plain nn.Embedding (a LoRA wrapper, say), which
    torch's RowwiseParallel cannot shard."""
    if isinstance(module, nn.Embedding):
        return {"": module}
    found = {}
    for prefix, layer in module.named_modules():
        kind = type(layer)  # bertembed's layer (a patched one keeps the member's names) or transformers'
        family = (callable(getattr(layer, "submodules", None)) and hasattr(layer, "_stored_as")
                  or kind.__module__.startswith("transformers.models.") and kind.__name__.endswith("Embeddings"))
        attribute = next((n for n in WORD_NAMES if isinstance(layer._modules.get(n), nn.Module)), None)
        if not family or attribute is None:
            continue
        name, table = f"{prefix}.{attribute}".lstrip("."), getattr(layer, attribute)
        if type(table) is not nn.Embedding:
            raise ValueError(f"{name} is a {type(table).__name__}, not an nn.Embedding: torch's RowwiseParallel shards "
                             f"nn.Embedding tables only; shard before wrapping it (LoRA), or merge the wrapper first")
        found[name] = table
    return found


def _before_lookup(table: nn.Embedding, args: tuple) -> None:
    """Forward pre-hook: a ValueError naming the first id outside all V rows, before the sharded lookup; and the
    table's gradient kept sharded (`_resharded`). That hook lives on the parameter, which `to_empty`, `.to()` and
    loading with `assign=True` replace: it is put on the table's parameter of the moment, once."""
    ids = args[0]
    if isinstance(ids, DTensor):  # (given as a DTensor already: its values are the same on every rank)
        ids = ids.to_local()
    check_id_ranges(ids, None, None, (table.num_embeddings, None, None))
    weight = table.weight
    if isinstance(weight, DTensor) and not getattr(weight, "_bertembed_resharded", False):
        weight.register_post_accumulate_grad_hook(_resharded)
        weight._bertembed_resharded = True


def _resharded(weight: DTensor) -> None:
    """Keep the table's gradient as sharded as the table. torch's sharded lookup has no row-wise backward: it computes
    the whole gradient [V, E], replicated, on every rank; its own rows are all a rank needs (a local slice, no
    communication), and the optimizer's state then takes the table's layout, 1/world of it, too."""
    if weight.grad is not None and weight.grad.placements != weight.placements:
        weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)


def rank_reader(device_mesh: DeviceMesh) -> Callable[[Any], DTensor]:
    """A reader for `bertembed.checkpoint.load_checkpoint(word_reader=...)`: from safetensors' slice of the word table
    (`safe_open(...).get_slice(key)`), this rank's rows alone, as the DTensor [V, E] that `shard_vocab` makes: torch's
    split under `Shard(0)`, as `distribute_tensor` makes it (`torch.chunk`: ceil(V / world) rows each, fewer or none on
    the last ranks). No rank reads, or ever holds, the whole table."""

    def read(sliced) -> DTensor:
        rows, width = sliced.get_shape()
        chunk = -(-rows // device_mesh.size())
        start = min(device_mesh.get_local_rank() * chunk, rows)
        return DTensor.from_local(sliced[start:min(start + chunk, rows)], device_mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size((rows, width)), stride=(width, 1))

    return read
