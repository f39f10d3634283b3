"""The reference computation again, in numpy, so the command line starts without importing torch (1-2 s alone).

The three rows are summed in float32 in the same order as `embeddings.BertEmbeddings`; LayerNorm's statistics are
taken in float64. The tests hold it to the torch layer within 1e-6 (outputs of magnitude up to about 5 here).
Only for inference and explanation: no dropout, no gradients.

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bertembed.checkpoint import load_checkpoint
from bertembed.config import EmbeddingConfig
from bertembed.sources import Source


def sinusoidal_table_np(positions: int, hidden: int) -> np.ndarray:
    """The fixed table of "Attention Is All You Need": [P, H] float64, sin on even columns, cos on odd ones."""
    pos = np.arange(positions, dtype=np.float64)[:, None]
    freq = np.exp(np.arange(0, hidden, 2, dtype=np.float64) * (-np.log(10000.0) / hidden))
    table = np.zeros((positions, hidden))
    table[:, 0::2], table[:, 1::2] = np.sin(pos * freq), np.cos(pos * freq[: hidden // 2])
    return table


@dataclass
class NumpyEmbeddings:
    """The five embedding tensors as float32 arrays, under `BertEmbeddings.state_dict()` names."""

    config: EmbeddingConfig
    tensors: dict[str, np.ndarray]
    source: Source

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path | None = None, **kwargs) -> NumpyEmbeddings:
        """Same sources as `BertEmbeddings.from_pretrained`; torch is imported only for .bin or bfloat16 files."""
        checkpoint = load_checkpoint(name_or_path, framework="np", **kwargs)  # (bfloat16 tables come as float32)
        tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in checkpoint.tensors.items()}
        return cls(checkpoint.config, tensors, checkpoint.source)

    def decompose(self, input_ids: np.ndarray, token_type_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """word, position, segment, sum [B, L, H]; mean, std [B, L]; output [B, L, H] (LayerNorm, eval mode)."""
        cfg = self.config
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be an integer array [B, L], got {ids.dtype} {ids.shape}")
        types = np.zeros_like(ids) if token_type_ids is None else np.asarray(token_type_ids)
        length = ids.shape[1]
        for name, values, limit in (("input_ids", ids, cfg.vocab_size), ("token_type_ids", types, cfg.type_vocab_size)):
            if values.size and (values.min() < 0 or values.max() >= limit):
                raise ValueError(f"{name} holds values outside [0, {limit}); use ids from this checkpoint's tokenizer")
        if length > cfg.max_position_embeddings:
            raise ValueError(f"{length} tokens, but the position table has {cfg.max_position_embeddings} rows: "
                             f"shorten the text")
        word = self.tensors["word_embeddings.weight"][ids]
        segment = self.tensors["token_type_embeddings.weight"][types]
        position = self._positions(length)[None].repeat(ids.shape[0], axis=0)
        total = word + segment + position  # (word + segment) + position, left to right as in the torch layer
        mean = total.mean(axis=-1, dtype=np.float64)
        var = ((total - mean[..., None]) ** 2).mean(axis=-1)
        std = np.sqrt(var + cfg.layer_norm_eps)
        normed = (total - mean[..., None]) / std[..., None]
        output = (normed * self.tensors["LayerNorm.weight"] + self.tensors["LayerNorm.bias"]).astype(np.float32)
        return {"word": word, "position": position, "segment": segment, "sum": total, "mean": mean.astype(np.float32),
                "std": std.astype(np.float32), "output": output}

    def _positions(self, length: int) -> np.ndarray:
        kind, cfg = self.config.position_embedding_type, self.config
        if kind == "absolute":
            return self.tensors["position_embeddings.weight"][:length]
        if kind == "none":
            return np.zeros((length, cfg.hidden_size), dtype=np.float32)
        return sinusoidal_table_np(length, cfg.hidden_size).astype(np.float32)
