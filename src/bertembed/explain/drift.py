"""Drift between two checkpoints of the same architecture (say, a model and its fine-tuned copy): per table, how far
it moved and which rows moved most. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertembed.explain._common import Figure, ModelArg, Result, axes, load_layer, plotly_fig, row_norms
from bertembed.sources import Source

DRIFT_TABLES = {"word": "word_embeddings.weight", "position": "position_embeddings.weight",
                "segment": "token_type_embeddings.weight", "LayerNorm.weight": "LayerNorm.weight",
                "LayerNorm.bias": "LayerNorm.bias", "projection.weight": "projection.weight",
                "projection.bias": "projection.bias"}  # (the projection E -> H of ALBERT, ELECTRA, DeBERTa: where held)


@dataclass
class TableDrift:  # one tensor of A against the same tensor of B
    table: str
    shape: list[int]
    relative_change: float  # |B - A|_F / |A|_F over the whole tensor: small for a big table with few rows moved
    max_abs_change: float  # the largest change of one entry (absolute)
    rows_changed: int  # rows (or elements, for LayerNorm's vectors) not exactly equal
    median_row_change: float = 0.0  # median |row B - row A| / |row A| over the moved rows: independent of size
    top: list[dict] = field(default_factory=list)  # {"row", "label", "change", "relative"}, by relative change
    non_finite: dict[str, list[int]] = field(default_factory=dict)  # "A"/"B": rows (elements) holding NaN or inf


@dataclass
class DriftReport(Result):
    question = "How far did each tensor move between two checkpoints?"
    answer = "How far each tensor moved from checkpoint A to B."
    rows_title = "drift per table"

    source_a: Source
    source_b: Source
    tables: list[TableDrift]

    def summary(self) -> dict:
        out = {"model_a": self.source_a.name, "model_b": self.source_b.name}
        for t in self.tables:
            out |= {f"{t.table}_{k}": getattr(t, k) for k in ("relative_change", "rows_changed", "median_row_change")}
        warning = self.warning()
        return out | {"warning": warning} if warning else out

    def warning(self) -> str:
        """Which tensor of which checkpoint holds NaN or inf, and where; empty when every tensor is finite."""
        found = [f"{t.table} of {side} ({(self.source_a if side == 'A' else self.source_b).name}) at row(s) "
                 f"{', '.join(map(str, rows[:5]))}{', ...' if len(rows) > 5 else ''} of {t.shape[0]}"
                 for t in self.tables for side, rows in t.non_finite.items()]
        if not found:
            return ""
        return ("NaN or inf values in " + "; ".join(found) + ". The changes of those tensors are not finite "
                "(nan or inf in the table, null in JSON), and their rows are left out of the most-changed lists")

    def rows(self) -> list[dict]:
        return [{"table": t.table, "shape": "x".join(map(str, t.shape)), "rows_changed": t.rows_changed,
                 "median_row_change": t.median_row_change, "relative_change": t.relative_change,
                 "max_abs_change": t.max_abs_change, "most_changed": ", ".join(
                     f"{r['label']} ({r['relative']:.2g} of its norm)" if np.isfinite(r["relative"]) else
                     f"{r['label']} (was a zero row)" for r in t.top)}
                for t in self.tables]

    def figures(self) -> list[Figure]:
        parts = [f"{t.table}: {t.rows_changed} of {t.shape[0]} rows moved, a moved row by {t.median_row_change:.2g} "
                 f"of its norm (median), the whole tensor by {t.relative_change:.2g}" for t in self.tables]
        word = next((t for t in self.tables if t.table == "word" and t.top), None)
        top = f" Most-changed tokens (relative to their norm): {', '.join(x['label'] for x in word.top[:5])}." \
            if word else ""
        caption = f"From {self.source_a.name} to {self.source_b.name}, per tensor: " + "; ".join(parts) + "." + top
        return [Figure("drift", "Drift per tensor", caption, self.plot, self.plotly)]

    def plotly(self):
        traces = [{"type": "bar", "x": [t.table for t in self.tables], "marker": {"color": "#737373"},
                   "y": [t.median_row_change if t.median_row_change > 0 else None for t in self.tables],
                   "customdata": [[t.rows_changed, t.shape[0], t.relative_change] for t in self.tables],
                   "hovertemplate": "%{x}: %{customdata[0]} of %{customdata[1]} rows moved, a moved row by %{y:.3g} "
                                    "of its norm (median), the whole tensor by %{customdata[2]:.3g}<extra></extra>"}]
        return plotly_fig(traces, "Drift per tensor between two checkpoints", "tensor",
                          "median |Δ row| / |row|, rows that moved", yaxis={"type": "log"})

    def plot(self, ax=None):
        """Per tensor, the median |row B - row A| / |row A| over the rows that moved (it does not shrink with size)."""
        fig, ax = axes(ax, size=(6.5, 3.4))
        values = [t.median_row_change if t.median_row_change > 0 else np.nan for t in self.tables]
        bars = ax.bar([t.table for t in self.tables], values, color="0.45")
        ax.bar_label(bars, labels=[f"{t.median_row_change:.2g}, {t.rows_changed} of {t.shape[0]}" if t.rows_changed
                                   else "" for t in self.tables], fontsize=7)
        ax.set(yscale="log" if any(v == v for v in values) else "linear", xlabel="tensor",
               ylabel="median |Δ row| / |row|, rows that moved",
               title="Drift per tensor between two checkpoints (label: change, rows moved)")
        if not any(v == v for v in values):
            ax.text(0.5, 0.5, "no tensor changed", transform=ax.transAxes, ha="center")
        ax.tick_params(axis="x", labelsize=8)
        return fig


def _labeller(layer, name: str):
    """Turns a row index into a readable label: the token for the word table, 'pos N', 'segment A/B'."""
    if name == "word":
        try:
            tokenizer = layer.tokenizer
            return lambda i: f"{tokenizer.backend.id_to_token(i)} ({i})"
        except (FileNotFoundError, ValueError):
            return lambda i: f"id {i}"
    return {"position": lambda i: f"pos {i}", "segment": lambda i: f"segment {'AB'[i] if i < 2 else i}"}.get(
        name, lambda i: f"[{i}]")


def _table_drift(name: str, a: np.ndarray, b: np.ndarray, label, top: int) -> TableDrift:
    """One tensor's drift; a LayerNorm vector [N] is taken as N rows of one element."""
    shape, a, b = list(a.shape), a.reshape(len(a), -1), b.reshape(len(b), -1)
    a64, delta = a.astype(np.float64), b.astype(np.float64) - a
    per_row, base = row_norms(delta), row_norms(a64)
    differs = (a != b) & ~(np.isnan(a) & np.isnan(b))  # a NaN left as it was is no change
    relative = np.divide(per_row, base, out=np.full_like(per_row, np.inf), where=base > 0)  # (a row from zero: inf)
    moved = (per_row > 0) & np.isfinite(per_row) & ~np.isnan(relative)  # unchanged rows, NaN or inf drop out
    order = np.argsort(-np.where(moved, relative, -1.0), kind="stable")[:int(moved.sum())][:top]
    scaled, whole, norm = moved & np.isfinite(relative), np.linalg.norm(delta), np.linalg.norm(a64)  # (NaN stays NaN)
    non_finite = {side: np.flatnonzero(~np.isfinite(x).all(1)).tolist() for side, x in (("A", a), ("B", b))}
    return TableDrift(
        table=name, shape=shape, relative_change=float(whole / norm if norm != 0 else np.inf if whole > 0 else 0.0),
        max_abs_change=float(np.abs(delta).max()), rows_changed=int(differs.any(1).sum()),
        median_row_change=float(np.median(relative[scaled])) if scaled.any() else 0.0,
        top=[{"row": int(i), "label": label(int(i)), "change": float(per_row[i]), "relative": float(relative[i])}
             for i in order],
        non_finite={side: rows for side, rows in non_finite.items() if rows})


