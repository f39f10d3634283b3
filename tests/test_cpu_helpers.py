"""Building blocks of the CPU kernels that the layer tests reach only through their results."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

import numba  # noqa: E402
from numba import njit  # noqa: E402

from bertembed.fast import cpu  # noqa: E402


@njit
def _fill_through_borrowed(a, n):
    scratch = np.arange(n).astype(np.float32)  # a local owner: numba frees it after its last use unless held
    view, rows = cpu.borrowed(scratch), cpu.borrowed(a)
    for j in range(n):
        rows[1, j] = view[j] * 2 + rows[0, j]
    first_row = rows[0]  # a view of a borrowed array
    first_row[0] = 7
    cpu.hold(scratch)
    return view.sum()


def test_borrowed_views_read_and_write_their_owners_memory():
    a = np.ones((2, 5), np.float32)
    assert _fill_through_borrowed(a, 5) == 10.0
    np.testing.assert_array_equal(a[1], [1, 3, 5, 7, 9])
    np.testing.assert_array_equal(a[0], [7, 1, 1, 1, 1])


@njit
def _scaled_sum(a, k, wide):
    cpu.wide_vectors(wide)
    total = np.float32(0.0)
    for j in range(a.size):
        total += a[j] * k
    return total


@njit
def _asks_at_run_time(flag):
    cpu.wide_vectors(flag > 0)


@njit
def _sums(a, k):
    """The two versions of `_scaled_sum`, each called with a constant, as the kernels call their row passes."""
    return _scaled_sum(a, k, True), _scaled_sum(a, k, False)


@pytest.mark.parametrize("wide", [True, False])
def test_wide_vectors_marks_only_the_wide_version_and_changes_no_result(wide):
    a = np.arange(37, dtype=np.float32)
    assert _sums(a, np.float32(2.0)) == (np.float32(2 * a.sum()),) * 2
    (ir,) = (text for signature, text in _scaled_sum.inspect_llvm().items()
             if getattr(signature[2], "literal_value", None) is wide)
    assert ('"prefer-vector-width"="512"' in ir) == (wide is True)


def test_wide_vectors_wants_a_constant():
    with pytest.raises(numba.TypingError, match="constant True or False"):
        _asks_at_run_time(1)
