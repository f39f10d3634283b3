"""One text (or pair) taken apart: per token, the word, position and segment vectors, LayerNorm's statistics,
the output, and a by-hand float64 recomputation of LayerNorm(word + position + segment) checked against the layer.

Dimension letters: L length, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bertembed.sources import Source


@dataclass
class TextDecomposition:
    """The parts of one sequence. Vectors are [L, H] float32 arrays; statistics are [L]."""

    source: Source
    engine: str  # "numpy" (torch-free, fast start) or "torch" (the BertEmbeddings module)
    tokens: list[str]
    ids: list[int]
    segments: list[int]
    positions: list[int]
    word: np.ndarray
    position: np.ndarray
    segment: np.ndarray
    sum: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    output: np.ndarray
    gamma: np.ndarray  # LayerNorm.weight [H]
    beta: np.ndarray  # LayerNorm.bias [H]
    eps: float

    def by_hand(self) -> np.ndarray:
        """LayerNorm(word + position + segment) recomputed from the parts in float64: [L, H]."""
        total = self.word.astype(np.float64) + self.position + self.segment
        mean = total.mean(-1, keepdims=True)
        var = ((total - mean) ** 2).mean(-1, keepdims=True)
        return (total - mean) / np.sqrt(var + self.eps) * self.gamma.astype(np.float64) + self.beta

    @property
    def max_abs_diff(self) -> float:
        """Largest |by-hand - layer output| over all tokens and dimensions."""
        return float(np.abs(self.by_hand() - self.output).max())

    def norms(self) -> dict[str, np.ndarray]:
        """Euclidean norm per token of each part: [L] arrays."""
        return {name: np.linalg.norm(getattr(self, name).astype(np.float64), axis=-1)
                for name in ("word", "position", "segment", "sum", "output")}

    def rows(self) -> list[dict]:
        """One dict per token, for tables and JSON."""
        norms = self.norms()
        return [{"position": self.positions[i], "token": self.tokens[i], "id": self.ids[i],
                 "segment": self.segments[i], "word_norm": float(norms["word"][i]),
                 "position_norm": float(norms["position"][i]), "segment_norm": float(norms["segment"][i]),
                 "ln_mean": float(self.mean[i]), "ln_std": float(self.std[i]), "output_norm": float(norms["output"][i])}
                for i in range(len(self.tokens))]


def explain_text(text: str, text_b: str | None = None, model: str | Path | None = None, *,
                 engine: str = "numpy") -> TextDecomposition:
    """Tokenize `text` (and `text_b` as segment B) with the checkpoint's tokenizer and decompose its embedding.

    Raises ValueError for an empty text or one longer than the position table (no silent truncation here).
    """
    from bertembed.tokenizer import Tokenizer

    for name, value in (("TEXT", text), ("TEXT_B", text_b)):
        if value is not None and not value.strip():
            raise ValueError(f"{name} is empty; give a sentence to explain, e.g. \"The quick brown fox\"")
    if engine not in ("numpy", "torch"):
        raise ValueError(f"engine={engine!r}: use 'numpy' or 'torch'")
    tokenizer = Tokenizer.from_pretrained(model)
    enc = tokenizer(text, text_b, truncation=False, padding=False)
    if len(enc.input_ids) > tokenizer.max_length:
        raise ValueError(f"the text is {len(enc.input_ids)} tokens with [CLS] and [SEP], but the model has "
                         f"{tokenizer.max_length} positions: shorten it by {len(enc.input_ids) - tokenizer.max_length} "
                         f"tokens")
    ids, types = np.array([enc.input_ids]), np.array([enc.token_type_ids])
    if engine == "numpy":
        from bertembed.numpy_layer import NumpyEmbeddings

        layer = NumpyEmbeddings.from_pretrained(model)
        parts, source, config = layer.decompose(ids, types), layer.source, layer.config
        gamma, beta = layer.tensors["LayerNorm.weight"], layer.tensors["LayerNorm.bias"]
    else:
        import torch

        from bertembed.embeddings import BertEmbeddings

        module = BertEmbeddings.from_pretrained(model).eval()
        with torch.no_grad():
            dec = module.decompose(torch.from_numpy(ids), torch.from_numpy(types))
        parts = {k: v.float().numpy() for k, v in vars(dec).items()}
        source, config = module.source, module.config
        gamma, beta = module.LayerNorm.weight.detach().numpy(), module.LayerNorm.bias.detach().numpy()
    return TextDecomposition(
        source=source, engine=engine, tokens=list(enc.tokens), ids=list(enc.input_ids),
        segments=list(enc.token_type_ids), positions=list(range(len(enc.input_ids))),
        **{k: parts[k][0] for k in ("word", "position", "segment", "sum", "mean", "std", "output")},
        gamma=gamma, beta=beta, eps=config.layer_norm_eps)
