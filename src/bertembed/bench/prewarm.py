"""Compiles bertembed's CPU kernels in a background process while `torch.compile` compiles transformers' layer.

numba compiles a kernel on its first call and keeps it in its on-disk cache. On a fresh install the four float32
kernels the quick sweep calls (forward and backward, one thread and all threads) took about 12 s to compile on an
Intel 2-vCPU VM and 33 s on an AMD one, and inductor's first graphs 20 s and 28 s: one after the other they made a
first `bertembed bench --quick` take over a minute. The worker starts this process just before building the first
`torch.compile` candidate (with `--quick`, before timing anything: it then builds all of them,
`worker.compile_ahead`), whose compile leaves a core idle, and waits for it before timing anything more
(`Prewarm.wait`), so no timing shares the machine with it. When the caches are already warm it finishes in a few
seconds, also within the compile.

    python -m bertembed.bench.prewarm CASES_JSON
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from typing import Any

from bertembed.bench.cases import Case

log = logging.getLogger(__name__)


def kernel_cases(cases: list[Case]) -> list[Case]:
    """One CPU case per kernel signature the sweep calls: per dtype and mode, one sentence (the one-thread kernels)
    and one batch (the parallel ones), each at the smallest hidden size (the compiled code does not depend on it)."""
    chosen: dict[tuple[str, str, bool], Case] = {}
    for case in cases:
        if case.device != "cpu":
            continue
        key = (case.dtype, case.mode, case.batch == 1)
        if key not in chosen or case.hidden < chosen[key].hidden:
            chosen[key] = case
    return list(chosen.values())


class Prewarm:
    """The background process; `wait()` blocks until it is done (a failure there is logged, never raised: the
    kernels then compile on first call, as without it)."""

    def __init__(self, cases: list[Case], vocab_size: int) -> None:
        work = kernel_cases(cases)
        self._stderr = tempfile.TemporaryFile("w+")
        spec = {"cases": [c.to_dict() for c in work], "vocab_size": vocab_size}
        self._proc: subprocess.Popen | None = None
        if work:
            self._proc = subprocess.Popen([sys.executable, "-m", "bertembed.bench.prewarm", json.dumps(spec)],
                                          stdout=subprocess.DEVNULL, stderr=self._stderr)

    def wait(self) -> None:
        """Block until the process has finished; later calls return at once."""
        if self._stderr.closed:
            return
        if self._proc is not None and self._proc.wait() != 0:
            self._stderr.seek(0)
            log.warning("compiling the fused kernels ahead failed (they compile on first call instead):\n%s",
                        self._stderr.read()[-2000:])
        self._stderr.close()


def main(argv: list[str] | None = None) -> None:
    from bertembed.bench import candidates as cands

    spec: dict[str, Any] = json.loads((sys.argv[1:] if argv is None else argv)[0])
    for data in spec["cases"]:
        work = cands.make_workload(Case.from_dict(data), vocab_size=spec["vocab_size"])
        try:
            candidate = cands.build("bertembed-fused", work)
        except cands.NotAvailable:  # no numba here, say: the bench reports that itself, with the reason
            return
        candidate.call()


if __name__ == "__main__":
    main()
