"""What calling compiled code costs a sentence: numba's dispatcher against a C function called through ctypes.

    python benchmarks/dispatch_cost.py

A sentence's short path (`kernels/lean._infer`) makes one compiled call with seven arguments: four ints, the tables'
ten addresses as a tuple, a float and the output array. This times a bare function of those argument types through
numba's dispatcher, and a `numba.cfunc` of the same values as flat C arguments, called through `ctypes` (with the
output's address read by `ndarray.ctypes`, and without). Neither does any work. Best of 5 loops of 200 000 calls, ns.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
from numba import cfunc, njit, types


@njit
def _through_dispatcher(ids_at, tts_at, has_tts, past, tables, eps, out):
    return out.shape[0] + tables[8] + ids_at > 0


_FLAT = [types.int64] * 14 + [types.float64] + [types.int64] * 4  # 4 ints, 10 addresses, eps, out's address, B, L, H


@cfunc(types.boolean(*_FLAT))
def _as_c_function(ids_at, tts_at, has_tts, past, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, eps, out_at, b, length, h):
    return out_at + t8 + ids_at + b > 0


def best_ns(call, calls: int = 200_000) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e9)
    return best


def main() -> None:
    c_types = [ctypes.c_int64] * 14 + [ctypes.c_double] + [ctypes.c_int64] * 4
    through_ctypes = ctypes.CFUNCTYPE(ctypes.c_bool, *c_types)(_as_c_function.address)
    tables, out = tuple(range(1, 11)), np.empty((1, 11, 768), np.float32)
    flat = (1, 1, 0, 0, *tables, 1e-12, out.ctypes.data, 1, 11, 768)
    rows = {
        "numba dispatcher, _infer's argument types": lambda: _through_dispatcher(1, 1, False, 0, tables, 1e-12, out),
        "cfunc through ctypes, flat arguments": lambda: through_ctypes(*flat),
        "the same, reading out.ctypes.data each call": lambda: through_ctypes(1, 1, 0, 0, *tables, 1e-12,
                                                                              out.ctypes.data, 1, 11, 768),
        "an empty lambda": lambda: None,
    }
    for call in rows.values():
        call()
    for name, call in rows.items():
        print(f"{name:48} {best_ns(call):7.0f} ns")


if __name__ == "__main__":
    main()
