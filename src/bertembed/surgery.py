"""Surgery on the layer's tables, in place, config included: more positions (`extend_positions`), another vocabulary
size (`resize_vocab`); the methods and transformers' rules they follow: docs/surgery.md. R reserved position rows
(RoBERTa's), N usable positions, V vocabulary, E table width."""

from __future__ import annotations

import torch
from torch import nn

METHODS = ("copy", "interpolate", "repeat_last", "sinusoidal")
MAX_POSITIONS = 1 << 20  # (128 times ModernBERT's 8,192 positions: past it, a typo, not a table)


def extend_positions(layer, n: int, method: str = "copy"):
    """Let `layer` take sequences of `n` positions (reserved rows not counted): its position table [R + N_old, E]
    grown to [R + n, E] by `method`, the R reserved rows kept on top; `max_position_embeddings` and the default-id
    buffers follow."""
    from bertembed.numpy_layer import sinusoidal_table_np

    config, positions = layer.config, layer.position_embeddings
    if not isinstance(positions, nn.Embedding):
        kind = "no position table (positions enter in attention)" if positions is None else \
            "a computed sinusoidal table (build the layer with a larger max_position_embeddings instead)"
        raise ValueError(f"this {config.model_type} layer has {kind}: there is nothing to extend")
    table = positions.weight.detach()
    head, old = table[:config.first_position], table[config.first_position:]
    count = old.shape[0]
    if not isinstance(n, int) or isinstance(n, bool) or not count < n <= MAX_POSITIONS:
        raise ValueError(f"n={n!r} must be an integer above the {count} positions the table has now (shrinking a "
                         f"table is not extending it) and at most {MAX_POSITIONS:,}")
    if method == "copy":
        grown = old[torch.arange(n) % count]
    elif method == "repeat_last":
        grown = torch.cat([old, old[-1:].expand(n - count, -1)])
    elif method == "interpolate":  # old row i at row f*i (f = n / count, whole), linear between, the last repeated
        if n % count:
            raise ValueError(f"method='interpolate' places old row i at row f*i: {n} positions must be a whole "
                             f"multiple of the {count} there are now (e.g. {2 * count}); or use method='copy'")
        at = torch.arange(n, dtype=torch.float64) / (n // count)
        low = at.floor().long()
        high = (low + 1).clamp(max=count - 1)  # (past the last old row: that row, repeated)
        grown = torch.lerp(old[low].double(), old[high].double(), (at - low)[:, None]).to(old.dtype)
    elif method == "sinusoidal":  # sin/cos rows scaled to the old rows' mean norm
        norm = old.double().norm(dim=1).mean()
        fresh = torch.from_numpy(sinusoidal_table_np(n, old.shape[1]))[count:]
        fresh = fresh * (norm / fresh.norm(dim=1, keepdim=True))
        grown = torch.cat([old, fresh.to(old.dtype)])
    else:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    rows = torch.cat([head, grown.to(table.device)])
    layer.position_embeddings = nn.Embedding.from_pretrained(rows, freeze=not positions.weight.requires_grad,
                                                             padding_idx=positions.padding_idx)
    layer.config = config.replace(max_position_embeddings=rows.shape[0])
    ids = torch.arange(rows.shape[0], device=rows.device)[None]
    for name in ("position_ids", "token_type_ids"):  # (the buffers the layer has: a patched one may lack some)
        if name in layer._buffers:
            layer._buffers[name] = ids if name == "position_ids" else torch.zeros_like(ids)
    return layer


def resize_vocab(layer, n: int, *, pad_to_multiple_of: int | None = None, init: str = "mean"):
    """Give the word table `n` rows (rounded up to `pad_to_multiple_of`), as transformers' `resize_token_embeddings`:
    old rows kept, shrinking drops rows from the end (not the padding row: ValueError), new rows by `init`."""
    if init not in ("mean", "normal"):
        raise ValueError(f"init={init!r} is not 'mean' or 'normal'")
    if pad_to_multiple_of is not None:
        if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive integer")
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n={n!r} must be a positive number of rows")
    words = layer.word_embeddings
    if n == words.weight.shape[0]:
        return layer
    if words.padding_idx is not None and words.padding_idx >= n:
        raise ValueError(f"n={n} would drop the padding row {words.padding_idx}: transformers clears padding_idx then "
                         f"but keeps config.pad_token_id outside the table, which no saved checkpoint loads; keep at "
                         f"least {words.padding_idx + 1} rows")
    rows = grown_rows(words.weight.detach(), n, init, layer.config.initializer_range)
    layer.word_embeddings = nn.Embedding.from_pretrained(rows, freeze=not words.weight.requires_grad,
                                                         padding_idx=words.padding_idx)
    layer.config = layer.config.replace(vocab_size=n)
    return layer


def grown_rows(old: torch.Tensor, n: int, init: str, std: float) -> torch.Tensor:
    """A table of `n` rows: the first rows of `old` [V, E], new rows from normal(0, `std`) (`init="normal"`) or near
    the old rows' mean ("mean": a normal with their mean and 1e-9 times their covariance, the plain mean where that
    is not positive definite), drawn in transformers' order, so that one seed gives the same rows."""
    count, width = old.shape
    resized = nn.Embedding(n, width, device=old.device, dtype=old.dtype)  # (its own init draws, as transformers')
    with torch.no_grad():
        if n > count and init == "normal":
            nn.init.normal_(resized.weight, std=std)
        elif n > count:
            weights = old.float()
            mean = weights.mean(0)
            centred = weights - mean
            covariance = 1e-9 * (centred.T @ centred / count)  # (in transformers' order: the same bits)
            if torch.distributions.constraints.positive_definite.check(covariance).all():
                drawn = torch.distributions.MultivariateNormal(mean, covariance_matrix=covariance).sample((n - count,))
            else:
                drawn = mean[None].repeat(n - count, 1)
            resized.weight[count:] = drawn.to(old.dtype)
        resized.weight[:min(n, count)] = old[:min(n, count)]
    return resized.weight.detach()
