"""`nn.Embedding` is a table lookup, which equals a one-hot product: one_hot(ids) [L, V] @ W [V, H] = W[ids].
Checked on the user's own ids, with what each way costs in time and memory. L length, V vocabulary, H hidden."""

from __future__ import annotations

import timeit
from dataclasses import dataclass

import numpy as np

from bertembed.explain._common import PART_COLOURS, STRUCTURAL, Figure, ModelArg, Result, axes, load_text, plotly_fig
from bertembed.sources import Source

# The one-hot matrix is [L, V] float32 and the timing builds it again on every call. 512 MiB bounds the memory and
# the time (a few seconds) of the demonstration; BERT's own case, 512 positions x 30522 ids, is 60 MiB.
MAX_ONEHOT_BYTES = 512 * 2**20


@dataclass
class OneHotReport(Result):
    """Lookup versus one-hot product on one text's ids (numpy, float32, one thread of work each)."""

    question = "Is nn.Embedding a one-hot matrix product?"
    answer = ("Yes: one_hot(ids) @ W picks the same rows as W[ids], bit for bit; the lookup skips the product. "
              "Pretrained static vectors (word2vec, GloVe) can be loaded into such a table too; BERT's is trained with "
              "the model (and tied to its MLM decoder), and Google's original TPU code could do the lookup as this "
              "product.")
    tag = STRUCTURAL

    source: Source
    tokens: list[str]
    ids: list[int]
    equal: bool  # the two results are identical, bit for bit
    max_abs_diff: float
    lookup_seconds: float  # median of repeats
    onehot_seconds: float  # building the one-hot matrix and multiplying
    lookup_bytes: int  # bytes read: L rows of H float32
    onehot_bytes: int  # bytes of the one-hot matrix plus the whole table read by the product
    vocab_size: int
    hidden: int
    repeats: int = 1  # the times are medians of this many repeats; their spread, the fastest and slowest:
    lookup_range: tuple[float, float] = (0.0, 0.0)
    onehot_range: tuple[float, float] = (0.0, 0.0)

    def summary(self) -> dict:
        return {"model": self.model, "tokens": len(self.ids), "equal": self.equal, "max_abs_diff": self.max_abs_diff,
                "repeats": self.repeats, "lookup_us": self.lookup_seconds * 1e6,
                "lookup_us_range": [round(t * 1e6, 3) for t in self.lookup_range],
                "onehot_us": self.onehot_seconds * 1e6,
                "onehot_us_range": [round(t * 1e6, 1) for t in self.onehot_range],
                "slowdown": self.onehot_seconds / max(self.lookup_seconds, 1e-12),
                "lookup_bytes": self.lookup_bytes, "onehot_bytes": self.onehot_bytes,
                "memory_ratio": self.onehot_bytes / max(self.lookup_bytes, 1)}

    def figures(self) -> list[Figure]:
        s, same = self.summary(), "identical" if self.equal else "different"
        spans = ["-".join(f"{t * 1e6:.3g}" for t in times) + " µs" for times in (self.lookup_range, self.onehot_range)]
        caption = (f"one_hot(ids) @ W and W[ids] on {len(self.ids)} tokens: {same}"
                   f" (max |diff| {self.max_abs_diff:.1e}). Medians of {self.repeats} repeats (fastest-slowest): the "
                   f"lookup took {s['lookup_us']:.2g} µs ({spans[0]}) and touched "
                   f"{self.lookup_bytes / 1e3:.3g} kB; the product took {s['onehot_us']:.3g} µs "
                   f"({spans[1]}; {s['slowdown']:.0f}x) and touched {self.onehot_bytes / 1e6:.3g} MB, "
                   f"because it reads all {self.vocab_size} rows of the table.")
        return [Figure("onehot", "One-hot vs lookup", caption, self.plot, self.plotly)]

    def plot(self):
        fig, panels = axes(size=(8, 3.2), panels=2)
        for ax, values, unit, title in zip(panels, ([self.lookup_seconds * 1e6, self.onehot_seconds * 1e6],
                                                    [self.lookup_bytes / 1e3, self.onehot_bytes / 1e3]),
                                           ("microseconds", "kB touched"), ("time (median)", "memory"), strict=True):
            bars = ax.bar(["lookup W[ids]", "one_hot(ids) @ W"], values, color=[PART_COLOURS["word"], "0.45"])
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.set(yscale="log", ylabel=unit, title=title)
        fig.suptitle(f"Same result ({'identical' if self.equal else 'DIFFERENT'}), {len(self.ids)} tokens")
        return fig

    def plotly(self):
        ways, colours = ["lookup W[ids]", "one_hot(ids) @ W"], [PART_COLOURS["word"], "#737373"]
        traces = [{"type": "bar", "x": ways, "y": values, "marker": {"color": colours}, "showlegend": False,
                   "xaxis": f"x{n}", "yaxis": f"y{n}", "hovertemplate": f"%{{x}}: %{{y:.3g}} {unit}<extra></extra>"}
                  for n, values, unit in (("", [self.lookup_seconds * 1e6, self.onehot_seconds * 1e6], "µs"),
                                          ("2", [self.lookup_bytes / 1e3, self.onehot_bytes / 1e3], "kB"))]
        return plotly_fig(traces, f"Same result ({'identical' if self.equal else 'DIFFERENT'}), {len(self.ids)} "
                             f"tokens: time (median) and memory", "", "microseconds", height=360,
                             xaxis={"domain": [0, 0.45]}, xaxis2={"domain": [0.55, 1], "anchor": "y2"},
                             yaxis={"type": "log"}, yaxis2={"type": "log", "anchor": "x2", "title": "kB touched"})


