"""Compile bertembed's Triton kernels ahead of time for an H100 (sm_90), with no GPU: `python tests/triton_aot.py`.

Run without TRITON_INTERPRET (the interpreter's variable is read when a kernel is decorated, and an interpreted kernel
cannot be compiled). Each case goes through Triton's whole compiler, to PTX and then cubin (Triton's own ptxas).
Prints one line a case and exits 1 if any failed. tests/test_triton_compiles.py runs it in a subprocess.
"""

from __future__ import annotations

import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bertembed.fast import triton as kernels

TARGET = GPUTarget("cuda", 90, 32)
_IDS = dict(ids="*i64", tts="*i64", pids="*i64", bad="*i64")
_SIZES = dict(N="i32", H="i32", V="i32", T="i32", P="i32", seed="i32", p="fp32")


def _forward(table: str, **constants) -> tuple:
    runtime = _IDS | _SIZES | dict(word=table, seg=table, pos=table, gamma=table, beta=table, out=table,
                                   mean="*fp32", rstd="*fp32", eps="fp32")
    base = dict(DROPOUT=False, STATS=False, COUNT=False, EVICT=True, R=1, BLOCK=1024)
    return kernels._forward_kernel, runtime, base | constants


def _backward(table: str, **constants) -> tuple:
    runtime = _IDS | _SIZES | dict(grad=table, word=table, seg=table, pos=table, gamma=table, mean="*fp32",
                                   rstd="*fp32", dx_buf="*fp32", dword="*fp32", dpos="*fp32", part="*fp32", pad="i32")
    base = dict(ROWS=4, DROPOUT=True, ATOMIC=True, WANT_WORD=True, WANT_POS=True, COUNT=False,
                BLOCK=1024)
    return kernels._backward_kernel, runtime, base | constants


CASES = {
    "forward, inference, float32": _forward("*fp32"),
    "forward, training (statistics, dropout), H 384": _forward("*fp32", STATS=True, DROPOUT=True, BLOCK=512),
    "forward, bfloat16, 2 rows a program, no hints": _forward("*bf16", R=2, EVICT=False),
    "forward, float16": _forward("*fp16"),
    "backward, float32, atomics, dropout": _backward("*fp32"),
    "backward, bfloat16, deterministic, frozen word and position tables": _backward(
        "*bf16", ATOMIC=False, DROPOUT=False, WANT_WORD=False, WANT_POS=False),
    "backward, float16, one row a program, no position gradient, bad ids counted": _backward(
        "*fp16", ROWS=1, WANT_POS=False, COUNT=True),
}


def compile_case(kernel, runtime: dict, constants: dict):
    """The compiled kernel (PTX and cubin) of `kernel` for these argument types and constexpr values."""
    names = kernel.arg_names
    missing = set(names) - set(runtime) - set(constants)
    if missing:
        raise ValueError(f"no type or value for {sorted(missing)}")
    signature = {name: "constexpr" if name in constants else runtime[name] for name in names}
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    aligned = [name for name in names if runtime.get(name, "").startswith("*") or name == "H"]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": 4})


def main() -> int:
    failed = 0
    for name, (kernel, runtime, constants) in CASES.items():
        try:
            compiled = compile_case(kernel, runtime, constants)
            print(f"ok      {name}: {len(compiled.asm['ptx'])} characters of PTX, {len(compiled.asm['cubin'])} bytes "
                  f"of cubin")
        except Exception:  # noqa: BLE001  (every case is tried; the failures are printed in full)
            failed += 1
            print(f"FAILED  {name}:\n{traceback.format_exc()}")
    print(f"{len(CASES)} cases")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
