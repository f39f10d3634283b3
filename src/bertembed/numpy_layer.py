"""The reference computation again, in numpy, so the command line starts without importing torch; inference only.
Rows summed in float32 in the torch layer's order, LayerNorm's statistics in float64: within float32 rounding of it
(1e-6 where outputs stay below about 8, as the bundled model's do; 6e-6 at 40).
B batch, L length, W the layer's output width.
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
    """The embedding tensors as float32 arrays, under `BertEmbeddings.state_dict()` names."""

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
        """word, position, segment, sum [B, L, W]; mean, std [B, L]; output [B, L, W] (eval mode), each member's way;
        an absent table's part is zeros."""
        cfg, t = self.config, self.tensors
        ids = np.asarray(input_ids)
        types = np.zeros_like(ids) if token_type_ids is None else np.asarray(token_type_ids)
        for name, given in (("input_ids", ids), ("token_type_ids", types)):
            if given.ndim != 2 or given.dtype.kind not in "iu" or given.shape != ids.shape:
                raise ValueError(f"{name} must be an integer array [B, L] (input_ids'), got {given.dtype} "
                                 f"{given.shape}")
        length = ids.shape[1]
        for name, values, limit in (("input_ids", ids, cfg.vocab_size),
                                    ("token_type_ids", types, cfg.type_vocab_size or 1)):
            if values.size and (values.min() < 0 or values.max() >= limit):
                raise ValueError(f"{name} holds values outside [0, {limit}); use ids from this checkpoint's tokenizer")
        if cfg.position_embedding_type != "none" and cfg.first_position + length > cfg.max_position_embeddings:
            raise ValueError(f"{length} tokens, but the position table has {cfg.max_position_embeddings} rows: "
                             f"shorten the text")
        word = t["word_embeddings.weight"][ids]
        zeros = np.zeros_like(word)
        segment = t["token_type_embeddings.weight"][types] if cfg.type_vocab_size else zeros
        # position rows 0, 1, 2, ...; or counted from the padding id (RoBERTa, MPNet), pads on the padding row
        rows = np.broadcast_to(np.arange(length), ids.shape)
        if cfg.positions_from_padding:
            rows = np.cumsum(ids != cfg.pad_token_id, axis=1) * (ids != cfg.pad_token_id) + cfg.pad_token_id
        position = zeros
        if cfg.position_embedding_type == "absolute":
            position = t["position_embeddings.weight"][rows]
        elif cfg.position_embedding_type == "sinusoidal":
            position = sinusoidal_table_np(int(rows.max()) + 1, cfg.table_width).astype(np.float32)[rows]
        # in the member's order, as the torch layer adds them (an absent table adds zeros: the same numbers)
        total = (word + position) + segment if cfg.sum_order == "position_first" else (word + segment) + position
        if cfg.projection == "before_norm":  # (DeBERTa's E -> H: the parts shown as they enter the norm)
            total, word, position, segment = (x @ t["projection.weight"].T for x in (total, word, position, segment))
        mean = total.mean(axis=-1, dtype=np.float64)
        var = ((total - mean[..., None]) ** 2).mean(axis=-1)
        std = np.sqrt(var + cfg.layer_norm_eps)
        normed = (total - mean[..., None]) / std[..., None] * t["LayerNorm.weight"]
        output = (normed + t["LayerNorm.bias"] if cfg.norm_bias else normed).astype(np.float32)
        return {"word": word, "position": position, "segment": segment, "sum": total, "mean": mean.astype(np.float32),
                "std": std.astype(np.float32), "output": output}
