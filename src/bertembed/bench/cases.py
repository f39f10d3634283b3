"""What `bertembed bench` measures: the cases (shape, mode, dtype, device) and the bandwidth-bound arithmetic.

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

HIDDENS: tuple[int, ...] = (384, 768, 1024)  # MiniLM / bert-base / bert-large
SHAPES: tuple[tuple[int, int], ...] = ((1, 11), (32, 128), (8, 512), (64, 512))  # (B, L): one sentence .. a full batch
PREFIX = "BENCH "  # starts each line of results a worker (`worker.py`) writes for the runner (`runner.py`) to read
QUICK_HIDDENS: tuple[int, ...] = (768,)
QUICK_SHAPES: tuple[tuple[int, int], ...] = ((1, 11), (32, 128))
MODES: tuple[str, ...] = ("fwd", "fwdbwd")
CANDIDATES: tuple[str, ...] = ("hf-eager", "hf-compile", "ort-fused", "bertembed-reference", "bertembed-fused",
                               "bertembed-fused-device-checks")
# Candidates that run bfloat16 tables: ORT's op is float32 here, and compiling bf16 would double the compile time.
BF16_CANDIDATES: tuple[str, ...] = ("hf-eager", "bertembed-reference", "bertembed-fused",
                                    "bertembed-fused-device-checks")
GPU_CANDIDATES: tuple[str, ...] = ("hf-eager", "hf-compile", "bertembed-reference", "bertembed-fused",
                                   "bertembed-fused-device-checks")
CPU_CANDIDATES: tuple[str, ...] = ("hf-eager", "hf-compile", "ort-fused", "bertembed-reference", "bertembed-fused")

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Case:
    """One measured configuration; every candidate runs it with the same weights and ids."""

    hidden: int
    batch: int
    length: int
    mode: str = "fwd"  # "fwd" (eval, no grad) or "fwdbwd" (train mode, dropout on, backward into fresh grads)
    dtype: str = "float32"  # of the tables, LayerNorm parameters and output
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Case.mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"Case.dtype must be one of {tuple(_ITEMSIZE)}, got {self.dtype!r}")

    @property
    def key(self) -> str:
        return f"{self.device} H={self.hidden} B={self.batch} L={self.length} {self.mode} {self.dtype}"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def output_bytes(self) -> int:
        """Size of the [B, L, H] output."""
        return self.batch * self.length * self.hidden * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def bound_bytes(batch: int, length: int, hidden: int, itemsize: int = 4) -> int:
    """Least memory traffic of one forward: B*L*3 gathered rows (word, position, segment) of H values, LayerNorm's
    gamma and beta (2*H), and the [B, L, H] output written once. The int ids (B*L*2 values) are left out."""
    rows = batch * length * 3 * hidden * itemsize
    gamma_beta = 2 * hidden * itemsize
    output = batch * length * hidden * itemsize
    return rows + gamma_beta + output


def bound_seconds(case: Case, bandwidth_bytes_per_s: float) -> float:
    """Bandwidth-bound time of a forward: `bound_bytes` over the measured copy bandwidth (read + write)."""
    return bound_bytes(case.batch, case.length, case.hidden, case.itemsize) / bandwidth_bytes_per_s


def default_cases(quick: bool = False, hiddens: tuple[int, ...] | None = None, device: str = "cpu",
                  shapes: tuple[tuple[int, int], ...] | None = None) -> list[Case]:
    """The issue's sweep: float32 forward and fwd+bwd over hiddens x shapes, plus a bfloat16 forward at (64, 512)
    per hidden (compared with float32 there). `quick`: hidden 768, (1, 11) and (32, 128), float32 only. `hiddens`
    and `shapes` narrow it (the bfloat16 case stays only if (64, 512) does)."""
    hiddens = hiddens or (QUICK_HIDDENS if quick else HIDDENS)
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    cases = [Case(h, b, length, mode, "float32", device) for h in hiddens for b, length in shapes for mode in MODES]
    if not quick and (64, 512) in shapes:
        cases += [Case(h, 64, 512, "fwd", "bfloat16", device) for h in hiddens]
    return cases


def candidates_for(case: Case, names: tuple[str, ...] = CANDIDATES) -> list[str]:
    """The candidates that run `case`: ORT is CPU-only and forward-only, the GPU's id checks GPU-only; bf16 runs only
    some (see BF16_CANDIDATES)."""
    allowed = GPU_CANDIDATES if case.device != "cpu" else CPU_CANDIDATES
    if case.dtype != "float32":
        allowed = tuple(n for n in allowed if n in BF16_CANDIDATES)
    return [n for n in names if n in allowed]
