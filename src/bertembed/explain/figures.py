"""The figures of every analysis, each paired with a caption stating the measured numbers (`FIGURES`), so the HTML
report, `--plots DIR`, notebooks and the guide show the same figures with the same words.

Each `plot_*` takes a result (and optionally a matplotlib `ax`) and returns the Figure, never calling `show()`;
matplotlib is imported only when one is drawn (Agg backend). Captions need no matplotlib.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

PART_COLOURS = {"word": "#4c72b0", "position": "#dd8452", "segment": "#55a868"}
SEGMENT_COLOURS = ("#8172b3", "#e1a13a")  # segment A, segment B
SEGMENT_B_SHADE = "#f3e6c4"


@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem for --plots DIR
    title: str
    kind: str  # the result class it draws
    draw: Callable[[Any], Any]
    caption: Callable[[Any], str]


FIGURES: list[FigureSpec] = []  # in the order the report shows them


def figure(kind: str, title: str, caption: Callable[[Any], str]):
    """Register a `plot_*` function as a figure of results of class `kind`, named after the function."""
    def register(draw):
        FIGURES.append(FigureSpec(draw.__name__.removeprefix("plot_"), title, kind, draw, caption))
        return draw
    return register


def _axes(ax=None, size=(7.5, 3.6), panels=1):
    """(figure, ax), or (figure, [ax, ...]) for `panels` > 1, on a new figure unless `ax` is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if ax is None:
        return plt.subplots(1, panels, figsize=size, layout="constrained")
    return ax.figure, ax


def _shade_segment_b(ax, segments) -> None:
    """Shade the tokens of segment B and label both segments."""
    b = [i for i, s in enumerate(segments) if s == 1]
    if b:
        ax.axvspan(b[0] - 0.5, b[-1] + 0.5, color=SEGMENT_B_SHADE, zorder=0, label="segment B (shaded)")


def _token_axis(ax, tokens) -> None:
    ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(tokens) - 0.4)


def caption_decomposition_norms(dec) -> str:
    n = dec.norms()
    b = sum(dec.segments)
    means = ", ".join(f"{part} {n[part].mean():.3f}" for part in dec.parts)
    return (f"{len(dec.tokens)} tokens ({b} in segment B, shaded). Mean norms: {means}; their sum "
            f"{n['sum'].mean():.3f}. "
            f"After LayerNorm the output norm is {n['output'].mean():.2f} on average: LayerNorm rescales every "
            f"token to unit variance, then applies its learned gain and bias.")


@figure("TextDecomposition", "Norms per token", caption_decomposition_norms)
def plot_decomposition_norms(dec, ax=None):
    """Per token: the norms of its word, position and segment vectors, those the member has (grouped bars)."""
    fig, ax = _axes(ax)
    norms, x = dec.norms(), np.arange(len(dec.tokens))
    _shade_segment_b(ax, dec.segments)
    width = 0.8 / len(dec.parts)
    for j, name in enumerate(dec.parts):
        ax.bar(x + (j - (len(dec.parts) - 1) / 2) * width, norms[name], width, color=PART_COLOURS[name],
               label=f"{name} vector")
    _token_axis(ax, dec.tokens)
    ax.set(ylabel="L2 norm", title="How long is each part of the sum? (per token)")
    ax.legend(fontsize=8, ncols=4, loc="upper right")
    return fig


def caption_variance_shares(dec) -> str:
    s = dec.overall_shares()
    return (f"Share of the variance over the hidden dimensions of {' + '.join(dec.parts)} that comes from each part "
            f"(Cov(part, sum) / Var(sum); the shares add up to 1 per token). Pooled over the tokens: "
            f"{', '.join(f'{part} {s[part]:.0%}' for part in dec.parts)}. "
            f"{dec.recipe} recomputed by hand equals the layer's output to {dec.max_abs_diff:.1e}.")


