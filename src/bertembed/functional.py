"""The embedding layer's math as one function of its tables: what `bertembed.fast` is tested against and falls back
to (`backend="reference"`, a double backward). Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embed(input_ids: torch.Tensor, word: torch.Tensor, segment: torch.Tensor | None, position: torch.Tensor | None,
          weight: torch.Tensor, bias: torch.Tensor | None, token_type_ids: torch.Tensor | None,
          position_ids: torch.Tensor | None, *, eps: float = 1e-12, p: float = 0.0, padding_idx: int | None = None,
          position_padding_idx: int | None = None) -> torch.Tensor:
    """dropout(LayerNorm((word[input_ids] + segment[token_type_ids]) + position[position_ids])): [B, L, H], in the
    order the fused kernels add (a None table adds nothing); dropout only for p > 0.

    input_ids [B, L]; token_type_ids, position_ids: any shape that broadcasts to [B, L] (None: with no table).
    padding_idx, position_padding_idx: the rows whose gradients stay zero, as nn.Embedding's (None: none)."""
    x = F.embedding(input_ids, word, padding_idx)
    if segment is not None:
        x = x + F.embedding(token_type_ids, segment)
    if position is not None:
        x = x + F.embedding(position_ids, position, position_padding_idx)
    x = F.layer_norm(x, (word.shape[1],), weight, bias, eps)
    return F.dropout(x, p, training=True) if p > 0 else x


def default_positions(length: int, past: int = 0, input_ids: torch.Tensor | None = None, pad: int | None = None,
                      device: torch.device | None = None) -> torch.Tensor:
    """The default position ids: [1, L] past, past + 1, ...; or, where positions count from the padding (`pad`
    given: RoBERTa, MPNet), transformers' `(cumsum(ids != pad) + past) * (ids != pad) + pad` from input_ids [B, L]
    (pads get the padding row, tokens count from pad + 1), and without input_ids [1, L] from pad + 1 (no offset)."""
    if pad is None:
        return torch.arange(past, past + length, device=device)[None]
    if input_ids is None:
        return torch.arange(pad + 1, pad + 1 + length, device=device)[None]
    mask = input_ids.ne(pad).int()
    return ((torch.cumsum(mask, dim=1).type_as(mask) + past) * mask).long() + pad
