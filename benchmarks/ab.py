"""A/B of two commits: the fused layer in this tree against the same layer at a git revision, on the same machine
in the same minutes, so both see the same machine state (a shared VM's memory speed drifts between periods, which
makes separate runs incomparable).

    python benchmarks/ab.py --against 3e3de39 [--pairs 7] [--backend auto]

The revision is checked out into a temporary git worktree. Each pair runs one process per tree, in alternating
order; each process times its layer (torch.utils.benchmark, 2 threads, random BERT-base-sized tables, seed 0) on
the cases below and prints the medians. Printed: per case, the median over pairs of (revision's time / this tree's)
with its range: above 1 means this tree is faster. Against its own revision (2 pairs, a shared 2-core VM under load)
it read 0.98-1.02x for the sentence and the training step but 1.36x for the forward: use more pairs on a quiet
machine before trusting a forward difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("forward (32, 128)", 32, 128, "fwd"), ("training step (32, 128), dropout 0.1", 32, 128, "train"),
         ("sentence (1, 11)", 1, 11, "fwd")]

# run in each tree's own process: only the public API, so any revision with BertEmbeddings(config, backend=) works
TIMER = """
import json, sys, torch, torch.utils.benchmark as tb
from bertembed import BertEmbeddings, EmbeddingConfig
torch.set_num_threads(2); torch.manual_seed(0)
layer = BertEmbeddings(EmbeddingConfig(hidden_dropout_prob=0.1), backend=sys.argv[1])
times = {}
for name, batch, length, mode in json.loads(sys.argv[2]):
    ids = torch.randint(1, 30522, (batch, length), generator=torch.Generator().manual_seed(1))
    if mode == "fwd":
        layer.eval(); stmt = "with torch.no_grad(): layer(ids)"
    else:
        layer.train(); grad = torch.randn(batch, length, 768); stmt = "layer(ids).backward(grad)"
    timer = tb.Timer(stmt, globals={"layer": layer, "ids": ids, "torch": torch, "grad": locals().get("grad")})
    timer.timeit(3)  # compile and warm up
    times[name] = timer.blocked_autorange(min_run_time=1.0).median
print(json.dumps(times))
"""


def time_tree(src: Path, backend: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", TIMER, backend, json.dumps(CASES)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"timing {src} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the git revision to compare this tree with")
    parser.add_argument("--pairs", type=int, default=7, help="alternating pairs of runs (default 7)")
    parser.add_argument("--backend", default="auto", help="the layer's backend in both trees (default auto)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), args.against], cwd=ROOT, check=True)
        try:
            ratios: dict[str, list[float]] = {name: [] for name, *_ in CASES}
            for pair in range(args.pairs):
                trees = [ROOT / "src", other / "src"][:: 1 if pair % 2 == 0 else -1]
                ours, theirs = (time_tree(t, args.backend) for t in trees)
                if pair % 2:
                    ours, theirs = theirs, ours
                for name in ratios:
                    ratios[name].append(theirs[name] / ours[name])
                print(f"pair {pair + 1}/{args.pairs}: " + ", ".join(f"{r[-1]:.2f}x" for r in ratios.values()),
                      file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)
    print(f"{args.against} time / this tree's time (median over {args.pairs} pairs, [min, max]):")
    for name, values in ratios.items():
        print(f"  {name:40s} {statistics.median(values):.2f}x  [{min(values):.2f}, {max(values):.2f}]")


if __name__ == "__main__":
    main()