@figure("TextDecomposition", "Variance shares", caption_variance_shares)
def plot_variance_shares(dec, ax=None):
    """Per token: each part's share of the variance of the sum (stacked; shares add to 1)."""
    fig, ax = _axes(ax)
    shares, x = dec.variance_shares(), np.arange(len(dec.tokens))
    _shade_segment_b(ax, dec.segments)
    pos_base, neg_base = np.zeros(len(x)), np.zeros(len(x))
    for name in dec.parts:
        value = shares[name]
        base = np.where(value >= 0, pos_base, neg_base)
        ax.bar(x, value, 0.7, bottom=base, color=PART_COLOURS[name], label=name)
        pos_base, neg_base = pos_base + np.clip(value, 0, None), neg_base + np.clip(value, None, 0)
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    _token_axis(ax, dec.tokens)
    ax.set(ylabel="share of Var(sum) over hidden dims", title="Who decides what LayerNorm sees? (variance shares)")
    ax.legend(fontsize=8, ncols=4, loc="lower right")
    return fig


def _heatmap(ax, matrix, title):
    image = ax.imshow(matrix, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    ax.set(xlabel="position j", ylabel="position i", title=title)
    return image


def caption_position_similarity(r) -> str:
    return (f"Cosine similarity between every pair of the {len(r.norms)} learned position vectors (left) and of a "
            f"sinusoidal table of the same size (right). The two patterns correlate r = {r.structure_correlation:.2f} "
            f"(off-diagonal entries). Neighbouring learned positions have cosine "
            f"{float(np.diag(r.similarity, 1).mean()):.2f} on average: similar near the diagonal, like the sinusoids, "
            f"but the learned table is not their formula.")


@figure("PositionReport", "Position similarity", caption_position_similarity)
def plot_position_similarity(report):
    """Cosine similarity of every pair of positions: learned table (left) and sinusoidal table (right)."""
    fig, (left, right) = _axes(size=(10, 4.6), panels=2)
    _heatmap(left, report.similarity, "learned position vectors")
    image = _heatmap(right, report.sinusoid_similarity, "sinusoidal table, same size")
    fig.colorbar(image, ax=[left, right], label="cosine similarity", shrink=0.85)
    fig.suptitle(f"Position-position similarity (structure correlation r = {report.structure_correlation:.2f})")
    return fig


def describe_seam(seam: dict) -> str:
    """One seam from `find_seams` in words, with what may have left it (said as a hypothesis, with its confounds)."""
    at = seam["at"]
    text = (f" A seam at position {at}: the cosine between neighbours dips to {seam['neighbour_cosine']:.2f} "
            f"(typically {seam['typical_neighbour_cosine']:.2f}) and the mean norm steps from "
            f"{seam['norm_before']:.3f} to {seam['norm_after']:.3f}. ")
    if abs(at - 128) <= 2:
        return text + ("A hypothesis, not a proof: BERT pre-trained 90% of its steps on 128-token sequences; a "
                       "fine-tune cut at 128 tokens could leave it too (all-MiniLM-L6-v2's own fine-tune was).")
    return text + (f"A hypothesis: training on sequences of about {at} tokens (pre-training or a fine-tune) leaves "
                   f"rows past them trained less; the model's training recipe would tell.")


def caption_position_norms(r) -> str:
    text = (f"Norm of each position vector: {r.norms.min():.3f} to {r.norms.max():.3f} (position "
            f"{int(np.argmax(r.norms)) + r.first} is the largest), and the cosine of each with the next.")
    no_seam = " No seam: no boundary stands out from the rest of the table."
    return text + ("".join(map(describe_seam, r.seams)) or no_seam)


@figure("PositionReport", "Position norms", caption_position_norms)
def plot_position_norms(report, ax=None):
    """Norm of each position vector and the cosine with the next position; a line at each seam found in the table."""
    fig, ax = _axes(ax)
    count, first = len(report.norms), report.first
    ax.plot(range(first, first + count), report.norms, color=PART_COLOURS["position"], lw=1.2,
            label="norm of position vector")
    ax.set(xlabel="position", ylabel="L2 norm", title="Position vectors by position")
    twin = ax.twinx()
    twin.plot(range(first, first + count - 1), np.diag(report.similarity, 1), color="0.45", lw=0.8,
              label="cosine with next position")
    twin.set(ylabel="cosine with next position", ylim=(min(0, float(np.diag(report.similarity, 1).min())), 1.05))
    for seam in report.seams:
        ax.axvline(seam["at"], color="k", ls="--", lw=0.8)
        ax.text(seam["at"] + 3, ax.get_ylim()[1] * 0.95, f"seam at {seam['at']}", fontsize=8, va="top")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="center right")
    return fig


