"""The projector: the whole word table in 2-D (its two principal components), where the report's search box finds a
token and marks its nearest rows by cosine (found in the full space, once per checkpoint, and cached on disk as int32
ids and float16 cosines), beside the text's own tokens. V vocabulary, E table width, k neighbours."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bertembed.atomic import write_atomic
from bertembed.explain._common import PART_COLOURS, Figure, ModelArg, Result, axes, load_text, plotly_fig
from bertembed.explain.tokens import vocabulary
from bertembed.sources import Source

logger = logging.getLogger(__name__)
# Every row's neighbours take a [V, V] product: about 20 s once for BERT's 30,522 rows (cached). The page holds ~150
# bytes per row beside plotly.js's 4.8 MB: RoBERTa's 50,265 rows fit in 15 MB, XLM-R's 250,002 would take 40 MB.
MAX_ROWS = 55_000
GLUE = """<p><label>Find a token: <input type="search" id="word_map_search" placeholder="king"></label>
<span id="word_map_found"></span></p><script>(() => {
const bytes = s => Uint8Array.from(atob(s), c => c.charCodeAt(0)).buffer, k = %d;
const ids = new Int32Array(bytes("%s")), scores = new Float32Array(bytes("%s")), xy = new Float32Array(bytes("%s"));
const map = document.getElementById("word_map"), found = document.getElementById("word_map_found");
document.getElementById("word_map_search").addEventListener("input", event => {
  const words = map.data[0].text, asked = event.target.value.trim(), x = j => xy[2 * j], y = j => xy[2 * j + 1];
  const i = words.includes(asked) ? words.indexOf(asked) : words.indexOf(asked.toLowerCase());
  if (i < 0) return found.textContent = asked && `${asked}: not an entry of the vocabulary`;
  const near = Array.from(ids.subarray(i * k, i * k + k));
  const named = near.map((j, n) => `${words[j]} ${scores[i * k + n].toFixed(3)}`);
  Plotly.restyle(map, {x: [[x(i)], near.map(x)], y: [[y(i)], near.map(y)],
                       text: [[words[i]], named], customdata: [[i], near]}, [2, 3]);
  found.textContent = `${words[i]} (id ${i}), nearest by cosine: ${named.join(", ")}`;
});})();</script>"""


@dataclass
class WordMap(Result):
    """The word table on its two principal components, and every row's nearest rows."""

    question = "Where does each token sit among all the others?"
    answer = ("The whole word table on its two principal components. Find a token: its nearest rows by cosine, in "
              "the full space (not in 2-D), are marked with their scores. The text's own tokens are labelled.")

    source: Source
    tokens: list[str]  # the text's (or the pair's)
    ids: list[int]
    xy: np.ndarray = field(repr=False)  # [V, 2] float32: each row on the two components
    shares: tuple[float, float]  # each component's share of the table's variance
    neighbours: np.ndarray = field(repr=False)  # [V, k] int32, nearest first
    scores: np.ndarray = field(repr=False)  # [V, k] float16: their cosines
    vocabulary: list[str] = field(repr=False)
    cache: Path | None = None  # where the neighbours are kept

    def summary(self) -> dict:
        return {"model": self.model, "rows": len(self.xy), "component_1_share": self.shares[0],
                "component_2_share": self.shares[1], "neighbours_per_row": self.neighbours.shape[1],
                "cache": str(self.cache), "cache_bytes": self.neighbours.nbytes + self.scores.nbytes}

    def figures(self) -> list[Figure]:
        caption = (f"All {len(self.xy)} rows of the word table on its first two principal components "
                   f"({self.shares[0]:.1%} and {self.shares[1]:.1%} of the variance), the text's "
                   f"{len(self.tokens)} tokens labelled. Two components keep little of the table: neighbours in the "
                   f"plane need not be neighbours in the full space, which is where the search measures cosine.")
        return [Figure("word_map", "The word table in 2-D", caption, self.plot, self.plotly)]

    def plot(self, ax=None):
        fig, ax = axes(ax, size=(7.5, 6))
        ax.plot(*self.xy.T, ",", alpha=0.3, color=PART_COLOURS["word"])
        for token, i in zip(self.tokens, self.ids, strict=True):
            ax.annotate(token, self.xy[i], fontsize=8, color="crimson")
        ax.set(xlabel=f"component 1 ({self.shares[0]:.1%})", ylabel=f"component 2 ({self.shares[1]:.1%})",
               title="The word table on its two principal components")
        return fig

    def plotly(self):
        def marked(name: str, colour: str, ids=(), text=()) -> dict:
            return {"type": "scatter", "mode": "markers+text", "name": name, "x": self.xy[list(ids), 0],
                    "y": self.xy[list(ids), 1], "text": list(text), "textposition": "top center",
                    "marker": {"color": colour, "size": 8}, "hovertemplate": "%{text}<extra></extra>"}

        rows = {"type": "scattergl", "mode": "markers", "name": "one token", "x": self.xy[:, 0], "y": self.xy[:, 1],
                "text": self.vocabulary, "marker": {"size": 3, "color": PART_COLOURS["word"], "opacity": 0.35},
                "hovertemplate": "%{text}<extra></extra>"}
        traces = [rows, marked("the text's tokens", "crimson", self.ids, self.tokens), marked("found", "black"),
                  marked("its nearest rows (cosine)", PART_COLOURS["position"])]
        return plotly_fig(traces, "The word table on its two principal components", f"component 1 "
                          f"({self.shares[0]:.1%})", f"component 2 ({self.shares[1]:.1%})", height=640)

    def controls(self) -> str:
        encoded = [base64.b64encode(a.tobytes()).decode("ascii")
                   for a in (self.neighbours.astype("<i4"), self.scores.astype("<f4"), self.xy.astype("<f4"))]
        return GLUE % (self.neighbours.shape[1], *encoded)


