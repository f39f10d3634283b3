"""Where a fused CPU forward spends its time outside the kernel: the module's forward, the kernels' torch glue
(`cpu_run.run_forward`) and the kernel alone (numpy arguments built once, one output buffer), timed alternately in one
process, eval mode under `torch.no_grad()`, H 768, random BERT-sized tables, 2 threads.

    MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_MMAP_MAX_=0 python benchmarks/glue_overhead.py [--dtype bfloat16]

`--dtype mixed`: bfloat16 tables with the LayerNorm kept in float32.

Prints the median over blocks of each block's median call, in ms. To compare revisions, run it with
`PYTHONPATH=<worktree>/src` for each, one after the other (the VM's memory speed drifts: repeat both).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bertembed import BertEmbeddings, EmbeddingConfig
from bertembed.kernels import cpu, cpu_run
from bertembed.kernels.cpu_elements import dropout_threshold

SHAPES = [(32, 128), (1, 11)]


def candidates(batch: int, length: int, dtype: torch.dtype, norm: torch.dtype) -> dict:
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=30522, hidden_size=768), backend="cpu").eval().to(dtype)
    layer.LayerNorm.to(norm)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30522, (batch, length), generator=gen)
    types = torch.randint(0, 2, (batch, length), generator=gen)
    positions = torch.arange(length).repeat(batch)
    tables = (layer.word_embeddings.weight, layer.token_type_embeddings.weight, layer.position_embeddings.weight,
              layer.LayerNorm.weight, layer.LayerNorm.bias)
    n = batch * length
    out, mean, rstd = torch.empty(n, 768, dtype=dtype), torch.empty(n), torch.empty(n)
    kernel = cpu.forward if n * 768 >= cpu_run._PARALLEL_FROM else cpu.forward_serial
    arrays = [cpu_run._np(t) for t in (ids.reshape(-1), types.reshape(-1), positions, *tables[:3],
                                       *(t.float() for t in tables[3:]))]  # the kernel's LayerNorm: float32
    args = (*arrays, 1e-12, dropout_threshold(0.0), 1.0, np.uint64(0), cpu_run._np(out), cpu_run._np(mean),
            cpu_run._np(rstd), cpu_run.forward_chunks(n),
            cpu_run.stream_output(out, fresh=False))  # as run_forward does, for a buffer used again
    return {
        "module forward": lambda: layer(ids, types),
        "cpu_run.run_forward": lambda: cpu_run.run_forward(ids.reshape(-1), types.reshape(-1), positions, *tables,
                                                           1e-12, 0.0, 0),
        "kernel alone": lambda: kernel(*args),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "mixed"], default="float32",
                        help="the layer's dtype; mixed: bfloat16 tables, float32 LayerNorm")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with torch.no_grad():
        for batch, length in SHAPES:
            dtype = torch.bfloat16 if args.dtype == "mixed" else getattr(torch, args.dtype)
            steps = candidates(batch, length, dtype, torch.float32 if args.dtype == "mixed" else dtype)
            calls = 30 if batch * length > 100 else 2000
            medians = {name: [] for name in steps}
            for step in steps.values():
                step(), step()
            for _ in range(args.blocks):
                for name, step in steps.items():
                    times = []
                    for _ in range(calls):
                        start = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - start)
                    medians[name].append(np.median(times))
            line = "  ".join(f"{name} {np.median(m) * 1e3:.4f} ms" for name, m in medians.items())
            print(f"({batch}, {length}): {line}", flush=True)


if __name__ == "__main__":
    main()