def caption_position_spectrum(r) -> str:
    return (f"How each hidden dimension varies along the positions, as a spectrum. Frequencies 1-{r.k} (the shaded "
            f"band) hold {r.lowfreq_share:.0%} of the learned table's variance over positions "
            f"({r.lowfreq_share_sinusoid:.0%} for the sinusoidal table, {r.lowfreq_share_noise:.0%} for white noise). "
            f"Per hidden dimension, the strongest frequency has median {np.median(r.peaks):.0f} cycles over the table "
            f"(sinusoidal: {np.median(r.sinusoid_peaks):.0f}).")


@figure("PositionReport", "Position spectrum", caption_position_spectrum)
def plot_position_spectrum(report, ax=None):
    """Share of variance over positions at each frequency, pooled over hidden dims: learned vs sinusoidal; the band
    shaded is the one `lowfreq_share` sums."""
    fig, ax = _axes(ax)
    freqs = np.arange(len(report.spectrum))
    ax.semilogy(freqs[1:], report.spectrum[1:], color=PART_COLOURS["position"], label="learned table")
    ax.semilogy(freqs[1:], report.sinusoid_spectrum[1:], color="0.3", ls="--", label="sinusoidal table")
    ax.axhline(2 / (2 * len(freqs) - 3), color="0.6", ls=":", label="white noise (flat)")
    ax.axvspan(0.5, report.k + 0.5, color="#eeeeee", zorder=0,
               label=f"frequencies 1-{report.k}: {report.lowfreq_share:.0%} of the learned table's variance")
    ax.set(xlabel="frequency (cycles over the whole position range)", ylabel="share of variance (log)",
           title="Spectrum over positions, pooled over hidden dimensions", xscale="log")
    ax.legend(fontsize=8)
    return fig


def caption_position_pca(r) -> str:
    return (f"Each position on the table's first two principal components (each hidden dimension centred over "
            f"positions): they hold {r.pca_share_2:.0%} of the variance, the first ten {r.pca_share_10:.0%}. "
            f"Neighbouring positions lie next to each other on one curve: order is encoded smoothly, in a few "
            f"directions of the hidden space, whatever their rotation.")


@figure("PositionReport", "Positions on two principal components", caption_position_pca)
def plot_position_pca(report, ax=None):
    """The positions on the first two principal components of the table (hidden dimensions centred), coloured by
    position: a smooth curve is how order is encoded."""
    fig, ax = _axes(ax, size=(6, 5))
    x, y = report.pca_coords[:, 0], report.pca_coords[:, 1]
    ax.plot(x, y, color="0.8", lw=0.6, zorder=1)
    points = ax.scatter(x, y, c=np.arange(report.first, report.first + len(x)), cmap="viridis", s=8, zorder=2)
    fig.colorbar(points, ax=ax, label="position")
    ax.set(xlabel="first principal component", ylabel="second principal component",
           title=f"Positions on two components ({report.pca_share_2:.0%} of the variance)")
    return fig


