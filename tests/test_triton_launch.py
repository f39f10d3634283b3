"""`triton_launch.Launcher`'s cache on CPU, with a stand-in for a @triton.jit kernel: which calls go through Triton's
`kernel[grid](...)` (which compiles and returns the compiled kernel) and which through the compiled kernel's runner.
On a GPU the same path runs for real (tests/test_kernels_triton.py); without one, the Triton tests run in the
interpreter, where the Launcher always defers to Triton."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bertembed.kernels import triton_launch


class FakeCompiled:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("runner", self.key, grid, args))


class FakeKernel:
    """Parameters x (a pointer), n (an int), BLOCK (a constexpr), as `kernel.arg_names`, `kernel.params` give them."""

    arg_names = ["x", "n", "BLOCK"]
    params = [SimpleNamespace(is_constexpr=c) for c in (False, False, True)]

    def __init__(self):
        self.log, self.compiles = [], 0

    def __getitem__(self, grid):
        def run(*args, num_warps):
            self.compiles += 1
            self.log.append(("triton", grid, args, num_warps))
            return FakeCompiled(self.log, self.compiles)

        return run


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(triton_launch, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = FakeKernel()
    return triton_launch.Launcher(kernel), kernel


def test_second_call_of_a_key_runs_the_compiled_kernel_with_every_argument_in_order(launcher):
    launch, kernel = launcher
    x = torch.zeros(64)
    launch(8, 4, BLOCK=128, n=32, x=x)
    launch(16, 4, n=48, x=x, BLOCK=128)  # 48 and 32: both divisible by 16, neither 1, so the same kernel
    assert [entry[0] for entry in kernel.log] == ["triton", "runner"]
    assert kernel.log[1][1:] == (1, (16, 1, 1), (x, 48, 128))


@pytest.mark.parametrize("change", [dict(n=33), dict(n=1), dict(n=2**31), dict(BLOCK=256), dict(x="offset"),
                                    dict(x="int64"), dict(num_warps=8)])
def test_what_triton_specialises_on_leads_to_triton_again(launcher, change):
    launch, kernel = launcher
    x = torch.zeros(64)
    args = dict(x=x, n=32, BLOCK=128)
    launch(8, 4, **args)
    changed = dict(args, **{k: v for k, v in change.items() if k != "num_warps"})
    if change.get("x") == "offset":
        changed["x"] = x[1:]  # 4 bytes in: no longer 16-byte aligned
    elif change.get("x") == "int64":
        changed["x"] = torch.zeros(64, dtype=torch.int64)
    launch(8, change.get("num_warps", 4), **changed)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton"]
    launch(8, change.get("num_warps", 4), **changed)
    assert kernel.log[-1][0] == "runner" and kernel.log[-1][1] == 2


def test_the_cache_starts_again_past_its_size(launcher, monkeypatch):
    monkeypatch.setattr(triton_launch, "_MAX_KEYS", 2)
    launch, kernel = launcher
    x = torch.zeros(64)
    for block in (16, 32, 64):
        launch(1, 4, x=x, n=32, BLOCK=block)
    assert len(launch.compiled) == 1