def nearest_rows(words: np.ndarray, k: int = 10, progress: Callable[[str, int, int], None] | None = None):
    """Every row's `k` nearest rows of `words` [V, E] by cosine, itself excluded: (ids [V, k] int32, cosines [V, k]
    float16, the cache file), nearest first. Read from the cache ($BERTEMBED_CACHE, else $XDG_CACHE_HOME/bertembed,
    else ~/.cache/bertembed; the file named by a hash of the table) if found before, else computed and cached."""
    words = np.ascontiguousarray(words, dtype=np.float32)
    key = hashlib.blake2b(str(words.shape).encode(), digest_size=16)
    key.update(words.data)
    folder = os.environ.get("BERTEMBED_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                        "bertembed")
    path = Path(folder, f"neighbours-{key.hexdigest()}-k{k}.npz")
    with contextlib.suppress(OSError, KeyError, ValueError), np.load(path) as cached:  # (else: not found yet)
        return cached["ids"], cached["scores"], path
    unit = words / np.maximum(np.linalg.norm(words, axis=1, keepdims=True), 1e-30)
    ids, scores, step = np.empty((len(words), k), np.int32), np.empty((len(words), k), np.float16), 1024
    for start in range(0, len(words), step):
        cos = unit[start:start + step] @ unit.T
        cos[np.arange(len(cos)), np.arange(start, start + len(cos))] = -np.inf  # (not itself)
        cos[np.isnan(cos)] = -np.inf  # (a row holding NaN is nobody's neighbour)
        top = np.argpartition(-cos, k, axis=1)[:, :k]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(cos, top, 1), axis=1, kind="stable"), 1)
        ids[start:start + step], scores[start:start + step] = top, np.take_along_axis(cos, top, 1)
        if progress:
            progress("nearest rows (once per checkpoint)", min(start + step, len(words)), len(words))
    buffer = io.BytesIO()
    np.savez(buffer, ids=ids, scores=scores)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, buffer.getvalue())
    except OSError as err:  # (a read-only home: the report is made all the same, the next one finds them again)
        logger.warning("the nearest rows are not cached (%s); set BERTEMBED_CACHE to a writable folder", err)
    return ids, scores, path


def word_map(text: str, text_b: str | None = None, model: ModelArg = None, *,
             progress: Callable[[str, int, int], None] | None = None) -> WordMap:
    """The word table of `model` on its two principal components, every row's 10 nearest rows (`nearest_rows`), and
    where the tokens of `text` (and `text_b`) sit. ValueError for a blank text or a table over MAX_ROWS rows."""
    layer, enc = load_text(model, text, text_b)
    words = layer.tensors["word_embeddings.weight"]
    if len(words) > MAX_ROWS:
        raise ValueError(f"the projector maps at most {MAX_ROWS:,} rows (MAX_ROWS), and {layer.source.name}'s word "
                         f"table has {len(words):,}: its neighbours would take too long and its page too much")
    neighbours, scores, cache = nearest_rows(words, min(10, len(words) - 1), progress)
    centred = words.astype(np.float64) - words.mean(0)
    variances, components = np.linalg.eigh(centred.T @ centred)  # (ascending: the two largest are the last)
    return WordMap(source=layer.source, tokens=list(enc.tokens), ids=list(enc.input_ids),
                   xy=(centred @ components[:, :-3:-1]).astype(np.float32),
                   shares=tuple(float(v) for v in variances[:-3:-1] / variances.sum()), neighbours=neighbours,
                   scores=scores, vocabulary=vocabulary(layer.tokenizer, len(words)), cache=cache)