def caption_segments(r) -> str:
    verdict = "they ARE zeros and ones" if r.zeros_and_ones else "not zeros and ones"
    return (f"The segment table has {len(r.norms)} learned rows: |A| = {r.norms[0]:.3f}, |B| = {r.norms[1]:.3f}, "
            f"cosine(A, B) = {r.cosine:.2f}, |B - A| = {r.difference_norm:.3f}; {verdict}. For scale: the median word "
            f"vector has norm {r.median_word_norm:.3f}, the median position vector {r.median_position_norm:.3f}.")


@figure("SegmentReport", "Segment vectors", caption_segments)
def plot_segments(report, ax=None):
    """The two segment vectors' norms, their difference, and typical word and position norms for scale."""
    fig, ax = _axes(ax, size=(6.5, 3.4))
    labels = ["segment A\n(id 0)", "segment B\n(id 1)", "|B - A|", "median\nword", "median\nposition"]
    values = [*report.norms[:2], report.difference_norm, report.median_word_norm, report.median_position_norm]
    colours = [SEGMENT_COLOURS[0], SEGMENT_COLOURS[1], "0.35", PART_COLOURS["word"], PART_COLOURS["position"]]
    bars = ax.bar(labels, values, color=colours)
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set(ylabel="L2 norm", title=f"Segment vectors: learned, cosine(A, B) = {report.cosine:.2f}")
    return fig


def caption_segment_effect(r) -> str:
    return (f"The same text ({len(r.tokens)} tokens) embedded with every token in segment A, then in segment B: the "
            f"output moves by {r.output_change.mean():.2f} on average (mean output norm {r.output_norm:.2f}), output "
            f"cosine {r.output_cosine.mean():.3f}. In a pair, [CLS] A [SEP] take segment A and B [SEP] take "
            f"segment B: one sequence, processed in parallel, told apart only by this added vector.")


@figure("SegmentReport", "Segment A vs B", caption_segment_effect)
def plot_segment_effect(report, ax=None):
    """Per token: how far the output moves when the same text is put in segment B instead of A."""
    fig, ax = _axes(ax)
    ax.bar(range(len(report.tokens)), report.output_change, color=SEGMENT_COLOURS[1],
           label="|output(B) - output(A)|")
    ax.axhline(report.output_norm, color="0.3", ls="--", lw=0.8, label=f"mean |output| = {report.output_norm:.2f}")
    _token_axis(ax, report.tokens)
    ax.set(ylabel="L2 distance", title="Same text, segment A vs segment B: change in the layer's output")
    ax.legend(fontsize=8)
    return fig


def caption_token_norms(r) -> str:
    text = (f"Norm of each of the {len(r.norms)} word-table rows against its id: median {r.median_norm:.3f}; "
            f"[PAD] row {'is all zeros' if r.pad_is_zero else 'is not zero'}.")
    if r.unused_median_norm is not None:
        text += f" The never-used [unusedN] rows have median norm {r.unused_median_norm:.3f}."
    if r.rank_norm_correlation is not None:
        text += (f" From id {r.rank_start} ('the') on, ids follow frequency roughly; Spearman correlation of id and "
                 f"norm there: {r.rank_norm_correlation:+.2f}.")
    return text


@figure("TokenReport", "Token norms", caption_token_norms)
def plot_token_norms(report, ax=None):
    """Norm of every word-table row against its id; special tokens marked."""
    fig, ax = _axes(ax)
    ids = np.arange(len(report.norms))
    ax.plot(ids, report.norms, ",", alpha=0.3, color=PART_COLOURS["word"], label="one token")  # (pixels: fast)
    edges = np.unique(np.linspace(0, len(ids), 61).astype(int))
    spans = list(zip(edges[:-1], edges[1:], strict=True))
    ax.plot([(a + b) / 2 for a, b in spans], [np.median(report.norms[a:b]) for a, b in spans], color="k",
            lw=1.2, label="median per bin")
    for s in report.special:
        ax.annotate(s["token"], (s["id"], s["norm"]), fontsize=7, color="crimson")
    if report.rank_start is not None:
        ax.axvline(report.rank_start, color="crimson", ls=":", lw=0.8, label="frequency-ordered words start")
    ax.set(xlabel="token id (after the specials: roughly frequency rank)", ylabel="L2 norm of row",
           title="Word vectors: norm by vocabulary id")
    ax.legend(fontsize=8, markerscale=6)
    return fig


