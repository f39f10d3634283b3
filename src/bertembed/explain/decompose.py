"""One text (or pair) taken apart: per token, the word, position and segment vectors, LayerNorm's statistics, the
output, and LayerNorm(word + position + segment) recomputed by hand in float64. L length, H hidden."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bertembed.explain._common import PART_COLOURS, STRUCTURAL, Figure, Result, axes, load_text, plotly_fig
from bertembed.explain.segments import literal_separator
from bertembed.sources import Source

PARTS = ("word", "position", "segment")


@dataclass
class TextDecomposition(Result):
    """The parts of one sequence. Vectors are [L, H] float32 arrays; statistics are [L]."""

    question = "What does the layer add to each token?"
    answer = ("Each token's vector is the sum of its rows (word, and position and segment where the member has those "
              "tables), then LayerNorm. The table gives each part's norm and its share of the variance LayerNorm sees.")
    rows_title = "one row per token"
    tag = STRUCTURAL

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
    parts: tuple[str, ...] = PARTS  # the parts the member adds (a table it lacks adds nothing: DeBERTa v3's segment)
    recipe: str = "LayerNorm(word + segment + position)"  # the member's own, in its order (`recipe`)
    warning: str | None = None  # a literal separator in a text (it stays in that text's segment)

    def by_hand(self) -> np.ndarray:
        """LayerNorm(word + position + segment) recomputed from the parts in float64: [L, H]."""
        total = self.word.astype(np.float64) + self.position + self.segment
        mean = total.mean(-1, keepdims=True)
        var = ((total - mean) ** 2).mean(-1, keepdims=True)
        return (total - mean) / np.sqrt(var + self.eps) * self.gamma.astype(np.float64) + self.beta

    @property
    def max_abs_diff(self) -> float:
        """Largest |by-hand - layer output| over all tokens and dimensions; NaN when the tables hold NaN or inf."""
        with np.errstate(invalid="ignore"):  # inf - inf: the NaN it gives is the answer, shown as such
            return float(np.abs(self.by_hand() - self.output).max())

    def norms(self) -> dict[str, np.ndarray]:
        """Euclidean norm per token of each part: [L] arrays."""
        return {name: np.linalg.norm(getattr(self, name).astype(np.float64), axis=-1)
                for name in (*self.parts, "sum", "output")}

    def _covariances(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Per part, part * (sum - its mean over H), and that centred sum squared: [L, H] float64 arrays."""
        total = self.sum.astype(np.float64)
        centred = total - total.mean(-1, keepdims=True)
        return {name: getattr(self, name).astype(np.float64) * centred for name in self.parts}, centred ** 2

    def variance_shares(self) -> dict[str, np.ndarray]:
        """Each part's share Cov_H(part, sum) / Var_H(sum) of the variance LayerNorm divides by: [L] arrays adding up
        to 1 per token (a part that cancels the others has a negative share)."""
        cov, var = self._covariances()
        return {name: c.mean(-1) / var.mean(-1) for name, c in cov.items()}

    def overall_shares(self) -> dict[str, float]:
        """The same shares pooled over all tokens (covariances and variances summed before dividing)."""
        cov, var = self._covariances()
        return {name: float(c.sum() / float(var.sum())) for name, c in cov.items()}

    def rows(self) -> list[dict]:
        norms, shares = self.norms(), self.variance_shares()
        columns = {"position": self.positions, "token": self.tokens, "id": self.ids, "segment": self.segments,
                   **{f"{k}_norm": norms[k] for k in self.parts}, **{f"{k}_share": shares[k] for k in self.parts},
                   "ln_mean": self.mean, "ln_std": self.std, "output_norm": norms["output"]}
        return [{k: float(v[i]) if isinstance(v, np.ndarray) else v[i] for k, v in columns.items()}
                for i in range(len(self.tokens))]

    def summary(self) -> dict:
        norms = self.norms()
        out = {"model": self.source.name, "tokens": len(self.tokens), "segment_b_tokens": int(sum(self.segments))}
        out |= {f"{k}_share": v for k, v in self.overall_shares().items()}
        out |= {f"mean_{k}_norm": float(v.mean()) for k, v in norms.items()}
        out["max_abs_diff"] = self.max_abs_diff
        return out | ({"warning": self.warning} if self.warning else {})

    def figures(self) -> list[Figure]:
        n, s = self.norms(), self.overall_shares()
        means = ", ".join(f"{part} {n[part].mean():.3f}" for part in self.parts)
        projected = " (each part after the projection E -> H, as it enters LayerNorm)" * ("@ projection" in self.recipe)
        norms = (f"{len(self.tokens)} tokens ({sum(self.segments)} in segment B, shaded). Mean norms{projected}: "
                 f"{means}; their sum {n['sum'].mean():.3f}. After LayerNorm the output norm is "
                 f"{n['output'].mean():.2f} on average: LayerNorm rescales every token to unit variance, then applies "
                 f"its learned gain (and bias, where it has one).")
        shares = (f"Share of the variance over the hidden dimensions of {' + '.join(self.parts)} that comes from each "
                  f"part (Cov(part, sum) / Var(sum); the shares add up to 1 per token). Pooled over the tokens: "
                  f"{', '.join(f'{part} {s[part]:.0%}' for part in self.parts)}. {self.recipe} recomputed by hand "
                  f"equals the layer's output to {self.max_abs_diff:.1e}.")
        return [Figure("decomposition_norms", "Norms per token", norms, self.plot_norms, lambda: self._plotly(
                    self.norms(), "norm", "How long is each part of the sum? (per token; segment B shaded)",
                    "L2 norm")),
                Figure("variance_shares", "Variance shares", shares, self.plot_variance_shares, lambda: self._plotly(
                    self.variance_shares(), "share", "Who decides what LayerNorm sees? (variance shares)",
                    "share of Var(sum) over hidden dims", barmode="relative"))]

    def _plotly(self, values: dict[str, np.ndarray], what: str, title: str, ytitle: str, **layout):
        """Per token, one bar per part (hover: token, position, segment, the part's value), segment B shaded."""
        where = [[t, p, "AB"[s]] for t, p, s in zip(self.tokens, self.positions, self.segments, strict=True)]
        traces = [{"type": "bar", "x": list(range(len(self.tokens))), "y": values[name], "name": name,
                   "marker": {"color": PART_COLOURS[name]}, "customdata": where,
                   "hovertemplate": f"%{{customdata[0]}} (position %{{customdata[1]}}, segment %{{customdata[2]}})"
                                    f"<br>{name} {what} %{{y:.3f}}<extra></extra>"} for name in self.parts]
        return plotly_fig(traces, title, "", ytitle, self.tokens, self.segments, **layout)

    def plot_norms(self, ax=None):
        """Per token: the norms of its word, position and segment vectors, those the member has (grouped bars)."""
        fig, ax = axes(ax, tokens=self.tokens, segments=self.segments)
        norms, x = self.norms(), np.arange(len(self.tokens))
        width = 0.8 / len(self.parts)
        for j, name in enumerate(self.parts):
            ax.bar(x + (j - (len(self.parts) - 1) / 2) * width, norms[name], width, color=PART_COLOURS[name],
                   label=f"{name} vector")
        ax.set(ylabel="L2 norm", title="How long is each part of the sum? (per token)")
        ax.legend(fontsize=8, ncols=4, loc="upper right")
        return fig

    def plot_variance_shares(self, ax=None):
        """Per token: each part's share of the variance of the sum (stacked; shares add to 1)."""
        fig, ax = axes(ax, tokens=self.tokens, segments=self.segments)
        shares, x = self.variance_shares(), np.arange(len(self.tokens))
        pos_base, neg_base = np.zeros(len(x)), np.zeros(len(x))
        for name, value in shares.items():
            ax.bar(x, value, 0.7, bottom=np.where(value >= 0, pos_base, neg_base), color=PART_COLOURS[name], label=name)
            pos_base, neg_base = pos_base + np.clip(value, 0, None), neg_base + np.clip(value, None, 0)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set(ylabel="share of Var(sum) over hidden dims", title="Who decides what LayerNorm sees? (variance shares)")
        ax.legend(fontsize=8, ncols=4, loc="lower right")
        return fig


