"""Are BERT's learned position embeddings sinusoidal? The position table measured against the fixed sin/cos table.

BERT was pre-trained on sequences of 128 tokens for 90% of its steps and of 512 only for the last 10% (paper, A.2),
so rows past 128 saw far fewer updates: `split` compares the two ranges.

Dimension letters: P positions, H hidden, K low-frequency components.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertembed.explain._common import ModelArg, cosine_matrix, load_layer, repr_html, row_norms, table
from bertembed.numpy_layer import sinusoidal_table_np

PRETRAIN_SHORT_LENGTH = 128  # BERT's pre-training length for 90% of the steps


def structure_correlation(sim_a: np.ndarray, sim_b: np.ndarray) -> float:
    """Pearson correlation of the off-diagonal entries of two [P, P] similarity matrices (1.0 for equal structure)."""
    upper = np.triu_indices(sim_a.shape[0], k=1)
    return float(np.corrcoef(sim_a[upper], sim_b[upper])[0, 1])


def dct_basis(positions: int, k: int) -> np.ndarray:
    """The k lowest non-constant cosines over positions, orthonormal columns [P, k] (DCT-II, frequencies 1..k)."""
    p = np.arange(positions)[:, None] + 0.5
    basis = np.cos(np.pi * p * np.arange(1, k + 1)[None] / positions)
    return basis / np.linalg.norm(basis, axis=0)


def lowfreq_share(matrix: np.ndarray, k: int) -> float:
    """Share of the variance over positions of each column of [P, H] that the k lowest cosines explain (pooled)."""
    centred = matrix - matrix.mean(0)
    basis = dct_basis(matrix.shape[0], k)
    return float(((basis.T @ centred) ** 2).sum() / (centred ** 2).sum())


def peak_frequencies(matrix: np.ndarray) -> np.ndarray:
    """Per column of [P, H]: the frequency (cycles over P positions, >= 1) holding most of its variance: [H]."""
    power = np.abs(np.fft.rfft(matrix - matrix.mean(0), axis=0)) ** 2
    return 1 + np.argmax(power[1:], axis=0)


def spectrum(matrix: np.ndarray) -> np.ndarray:
    """Power over positions per frequency (cycles per P positions), averaged over columns, summing to 1: [P//2+1]."""
    power = (np.abs(np.fft.rfft(matrix - matrix.mean(0), axis=0)) ** 2).mean(1)
    return power / power.sum()


@dataclass
class PositionReport:
    """The learned position table [P, H] next to a sinusoidal table of the same size."""

    model: str
    similarity: np.ndarray = field(repr=False)  # [P, P] cosine similarity of learned rows
    sinusoid_similarity: np.ndarray = field(repr=False)  # [P, P] the same for the sinusoidal table
    norms: np.ndarray = field(repr=False)  # [P]
    structure_correlation: float  # learned vs sinusoidal similarity structure
    k: int  # how many low-frequency cosines
    lowfreq_share: float  # of the learned table's variance over positions
    lowfreq_share_sinusoid: float
    lowfreq_share_noise: float  # expected for white noise: k / (P - 1)
    spectrum: np.ndarray = field(repr=False)  # [P//2+1]
    sinusoid_spectrum: np.ndarray = field(repr=False)
    peaks: np.ndarray = field(default=None, repr=False)  # [H] per-dimension peak frequency, learned table
    sinusoid_peaks: np.ndarray = field(default=None, repr=False)  # [H] the same for the sinusoidal table
    split: dict = field(default_factory=dict)  # before/after PRETRAIN_SHORT_LENGTH; empty if P <= 128
    verdict: str = ""

    def summary(self) -> dict:
        out = {"model": self.model, "positions": len(self.norms), "structure_correlation":
               self.structure_correlation, "k": self.k, "lowfreq_share": self.lowfreq_share,
               "lowfreq_share_sinusoid": self.lowfreq_share_sinusoid, "lowfreq_share_noise": self.lowfreq_share_noise,
               "norm_min": float(self.norms.min()), "norm_max": float(self.norms.max()),
               "mean_adjacent_cosine": float(np.diag(self.similarity, 1).mean()),
               "median_peak_frequency": float(np.median(self.peaks)),
               "median_peak_frequency_sinusoid": float(np.median(self.sinusoid_peaks))}
        return out | {f"split_{k}": v for k, v in self.split.items()} | {"verdict": self.verdict}

    def _repr_html_(self) -> str:
        return repr_html(self)


def split_stats(sim: np.ndarray, norms: np.ndarray, at: int = PRETRAIN_SHORT_LENGTH) -> dict:
    """Norms, neighbour cosines and within-range cosines before and after position `at` ({} if P <= at)."""
    if len(norms) <= at:
        return {}
    adjacent = np.diag(sim, 1)
    upper = np.triu(np.ones_like(sim, dtype=bool), 1)
    ranges = {"before": slice(0, at), "after": slice(at, len(norms))}
    out = {"at": at}
    for name, r in ranges.items():
        out[f"mean_norm_{name}"] = float(norms[r].mean())
        out[f"adjacent_cosine_{name}"] = float(adjacent[r][: len(norms[r]) - 1].mean())
        out[f"within_cosine_{name}"] = float(sim[r, r][upper[r, r]].mean())
    out["cross_cosine"] = float(sim[ranges["before"], ranges["after"]].mean())
    out["boundary_cosine"] = float(sim[at - 1, at])  # the step from the last short position to the first long one
    return out


def _verdict(r: float, share: float, sin_share: float, noise: float, k: int, split: dict) -> str:
    if r > 0.95:
        head = f"Yes, in structure: its similarity pattern matches the sinusoidal table's (r = {r:.2f})."
    else:
        shape = "smooth and wave-like" if share > 5 * noise else "not smooth"
        head = (f"No: learned, not the sin/cos table. Its similarity structure correlates r = {r:.2f} with the "
                f"sinusoidal table's; the {k} lowest frequencies explain {share:.0%} of its variance over positions "
                f"(sinusoidal {sin_share:.0%}, white noise {noise:.0%}), so it is {shape}, but not the fixed formula.")
    if split:
        head += (f" Positions >= {split['at']}: mean norm {split['mean_norm_after']:.3f} vs "
                 f"{split['mean_norm_before']:.3f} before; neighbour cosine {split['adjacent_cosine_after']:.2f} vs "
                 f"{split['adjacent_cosine_before']:.2f}, but only {split['boundary_cosine']:.2f} between "
                 f"{split['at'] - 1} and {split['at']}.")
    return head


def analyze_positions(model: ModelArg = None, *, k: int = 16) -> PositionReport:
    """Measure the learned position table of `model` (see `PositionReport`). Raises ValueError if it has none, or for
    k < 1; a k past the table's P - 1 frequencies is lowered to P - 1 (the report's `k` says which was used)."""
    if k < 1:
        raise ValueError(f"k={k}: fit at least 1 low-frequency cosine")
    layer = load_layer(model)
    learned = table(layer, "position")
    count = learned.shape[0]
    if count < 3:
        raise ValueError(f"the position table has {count} rows; at least 3 are needed to compare structures")
    k = min(k, count - 1)
    sinus = sinusoidal_table_np(*learned.shape)
    sim, sin_sim = cosine_matrix(learned), cosine_matrix(sinus)
    norms = row_norms(learned)
    r = structure_correlation(sim, sin_sim)
    share, sin_share, noise = lowfreq_share(learned, k), lowfreq_share(sinus, k), k / (count - 1)
    split = split_stats(sim, norms)
    return PositionReport(
        model=layer.source.name, similarity=sim, sinusoid_similarity=sin_sim, norms=norms,
        structure_correlation=r, k=k, lowfreq_share=share, lowfreq_share_sinusoid=sin_share,
        lowfreq_share_noise=noise, spectrum=spectrum(learned), sinusoid_spectrum=spectrum(sinus),
        peaks=peak_frequencies(learned), sinusoid_peaks=peak_frequencies(sinus), split=split,
        verdict=_verdict(r, share, sin_share, noise, k, split))
