"""The short path for GPU inference: `BertEmbeddings.forward` straight to the Triton forward kernel.

On a GPU the kernel runs while Python prepares the next call, so the glue decides the time whenever it is longer than
the kernel: at (64, 512), hidden 1024, the kernel takes about 95 us on an H100, and the general path's glue (backend
selection, input checks, flattening the ids, `nn.Module.__getattr__` for each table) was of that order on the lent
machine's CPU. This path reads the tables through the module's dicts, checks only what the kernel needs, and lets the
kernel take positions from the token's index (and segment 0 when no segment ids are given). With `layer.id_checks ==
"host"` (the default) the ids are still checked before the kernel (`validation._check_ranges`: one wait for the device);
with "device" there is no wait, and a token with a bad id gets a row of NaN. Anything else (dropout in training mode,
autograd, explicit position ids, `inputs_embeds`, other dtypes or shapes) returns None, and the general path takes over
with the reference layer's errors.

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

import torch

from bertembed.embeddings import default_ids_untouched
from bertembed.kernels import _DTYPES, ID_CHECKS
from bertembed.kernels import triton as triton_kernels
from bertembed.kernels.submodules import short_path_tables
from bertembed.validation import (
    check_inputs,
    forward_ad_on,
    in_torch_func,
    norm_dtypes_fit,
    table_rows,
    table_shape_problem,
)


def _tables(layer, state: dict) -> tuple[tuple[torch.Tensor, ...], float] | None:
    """((word, segment, position, LayerNorm weight, bias), LayerNorm eps) when all are contiguous CUDA tensors of one
    table dtype, with a LayerNorm dtype torch's LayerNorm takes beside it (the general path raises for the others), and
    the fused kernel may stand in for the submodules (`submodules.short_path_tables`)."""
    found = short_path_tables(layer, state)
    if found is None:
        return None
    tables = found[0]
    dtype = tables[0].dtype
    if any(not t.is_cuda or not t.is_contiguous() or t.dtype != dtype for t in tables[:3]) \
            or any(not t.is_cuda for t in tables[3:]) or not norm_dtypes_fit(dtype, tables[3], tables[4]) \
            or table_shape_problem(tables):  # (the general path raises for it)
        return None
    return found


def try_infer(layer, input_ids, token_type_ids, position_ids, inputs_embeds, past_key_values_length):
    """The output [B, L, H], or None when these inputs are not for the short path."""
    try:  # (free in Python 3.11 unless raised)
        if torch.is_grad_enabled() or position_ids is not None or inputs_embeds is not None \
                or type(input_ids) is not torch.Tensor or not input_ids.is_cuda or input_ids.dtype != torch.int64 \
                or input_ids.dim() != 2 or not input_ids.is_contiguous() or type(past_key_values_length) is not int \
                or in_torch_func() or forward_ad_on() or not default_ids_untouched(layer):
            return None
        if token_type_ids is not None and (type(token_type_ids) is not torch.Tensor or not token_type_ids.is_cuda
                                           or token_type_ids.dtype != torch.int64 or not token_type_ids.is_contiguous()
                                           or token_type_ids.shape != input_ids.shape):  # ([1, L] broadcasts: not here)
            return None
    except RuntimeError:  # ids with no strides (sparse CSR has no is_contiguous): the general path names them
        return None
    state = layer.__dict__
    found = _tables(layer, state)
    checks = state.get("id_checks", "host")
    if found is None or checks not in ID_CHECKS or found[0][0].device != input_ids.device \
            or found[0][0].dtype not in _DTYPES["triton"]:
        return None
    tables, eps = found
    batch, length = check_inputs(layer.config, input_ids, token_type_ids, None, None, past_key_values_length,
                                 check_ranges=checks == "host", rows=table_rows(tables))
    word, segment, position, weight, bias = tables
    out = torch.empty((batch, length, word.shape[1]), dtype=word.dtype, device=word.device)
    types = None if token_type_ids is None else token_type_ids.view(-1)
    triton_kernels.run_forward(input_ids.view(-1), types, None, word, segment, position, weight,
                               bias, eps, 0.0, 0, out=out, stats=False, length=length,
                               past=past_key_values_length)
    return out
