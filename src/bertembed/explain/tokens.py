"""The word table as a dictionary of vectors: a token's nearest neighbours, the special rows, and norm against id
(in BERT's vocabulary a rough frequency rank). V vocabulary, H hidden."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertembed.explain._common import PART_COLOURS, Figure, ModelArg, Result, axes, load_layer, plotly_fig, row_norms
from bertembed.sources import Source
from bertembed.tokenizer import check_text

RANK_START_TOKEN = "the"  # in BERT's vocabulary the frequency-ordered whole words start here (id 1996)
MAX_PIECES = 16  # each piece costs a search of the [V, H] table and a line: a word or a few, not a text


@dataclass
class TokenReport(Result):
    """A token's row and neighbours, the special rows, and norms against vocabulary order."""

    question = "What is in the word table?"
    answer = "nn.Embedding is a table; a token id picks its row. Rows of related words point the same way."

    source: Source
    token: str
    token_id: int
    token_norm: float
    neighbours: list[dict]  # {"token", "id", "cosine"}, most similar first, the token itself excluded
    special: list[dict]  # {"token", "id", "norm"} for the special tokens present
    pad_is_zero: bool | None  # None: the layer has no padding row (a config's null pad id)
    median_norm: float
    unused_median_norm: float | None  # the never-seen [unusedN] rows, if the vocabulary has them
    rank_start: int | None  # first id of the frequency-ordered region, None when the order is unknown
    rank_norm_correlation: float | None  # Spearman correlation of id (rank) and norm in that region
    norms: np.ndarray = field(repr=False)  # [V]
    asked: str = ""  # the word asked for, when `token` is the entry it normalises to ("Paris" -> "paris")
    pieces: list[dict] = field(default_factory=list)  # {"token", "id", "neighbours"}: the pieces a word splits into
    note: str = ""
    vocabulary: list[str] = field(default_factory=list, repr=False)  # every row's token, by id (for hover)

    def summary(self) -> dict:
        return {"model": self.model, **({"asked": self.asked, "note": self.note} if self.note else {}),
                "token": self.token, "token_id": self.token_id, "token_norm": self.token_norm,
                "nearest": _listed(self.neighbours), **{f"piece {p['token']}": _listed(p["neighbours"])
                                                         for p in self.pieces[1:]},
                **{k: getattr(self, k) for k in ("pad_is_zero", "median_norm", "unused_median_norm", "rank_start",
                                                 "rank_norm_correlation")}}

    def figures(self) -> list[Figure]:
        pad = {None: "no padding row", True: "[PAD] row is all zeros", False: "[PAD] row is not zero"}
        norms = (f"Norm of each of the {len(self.norms)} word-table rows against its id: median "
                 f"{self.median_norm:.3f}; {pad[self.pad_is_zero]}.")
        if self.unused_median_norm is not None:
            norms += f" The never-used [unusedN] rows have median norm {self.unused_median_norm:.3f}."
        if self.rank_norm_correlation is not None:
            norms += (f" From id {self.rank_start} ('the') on, ids follow frequency roughly; Spearman correlation of "
                      f"id and norm there: {self.rank_norm_correlation:+.2f}.")
        near = (f"{self.token!r} is row {self.token_id} (norm {self.token_norm:.3f}). Its nearest rows by cosine: "
                f"{_listed(self.neighbours)}. The table is a dictionary of learned vectors; neighbours share meaning "
                f"before any context is added.")
        return [Figure("token_norms", "Token norms", norms, self.plot_norms, self.plotly_norms),
                Figure("neighbours", "Nearest neighbours", near, self.plot_neighbours, self.plotly_neighbours)]

    def plotly_norms(self):
        special = [s["id"] for s in self.special]
        traces = [{"type": "scattergl", "mode": "markers", "y": self.norms.astype(np.float32), "name": "one token",
                   "text": self.vocabulary, "marker": {"size": 2, "color": PART_COLOURS["word"], "opacity": 0.4},
                   "hovertemplate": "%{text} (id %{x}): norm %{y:.3f}<extra></extra>"},
                  {"type": "scatter", "mode": "markers+text", "x": special, "y": self.norms[special],
                   "text": [s["token"] for s in self.special], "textposition": "top center", "name": "special rows",
                   "marker": {"color": "crimson"}, "hovertemplate": "%{text} (id %{x}): norm %{y:.3f}<extra></extra>"}]
        return plotly_fig(traces, "Word vectors: norm by vocabulary id (zoom in to read tokens)",
                          "token id (after the specials: roughly frequency rank)", "L2 norm of row")

    def plotly_neighbours(self):
        near = self.neighbours[::-1]
        traces = [{"type": "bar", "orientation": "h", "x": [n["cosine"] for n in near], "y": [n["token"] for n in near],
                   "customdata": [n["id"] for n in near], "marker": {"color": PART_COLOURS["word"]},
                   "hovertemplate": "%{y} (id %{customdata}): cosine %{x:.3f}<extra></extra>"}]
        return plotly_fig(traces, f"Nearest neighbours of {self.token!r} in the word table", "cosine similarity",
                          "token", yaxis={"type": "category"})

    def plot_norms(self, ax=None):
        """Norm of every word-table row against its id; special tokens marked."""
        fig, ax = axes(ax)
        ids = np.arange(len(self.norms))
        ax.plot(ids, self.norms, ",", alpha=0.3, color=PART_COLOURS["word"], label="one token")  # (pixels: fast)
        edges = np.unique(np.linspace(0, len(ids), 61).astype(int))
        spans = list(zip(edges[:-1], edges[1:], strict=True))
        ax.plot([(a + b) / 2 for a, b in spans], [np.median(self.norms[a:b]) for a, b in spans], color="k",
                lw=1.2, label="median per bin")
        for s in self.special:
            ax.annotate(s["token"], (s["id"], s["norm"]), fontsize=7, color="crimson")
        if self.rank_start is not None:
            ax.axvline(self.rank_start, color="crimson", ls=":", lw=0.8, label="frequency-ordered words start")
        ax.set(xlabel="token id (after the specials: roughly frequency rank)", ylabel="L2 norm of row",
               title="Word vectors: norm by vocabulary id")
        ax.legend(fontsize=8, markerscale=6)
        return fig

    def plot_neighbours(self, ax=None):
        fig, ax = axes(ax, size=(6, 3.6))
        names = [n["token"] for n in self.neighbours][::-1]
        ax.barh(names, [n["cosine"] for n in self.neighbours][::-1], color=PART_COLOURS["word"])
        ax.set(xlabel="cosine similarity", ylabel="token", xlim=(min(0, *(n["cosine"] for n in self.neighbours)), 1),
               title=f"Nearest neighbours of {self.token!r} in the word table")
        return fig