def caption_neighbours(r) -> str:
    near = ", ".join(f"{n['token']} ({n['cosine']:.2f})" for n in r.neighbours[:5])
    return (f"{r.token!r} is row {r.token_id} (norm {r.token_norm:.3f}). Its nearest rows by cosine: {near}. The "
            f"table is a dictionary of learned vectors; neighbours share meaning before any context is added.")


@figure("TokenReport", "Nearest neighbours", caption_neighbours)
def plot_neighbours(report, ax=None):
    """The token's nearest rows in the word table by cosine."""
    fig, ax = _axes(ax, size=(6, 3.6))
    names = [n["token"] for n in report.neighbours][::-1]
    ax.barh(names, [n["cosine"] for n in report.neighbours][::-1], color=PART_COLOURS["word"])
    ax.set(xlabel="cosine similarity", ylabel="token", xlim=(min(0, *(n["cosine"] for n in report.neighbours)), 1),
           title=f"Nearest neighbours of {report.token!r} in the word table")
    return fig


def caption_onehot(r) -> str:
    s = r.summary()
    return (f"one_hot(ids) @ W and W[ids] on {len(r.ids)} tokens: {'identical' if r.equal else 'different'} "
            f"(max |diff| {r.max_abs_diff:.1e}). The lookup took {s['lookup_us']:.2g} µs and touched "
            f"{r.lookup_bytes / 1e3:.3g} kB; the product took {s['onehot_us']:.3g} µs ({s['slowdown']:.0f}x) and "
            f"touched {r.onehot_bytes / 1e6:.3g} MB, because it reads all {r.vocab_size} rows of the table.")


@figure("OneHotReport", "One-hot vs lookup", caption_onehot)
def plot_onehot(report):
    """Time and memory of the lookup and of the one-hot product (log scale)."""
    fig, (left, right) = _axes(size=(8, 3.2), panels=2)
    for ax, values, unit, title in ((left, [report.lookup_seconds * 1e6, report.onehot_seconds * 1e6], "microseconds",
                                     "time (median)"),
                                    (right, [report.lookup_bytes / 1e3, report.onehot_bytes / 1e3], "kB touched",
                                     "memory")):
        bars = ax.bar(["lookup W[ids]", "one_hot(ids) @ W"], values, color=[PART_COLOURS["word"], "0.45"])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set(yscale="log", ylabel=unit, title=title)
    fig.suptitle(f"Same result ({'identical' if report.equal else 'DIFFERENT'}), {len(report.ids)} tokens")
    return fig


def caption_finetune_rows(r) -> str:
    parts = []
    for run in r.runs:
        moved = ", ".join(f"{t.table} {t.moved}/{t.rows}" for t in run.tables)
        parts.append(f"{run.spec.name}: {moved} (loss {run.loss_first:.3f} -> {run.loss_last:.3f})")
    return (f"{r.steps} steps on {len(r.sentences)} sentences, lr {r.lr:g}. Rows moved per table: " + "; ".join(parts)
            + f". The sentences use {len(r.occurred['word'])} distinct tokens, {len(r.occurred['position'])} "
              f"positions and {len(r.occurred['segment'])} segment(s); every row that moved is one of them unless "
              f"weight decay is on. All {len(r.trainable)} embedding parameters are trainable by default.")


