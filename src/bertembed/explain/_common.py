"""What the analyses share: the checkpoint read once, its tables as measured, the base of their results, JSON, and
figures (matplotlib imported only to draw one; plots return the figure and never call `show()`)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import html
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

import numpy as np

from bertembed.config import NotInThisMember
from bertembed.numpy_layer import NumpyEmbeddings, sinusoidal_table_np
from bertembed.sources import DEFAULT_MODEL, Source, resolve
from bertembed.tokenizer import Tokenizer, check_not_blank

ModelArg = Union[str, Path, None, Source, NumpyEmbeddings]
STRUCTURAL, MEASURED = "holds for every checkpoint of this architecture", "measured on this checkpoint"
PART_COLOURS = {"word": "#4c72b0", "position": "#dd8452", "segment": "#55a868"}


class Tables:
    """A checkpoint resolved once for the analyses: its tokenizer and float32 tables, each read on first use. `model`:
    a hub id, folder or weights file, None for the bundled default, its `Source`, or a loaded `NumpyEmbeddings`."""

    def __init__(self, model: ModelArg = None):
        if isinstance(model, NumpyEmbeddings):
            self.numpy, model = model, model.source
        self.source = resolve(model)

    @functools.cached_property
    def numpy(self) -> NumpyEmbeddings:
        return NumpyEmbeddings.from_pretrained(self.source)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_pretrained(self.source)

    @property
    def config(self):
        return self.numpy.config

    @property
    def tensors(self) -> dict[str, np.ndarray]:
        return self.numpy.tensors

    def encode(self, text: str, text_b: str | None = None, names: tuple[str, str] = ("the text", "text_b")):
        """`text` and `text_b` encoded whole. ValueError for a text that gives no tokens, or one longer than the
        position table (saying how to shorten or window it)."""
        tokenizer = self.tokenizer
        tokenizer.require_tokens(text, names[0], text_b, names[1])
        enc = tokenizer(text, text_b, truncation=False, padding=False)
        count, limit = len(enc.input_ids), tokenizer.max_length
        if count > limit:
            stride = limit // 4
            windows = tokenizer(text, text_b, padding=False, stride=stride, return_overflowing_tokens=True).input_ids
            raise ValueError(f"the text is {count} tokens with its special tokens, but the model has {limit} "
                             f"positions: shorten it by {count - limit} tokens, or take it in windows: "
                             f"Tokenizer(...)(text, return_overflowing_tokens=True, stride={stride}) gives "
                             f"{len(windows)} windows of at most {limit} tokens, each with its own specials, "
                             f"neighbours sharing {stride}; or extend the positions (layer.extend_positions)")
        return enc

    def table(self, name: str) -> np.ndarray:
        """One table ("word", "position", "segment") as [rows, E] float64: the rows tokens use (a RoBERTa-style
        position table's reserved rows skipped; a sinusoidal one computed), or NotInThisMember."""
        cfg, member = self.config, f"{self.source.name} ({self.config.model_type})"
        if name == "position":
            if cfg.position_embedding_type == "none":
                raise NotInThisMember(f"{member} has no position table: its positions enter in attention (rotary, "
                                      f"ALiBi or relative), so there are no position vectors here to measure")
            if cfg.position_embedding_type == "sinusoidal":
                return sinusoidal_table_np(cfg.max_position_embeddings, cfg.table_width)
            return self.tensors["position_embeddings.weight"][cfg.first_position:].astype(np.float64)
        if name == "segment" and cfg.type_vocab_size < 2:
            what = "no segment table: it has no token types" if not cfg.type_vocab_size else \
                "one segment row: every token gets the same segment vector, so segments A and B cannot differ"
            raise NotInThisMember(f"{member} has {what}")
        key = {"word": "word_embeddings.weight", "segment": "token_type_embeddings.weight"}[name]
        return self.tensors[key].astype(np.float64)


def load_layer(model: ModelArg | Tables = None) -> Tables:
    """`model` as `Tables`, resolved once (a `Tables` is handed on as it is)."""
    return model if isinstance(model, Tables) else Tables(model)


def load_text(model: ModelArg | Tables, text: str, text_b: str | None = None,
              names: tuple[str, str] = ("the text", "text_b")):
    """(`model` as `Tables`, `text` and `text_b` encoded): a blank text is refused before the checkpoint is read."""
    check_not_blank(text, names[0], text_b, names[1])
    layer = load_layer(model)
    return layer, layer.encode(text, text_b, names)


def row_norms(matrix: np.ndarray) -> np.ndarray:
    """Euclidean norm of each row: [N, H] -> [N]."""
    return np.linalg.norm(matrix, axis=-1)


LABELS = {"k": "low frequencies fitted (k)", "pca_share_2": "variance on 2 principal components",
          "pca_share_10": "variance on 10 principal components", "lowfreq_share": "variance at frequencies 1..k",
          "lowfreq_share_sinusoid": "the same, sin/cos table", "lowfreq_share_noise": "the same, white noise",
          "entrywise_correlation": "entry-by-entry correlation with sin/cos (the naive test)",
          "structure_correlation": "structure correlation with sin/cos",
          "median_row_change": "a moved row's change |Δ|/|row| (median)",
          "relative_change": "whole tensor |B - A|/|A|", "max_abs_change": "largest entry change |Δ|",
          "most_changed": "most changed rows (|Δ|/|row|)", "ln_mean": "LayerNorm mean", "ln_std": "LayerNorm std",
          "constant_shift_change": "output change when 1 is added to every entry (LayerNorm removes it)"}


def label(key: str) -> str:
    """A summary key as people read it: "mean_adjacent_cosine" -> "mean adjacent cosine" (a few spelled out)."""
    return LABELS.get(key, key.replace("_", " "))


def summary_rows(summary: dict) -> list[dict]:
    """A summary's scalars (not its lists or dicts) as {"measure", "value"} rows."""
    return [{"measure": label(k), "value": v} for k, v in summary.items() if not isinstance(v, (list, dict))]


def to_jsonable(value: Any) -> Any:
    """Plain Python for json.dumps(..., allow_nan=False): arrays become lists, numpy scalars numbers, paths strings,
    and NaN or inf null (JSON has no such numbers, and strict parsers reject Python's NaN)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value) if isinstance(value, Path) else value


def html_table(rows: list[dict], caption: str = "") -> str:
    """An HTML table of dicts: the first row's keys (named by `label`) are the columns, numbers to 4 digits."""
    if not rows:
        return "<p>(no rows)</p>"

    def cell(v):
        return html.escape(f"{v:.4g}" if isinstance(v, (float, np.floating)) else str(v))

    head = "".join(f"<th>{html.escape(label(str(c)))}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in rows[0]) + "</tr>" for r in rows)
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclasses.dataclass(frozen=True)
class Figure:
    """One figure: its PNG's name, title, caption (the numbers in words), `draw()` (matplotlib) and `plotly()`, its
    interactive twin for the HTML report."""

    name: str
    title: str
    caption: str
    draw: Callable[[], Any]
    plotly: Callable[[], Any]

    def png(self) -> bytes:
        """The figure drawn and rendered to PNG bytes (the matplotlib figure closed)."""
        import matplotlib.pyplot as plt

        fig, buf = self.draw(), io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        return buf.getvalue()


def axes(ax=None, size=(7.5, 3.6), panels=1, tokens=None, segments=()):
    """(figure, ax), or (figure, [ax, ...]) for `panels` > 1, on a new figure unless `ax` is given; `tokens` name the
    x axis's positions 0, 1, ..., and the tokens of segment B (1 in `segments`) are shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, panels, figsize=size, layout="constrained") if ax is None else (ax.figure, ax)
    if tokens is not None:
        ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(tokens) - 0.4)
    for shape in shade_segment_b(segments):
        ax.axvspan(shape["x0"], shape["x1"], color=shape["fillcolor"], zorder=0, label="segment B (shaded)")
    return fig, ax


# every interactive figure's layout (a template by name: a Layout object would be validated again)
PLOTLY_LAYOUT = {"height": 420, "template": "plotly_white", "margin": {"t": 50, "b": 40},
                 "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1, "yanchor": "bottom"}}


def plotly_fig(traces: list[dict], title: str, xtitle: str, ytitle: str, tokens=None, segments=(), **layout):
    """A plotly figure of `traces` (dicts) under the report's layout; `tokens` and `segments` as for `axes`."""
    import plotly.graph_objects as go

    fig = go.Figure(traces, layout={"title": title, "xaxis_title": xtitle, "yaxis_title": ytitle, **PLOTLY_LAYOUT})
    if tokens is not None:
        fig.update_xaxes(tickvals=list(range(len(tokens))), ticktext=list(tokens), tickangle=-60)
    return fig.update_layout(shapes=[*layout.pop("shapes", []), *shade_segment_b(segments)], **layout)


def shade_segment_b(segments: list[int]) -> list[dict]:
    """A plotly shape behind the tokens of segment B (none without them)."""
    b = [i for i, s in enumerate(segments) if s == 1]
    return [{"type": "rect", "yref": "paper", "x0": b[0] - 0.5, "x1": b[-1] + 0.5, "y0": 0, "y1": 1, "layer": "below",
             "fillcolor": "#f3e6c4", "line": {"width": 0}}] if b else []


def figure_html(figure: Figure, interactive: bool = False) -> str:
    """A figure and its caption: with `interactive` its plotly twin (the page loads plotly.js), else its PNG inline."""
    title = html.escape(figure.title)
    if interactive:
        import plotly.io

        shown = plotly.io.to_html(figure.plotly(), include_plotlyjs=False, full_html=False, div_id=figure.name,
                                  config={"displaylogo": False})
    else:
        shown = f'<img alt="{title}" src="data:image/png;base64,{base64.b64encode(figure.png()).decode("ascii")}">'
    return f"<figure>{shown}<figcaption><b>{title}.</b> {html.escape(figure.caption)}</figcaption></figure>"


class Result:
    """What every analysis returns: its data, a `summary()` for JSON and tables, its figures; notebooks render it."""

    question = ""  # the question it answers: the title of its table and of its report section
    answer = ""  # the report section's one-line answer; "" for the summary's verdict
    tag = MEASURED  # whether the answer holds for every checkpoint of the architecture or was measured on this one
    rows_title = ""  # the caption of the `rows()` table shown under the summary in notebooks; "" for none

    @property
    def model(self) -> str:  # the name of the checkpoint measured
        return self.source.name

    def figures(self) -> list[Figure]:
        return []

    def controls(self) -> str:
        """HTML the report puts under the section's interactive figures (the projector's search box); "" for none."""
        return ""

    def _repr_html_(self) -> str:
        """Its summary as a table, its figures when matplotlib is installed, then its rows."""
        summary = self.summary()
        parts = [f"<h4>{html.escape(self.question)}</h4>"]
        if DEFAULT_MODEL in (summary.get("model"), summary.get("model_a"), summary.get("model_b")):
            parts.append("<p>measured on the bundled all-MiniLM-L6-v2 (BERT's architecture, fine-tuned for sentence "
                         "embeddings), not bert-base-uncased</p>")
        parts.append(html_table(summary_rows(summary)))
        try:
            parts += [figure_html(f) for f in self.figures()]
        except ImportError:
            parts.append("<p>(install matplotlib, the viz extra, to see the figures)</p>")
        if self.rows_title:
            parts.append(html_table(self.rows(), self.rows_title))
        return "\n".join(parts)


@dataclasses.dataclass
class NotMeasured(Result):
    """An analysis that does not apply to the checkpoint's member, and why (a report section of one sentence)."""

    question = "Not measured in this member"
    tag = ""  # (nothing is claimed)

    title: str
    reason: str

    def summary(self) -> dict:
        return {"verdict": self.reason}

    def rows(self) -> list[dict]:
        return [{"measure": self.title, "value": "not measured"}]
