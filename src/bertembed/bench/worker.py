"""One allocator condition of `bertembed bench`, run in its own process so glibc's malloc settings hold from start.

    python -m bertembed.bench.worker SPEC_JSON

writes one line per measured (case, candidate), `BENCH {json}`, on stdout, after one `BENCH {json}` line of
metadata (bandwidth, versions). The parent (`bertembed.bench.runner`) reads them as they come.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bertembed.bench import candidates as cands
from bertembed.bench.cases import CANDIDATES, PREFIX, Case, bound_bytes, candidates_for
from bertembed.bench.measure import apply_steady_malloc, copy_bandwidth, peak_bytes, time_call, warm_up
from bertembed.bench.prewarm import Prewarm

log = logging.getLogger(__name__)


def setup(spec: dict[str, Any]) -> dict[str, Any]:
    """Threads and allocator for this process; returns the metadata record (threads, whether mallopt took, the
    1 GiB copy bandwidth per device)."""
    threads = int(spec["threads"])
    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    steady = apply_steady_malloc() if spec["condition"] == "steady" else False
    devices = sorted({Case.from_dict(c).device for c in spec["cases"]})
    bandwidth = {d: copy_bandwidth(d, spec.get("bandwidth_bytes", 1 << 30), threads,
                                   spec.get("bandwidth_min_run_time", 0.5)) for d in devices}
    return {"type": "meta", "condition": spec["condition"], "mallopt_applied": steady, "threads": threads,
            "torch_threads": torch.get_num_threads(), "bandwidth_bytes_per_s": bandwidth,
            "load_average": os.getloadavg()}  # other processes' load: > ~0.2 means the timings are disturbed


def measure_one(name: str, work: cands.Workload, reference: torch.Tensor | None, spec: dict[str, Any],
                bandwidth: dict[str, float], before_timing: Callable[[], None] = lambda: None,
                built: Callable[[], cands.Candidate] | None = None) -> dict[str, Any]:
    """Build, check, time and memory-profile one candidate on one case; never raises for the candidate's faults.
    `before_timing` runs once it is built and warmed up (to wait for a background compile). `built`: returns the
    candidate built ahead (or raises what building it raised), in place of building it here."""
    case = work.case
    record: dict[str, Any] = {"type": "result", "condition": spec["condition"], "case": case.to_dict(),
                              "key": case.key, "candidate": name, "output_bytes": case.output_bytes}
    try:
        candidate = built() if built is not None else cands.build(name, work)
        warm_up(candidate.call, spec.get("warmup", 3))
        before_timing()
        if case.mode == "fwd":
            record["max_abs_diff"] = diff = cands.max_abs_diff(candidate.call(), reference)
            if diff > cands.DIFF_TOLERANCE[case.dtype]:
                _note(record, f"OUTPUT DIFFERS from the reference by up to {diff:.2e}: timing a different layer")
        timing = time_call(candidate.call, int(spec["threads"]), float(spec["min_run_time"]), case.key)
        record.update(status="ok", median_s=timing.median, iqr_s=timing.iqr, runs=timing.runs)
        if candidate.torch_memory:
            record["peak_bytes"] = peak_bytes(candidate.call, case.device)
            if case.mode == "fwd" and record["peak_bytes"] < case.output_bytes:  # e.g. a numpy-backed output
                _note(record, f"peak memory not measured: torch's allocator saw {record.pop('peak_bytes')} bytes, "
                              f"less than the output, so the output was allocated outside it")
        else:
            _note(record, "peak memory not measured: allocations are outside torch's allocator")
    except cands.NotAvailable as err:
        return {**record, "status": "not available", "note": str(err)}
    except Exception as err:  # noqa: BLE001  (a failing candidate is reported, the run goes on)
        log.exception("%s failed on %s", name, case.key)
        return {**record, "status": "error", "note": f"{type(err).__name__}: {str(err)[:300]}"}
    if case.mode == "fwd":
        traffic = bound_bytes(case.batch, case.length, case.hidden, case.itemsize)
        record.update(bound_s=traffic / bandwidth["working_set"], bound_dram_s=traffic / bandwidth["dram"],
                      copy_bytes_per_s=bandwidth["working_set"], achieved_bytes_per_s=traffic / timing.median)
    return record


def _note(record: dict[str, Any], text: str) -> None:
    record["note"] = "; ".join(filter(None, (record.get("note"), text)))


def case_bandwidth(case: Case, spec: dict[str, Any], dram: float) -> dict[str, float]:
    """Copy bandwidth at the case's own footprint (a copy moving as many bytes, read + write, as the op's least
    traffic: the cache level the op's data lives in), and the machine's large-buffer (DRAM) figure."""
    traffic = bound_bytes(case.batch, case.length, case.hidden, case.itemsize)
    working_set = copy_bandwidth(case.device, max(traffic // 2 // 4 * 4, 4096), int(spec["threads"]),
                                 float(spec.get("bandwidth_min_run_time", 0.5)) / 2)
    return {"working_set": working_set, "dram": dram}


def run_cases(spec: dict[str, Any], bandwidth: dict[str, float]) -> Iterator[dict[str, Any]]:
    """Every (candidate, case) of `spec`, one record each, candidate by candidate in CANDIDATES' order.

    Candidate-major, with the fused path last: a thread pool a candidate starts (numba's, ORT's, inductor's kernels)
    lives on in the process, and measured here it slowed the next candidate's fwd+bwd up to 2x; in this order only
    the candidates after it could feel it, and with `--isolate` none does.
    """
    names = tuple(spec.get("candidates") or CANDIDATES)
    cases = [Case.from_dict(c) for c in spec["cases"]]
    workload = functools.partial(cands.make_workload, seed=spec.get("seed", 0),
                                 vocab_size=spec.get("vocab_size", 30522))
    prewarm = None  # started with the first torch.compile build, when the fused path runs later (`bench.prewarm`)
    ahead: dict[Case, Callable[[], cands.Candidate]] = {}
    if spec.get("compile_ahead") and "hf-compile" in names:
        prewarm, ahead = compile_ahead(spec, [c for c in cases if "hf-compile" in candidates_for(c, names)], workload)
    references: dict[Case, torch.Tensor] = {}  # each forward case's reference output, for the next candidates
    case_bws: dict[Case, dict[str, float]] = {}
    for name in names:
        for case in cases:
            if name not in candidates_for(case, names):
                continue
            work = workload(case)
            reference = references.get(case)
            if case.mode == "fwd" and reference is None:
                reference = cands.reference_output(work)
                if len(names) > 1:  # (an isolated worker runs one candidate: nothing to keep it for)
                    references[case] = reference
            if case.mode == "fwd" and case not in case_bws:  # once per case: every candidate's bound is the same
                case_bws[case] = case_bandwidth(case, spec, bandwidth[case.device])
            case_bw = case_bws.get(case, {})
            if name == "hf-compile" and spec.get("prewarm_kernels") and prewarm is None:
                prewarm = Prewarm(cases, spec.get("vocab_size", 30522))
                record = measure_one(name, work, reference, spec, case_bw, before_timing=prewarm.wait)
                prewarm.wait()  # done already, unless the candidate failed before its timing
                yield record
            else:
                built = ahead.pop(case) if name == "hf-compile" and case in ahead else None
                yield measure_one(name, work, reference, spec, case_bw, built=built)
            del work, reference
            gc.collect()


def compile_ahead(spec: dict[str, Any], cases: list[Case], workload: Callable[[Case], cands.Workload]
                  ) -> tuple[Prewarm | None, dict[Case, Callable[[], cands.Candidate]]]:
    """`torch.compile`'s candidates for `cases`, built before anything is timed, while the fused kernels compile
    beside them (`Prewarm`, when asked for), which this waits for. Returns the prewarm (None when not asked for) and,
    per case, what returns its built candidate or raises what building it raised.

    For `--quick`, on a fresh install: one after the other, inductor's four graphs took 28 s and numba's kernels 33
    s on a 2-vCPU VM, and until now only the first graph overlapped with the kernels. Each candidate keeps its
    compiled graph (no dynamo reset after the first): few cases only, within dynamo's recompile limit."""
    prewarm = Prewarm(cases, spec.get("vocab_size", 30522)) if spec.get("prewarm_kernels") else None
    ahead: dict[Case, Callable[[], cands.Candidate]] = {}
    torch._dynamo.reset()
    for case in cases:
        try:
            candidate = cands.build("hf-compile", workload(case), reset=False)
            ahead[case] = lambda built=candidate: built
        except Exception as err:  # noqa: BLE001  (reported when the case's turn comes, as if built then)
            ahead[case] = functools.partial(_reraise, err)
    if prewarm is not None:
        prewarm.wait()
    return prewarm, ahead


def _reraise(err: Exception) -> cands.Candidate:
    raise err


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(argv[0])
    meta = setup(spec)
    _emit(meta)
    with libraries_frozen(tuple(spec.get("candidates") or CANDIDATES)):
        for record in run_cases(spec, meta["bandwidth_bytes_per_s"]):
            _emit(record)


@contextlib.contextmanager
def libraries_frozen(names: tuple[str, ...]) -> Iterator[None]:
    """Imports what building the candidates `names` imports, then moves every object alive into the collector's
    permanent generation (`gc.freeze`) until the block ends. The `gc.collect()` after each record then walks only the
    objects made since: with dynamo, inductor and transformers imported it walked some 400 000 and took 0.3 s a
    record, 6 s of a `--quick` run. What the libraries made at import lives as long as the process anyway."""
    cands.preload(names)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # (objects still frozen at exit are never freed, and nanobind then reports them as leaks)


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(record) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
