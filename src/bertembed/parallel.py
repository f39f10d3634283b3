"""Scaling out on PyTorch's own engines (docs/distributed.md): `shard_vocab` shards the word tables by rows (tensor
parallel) and a masked-LM head tied to one, `vocab_parallel_cross_entropy` is the loss on the head's sharded logits,
`rank_reader` reads a rank's rows of a checkpoint. B batch, L length, V vocabulary, E table width."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from bertembed.family import MEMBERS, module_names
from bertembed.validation import check_id_ranges

log = logging.getLogger(__name__)

# what a transformers embeddings layer of the family calls its word table (ModernBERT's "tok_embeddings")
WORD_NAMES = tuple(sorted({module_names(member).get("word_embeddings", "word_embeddings") for member in MEMBERS}))


def shard_vocab(module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Shard every word table [V, E] in `module` (a bertembed layer, a transformers model of BERT's family, patched or
    not, or an `nn.Embedding`) by rows over the 1-D `device_mesh`, in place; returns `module`. Every rank passes the
    same ids [B, L] and gets the same rows [B, L, E]. Pass the whole model, not its base, so that a head tied to a
    table is seen: an nn.Linear head (a masked-LM decoder) keeps the table's sharded weight, its bias is sharded too,
    and it gives logits [B, L, V] as a DTensor sharded by columns, for `vocab_parallel_cross_entropy`."""
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
        options = [o for o in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(table, o) not in (None, False)]
        if options:
            raise ValueError(f"{name or 'the table'} has {', '.join(options)} set: the sharded lookup reads its rows "
                             f"as they are and writes dense, unscaled gradients; unset {' and '.join(options)} first")
        old = table.weight
        tied = [n for n, p in module.named_parameters(remove_duplicate=False)
                if p is old and n != f"{name}.weight".lstrip(".")]
        heads = [module.get_submodule(n.rpartition(".")[0]) for n in tied]
        if any(type(head) is not nn.Linear for head in heads):
            raise ValueError(f"{name}.weight is tied to {', '.join(tied)}: shard_vocab shards a table tied to an "
                             f"nn.Linear head alone. Train this model with FSDP2's fully_shard instead, or untie the "
                             f"weights (config.tie_word_embeddings=False) first")
        # (torch's split of the rows; its own sharded lookup's backward would build the whole [V, E] gradient)
        table.weight = nn.Parameter(distribute_tensor(old, device_mesh, [Shard(0)]), old.requires_grad)
        _retie(module, old, table.weight)
        for head in heads:  # logits [B, L, V] sharded by columns (a DTensor): vocab_parallel_cross_entropy's input
            bias = head.bias
            parallelize_module(head, device_mesh, ColwiseParallel(use_local_output=False))
            head.weight = table.weight  # (ColwiseParallel made a parameter of its own)
            _retie(module, bias, head.bias)  # (transformers ties the decoder's bias to predictions.bias; None: none)
        table.forward = MethodType(_lookup, table)
        table.register_forward_pre_hook(_before_lookup, prepend=True)
        if "." in name or name in WORD_NAMES:  # (the layer that holds the table, which checks ids before its lookup)
            layer = module.get_submodule(name.rpartition(".")[0])
            layer.register_forward_pre_hook(_before_layer)
            layer.register_forward_hook(_after_layer, always_call=True)
    log.info("bertembed.shard_vocab: %s sharded by rows over %d ranks", ", ".join(tables), device_mesh.size())
    return module