@figure("FinetuneReport", "Rows moved by fine-tuning", caption_finetune_rows)
def plot_finetune_rows(report, ax=None):
    """Rows moved per table in each run (log scale), with the table sizes for reference."""
    fig, ax = _axes(ax)
    tables = [t.table for t in report.runs[0].tables]
    width = 0.8 / len(report.runs)
    for i, run in enumerate(report.runs):
        offset = (i - (len(report.runs) - 1) / 2) * width
        x = np.arange(len(tables)) + offset
        moved = [t.moved for t in run.tables]
        # a log axis has no 0: a table with no row moved gets no bar, only its "0" label at the axis
        bars = ax.bar(x, [m if m > 0 else np.nan for m in moved], width, label=run.spec.name)
        ax.bar_label(bars, labels=[str(m) if m > 0 else "" for m in moved], fontsize=7)
        for xi, m in zip(x, moved, strict=True):
            if m == 0:
                ax.annotate("0", (xi, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(tables)), [f"{t.table}\n({t.rows} rows)" for t in report.runs[0].tables])
    ax.set(yscale="log", ylabel="rows that moved (log)", title=f"Fine-tuning for {report.steps} steps: rows moved")
    ax.legend(fontsize=8)
    return fig


def caption_finetune_positions(r) -> str:
    last = max(r.occurred["position"])
    return (f"Change of each of the first position rows. With Adam and no weight decay, positions 0-{last} (the "
            f"longest sentence) move and every later row stays exactly equal (change 0); AdamW's decay nudges every "
            f"row; freezing the word table does not stop the position table from training.")


@figure("FinetuneReport", "Position rows after fine-tuning", caption_finetune_positions)
def plot_finetune_positions(report, ax=None, first: int = 24):
    """|change| of the first position rows in each run: only positions that occurred move under Adam."""
    fig, ax = _axes(ax)
    for run, style in zip(report.runs, ("-o", "--s", ":^", "-.d"), strict=False):
        change = run.row_change.get("position")
        if change is not None:
            ax.plot(range(min(first, len(change))), change[:first], style, ms=4, label=run.spec.name)
    ax.axvline(max(report.occurred["position"]) + 0.5, color="k", ls="--", lw=0.8, label="longest sentence ends")
    ax.set(xlabel="position", ylabel="|row after - row before|", title="Position rows after fine-tuning",
           yscale="symlog", ylim=(0, None))
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.legend(fontsize=8)
    return fig


def caption_drift(r) -> str:
    parts = [f"{t.table}: {t.rows_changed} of {t.shape[0]} rows moved, a moved row by {t.median_row_change:.2g} of "
             f"its norm (median), the whole tensor by {t.relative_change:.2g}" for t in r.tables]
    word = next((t for t in r.tables if t.table == "word" and t.top), None)
    top = f" Most-changed tokens (relative to their norm): {', '.join(x['label'] for x in word.top[:5])}." \
        if word else ""
    head = f"From {r.model_a} to {r.model_b}, per tensor: "
    return head + "; ".join(parts) + "." + top


@figure("DriftReport", "Drift per tensor", caption_drift)
def plot_drift(report, ax=None):
    """Per tensor, how far a moved row moved (the median over the rows that changed of |row B - row A| / |row A|),
    labelled with how many rows moved: a measure that does not shrink with the table's size (log scale)."""
    fig, ax = _axes(ax, size=(6.5, 3.4))
    values = [t.median_row_change if t.median_row_change > 0 else np.nan for t in report.tables]
    bars = ax.bar([t.table for t in report.tables], values, color="0.45")
    ax.bar_label(bars, labels=[f"{t.median_row_change:.2g}, {t.rows_changed} of {t.shape[0]}" if t.rows_changed
                               else "" for t in report.tables], fontsize=7)
    ax.set(yscale="log" if any(v == v for v in values) else "linear", xlabel="tensor",
           ylabel="median |Δ row| / |row|, rows that moved",
           title="Drift per tensor between two checkpoints (label: change, rows moved)")
    if not any(v == v for v in values):
        ax.text(0.5, 0.5, "no tensor changed", transform=ax.transAxes, ha="center")
    ax.tick_params(axis="x", labelsize=8)
    return fig


def specs_for(result: Any) -> list[FigureSpec]:
    """The figures that draw this kind of result."""
    return [s for s in FIGURES if s.kind == type(result).__name__]
