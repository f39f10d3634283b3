"""What segment (token type) embeddings are: two learned vectors, one added to every token of sentence A, the other
to every token of sentence B. Not zeros and ones; measured here against typical word and position vectors, and by
what changes in the output when the same text is placed in segment A or in segment B.

Dimension letters: T token types (segments), L length, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertembed.explain._common import ModelArg, NotInThisMember, load_layer, repr_html, row_norms, table

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog"


@dataclass
class SegmentReport:
    """The segment table [T, H] and the effect of switching one text from segment A to segment B."""

    model: str
    vectors: np.ndarray = field(repr=False)  # [T, H]
    norms: list[float]  # per segment
    difference_norm: float  # |seg1 - seg0|
    cosine: float  # between seg0 and seg1
    median_word_norm: float
    median_position_norm: float
    zeros_and_ones: bool  # True only if seg0 is all 0 and seg1 all 1 (the belief some users hold)
    text: str
    tokens: list[str]
    output_change: np.ndarray = field(repr=False)  # [L] |out(B) - out(A)| per token
    output_cosine: np.ndarray = field(repr=False)  # [L] cosine of out(A) and out(B) per token
    output_norm: float  # mean |out(A)|, for scale
    pair_tokens: list[str] = field(default_factory=list)  # an example pair: how two sentences share one sequence
    pair_segments: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        return {"model": self.model, "segments": len(self.norms), "norm_a": self.norms[0], "norm_b": self.norms[1],
                "difference_norm": self.difference_norm, "cosine": self.cosine,
                "median_word_norm": self.median_word_norm, "median_position_norm": self.median_position_norm,
                "zeros_and_ones": self.zeros_and_ones, "text": self.text,
                "mean_output_change": float(self.output_change.mean()),
                "mean_output_cosine": float(self.output_cosine.mean()), "mean_output_norm": self.output_norm}

    def _repr_html_(self) -> str:
        return repr_html(self)


def analyze_segments(model: ModelArg = None, text: str = DEFAULT_TEXT,
                     text_b: str = "It was not amused.") -> SegmentReport:
    """Measure the segment table and the output of `text` in segment A versus segment B.

    Raises ValueError for a text (or `text_b`, the pair's second sentence) that is empty or gives no tokens, and for a
    text longer than the position table.
    """
    from bertembed.tokenizer import Tokenizer, check_not_blank

    check_not_blank(text, "the text")
    check_not_blank(text_b, "text_b")
    layer = load_layer(model)
    seg = table(layer, "segment")
    tokenizer = Tokenizer.from_pretrained(layer.source)
    tokenizer.require_tokens(text, "the text")
    tokenizer.require_tokens(text_b, "text_b")
    enc = tokenizer(text, truncation=False, padding=False)
    if len(enc.input_ids) > tokenizer.max_length:
        raise ValueError(f"the text is {len(enc.input_ids)} tokens, the model has {tokenizer.max_length} positions")
    ids = np.array([enc.input_ids, enc.input_ids])
    out = layer.decompose(ids, np.array([[0] * ids.shape[1], [1] * ids.shape[1]]))["output"].astype(np.float64)
    out_a, out_b = out[0], out[1]
    pair = tokenizer(text, text_b, truncation=False, padding=False)
    norms = row_norms(seg)
    return SegmentReport(
        model=layer.source.name, vectors=seg, norms=[float(n) for n in norms],
        difference_norm=float(np.linalg.norm(seg[1] - seg[0])),
        cosine=float(seg[0] @ seg[1] / max(norms[0] * norms[1], 1e-30)),
        median_word_norm=float(np.median(row_norms(table(layer, "word")))),
        median_position_norm=_median_position_norm(layer),
        zeros_and_ones=bool(np.all(seg[0] == 0) and np.all(seg[1] == 1)), text=text, tokens=list(enc.tokens),
        output_change=row_norms(out_b - out_a),
        output_cosine=(out_a * out_b).sum(-1) / np.maximum(row_norms(out_a) * row_norms(out_b), 1e-30),
        output_norm=float(row_norms(out_a).mean()), pair_tokens=list(pair.tokens),
        pair_segments=list(pair.token_type_ids))


def _median_position_norm(layer) -> float:
    try:
        return float(np.median(row_norms(table(layer, "position"))))
    except NotInThisMember:
        return float("nan")  # (no position table: nothing to compare the segment rows with)