def _retie(module: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Every module of `module` that holds `old` holds `new` instead."""
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if param is old:
                sub._parameters[key] = new


def _first_row(mesh: DeviceMesh, rows: int) -> tuple[int, int]:
    """The rows [first, stop) this rank holds in torch's split (`torch.chunk`: ceil(rows / world) rows a rank)."""
    chunk = -(-rows // mesh.size())
    first = min(mesh.get_local_rank() * chunk, rows)
    return first, min(first + chunk, rows)


def _lookup(table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The sharded table's forward: rows [B, L, E] of ids [B, L], the same on every rank (`_SummedRows`)."""
    ids = ids.to_local() if isinstance(ids, DTensor) else ids  # (a DTensor's values are the same on every rank)
    return _SummedRows.apply(table.weight.to_local(), ids, table)


class _SummedRows(torch.autograd.Function):
    """Each rank's rows of the ids from its shard [V / world, E] (zeros elsewhere), summed by an in-place all-reduce
    into [B, L, E] (DTensor's `Partial` to `Replicate` copies the rows: ~10 MiB more at a step's peak). Backward: the
    gradient of the shard's rows alone, `index_add_` into zeros of its shape (no [V, E] tensor)."""

    @staticmethod
    def forward(ctx, local, ids, table):
        first, stop = _first_row(table.weight.device_mesh, table.weight.shape[0])
        inside = (ids >= first) & (ids < stop)
        read = local if local.shape[0] else local.new_zeros((1, local.shape[1]))  # (a rank left without rows)
        rows = nn.functional.embedding(torch.where(inside, ids - first, 0), read).masked_fill_(~inside[..., None], 0)
        torch.distributed.all_reduce(rows, group=table.weight.device_mesh.get_group())
        written = inside if table.padding_idx is None else inside & (ids != table.padding_idx)
        ctx.save_for_backward(ids - first, written)
        ctx.shard = local.shape
        return rows

    @staticmethod
    def backward(ctx, grad):
        rows, written = ctx.saved_tensors  # (rows: the ids' rows in the shard)
        return grad.new_zeros(ctx.shard).index_add_(0, rows[written], grad[written]), None, None


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
            raise ValueError(f"{name} is a {type(table).__name__}, not an nn.Embedding: shard_vocab shards "
                             f"nn.Embedding tables only; shard before wrapping it (LoRA), or merge the wrapper first")
        found[name] = table
    return found


def _before_lookup(table: nn.Embedding, args: tuple) -> None:
    """Forward pre-hook: a ValueError on every rank where any rank has an id out of range (else the others wait)."""
    ids = args[0].to_local() if isinstance(args[0], DTensor) else args[0]  # (the same values on every rank)
    try:
        check_id_ranges(ids, None, None, (table.num_embeddings, None, None))
    except ValueError:
        _any_rank(table, True)
        raise
    if _any_rank(table, False):
        raise ValueError(f"input_ids of another rank hold an id outside the word table's {table.num_embeddings} rows "
                         f"(that rank's error names it): every rank raises; fix the ids on that rank")


def _any_rank(table: nn.Embedding, failed: bool) -> bool:
    """Whether any rank `failed` before its lookup: one all-reduce of a flag a forward (or `_after_layer`'s)."""
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


def vocab_parallel_cross_entropy(logits: DTensor, labels: torch.Tensor, *, ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """torch's `cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=..., label_smoothing=...)` (the mean
    over the labels not ignored) of logits [..., V] sharded by columns (as `shard_vocab`'s head gives them) and labels
    [...], the same on every rank, without gathering the logits (`_VocabParallelCrossEntropy`). Returns the loss, the
    same on every rank; its backward writes each rank's columns' gradient alone."""
    if not isinstance(logits, DTensor) or tuple(logits.placements) != (Shard(logits.ndim - 1),):
        raise ValueError(f"logits must be a DTensor sharded by its last dimension (Shard({logits.ndim - 1}),), as "
                         f"shard_vocab's head gives it; got {type(logits).__name__} "
                         f"{getattr(logits, 'placements', '')}")
    vocab = logits.shape[-1]
    labels = labels.reshape(-1)
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bad.any():
        raise ValueError(f"labels hold {labels[bad][0].item()}, outside the {vocab} classes and not ignore_index "
                         f"({ignore_index})")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    local = logits.to_local()
    local = local.reshape(labels.numel(), local.shape[-1])  # (a shard may have no columns)
    return _VocabParallelCrossEntropy.apply(local, labels, logits.device_mesh, vocab, ignore_index, label_smoothing)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy on the columns [N, V / world] of one rank: per token, the log of the sum
    of exponentials lse, the label's logit z_y and (label smoothing e) the sum of logits; loss = lse - (1 - e) z_y -
    e sum(z) / V, averaged over the N' tokens not ignored. Gradient: (softmax - (1 - e) onehot(y) - e / V) / N'."""

    @staticmethod
    def forward(ctx, logits, labels, mesh, vocab, ignore_index, smoothing):
        group, z = mesh.get_group(), logits.to(torch.promote_types(logits.dtype, torch.float32))
        first, stop = _first_row(mesh, vocab)
        columns = z.shape[-1]  # (0 on a rank torch's split leaves without rows: it adds nothing to the sums)
        top = z.amax(-1) if columns else z.new_full(labels.shape, -math.inf)
        torch.distributed.all_reduce(top, torch.distributed.ReduceOp.MAX, group=group)
        mine = (labels >= first) & (labels < stop)
        column = torch.where(mine, labels - first, 0).unsqueeze(-1)
        sums = z.new_zeros((3, *labels.shape))
        if columns:  # (where, not a product with `mine`: a masked -inf logit times 0 is NaN)
            label = torch.where(mine, z.gather(-1, column).squeeze(-1), 0)
            sums = torch.stack([(z - top.unsqueeze(-1)).exp().sum(-1), label, z.sum(-1)])
        torch.distributed.all_reduce(sums, group=group)  # (one all-reduce of three numbers a token)
        lse = top + sums[0].log()
        kept = labels != ignore_index
        losses = lse - (1 - smoothing) * sums[1] - (smoothing * sums[2] / vocab if smoothing else 0)
        count = kept.sum()
        ctx.save_for_backward(logits, lse, column, mine & kept, kept, count)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return torch.where(kept, losses, 0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, lse, column, labelled, kept, count = ctx.saved_tensors
        scale = grad * kept / count
        z = (logits.to(lse.dtype) - lse.unsqueeze(-1)).exp() - ctx.smoothing / ctx.vocab
        if z.shape[-1]:
            z.scatter_add_(-1, column, labelled.to(z.dtype).unsqueeze(-1) * (ctx.smoothing - 1))
        return (z * scale.unsqueeze(-1)).to(logits.dtype), None, None, None, None, None


def rank_reader(device_mesh: DeviceMesh) -> Callable[[Any], DTensor]:
    """A reader for `load_checkpoint(word_reader=...)`: from safetensors' slice of the word table, this rank's rows
    alone, as the DTensor [V, E] that `shard_vocab` makes (torch's split: ceil(V / world) rows each)."""

    def read(sliced) -> DTensor:
        rows, width = sliced.get_shape()
        first, stop = _first_row(device_mesh, rows)
        return DTensor.from_local(sliced[first:stop], device_mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size((rows, width)), stride=(width, 1))

    return read