def one_hot(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """[L] integer ids -> [L, V] float32 rows with a single 1."""
    out = np.zeros((len(ids), vocab_size), dtype=np.float32)
    out[np.arange(len(ids)), ids] = 1.0
    return out


def _times(fn, repeats: int, budget: float = 0.02) -> tuple[float, tuple[float, float]]:
    """(median, (fastest, slowest)) seconds per call over `repeats`, each looping calls for about `budget` seconds."""
    timer = timeit.Timer(fn)
    number = max(1, int(budget / max(timer.timeit(number=1), 1e-7)))
    times = [t / number for t in timer.repeat(repeat=repeats, number=number)]
    return float(np.median(times)), (min(times), max(times))


def analyze_onehot(text: str, model: ModelArg = None, *, text_b: str | None = None,
                   repeats: int = 7) -> OneHotReport:
    """Embed the ids of `text` (with `text_b`, of the pair) both ways, compare exactly, and time both (median of
    `repeats`). ValueError for a blank text, one longer than the position table, or one whose one-hot matrix would
    exceed MAX_ONEHOT_BYTES."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time each way at least once")
    layer, enc = load_text(model, text, text_b)
    ids = np.asarray(enc.input_ids)
    words = layer.tensors["word_embeddings.weight"]
    vocab, hidden = words.shape
    tokens, size = len(ids), len(ids) * vocab * 4
    if size > MAX_ONEHOT_BYTES:  # a vocabulary so large that even a short text's matrix is no demonstration
        raise ValueError(f"the one-hot matrix of {tokens} tokens x {vocab} ids would take {size:,} bytes "
                         f"({size / 2**20:.1f} MiB), over the limit of {MAX_ONEHOT_BYTES:,} (MAX_ONEHOT_BYTES): give "
                         f"at most {MAX_ONEHOT_BYTES // (vocab * 4)} tokens")
    if ids.max() >= vocab:
        raise ValueError(f"the tokenizer gave id {ids.max()}, but the word table has {vocab} rows; "
                         f"the tokenizer and the weights come from different models")
    looked_up, product = words[ids], one_hot(ids, vocab) @ words
    (lookup, lookup_range), (onehot, onehot_range) = (_times(f, repeats) for f in (
        lambda: words[ids], lambda: one_hot(ids, vocab) @ words))
    return OneHotReport(
        source=layer.source, tokens=list(enc.tokens), ids=ids.tolist(),
        equal=bool(np.array_equal(looked_up, product)), max_abs_diff=float(np.abs(looked_up - product).max()),
        lookup_seconds=lookup, onehot_seconds=onehot, lookup_bytes=tokens * hidden * 4,
        onehot_bytes=size + vocab * hidden * 4, vocab_size=vocab, hidden=hidden, repeats=repeats,
        lookup_range=lookup_range, onehot_range=onehot_range)
