"""One sentence (1, 11), hidden 768, through the CPU short path, in one process, with this tree's `lean._tables` and
with another revision's, alternating blocks of 2000 calls (40 blocks a side): what a change to the short path's
cache key costs a call.

    git worktree add /tmp/old 185ebc5 && python benchmarks/short_path_ab.py /tmp/old/src/bertembed/kernels/lean.py
"""

from __future__ import annotations

import ast
import statistics
import sys
import time

import torch

from bertembed import BertEmbeddings, EmbeddingConfig
from bertembed.kernels import lean


def other_tables(path: str):
    """The `_tables` function of another revision's lean.py, run in this tree's module namespace."""
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_tables")
    namespace = dict(vars(lean))
    exec(compile(ast.Module([node], []), path, "exec"), namespace)
    return namespace["_tables"]


def block_us(layer, ids, calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        layer(ids)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    sides = {"other": other_tables(sys.argv[1]), "this": lean._tables}
    torch.set_num_threads(2)
    layer = BertEmbeddings(EmbeddingConfig(hidden_size=768), backend="cpu").eval()
    ids = torch.randint(0, 30522, (1, 11))
    times = {name: [] for name in sides}
    with torch.no_grad():
        for rounds in range(41):
            for name, tables in list(sides.items())[:: 1 if rounds % 2 else -1]:
                lean._tables = tables
                layer.__dict__.pop(lean.KERNEL_CACHE, None)  # each side builds its own cache entry
                layer(ids)
                took = block_us(layer, ids)
                if rounds:  # the first round settles both
                    times[name].append(took)
    other, this = statistics.median(times["other"]), statistics.median(times["this"])
    print(f"other {other:.3f} us a call, this {this:.3f} us: {this - other:+.3f} us ({this / other:.3f}x)")


if __name__ == "__main__":
    main()