def _listed(neighbours: list[dict]) -> str:
    return ", ".join(f"{n['token']} ({n['cosine']:.2f})" for n in neighbours[:5])


def _entries(tokenizer, token: str) -> tuple[list[str], str]:
    """The vocabulary entries `token` stands for (itself, its normalised form, or its pieces) and a note saying
    which. ValueError when it gives none."""
    if tokenizer.token_to_id(token) is not None:
        return [token], ""
    normalizer = tokenizer.backend.normalizer
    normal = normalizer.normalize_str(token) if normalizer is not None else token
    if normal != token and tokenizer.token_to_id(normal) is not None:
        how = (["lower-casing"] if token.lower() != token and normal == normal.lower() else []) + \
            (["stripping accents and the like"] if token.lower() != normal.lower() else [])
        return [normal], f"{token!r} is {normal!r} to this tokenizer, which normalises its input ({', '.join(how)})"
    pieces = tokenizer.pieces(token).tokens
    shown = repr(token) if len(token) <= 60 else f"{token[:40]!r}... ({len(token)} characters)"
    if not pieces:
        raise ValueError(f"{shown} is not in the vocabulary and gives no tokens")
    unknown = getattr(tokenizer.backend.model, "unk_token", None)
    if unknown in pieces:  # (its neighbours would be the unknown row's, not the word's)
        raise ValueError(f"{shown} is not in the vocabulary: the tokenizer gives {pieces}, and {unknown} stands for "
                         f"characters it has no piece for")
    if len(pieces) > MAX_PIECES:
        raise ValueError(f"{shown} splits into {len(pieces)} tokens, over the limit of {MAX_PIECES} (MAX_PIECES): "
                         f"each token's neighbours are a search of the whole word table and a line of their own, so "
                         f"give one word or a few; bertembed explain takes a whole text apart")
    return pieces, f"{shown} is not one entry of the vocabulary: it splits into {pieces}; each piece has its row"


