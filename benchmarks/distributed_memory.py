"""Memory per rank of a BERT with a large word table, under tensor parallel (`shard_vocab`) and FSDP2 (`fully_shard`),
against the world size; gloo ranks as processes on the CPU.

    python benchmarks/distributed_memory.py --vocab 200000 --hidden 512 --layers 1 --worlds 1 2 3   # a 391 MiB table

Each rank builds the same model (a transformers BertModel patched with bertembed's CPU kernel, `--layers` encoder
layers), shards it, and takes one training step (forward, backward of the outputs' mean square; with `--adam`, an
AdamW step too) on the same (8, 128) ids (tensor parallel) or its part of 8 x world sequences (FSDP2). Per rank: the
bytes of parameters, gradients and Adam's moments the rank holds (a DTensor's local shard only); at rest: its resident
memory after the model is built and sharded, above what the process held before; the step's peak: the growth of the
kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs after the model is built and sharded) over one
step, and that growth over one process's. Times across ranks on a machine with fewer cores than ranks measure
oversubscription, not scaling: they are not printed.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys

import torch

MB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now; VmHWM: its peak since the last reset)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _model(vocab: int, hidden: int, layers: int):
    import transformers

    import bertembed

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden)
    return bertembed.patch(transformers.BertModel(config, add_pooling_layer=False), backend="cpu").train()


def _sharded(model, engine: str, mesh):
    if mesh is not None and engine == "tp":
        from bertembed.parallel import shard_vocab

        shard_vocab(model, mesh)
    elif mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.embeddings, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _step(model, optimizer, vocab: int, batch: int) -> None:
    ids = torch.randint(0, vocab, (batch, 128), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).last_hidden_state.square().mean().backward()
    if optimizer is not None:
        optimizer.step()


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (parameters, gradients, optimizer state): a DTensor's local shard only."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if isinstance(t, torch.Tensor))


def _rank(rank: int, world: int, port: int, engine: str, args, queue) -> None:
    torch.set_num_threads(1)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
    # a small model through the same engine first: numba's kernels, transformers' and torch's distributed modules
    # loaded, and gloo's buffers made, before the mark
    warm = _sharded(_model(1000, 64, 1), engine, mesh)
    _step(warm, None, 1000, 2)
    del warm
    mark = _status("VmRSS")
    model = _sharded(_model(args.vocab, args.hidden, args.layers), engine, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False) if args.adam else None
    if world > 1:  # (rank 0 scatters the tables: every rank past it, its buffers freed, before the marks)
        torch.distributed.barrier()
    gc.collect()
    rest = _status("VmRSS") - mark
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident memory now
    before = _status("VmRSS")
    _step(model, optimizer, args.vocab, 8)
    peak = _status("VmHWM") - before
    params = list(model.parameters())
    adam = [] if optimizer is None else [t for state in optimizer.state.values() for t in state.values()]
    queue.put((engine, world, rank, local_bytes(params), local_bytes(p.grad for p in params), local_bytes(adam), rest,
               peak))
    if world > 1:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=200000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--adam", action="store_true", help="an AdamW step in the training step")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--engines", nargs="+", default=["tp", "fsdp2"], choices=["tp", "fsdp2"])
    args = parser.parse_args()
    context = torch.multiprocessing.get_context("spawn")
    rows = []
    for engine in args.engines:
        for world in args.worlds:
            if world == 1 and engine != args.engines[0]:
                continue  # (one process: the same model whatever the engine)
            queue, port = context.Queue(), _free_port()
            ranks = [context.Process(target=_rank, args=(r, world, port, engine, args, queue)) for r in range(world)]
            for p in ranks:
                p.start()
            rows += sorted(queue.get() for _ in ranks)
            for p in ranks:
                p.join()
    one = next((peak for _, world, _, *_, peak in rows if world == 1), None)
    table = args.vocab * args.hidden * 4 / MB
    optimizer = "AdamW" if args.adam else "no optimizer"
    print(f"BERT, {args.layers} layers, word table {args.vocab} x {args.hidden} float32: {table:.0f} MiB; {optimizer}; "
          f"torch {torch.__version__}, {os.cpu_count()} cores; MiB per rank")
    print("| engine | world | rank | parameters | gradients | Adam state | at rest (RSS) | peak growth of a step (RSS) "
          "| over one process's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for engine, world, rank, params, grads, adam, rest, peak in rows:
        name = "one process" if world == 1 else {"tp": "tensor parallel", "fsdp2": "FSDP2"}[engine]
        ratio = f"{peak / one:.2f}x" if one else "-"
        print(f"| {name} | {world} | {rank} | {params / MB:.0f} | {grads / MB:.0f} | {adam / MB:.0f} | "
              f"{rest / MB:.0f} | {peak / MB:.0f} | {ratio} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
