"""bfloat16 in the numba kernels: the roundings against torch's own, bit for bit, and the layer against the reference.

Sums and output rows are rounded to nearest-even by integer arithmetic (`cpu.round_like`, `cpu.write_row`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from numba import njit  # noqa: E402

from bertembed.fast import cpu  # noqa: E402
from kernel_helpers import (  # noqa: E402
    awkward_ids,
    check_low_precision,
    twins,
)

_BF16 = np.zeros((1, 1), np.uint16)  # stands for a bfloat16 table in `round_like`'s dispatch


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _as_bfloat16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


@njit
def _round_sums(table, sums):
    out = np.empty_like(sums)
    for j in range(sums.size):
        out[j] = cpu.round_like(table, sums[j])
    return out


def _assert_same_bfloat16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns, except that any NaN stands for any other."""
    both_nan = got.isnan() & want.isnan()
    differ = (_bits(got) != _bits(want)) & ~both_nan.numpy()
    assert not differ.any(), f"{int(differ.sum())} differ, first at {np.flatnonzero(differ)[:5]}"
    assert torch.equal(got.isnan(), want.isnan())


def test_rounding_a_sum_is_torchs_for_every_bfloat16_value():
    """`round_like` (no NaN test of its own) against torch's bfloat16 add: every one of the 65536 bit patterns plus
    every NaN and infinity, and plus finite values of all magnitudes (ties to even included)."""
    every = np.arange(1 << 16, dtype=np.uint32)
    specials = np.concatenate([np.arange(0x7F80, 0x8000), np.arange(0xFF80, 0x10000)])  # infinities and NaNs
    finite = np.random.default_rng(0).choice(every[(every & 0x7F80) != 0x7F80], 256, replace=False)
    a = _as_bfloat16(np.repeat(every, specials.size + finite.size))
    b = _as_bfloat16(np.tile(np.concatenate([specials, finite]), every.size))
    sums = (a.float() + b.float()).numpy()  # exact or one rounding away: float32 holds the sum of two bfloat16s
    got = torch.from_numpy(_round_sums(_BF16, sums).view(np.uint32) >> 16).to(torch.int32)
    _assert_same_bfloat16(_as_bfloat16(got.numpy()), a + b)


@njit
def _write_rows(y, out):
    for i in range(out.shape[0]):
        cpu.write_row(y[i], out, i)


@pytest.mark.parametrize("hidden", [1, 31, 97, 768, 1000])
def test_rows_round_as_torch_does(hidden):
    """`write_row` into a bfloat16 output: torch's rounding for every float32 of any magnitude, subnormals included,
    NaNs of any payload and infinities."""
    gen = torch.Generator().manual_seed(hidden)
    y = torch.randn(3, hidden, generator=gen) * torch.logspace(-42, 38, 3 * hidden).view(3, hidden)
    specials = torch.tensor([0x7FFFFFFF, 0x7F800001, 0xFFC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000,
                             0x3F818000, 0x00000000, 0x80000000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    flat = y.view(-1)
    flat[: min(flat.numel(), specials.numel())] = specials[: flat.numel()]
    out = torch.full((3, hidden), 7.0, dtype=torch.bfloat16)
    _write_rows(y.numpy(), _bits(out))
    want = y.to(torch.bfloat16)
    subnormal = want.float().abs() < torch.finfo(torch.bfloat16).tiny
    assert hidden < 97 or (want[subnormal] != 0).any()  # subnormal results are there
    _assert_same_bfloat16(out, want)


@pytest.mark.parametrize(("hidden", "threads", "batch", "length"), [(97, 2, 2, 9), (768, 2, 2, 512), (200, 1, 4, 40)])
def test_bfloat16_outputs_match_reference_on_any_thread_count(hidden, threads, batch, length):
    """bfloat16 outputs, serial and parallel, in training and in inference."""
    ref, fused = twins(hidden, "cpu", dtype=torch.bfloat16)
    ids = awkward_ids(batch, length, ref.config.vocab_size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_low_precision(ref, fused, ids)
        with torch.no_grad():
            torch.testing.assert_close(fused(ids), ref(ids))
    finally:
        torch.set_num_threads(previous)


def test_float32_layer_norm_with_bfloat16_tables():
    """Mixed precision as often set up: bfloat16 tables, float32 LayerNorm weight and bias."""
    ref, fused = twins(64, "cpu", dtype=torch.bfloat16)
    for layer in (ref, fused):
        layer.LayerNorm.float()
    ids = awkward_ids(2, 9, ref.config.vocab_size)
    torch.testing.assert_close(fused(ids), ref(ids).to(torch.bfloat16))
