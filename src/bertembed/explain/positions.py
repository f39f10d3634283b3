"""Are learned position embeddings sinusoidal? The position table against a sin/cos table of the same size: entry
by entry, in structure, in smoothness, and its seams (docs/how-bert-embeddings-work.md, section 3). P positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertembed.explain._common import PART_COLOURS, Figure, ModelArg, Result, axes, load_layer, row_norms
from bertembed.numpy_layer import sinusoidal_table_np
from bertembed.sources import Source

SEAM_SCORE = 6.0  # robust z-scores (median and MAD over all boundaries) both the dip and the step must pass
SEAM_WINDOW = 8  # rows on each side whose mean norms make the step
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


def lowfreq_share(matrix: np.ndarray, k: int) -> float:
    """Share of the variance over positions at the frequencies 1..k (cycles over the whole table)."""
    return float(spectrum(matrix)[1:k + 1].sum())


def peak_frequencies(matrix: np.ndarray) -> np.ndarray:
    """Per column of [P, H]: the frequency (cycles over P positions, >= 1) holding most of its variance: [H]."""
    return 1 + np.argmax(_power(matrix)[1:], axis=0)


def find_seams(matrix: np.ndarray, first: int = 0) -> list[dict]:
    """Boundaries where the neighbour cosine dips and the mean norm steps, each by more than SEAM_SCORE robust
    z-scores; adjacent ones merge, the two at each end are left out. `first`: the position of the table's first row."""
    norms = row_norms(matrix)
    count = len(norms)
    if count < 4 * SEAM_WINDOW:
        return []
    cos = (matrix[:-1] * matrix[1:]).sum(1) / np.maximum(norms[:-1] * norms[1:], 1e-30)  # boundary b: rows b, b+1
    step = np.array([abs(norms[b + 1:b + 1 + SEAM_WINDOW].mean() - norms[max(0, b + 1 - SEAM_WINDOW):b + 1].mean())
                     for b in range(count - 1)])
    dip, jump = _robust_z(np.median(cos) - cos), _robust_z(step - np.median(step))
    score = np.minimum(dip, jump)
    seams: list[dict] = []
    for b in np.flatnonzero(score > SEAM_SCORE):
        if b < 2 or b > count - 4:
            continue
        entry = {"at": int(b + 1 + first), "neighbour_cosine": float(cos[b]), "typical_neighbour_cosine":
                 float(np.median(cos)), "norm_before": float(norms[max(0, b + 1 - SEAM_WINDOW):b + 1].mean()),
                 "norm_after": float(norms[b + 1:b + 1 + SEAM_WINDOW].mean()), "score": float(score[b])}
        if seams and entry["at"] - seams[-1]["at"] <= 3:
            if entry["score"] > seams[-1]["score"]:
                seams[-1] = entry
            continue
        seams.append(entry)
    return seams