def analyze_tokens(token: str = "king", model: ModelArg = None, *, k: int = 10) -> TokenReport:
    """Nearest neighbours of `token` (a vocabulary entry such as "king" or "##ing", a word the tokenizer normalises
    to one, or a word that splits into pieces, each piece with its neighbours) and the word table's norms."""
    if not check_text(token, "the token").strip():
        raise ValueError('the token is empty; give one vocabulary entry, e.g. "king"')
    if k < 1:
        raise ValueError(f"k={k}: ask for at least 1 neighbour")
    layer = load_layer(model)
    tokenizer = layer.tokenizer
    words = layer.table("word")
    entries, note = _entries(tokenizer, token)
    norms = row_norms(words)
    k, clamped = min(k, len(norms) - 1), np.maximum(norms, 1e-30)
    pieces = []
    for entry in entries:  # each piece's k nearest rows by cosine, itself excluded, most similar first
        row = tokenizer.token_to_id(entry)
        cos = (words @ words[row]) / (clamped * clamped[row])
        cos[row] = -np.inf
        top = np.argpartition(-cos, k)[:k]
        pieces.append({"token": entry, "id": row, "neighbours": [
            {"token": tokenizer.backend.id_to_token(int(i)), "id": int(i), "cosine": float(cos[i])}
            for i in top[np.argsort(-cos[top], kind="stable")]]})
    token_id = pieces[0]["id"]
    special = [{"token": t.content, "id": i, "norm": float(norms[i])}  # (the tokenizer's own: [CLS] or <s>, ...)
               for i, t in sorted(tokenizer.backend.get_added_tokens_decoder().items()) if t.special and i < len(norms)]
    unused = [i for i in range(min(len(norms), 1000)) if tokenizer.backend.id_to_token(i).startswith("[unused")]
    start = tokenizer.token_to_id(RANK_START_TOKEN)
    region = np.arange(start, len(norms)) if start is not None and start < len(norms) - 2 else None
    ranks = None if region is None else np.argsort(np.argsort(norms[region]))  # (Spearman: ids are their own ranks)
    pad = layer.config.pad_token_id  # (None: the layer has no padding row)
    pad_is_zero = None if pad is None else bool(np.all(words[pad] == 0))
    return TokenReport(
        source=layer.source, token=entries[0], token_id=token_id, token_norm=float(norms[token_id]),
        neighbours=pieces[0]["neighbours"], asked=token, pieces=pieces if len(pieces) > 1 else [], note=note,
        special=special, pad_is_zero=pad_is_zero, median_norm=float(np.median(norms)),
        unused_median_norm=float(np.median(norms[unused])) if unused else None,
        rank_start=None if region is None else int(start),
        rank_norm_correlation=None if ranks is None else float(np.corrcoef(region, ranks)[0, 1]), norms=norms,
        vocabulary=vocabulary(tokenizer, len(norms)))


def vocabulary(tokenizer, rows: int) -> list[str]:
    """The token of each of the word table's `rows`, by id ("" for an id the tokenizer lacks)."""
    return [tokenizer.backend.id_to_token(i) or "" for i in range(rows)]