def explain_text(text: str, text_b: str | None = None, model=None, *, engine: str = "numpy") -> TextDecomposition:
    """Tokenize `text` (and `text_b` as segment B) with `model`'s tokenizer and decompose its embedding. ValueError
    for a text that gives no tokens, or one longer than the position table (never truncated)."""
    if engine not in ("numpy", "torch"):
        raise ValueError(f"engine={engine!r}: use 'numpy' or 'torch'")
    layer, enc = load_text(model, text, text_b, ("TEXT", "TEXT_B"))
    ids, types = np.array([enc.input_ids]), np.array([enc.token_type_ids])
    if engine == "numpy":
        parts, config, tensors = layer.numpy.decompose(ids, types), layer.config, layer.tensors
    else:
        import torch

        from bertembed.embeddings import BertEmbeddings

        module = BertEmbeddings.from_pretrained(layer.source)
        with torch.no_grad():
            parts = vars(module.decompose(torch.from_numpy(ids), torch.from_numpy(types)))
        parts = {k: v.float().numpy() for k, v in parts.items()}
        config, tensors = module.config, {k: v.float().numpy() for k, v in module.state_dict().items()}
    gamma = tensors["LayerNorm.weight"]
    beta = tensors.get("LayerNorm.bias", np.zeros_like(gamma))  # (ModernBERT's norm has no bias)
    # the parts the member adds, and its recipe in its own order of the sum: BERT's "LayerNorm(word + segment +
    # position)", DeBERTa v3's "LayerNorm(word)" (ALBERT's and ELECTRA's projection is outside: layer.project)
    has = tuple(p for p in PARTS if p == "word" or (config.position_embedding_type != "none" if p == "position"
                                                    else config.type_vocab_size > 0))
    order = ("word", "position", "segment") if config.sum_order == "position_first" else ("word", "segment", "position")
    total = " + ".join(p for p in order if p in has)
    total = f"({total}) @ projection" if config.projection == "before_norm" else total
    return TextDecomposition(
        source=layer.source, engine=engine, tokens=list(enc.tokens), ids=list(enc.input_ids),
        segments=list(enc.token_type_ids),
        positions=list(range(config.first_position, config.first_position + len(enc.input_ids))),
        **{k: parts[k][0] for k in ("word", "position", "segment", "sum", "mean", "std", "output")},
        gamma=gamma, beta=beta, eps=config.layer_norm_eps, parts=has, recipe=f"LayerNorm({total})",
        warning=literal_separator(layer.tokenizer, text, text_b))
