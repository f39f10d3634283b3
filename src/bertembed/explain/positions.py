"""Are learned position embeddings sinusoidal? The position table against a sin/cos table of the same size: entry
by entry, in structure, in smoothness, and its seams (docs/how-bert-embeddings-work.md, section 3). P positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertembed.explain._common import PART_COLOURS, PLOTLY_LAYOUT, Figure, ModelArg, Result, axes, load_layer, row_norms
from bertembed.numpy_layer import sinusoidal_table_np
from bertembed.sources import Source

SEAM_SCORE = 6.0  # robust z-scores (median and MAD over all boundaries) the dip and a level change must pass
SEAM_WINDOW = 8  # rows on each side whose medians make a level
COMPONENTS = 4  # the leading principal components measured and drawn
WAVE = 0.5  # a component is called a wave when this share of its variance lies near its strongest frequency
NEAR, OUTLIER = 0.1, 0.5  # no dominant frequency: under NEAR of a component's variance near it, or a row with OUTLIER
CIRCLE = 0.25  # a pair's positions lie on a circle when their radius spreads less (see `turning`)
LABELLED = 24  # positions named on the principal-component plot
SEAM_TEXT = (" A seam at position {at}: the cosine between neighbours dips to {neighbour_cosine:.2f} "
             "({cosine_before:.2f} before, {cosine_after:.2f} after), and the norms' level (median of {w} rows each "
             "side, the seam's row left out) goes from {norm_before:.3f} to {norm_after:.3f}. ")
TABLES = ("learned position vectors", "sinusoidal table, same size")
WANG_AND_CHEN = ("Wang & Chen (2020), \"What Do Position Embeddings Learn? An Empirical Study of Pre-Trained Language "
                 "Model Positional Encoding\", EMNLP")


def cosine_matrix(matrix: np.ndarray) -> np.ndarray:
    """Cosine similarity of every row of [P, H] with every other: [P, P]."""
    unit = matrix / np.maximum(row_norms(matrix), 1e-30)[:, None]
    return unit @ unit.T


def structure_correlation(sim_a: np.ndarray, sim_b: np.ndarray) -> float:
    """Pearson correlation of the off-diagonal entries of two [P, P] similarity matrices (1.0 for equal structure)."""
    upper = np.triu_indices(sim_a.shape[0], k=1)
    return float(np.corrcoef(sim_a[upper], sim_b[upper])[0, 1])


def _power(matrix: np.ndarray) -> np.ndarray:
    """Power of each column of [P, H] (centred) at each frequency: [P//2 + 1, H]."""
    return np.abs(np.fft.rfft(matrix - matrix.mean(0), axis=0)) ** 2


def spectrum(matrix: np.ndarray) -> np.ndarray:
    """The share of the variance over positions at each frequency (cycles over the P positions), pooled over the
    columns of [P, H]: [P//2 + 1], summing to 1 (Parseval: the bins between 0 and Nyquist count twice)."""
    power = _power(matrix).sum(1)
    power[1:len(power) - (matrix.shape[0] % 2 == 0)] *= 2  # (the bins strictly between 0 and Nyquist)
    return power / max(power.sum(), 1e-300)


def peak_frequencies(matrix: np.ndarray) -> np.ndarray:
    """Per column of [P, H]: the frequency (cycles over P positions, >= 1) holding most of its variance: [H]."""
    return 1 + np.argmax(_power(matrix)[1:], axis=0)


def find_seams(matrix: np.ndarray, first: int = 0) -> list[dict]:
    """Boundaries of [P, H] where the neighbours' cosine dips below those on either side and the level (median of
    SEAM_WINDOW rows, the row after the boundary left out) of the norms or of that cosine steps, both by SEAM_SCORE
    robust z-scores; of seams closer than 4 the deepest stays. `first`: the position of the table's first row."""
    norms, w = row_norms(matrix), SEAM_WINDOW
    if len(norms) < 4 * w:
        return []
    cos = (matrix[:-1] * matrix[1:]).sum(1) / np.maximum(norms[:-1] * norms[1:], 1e-30)  # boundary b: rows b, b+1
    norm_level, cos_level = (np.median(np.lib.stride_tricks.sliding_window_view(x, w), 1) for x in (norms, cos))
    b = np.arange(w, len(norms) - w - 2)  # level before b: rows b-w+1..b (cosines b-w..b-1), after: from b+2
    level = np.maximum(_robust_z(abs(norm_level[b + 2] - norm_level[b + 1 - w])),
                       _robust_z(abs(cos_level[b + 2] - cos_level[b - w])))
    dip = [min(_robust_z(-cos[i], -side) for side in (cos[max(0, i - 4 * w):i - 1], cos[i + 2:i + 2 + 4 * w]))
           for i in b]  # (the boundaries touching rows i and i + 1 left out)
    seams: list[dict] = []
    for at in b[np.minimum(dip, level) > SEAM_SCORE]:
        seam = {"at": int(at + 1 + first), "neighbour_cosine": cos[at], "cosine_before": cos_level[at - w],
                "cosine_after": cos_level[at + 2], "norm_before": norm_level[at + 1 - w],
                "norm_after": norm_level[at + 2]}
        if seams and seam["at"] - seams[-1]["at"] <= 3:
            seams[-1] = min(seams[-1], seam, key=lambda s: s["neighbour_cosine"])
        else:
            seams.append(seam)
    return [{k: float(v) if k != "at" else v for k, v in seam.items()} for seam in seams]


def _robust_z(x: np.ndarray, sample: np.ndarray | None = None) -> np.ndarray:
    """(x - median) / (1.4826 MAD) of `sample` (default `x`): robust z-scores."""
    sample = x if sample is None else sample
    return (x - np.median(sample)) / max(1.4826 * np.median(np.abs(sample - np.median(sample))), 1e-12)


def components(matrix: np.ndarray, count: int = COMPONENTS) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """The principal components of [P, H] centred: their variance shares (descending), coordinates [P, count], and
    per component its strongest frequency ("cycles", "period"), the share "near" it (+-"width" cycles, max(1, 10%)),
    and the "row" holding most of its variance with that "row_share"."""
    centred = matrix - matrix.mean(0)
    values, vectors = np.linalg.eigh(centred.T @ centred)  # (ascending; cheaper than an SVD of [P, H])
    shares = np.clip(values[::-1], 0, None) / max(values.sum(), 1e-300)
    coords = centred @ vectors[:, ::-1][:, :count]
    power = _power(coords)[1:]  # [P//2, count]: frequencies 1, 2, ...
    power /= np.maximum(power.sum(0), 1e-300)
    rows = coords ** 2 / np.maximum((coords ** 2).sum(0), 1e-300)
    peaks = [(int(f), max(1, int(f) // 10)) for f in 1 + np.argmax(power, axis=0)]
    return shares, coords, [{"component": i + 1, "share": float(shares[i]), "cycles": f, "period": len(matrix) / f,
                             "width": w, "near": float(power[max(0, f - 1 - w):f + w, i].sum()),
                             "row": int(np.argmax(rows[:, i])), "row_share": float(rows[:, i].max())}
                            for i, (f, w) in enumerate(peaks)]


def turning(coords: np.ndarray) -> dict:
    """Positions on two components as z = pc1 + i pc2: the median "turn" |angle(z[t+1] / z[t])| (degrees), the angle
    swept in "total", the radius |z| and its "spread" (90th - 10th percentile) / median, the median |dz| / |z|."""
    z = coords[:, 0] + 1j * coords[:, 1]
    angle, radius = np.degrees(np.angle(z[1:] * np.conj(z[:-1]))), np.abs(z)
    p10, median, p90 = np.percentile(radius, [10, 50, 90])
    return {"turn": float(np.median(np.abs(angle))), "total": float(angle.sum()), "radius_min": float(radius.min()),
            "radius_median": float(median), "radius_max": float(radius.max()), "spread": float((p90 - p10) / median),
            "chord": float(np.median(np.abs(np.diff(z)) / np.maximum(radius[:-1], 1e-300)))}


@dataclass
class PositionReport(Result):
    """The learned position table [P, E] (the rows tokens use) next to a sinusoidal table of the same size."""

    question = "Why don't the learned positions look like sin/cos?"

    source: Source
    similarity: np.ndarray = field(repr=False)  # [P, P] cosine similarity of learned rows
    sinusoid_similarity: np.ndarray = field(repr=False)  # [P, P] the same for the sinusoidal table
    norms: np.ndarray = field(repr=False)  # [P]
    entrywise_correlation: float  # the naive test: Pearson of the two tables' entries, one by one
    structure_correlation: float  # learned vs sinusoidal similarity structure
    pca_share_2: float  # share of the variance over positions on the first 2 principal components
    pca_share_10: float
    pca_coords: np.ndarray = field(repr=False)  # [P, COMPONENTS] positions on the leading principal components
    components: list[dict]  # the leading components' share, cycles, period and near (see `components`)
    k: int  # the low-frequency band: frequencies 1..k (cycles over the table)
    lowfreq_share: float  # of the learned table's variance over positions
    lowfreq_share_sinusoid: float
    lowfreq_share_noise: float  # expected for white noise
    spectrum: np.ndarray = field(repr=False)  # [P//2+1]
    sinusoid_spectrum: np.ndarray = field(repr=False)
    peaks: np.ndarray = field(default=None, repr=False)  # [H] per-dimension peak frequency, learned table
    sinusoid_peaks: np.ndarray = field(default=None, repr=False)  # [H] the same for the sinusoidal table
    seams: list[dict] = field(default_factory=list)  # from `find_seams`
    first: int = 0  # the first position a token uses (RoBERTa-style tables reserve the rows before it)
    member: str = "bert"  # the checkpoint's model_type

    @property
    def noise_share(self) -> float:
        """The share of variance a table of white noise has at each frequency: 2 / (P - 1)."""
        return 2 / (len(self.norms) - 1)

    @property
    def adjacent_cosine(self) -> float:  # of neighbouring positions, on average
        return float(np.diag(self.similarity, 1).mean())

    @property
    def kind(self) -> str:
        """"sinusoidal" (sin/cos's structure), "noise" (no more than a random table's) or "learned"."""
        noise = abs(np.median(np.diag(self.similarity, 1))) < 0.2 and self.lowfreq_share < 3 * self.lowfreq_share_noise
        return "sinusoidal" if self.structure_correlation > 0.95 else "noise" if noise else "learned"

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.first, self.first + len(self.norms))

    def describe_components(self) -> str:
        """The leading components in words; a pair of waves at one frequency as what positions do on them."""
        c = self.components
        pair = len(c) > 1 and c[0]["cycles"] == c[1]["cycles"] and min(c[0]["near"], c[1]["near"]) >= WAVE
        said = [f"component {x['component']} ({x['share']:.0%}) " + (
            f"is the outlier row at position {x['row'] + self.first} ({x['row_share']:.0%} of its variance)"
            if x["row_share"] >= OUTLIER else "has no dominant frequency" if x["near"] < NEAR else
            f"peaks at {_cycles(x)} ({x['near']:.0%} of its variance within {_within(x)} of that frequency)")
            for x in c[2 * pair:]]
        if pair:
            t, turn = turning(self.pca_coords), 360 / c[0]["period"]
            moves = (f"turns {t['turn']:.2g}° round a circle from the last, neighbours {t['chord']:.2f} radii apart"
                     if t["spread"] < CIRCLE and abs(t["turn"] - turn) <= 0.1 * turn else
                     f"turns a median {t['turn']:.2g}° from the last ({abs(t['total']):.0f}° in all; the frequency "
                     f"gives {turn:.2g}°), at a radius of {t['radius_min']:.3g} to {t['radius_max']:.3g} (median "
                     f"{t['radius_median']:.3g}): no circle")
            said.insert(0, f"components 1 and 2 ({c[0]['share']:.0%} and {c[1]['share']:.0%} of the variance) are a "
                           f"sin/cos pair at {_cycles(c[0])} ({c[0]['near']:.0%} and {c[1]['near']:.0%} of their "
                           f"variance within {_within(c[0])} of it): on them each position {moves}")
        return "Of its principal components, " + "; ".join(said) + "."

    @property
    def verdict(self) -> str:
        if self.kind == "sinusoidal":
            return (f"Yes, in structure: its similarity pattern matches the sinusoidal table's (r = "
                    f"{self.structure_correlation:.2f}).")
        if self.kind == "noise":
            return (f"This table is no different from noise: neighbouring positions have cosine "
                    f"{self.adjacent_cosine:.2f}, the first 10 principal components hold {self.pca_share_10:.0%} of "
                    f"its variance and frequencies 1-{self.k} {self.lowfreq_share:.0%} (white noise: "
                    f"{self.lowfreq_share_noise:.0%}). An untrained (random) table looks like this; there is no code "
                    f"of position in it to compare with sin/cos.")
        waves = min(x["near"] for x in self.components[:2]) >= WAVE
        return (f"Entry by entry the learned and sin/cos tables correlate r = {self.entrywise_correlation:+.3f}, but "
                f"that is the wrong test: a table rotated in the hidden space works as well, and no training would "
                f"pick the formula's axes. In structure (which positions are alike) they correlate r = "
                f"{self.structure_correlation:.2f}. {self.describe_components()} "
                + ("So in its largest components the learned table is a few sinusoids in a rotated basis: the kind of "
                   "code sin/cos is, at frequencies and axes of its own. " if waves else "")
                + f"10 components hold {self.pca_share_10:.0%} of its variance over positions, and frequencies "
                f"1-{self.k} {self.lowfreq_share:.0%} (sin/cos {self.lowfreq_share_sinusoid:.0%}, noise "
                f"{self.lowfreq_share_noise:.0%}); compare {WANG_AND_CHEN}, who find BERT's table far less "
                f"sinusoidal than GPT-2's." + "".join(map(self.describe_seam, self.seams))
                + " Sinusoids were proposed because they are fixed (nothing to learn) and extrapolate past the "
                "training length; a learned table has exactly its rows, which is why BERT stops at 512 tokens.")

    def describe_seam(self, seam: dict) -> str:
        """One seam from `find_seams` in words, with what may have left it (a hypothesis, naming this checkpoint)."""
        tokens = seam["at"] - self.first  # (the tokens before it)
        bert = "BERT pre-trained 90% of its steps on 128 tokens, and " * (self.member == "bert")
        cut = f"; {bert}a fine-tune cut at 128 would leave it too" * (abs(tokens - 128) <= 2)
        return (SEAM_TEXT.format(**seam, w=SEAM_WINDOW) + f"A hypothesis: training on sequences of about {tokens} "
                f"tokens leaves the rows past them trained less{cut}; {self.model}'s training recipe would tell.")

    def summary(self) -> dict:
        measured = ("entrywise_correlation", "structure_correlation", "pca_share_2", "pca_share_10", "k",
                    "lowfreq_share", "lowfreq_share_sinusoid", "lowfreq_share_noise")
        return {"model": self.model, "positions": len(self.norms), "first_position": self.first,
                **{name: getattr(self, name) for name in measured}, "norm_min": float(self.norms.min()),
                "norm_max": float(self.norms.max()), "mean_adjacent_cosine": self.adjacent_cosine,
                "component_shares": tuple(round(c["share"], 4) for c in self.components),  # (tables show tuples)
                "component_cycles": tuple(c["cycles"] for c in self.components),
                "component_periods": tuple(round(c["period"], 2) for c in self.components),
                "seams": [s["at"] for s in self.seams], "noise_like": self.kind == "noise", "verdict": self.verdict}

    def figures(self) -> list[Figure]:
        alike = {"sinusoidal": "the sinusoids' own structure, whatever the rotation of the hidden space",
                 "noise": "no more alike than any two positions, unlike the sinusoids' bright diagonal",
                 "learned": "alike near the diagonal as the sinusoids are, in a pattern of its own"}[self.kind]
        similarity = (f"Cosine similarity between every pair of the {len(self.norms)} learned position vectors (left) "
                      f"and of a sinusoidal table of the same size (right). The two patterns correlate r = "
                      f"{self.structure_correlation:.2f} (off-diagonal entries). Neighbouring learned positions have "
                      f"cosine {self.adjacent_cosine:.2f} on average: {alike}.")
        norms = (f"Norm of each position vector: {self.norms.min():.3f} to {self.norms.max():.3f} (position "
                 f"{int(np.argmax(self.norms)) + self.first} is the largest), and the cosine of each with the next."
                 + ("".join(map(self.describe_seam, self.seams))
                    or " No seam: no boundary stands out from the rest of the table."))
        spectrum = (f"How each hidden dimension varies along the positions, as a spectrum. Frequencies 1-{self.k} (the "
                    f"shaded band) hold {self.lowfreq_share:.0%} of the learned table's variance over positions "
                    f"({self.lowfreq_share_sinusoid:.0%} for the sinusoidal table, {self.lowfreq_share_noise:.0%} for "
                    f"white noise). Per hidden dimension, the strongest frequency has median "
                    f"{np.median(self.peaks):.0f} cycles over the table (sinusoidal: "
                    f"{np.median(self.sinusoid_peaks):.0f}).")
        named = self.positions[self.labelled()]
        pca = (f"Left, each position on the table's first two principal components (each hidden dimension centred over "
               f"positions), positions {named[0]}, {named[1]}, ... {named[-1]} named and joined in order; right, the "
               f"first {len(self.components)} components against position. Two hold {self.pca_share_2:.0%} of the "
               f"variance, ten {self.pca_share_10:.0%}. {self.describe_components()}")
        return [Figure("position_similarity", "Position similarity", similarity, self.plot_similarity,
                       self.plotly_similarity),
                Figure("position_norms", "Position norms", norms, self.plot_norms, self.plotly_norms),
                Figure("position_spectrum", "Position spectrum", spectrum, self.plot_spectrum, self.plotly_spectrum),
                Figure("position_pca", "Positions on their principal components", pca, self.plot_pca, self.plotly_pca)]

    def labelled(self) -> np.ndarray:
        """The rows named on the principal-component plot: about 6 per period of component 1, `LABELLED` at most."""
        return np.arange(0, len(self.norms), max(1, round(self.components[0]["period"] / 6)))[:LABELLED]

    def plot_similarity(self):
        """Cosine similarity of every pair of positions: learned table (left) and sinusoidal table (right)."""
        fig, panels = axes(size=(10, 4.6), panels=2)
        ends = (self.positions[0] - 0.5, self.positions[-1] + 0.5)  # (numbered as the tokens use them: 2.. RoBERTa)
        for ax, matrix, title in zip(panels, (self.similarity, self.sinusoid_similarity), TABLES, strict=True):
            image = ax.imshow(matrix, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest",
                              extent=(*ends, *ends[::-1]))
            ax.set(xlabel="position j", ylabel="position i", title=title)
        fig.colorbar(image, ax=list(panels), label="cosine similarity", shrink=0.85)
        fig.suptitle(f"Position-position similarity (structure correlation r = {self.structure_correlation:.2f})")
        return fig

    def plotly_similarity(self):
        fig = _plotly("Position-position similarity", "position j", "position i", 2, TABLES)
        for col, matrix in enumerate((self.similarity, self.sinusoid_similarity), 1):
            fig.add_heatmap(z=matrix.astype(np.float32), x=self.positions, y=self.positions, zmin=-1, zmax=1,
                            colorscale="RdBu_r", hovertemplate="positions %{y}, %{x}: cosine %{z:.3f}", row=1, col=col)
        return fig.update_yaxes(autorange="reversed")

    def plot_norms(self, ax=None):
        """Norm of each position vector and the cosine with the next position; a line at each seam found."""
        fig, ax = axes(ax)
        ax.plot(self.positions, self.norms, color=PART_COLOURS["position"], lw=1.2, label="norm of position vector")
        ax.set(xlabel="position", ylabel="L2 norm", title="Position vectors by position")
        twin, cos = ax.twinx(), np.diag(self.similarity, 1)
        twin.plot(self.positions[:-1], cos, color="0.45", lw=0.8, label="cosine with next position")
        twin.set(ylabel="cosine with next position", ylim=(min(0, float(cos.min())), 1.05))
        for seam in self.seams:
            ax.axvline(seam["at"], color="k", ls="--", lw=0.8)
            ax.text(seam["at"] + 3, ax.get_ylim()[1] * 0.95, f"seam at {seam['at']}", fontsize=8, va="top")
        ax.legend(handles=ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0], fontsize=8,
                  loc="center right")
        return fig

    def plotly_norms(self):
        fig = _plotly("Position vectors by position", "position", "L2 norm", secondary_y=True)
        fig.add_scatter(x=self.positions, y=self.norms, name="norm of position vector",
                        hovertemplate="position %{x}: norm %{y:.3f}")
        fig.add_scatter(x=self.positions[:-1], y=np.diag(self.similarity, 1), name="cosine with next position",
                        hovertemplate="position %{x} and next: cosine %{y:.3f}", secondary_y=True)
        for seam in self.seams:
            fig.add_vline(seam["at"], line_dash="dash", annotation_text=f"seam at {seam['at']}")
        return fig.update_layout(yaxis2_title="cosine with next")

    def plot_spectrum(self, ax=None):
        """Share of variance over positions at each frequency, learned vs sinusoidal; the band `lowfreq_share` sums."""
        fig, ax = axes(ax)
        freqs = np.arange(len(self.spectrum))
        ax.semilogy(freqs[1:], self.spectrum[1:], color=PART_COLOURS["position"], label="learned table")
        ax.semilogy(freqs[1:], self.sinusoid_spectrum[1:], color="0.3", ls="--", label="sinusoidal table")
        ax.axhline(self.noise_share, color="0.6", ls=":", label="white noise (flat)")
        ax.axvspan(0.5, self.k + 0.5, color="#eeeeee", zorder=0,
                   label=f"frequencies 1-{self.k}: {self.lowfreq_share:.0%} of the learned table's variance")
        ax.set(xlabel="frequency (cycles over the whole position range)", ylabel="share of variance (log)",
               title="Spectrum over positions, pooled over hidden dimensions", xscale="log")
        ax.legend(fontsize=8)
        return fig

    def plotly_spectrum(self):
        fig = _plotly("Spectrum over positions", "frequency (cycles over the table)", "share of variance (log)")
        freqs = np.arange(1, len(self.spectrum))
        for name, values in (("learned table", self.spectrum[1:]), ("sinusoidal table", self.sinusoid_spectrum[1:]),
                             ("white noise (flat)", np.full(len(freqs), self.noise_share))):
            fig.add_scatter(x=freqs, y=values, name=name, hovertemplate="%{x} cycles: %{y:.2%} of the variance")
        fig.add_vrect(0.5, self.k + 0.5, fillcolor="gray", opacity=0.25, line_width=0,
                      showlegend=True, name=f"frequencies 1-{self.k}: {self.lowfreq_share:.0%} of the learned table")
        return fig.update_layout(xaxis_type="log", yaxis_type="log")

    def plot_pca(self):
        """Left, positions on the first two components, the `labelled` ones named; right, components by position."""
        fig, (ax, right) = axes(size=(12, 4.8), panels=2)
        (x, y), shown = self.pca_coords[:, :2].T, self.labelled()
        fig.colorbar(ax.scatter(x, y, c=self.positions, s=8, zorder=2), ax=ax, label="position")
        ax.plot(x[shown], y[shown], color="0.3", lw=0.7, zorder=1)
        for i in shown:
            ax.annotate(str(self.positions[i]), (x[i], y[i]), xytext=(3, 3), textcoords="offset points", fontsize=7)
        ax.set(xlabel="principal component 1", ylabel="principal component 2",
               title=f"Positions on two components ({self.pca_share_2:.0%} of the variance)")
        for c, coords in zip(self.components, self.pca_coords.T, strict=True):
            right.plot(self.positions, coords, lw=0.8, alpha=0.4 if c["period"] < 24 else 1,
                       label=f"component {c['component']} ({c['share']:.0%}): {_cycles(c)}")
        right.set(xlabel="position", ylabel="coordinate", title="Leading components against position")
        right.legend(fontsize=7)
        return fig

    def plotly_pca(self):
        fig = _plotly("Positions on their principal components", "principal component 1", "principal component 2", 2,
                      ("positions on components 1 and 2", "leading components against position"))
        fig.add_scatter(x=self.pca_coords[:, 0], y=self.pca_coords[:, 1], mode="markers", text=self.positions,
                        marker_color=self.positions, name="positions", row=1, col=1,
                        hovertemplate="position %{text}: (%{x:.3f}, %{y:.3f})")  # (hover names every position)
        for c, coords in zip(self.components, self.pca_coords.T, strict=True):
            fig.add_scatter(x=self.positions, y=coords, name=f"component {c['component']}: {_cycles(c)}", row=1, col=2,
                            hovertemplate=f"position %{{x}}: component {c['component']} %{{y:.3f}}")
        return fig


def _cycles(c: dict) -> str:
    """A component's strongest frequency in words ("88 cycles over the table, a period of 5.82 positions")."""
    if c["near"] < NEAR or c["row_share"] >= OUTLIER:
        return "no dominant frequency"
    return f"{c['cycles']} cycle{'s' * (c['cycles'] != 1)} over the table, a period of {c['period']:.3g} positions"


def _within(c: dict) -> str:
    return f"±{c['width']} cycle{'s' * (c['width'] != 1)}"


def _plotly(title: str, xtitle: str, ytitle: str, panels: int = 1, titles: tuple = (), secondary_y: bool = False):
    """An empty plotly figure of `panels` side by side under the report's layout, the first panel's axes named."""
    from plotly.subplots import make_subplots

    fig = make_subplots(1, panels, subplot_titles=titles, specs=[[{"secondary_y": secondary_y}] * panels])
    return fig.update_layout(title=title, xaxis_title=xtitle, yaxis_title=ytitle, **PLOTLY_LAYOUT)


def analyze_positions(model: ModelArg = None, *, k: int = 16) -> PositionReport:
    """Measure the position table of `model`: the rows tokens use. NotInThisMember where the member has none;
    ValueError for k < 1; a k past the table's P // 2 frequencies is lowered to it (the report's `k` is used)."""
    if k < 1:
        raise ValueError(f"k={k}: fit at least 1 low-frequency cosine")
    layer = load_layer(model)
    learned = layer.table("position")
    count = learned.shape[0]
    if count < 3:
        raise ValueError(f"the position table has {count} rows; at least 3 are needed to compare structures")
    k = min(k, count // 2)
    sinus = sinusoidal_table_np(*learned.shape)
    sim, sin_sim = cosine_matrix(learned), cosine_matrix(sinus)
    (shares, coords, leading), spec, sin_spec = components(learned), spectrum(learned), spectrum(sinus)
    return PositionReport(
        source=layer.source, similarity=sim, sinusoid_similarity=sin_sim, norms=row_norms(learned),
        entrywise_correlation=float(np.corrcoef(learned.ravel(), sinus.ravel())[0, 1]),
        structure_correlation=structure_correlation(sim, sin_sim), pca_share_2=float(shares[:2].sum()),
        pca_share_10=float(shares[:10].sum()), pca_coords=coords, components=leading, k=k,
        lowfreq_share=float(spec[1:k + 1].sum()), lowfreq_share_sinusoid=float(sin_spec[1:k + 1].sum()),
        lowfreq_share_noise=min(1.0, 2 * k / (count - 1)), spectrum=spec, sinusoid_spectrum=sin_spec,
        peaks=peak_frequencies(learned), sinusoid_peaks=peak_frequencies(sinus),
        seams=find_seams(learned, layer.config.first_position), first=layer.config.first_position,
        member=layer.config.model_type)
