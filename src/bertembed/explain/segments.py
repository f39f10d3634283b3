"""Segment (token type) embeddings: two learned vectors (not zeros and ones), measured against word and position
vectors and by how the output changes when one text moves from segment A to B. T segments, L length, H hidden."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertembed.explain._common import STRUCTURAL, Figure, ModelArg, Result, axes, load_layer, plotly_fig, row_norms
from bertembed.sources import Source
from bertembed.tokenizer import check_not_blank

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog"
SEGMENT_COLOURS = ("#8172b3", "#e1a13a")  # segment A, segment B


@dataclass
class SegmentReport(Result):
    """The segment table [T, H] and the effect of switching one text from segment A to segment B."""

    question = "What are segment embeddings: zeros and ones?"
    answer = ("No: two learned vectors. Segment A's is added to [CLS], sentence A and its [SEP]; segment B's to "
              "sentence B and the last [SEP]. Both sentences are one sequence.")
    tag = STRUCTURAL

    source: Source
    vectors: np.ndarray = field(repr=False)  # [T, H]
    norms: list[float]  # per segment
    difference_norm: float  # |seg1 - seg0|
    cosine: float  # between seg0 and seg1
    median_word_norm: float
    median_position_norm: float
    zeros_and_ones: bool  # True only if seg0 is all 0 and seg1 all 1 (a common belief)
    text: str
    tokens: list[str]  # the text's, or the pair's (one sequence) when a second text is given
    output_change: np.ndarray = field(repr=False)  # [L] |out(B) - out(A)| per token
    output_cosine: np.ndarray = field(repr=False)  # [L] cosine of out(A) and out(B) per token
    output_norm: float  # mean |out(A)|, for scale
    distance_from_zeros_and_ones: tuple[float, float] = (0.0, 0.0)  # |row A - 0|, |row B - 1|
    first_values: list[list[float]] = field(default_factory=list)
    constant_shift_change: float = 0.0  # max |LayerNorm(x + 1) - LayerNorm(x)| over the tokens, in float32
    pair_tokens: list[str] = field(default_factory=list)  # a pair (when a second text is given): one sequence
    pair_segments: list[int] = field(default_factory=list)
    warning: str | None = None

    def summary(self) -> dict:
        return {"model": self.model, "segments": len(self.norms), "norm_a": self.norms[0], "norm_b": self.norms[1],
                **{k: getattr(self, k) for k in ("difference_norm", "cosine", "median_word_norm",
                                                 "median_position_norm", "zeros_and_ones")},
                "distance_of_a_from_zeros": self.distance_from_zeros_and_ones[0],
                "distance_of_b_from_ones": self.distance_from_zeros_and_ones[1],
                "constant_shift_change": self.constant_shift_change, "text": self.text,
                "mean_output_change": float(self.output_change.mean()),
                "mean_output_cosine": float(self.output_cosine.mean()), "mean_output_norm": self.output_norm,
                **({"warning": self.warning} if self.warning else {})}

    def figures(self) -> list[Figure]:
        verdict = "they ARE zeros and ones" if self.zeros_and_ones else "not zeros and ones"
        a, b = self.distance_from_zeros_and_ones
        vectors = (f"Every value of the segment table's {len(self.norms)} learned rows, against 0 and 1: {verdict} "
                   f"(row A is {a:.3f} from all zeros, row B {b:.3f} from all ones). |A| = {self.norms[0]:.3f}, |B| "
                   f"= {self.norms[1]:.3f}, cosine(A, B) = {self.cosine:.2f}, |B - A| = {self.difference_norm:.3f}; "
                   f"for scale, the median word vector has norm {self.median_word_norm:.3f}, the median position "
                   f"vector {self.median_position_norm:.3f}. " + (
                       f"Rows of zeros and ones could not tell A from B: adding 1 to every entry of a token's sum "
                       f"changes LayerNorm's output by at most {self.constant_shift_change:.1e} here (float32 "
                       f"rounding), since LayerNorm subtracts the mean." if self.constant_shift_change < 1e-3 else
                       f"Here rows of zeros and ones would tell A from B, through the projection E -> H before "
                       f"LayerNorm: adding 1 to every entry of a token's sum adds W·1 after it, not a constant, and "
                       f"changes LayerNorm's output by up to {self.constant_shift_change:.2g}."))
        what = "The pair" if self.pair_tokens else "The same text"
        effect = (f"{what} ({len(self.tokens)} tokens) embedded with every token in segment A, then in segment "
                  f"B: the output moves by {self.output_change.mean():.2f} on average (mean output norm "
                  f"{self.output_norm:.2f}), output cosine {self.output_cosine.mean():.3f}. In a pair, [CLS] A [SEP] "
                  f"take segment A and B [SEP] take segment B (shaded): one sequence, processed in parallel, told "
                  f"apart only by this added vector.")
        return [Figure("segments", "Segment rows' values", vectors, self.plot_vectors, self.plotly_vectors),
                Figure("segment_effect", "Segment A vs B", effect, self.plot_effect, self.plotly_effect)]

    def vectors_title(self) -> str:
        return f"Segment rows: {'zeros and ones' if self.zeros_and_ones else 'learned values, not 0 and 1'} (dashed)"

    def plot_vectors(self, ax=None):
        """Every value of the two segment rows against the 0 and 1 people expect."""
        fig, ax = axes(ax)
        for row, name, colour in zip(self.vectors[:2], ("A (id 0)", "B (id 1)"), SEGMENT_COLOURS, strict=True):
            ax.plot(row, ".", ms=3, color=colour, label=f"segment {name}")
        for level in (0, 1):
            ax.axhline(level, color="0.3", ls="--", lw=0.8)
        ax.set(xlabel="hidden dimension", ylabel="value", title=self.vectors_title())
        ax.legend(fontsize=8)
        return fig

    def plotly_vectors(self):
        traces = [{"type": "scatter", "mode": "markers", "y": row, "name": f"segment {name}", "marker": {"color": c},
                   "hovertemplate": f"segment {name}, dimension %{{x}}: %{{y:.4f}}<extra></extra>"}
                  for row, name, c in zip(self.vectors[:2], "AB", SEGMENT_COLOURS, strict=True)]
        return plotly_fig(traces, self.vectors_title(), "hidden dimension", "value",
                          shapes=[_dashed(0), _dashed(1)])

    def plot_effect(self, ax=None):
        """Per token: how far the output moves when the same text is put in segment B instead of A."""
        fig, ax = axes(ax, tokens=self.tokens, segments=self.pair_segments)
        ax.bar(range(len(self.tokens)), self.output_change, color=SEGMENT_COLOURS[1],
               label="|output(B) - output(A)|")
        ax.axhline(self.output_norm, color="0.3", ls="--", lw=0.8, label=f"mean |output| = {self.output_norm:.2f}")
        ax.set(ylabel="L2 distance", title="Same tokens, segment A vs segment B: change in the layer's output")
        ax.legend(fontsize=8)
        return fig

    def plotly_effect(self):
        traces = [{"type": "bar", "y": self.output_change, "customdata": self.tokens, "name": "|output(B) - output(A)|",
                   "marker": {"color": SEGMENT_COLOURS[1]},
                   "hovertemplate": "%{customdata} (position %{x}): moves by %{y:.3f}<extra></extra>"}]
        return plotly_fig(traces, f"Same tokens, segment A vs segment B: change in the layer's output (dashed: mean "
                          f"|output| {self.output_norm:.2f})", "", "L2 distance", self.tokens, self.pair_segments,
                          shapes=[_dashed(self.output_norm)])


def _dashed(y: float) -> dict:  # a plotly shape across the plot
    return {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": y, "y1": y, "line": {"dash": "dash", "width": 1}}


def analyze_segments(text: str = DEFAULT_TEXT, text_b: str | None = None, model: ModelArg = None) -> SegmentReport:
    """Measure the segment table and the output of `text` in segment A versus B; with `text_b`, also the pair as one
    sequence. ValueError for a blank or too long text; NotInThisMember where the member has under two segment rows."""
    check_not_blank(text, text_b=text_b)
    layer = load_layer(model)
    seg = layer.table("segment")
    enc = layer.encode(text, text_b)  # (the pair as one sequence; refused without tokens or past the positions)
    ids = np.array([enc.input_ids, enc.input_ids])
    parts = layer.numpy.decompose(ids, np.array([[0] * ids.shape[1], [1] * ids.shape[1]]))
    out_a, out_b = parts["output"].astype(np.float64)
    norms = row_norms(seg)
    total = parts["sum"][0].astype(np.float32)
    # 1 added to every entry of the sum at E, as it reaches LayerNorm: 1, or W·1 after DeBERTa's projection E -> H
    shift = layer.numpy.tensors["projection.weight"].sum(1).astype(np.float32) \
        if layer.config.projection == "before_norm" else np.float32(1)
    position_norm = (float(np.median(row_norms(layer.table("position"))))  # (NaN: no position table to compare with)
                     if layer.config.position_embedding_type != "none" else float("nan"))
    return SegmentReport(
        source=layer.source, vectors=seg, norms=[float(n) for n in norms],
        difference_norm=float(np.linalg.norm(seg[1] - seg[0])),
        cosine=float(seg[0] @ seg[1] / max(norms[0] * norms[1], 1e-30)),
        median_word_norm=float(np.median(row_norms(layer.table("word")))), median_position_norm=position_norm,
        zeros_and_ones=bool(np.all(seg[0] == 0) and np.all(seg[1] == 1)), text=text, tokens=list(enc.tokens),
        output_change=row_norms(out_b - out_a),
        output_cosine=(out_a * out_b).sum(-1) / np.maximum(row_norms(out_a) * row_norms(out_b), 1e-30),
        output_norm=float(row_norms(out_a).mean()),
        distance_from_zeros_and_ones=(float(np.linalg.norm(seg[0])), float(np.linalg.norm(seg[1] - 1))),
        first_values=[[float(v) for v in row[:6]] for row in seg[:2]],
        constant_shift_change=float(np.abs(_normed32(total + shift) - _normed32(total)).max()),
        pair_tokens=list(enc.tokens) if text_b is not None else [],
        pair_segments=list(enc.token_type_ids) if text_b is not None else [],
        warning=literal_separator(layer.tokenizer, text, text_b))


def _normed32(x: np.ndarray) -> np.ndarray:
    """LayerNorm's normalisation in float32, as the layer computes it: (x - mean) / sqrt(var + eps)."""
    mean = x.mean(-1, keepdims=True, dtype=np.float32)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True, dtype=np.float32) + np.float32(1e-12))


def literal_separator(tokenizer, text: str, text_b: str | None = None) -> str | None:
    """A warning when a text holds its tokenizer's separator literally: it stays in that text's segment."""
    for segment, which in (("A", text), ("B", text_b)):
        for sep in ("[SEP]", "</s>"):
            if which and sep in which and tokenizer.token_to_id(sep) is not None:
                return (f"text {segment} holds a literal {sep}: it becomes the separator token but stays in segment "
                        f"{segment}, one text; two texts make a pair: give the second as its own (explain A B, "
                        f"inspect segments A --text-b B, or tok(a, b))")
    return None