def _robust_z(x: np.ndarray) -> np.ndarray:
    mad = 1.4826 * np.median(np.abs(x - np.median(x)))
    return (x - np.median(x)) / max(mad, 1e-12)


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
    pca_coords: np.ndarray = field(repr=False)  # [P, 2] positions on the first two components
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

    @property
    def adjacent_cosine(self) -> float:
        """The mean cosine of neighbouring positions."""
        return float(np.diag(self.similarity, 1).mean())

    @property
    def noise_like(self) -> bool:
        """No more structure than a random table: an untrained one?"""
        return bool(abs(float(np.median(np.diag(self.similarity, 1)))) < 0.2
                    and self.lowfreq_share < 3 * self.lowfreq_share_noise)

    @property
    def verdict(self) -> str:
        if self.structure_correlation > 0.95:
            return (f"Yes, in structure: its similarity pattern matches the sinusoidal table's (r = "
                    f"{self.structure_correlation:.2f}).")
        if self.noise_like:
            return (f"This table is no different from noise: neighbouring positions have cosine "
                    f"{self.adjacent_cosine:.2f}, the first 10 principal components hold {self.pca_share_10:.0%} of "
                    f"its variance and frequencies 1-{self.k} {self.lowfreq_share:.0%} (white noise: "
                    f"{self.lowfreq_share_noise:.0%}). An untrained (random) table looks like this; there is no code "
                    f"of position in it to compare with sin/cos.")
        text = (f"Entry by entry the learned and sin/cos tables correlate r = {self.entrywise_correlation:+.3f}, but "
                f"that is the wrong test: a table rotated in the hidden space works as well, and no training would "
                f"pick the formula's axes. In structure (which positions are alike) they correlate r = "
                f"{self.structure_correlation:.2f}. The learned table is low-dimensional and smooth: 2 principal "
                f"components hold {self.pca_share_2:.0%} of its variance over positions and 10 hold "
                f"{self.pca_share_10:.0%}, and frequencies 1-{self.k} hold {self.lowfreq_share:.0%} (sin/cos "
                f"{self.lowfreq_share_sinusoid:.0%}, noise {self.lowfreq_share_noise:.0%}): order is encoded along a "
                f"smooth curve, not by the formula (compare {WANG_AND_CHEN}, who find BERT's table far less "
                f"sinusoidal than GPT-2's).")
        return text + "".join(map(describe_seam, self.seams)) + (
            " Sinusoids were proposed because they are fixed (nothing to learn) and extrapolate past the training "
            "length; a learned table has exactly its rows, which is why BERT stops at 512 tokens.")

    def summary(self) -> dict:
        return {"model": self.model, "positions": len(self.norms), "first_position": self.first,
                "entrywise_correlation": self.entrywise_correlation,
                "structure_correlation": self.structure_correlation, "pca_share_2": self.pca_share_2,
                "pca_share_10": self.pca_share_10, "k": self.k, "lowfreq_share": self.lowfreq_share,
                "lowfreq_share_sinusoid": self.lowfreq_share_sinusoid, "lowfreq_share_noise": self.lowfreq_share_noise,
                "norm_min": float(self.norms.min()), "norm_max": float(self.norms.max()),
                "mean_adjacent_cosine": self.adjacent_cosine,
                "seams": [s["at"] for s in self.seams], "noise_like": self.noise_like, "verdict": self.verdict}

    def figures(self) -> list[Figure]:
        similarity = (f"Cosine similarity between every pair of the {len(self.norms)} learned position vectors (left) "
                      f"and of a sinusoidal table of the same size (right). The two patterns correlate r = "
                      f"{self.structure_correlation:.2f} (off-diagonal entries). Neighbouring learned positions have "
                      f"cosine {self.adjacent_cosine:.2f} on average: similar near the diagonal, like the sinusoids, "
                      f"but the learned table is not their formula.")
        norms = (f"Norm of each position vector: {self.norms.min():.3f} to {self.norms.max():.3f} (position "
                 f"{int(np.argmax(self.norms)) + self.first} is the largest), and the cosine of each with the next."
                 + ("".join(map(describe_seam, self.seams))
                    or " No seam: no boundary stands out from the rest of the table."))
        spectrum = (f"How each hidden dimension varies along the positions, as a spectrum. Frequencies 1-{self.k} (the "
                    f"shaded band) hold {self.lowfreq_share:.0%} of the learned table's variance over positions "
                    f"({self.lowfreq_share_sinusoid:.0%} for the sinusoidal table, {self.lowfreq_share_noise:.0%} for "
                    f"white noise). Per hidden dimension, the strongest frequency has median "
                    f"{np.median(self.peaks):.0f} cycles over the table (sinusoidal: "
                    f"{np.median(self.sinusoid_peaks):.0f}).")
        pca = (f"Each position on the table's first two principal components (each hidden dimension centred over "
               f"positions): they hold {self.pca_share_2:.0%} of the variance, the first ten {self.pca_share_10:.0%}. "
               f"Neighbouring positions lie next to each other on one curve: order is encoded smoothly, in a few "
               f"directions of the hidden space, whatever their rotation.")
        return [Figure("position_similarity", "Position similarity", similarity, self.plot_similarity),
                Figure("position_norms", "Position norms", norms, self.plot_norms),
                Figure("position_spectrum", "Position spectrum", spectrum, self.plot_spectrum),
                Figure("position_pca", "Positions on two principal components", pca, self.plot_pca)]

    def plot_similarity(self):
        """Cosine similarity of every pair of positions: learned table (left) and sinusoidal table (right)."""
        fig, panels = axes(size=(10, 4.6), panels=2)
        for ax, matrix, title in zip(panels, (self.similarity, self.sinusoid_similarity),
                                     ("learned position vectors", "sinusoidal table, same size"), strict=True):
            image = ax.imshow(matrix, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
            ax.set(xlabel="position j", ylabel="position i", title=title)
        fig.colorbar(image, ax=list(panels), label="cosine similarity", shrink=0.85)
        fig.suptitle(f"Position-position similarity (structure correlation r = {self.structure_correlation:.2f})")
        return fig

    def plot_norms(self, ax=None):
        """Norm of each position vector and the cosine with the next position; a line at each seam found."""
        fig, ax = axes(ax)
        count, first = len(self.norms), self.first
        ax.plot(range(first, first + count), self.norms, color=PART_COLOURS["position"], lw=1.2,
                label="norm of position vector")
        ax.set(xlabel="position", ylabel="L2 norm", title="Position vectors by position")
        twin = ax.twinx()
        twin.plot(range(first, first + count - 1), np.diag(self.similarity, 1), color="0.45", lw=0.8,
                  label="cosine with next position")
        twin.set(ylabel="cosine with next position", ylim=(min(0, float(np.diag(self.similarity, 1).min())), 1.05))
        for seam in self.seams:
            ax.axvline(seam["at"], color="k", ls="--", lw=0.8)
            ax.text(seam["at"] + 3, ax.get_ylim()[1] * 0.95, f"seam at {seam['at']}", fontsize=8, va="top")
        lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="center right")
        return fig

    def plot_spectrum(self, ax=None):
        """Share of variance over positions at each frequency, learned vs sinusoidal; the band `lowfreq_share` sums."""
        fig, ax = axes(ax)
        freqs = np.arange(len(self.spectrum))
        ax.semilogy(freqs[1:], self.spectrum[1:], color=PART_COLOURS["position"], label="learned table")
        ax.semilogy(freqs[1:], self.sinusoid_spectrum[1:], color="0.3", ls="--", label="sinusoidal table")
        ax.axhline(2 / (2 * len(freqs) - 3), color="0.6", ls=":", label="white noise (flat)")
        ax.axvspan(0.5, self.k + 0.5, color="#eeeeee", zorder=0,
                   label=f"frequencies 1-{self.k}: {self.lowfreq_share:.0%} of the learned table's variance")
        ax.set(xlabel="frequency (cycles over the whole position range)", ylabel="share of variance (log)",
               title="Spectrum over positions, pooled over hidden dimensions", xscale="log")
        ax.legend(fontsize=8)
        return fig

    def plot_pca(self, ax=None):
        """The positions on the table's first two principal components, coloured by position."""
        fig, ax = axes(ax, size=(6, 5))
        x, y = self.pca_coords[:, 0], self.pca_coords[:, 1]
        ax.plot(x, y, color="0.8", lw=0.6, zorder=1)
        points = ax.scatter(x, y, c=np.arange(self.first, self.first + len(x)), cmap="viridis", s=8, zorder=2)
        fig.colorbar(points, ax=ax, label="position")
        ax.set(xlabel="first principal component", ylabel="second principal component",
               title=f"Positions on two components ({self.pca_share_2:.0%} of the variance)")
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
    u, singular, _ = np.linalg.svd(learned - learned.mean(0), full_matrices=False)  # principal components
    shares, coords = singular ** 2 / max((singular ** 2).sum(), 1e-300), u[:, :2] * singular[:2]
    return PositionReport(
        source=layer.source, similarity=sim, sinusoid_similarity=sin_sim, norms=row_norms(learned),
        entrywise_correlation=float(np.corrcoef(learned.ravel(), sinus.ravel())[0, 1]),
        structure_correlation=structure_correlation(sim, sin_sim), pca_share_2=float(shares[:2].sum()),
        pca_share_10=float(shares[:10].sum()), pca_coords=coords, k=k, lowfreq_share=lowfreq_share(learned, k),
        lowfreq_share_sinusoid=lowfreq_share(sinus, k), lowfreq_share_noise=min(1.0, 2 * k / (count - 1)),
        spectrum=spectrum(learned), sinusoid_spectrum=spectrum(sinus), peaks=peak_frequencies(learned),
        sinusoid_peaks=peak_frequencies(sinus),
        seams=find_seams(learned, layer.config.first_position), first=layer.config.first_position)