def drift(model_a: ModelArg, model_b: ModelArg, *, top: int = 10) -> DriftReport:
    """Compare the embedding tensors of two checkpoints, listing the `top` most-changed rows of each. ValueError if
    their shapes differ or top < 0; a tensor holding NaN or inf gets NaN changes and a `warning()` naming it."""
    if top < 0:
        raise ValueError(f"top={top}: list 0 or more most-changed rows")
    a, b = load_layer(model_a), load_layer(model_b)
    if (kinds := (a.config.model_type, b.config.model_type))[0] != kinds[1]:  # (equal shapes, another recipe)
        raise ValueError(f"{a.source.name} is a {kinds[0]} checkpoint and {b.source.name} a {kinds[1]} one: compare "
                         f"two checkpoints of the same architecture")
    shapes = {k: (tuple(a.tensors[k].shape) if k in a.tensors else None,
                  tuple(b.tensors[k].shape) if k in b.tensors else None) for k in DRIFT_TABLES.values()}
    if wrong := [f"{k}: {sa} vs {sb}" for k, (sa, sb) in shapes.items() if sa != sb]:
        raise ValueError(f"{a.source.name} and {b.source.name} have different shapes, so their rows cannot be "
                         f"compared: {'; '.join(wrong)}. Compare two checkpoints of the same architecture")
    tables = [_table_drift(name, a.tensors[key], b.tensors[key], _labeller(a, name), top)
              for name, key in DRIFT_TABLES.items() if key in a.tensors]
    return DriftReport(a.source, b.source, tables)
