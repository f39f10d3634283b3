"""Memory per rank of an embedding layer with a large word table, under tensor parallel (`shard_vocab`, loaded by
rank with `from_pretrained(device_mesh=...)`) and FSDP2 (`fully_shard`), against the world size; gloo on the CPU.

    python benchmarks/distributed_memory.py --vocab 250002 --hidden 1024 --worlds 1 2 3   # XLM-R: 1 GB in float32

Per rank: at rest (after a training step, before the next), the bytes of the parameters, their gradients and Adam's
two moments that the rank holds (a DTensor's local shard only), and its resident memory above what the process held
before the layer was made; and the peak resident memory of one step (forward, backward, Adam) above the same mark,
read from the kernel's high-water mark (VmHWM, reset before the step). Times across ranks on a machine with fewer
cores than ranks measure oversubscription, not scaling: they are not printed.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

import torch

MB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now; VmHWM: its peak since the last reset)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _step(layer, optimizer, vocab: int) -> None:
    ids = torch.randint(0, vocab, (8, 128), generator=torch.Generator().manual_seed(0))
    layer(ids).square().mean().backward()
    optimizer.step()


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (parameters, gradients, optimizer state): a DTensor's local shard only."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if isinstance(t, torch.Tensor))


def _rank(rank: int, world: int, port: int, mode: str, folder: str, vocab: int, queue) -> None:
    from bertembed import BertEmbeddings

    torch.set_num_threads(1)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
    warm = BertEmbeddings(backend="cpu").train()  # (numba's kernels loaded before the mark)
    _step(warm, torch.optim.AdamW(warm.parameters()), 30522)
    del warm
    mark = _status("VmRSS")
    if mode == "tp":
        layer = BertEmbeddings.from_pretrained(folder, device_mesh=mesh, backend="cpu").train()
    else:
        layer = BertEmbeddings.from_pretrained(folder, backend="cpu").train()
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.AdamW(layer.parameters(), foreach=False)
    _step(layer, optimizer, vocab)  # (Adam's state exists from the first step)
    params = list(layer.parameters())
    held = [local_bytes(params), local_bytes(p.grad for p in params),
            local_bytes(t for state in optimizer.state.values() for t in state.values())]
    rest = _status("VmRSS") - mark
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident memory now
    _step(layer, optimizer, vocab)
    queue.put((mode, world, rank, *held, rest, _status("VmHWM") - mark))
    if world > 1:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=250002)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    from bertembed import BertEmbeddings, EmbeddingConfig

    context = torch.multiprocessing.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config = EmbeddingConfig(vocab_size=args.vocab, hidden_size=args.hidden, max_position_embeddings=514,
                                 type_vocab_size=1)
        BertEmbeddings(config).save_pretrained(folder)
        for mode in ("tp", "fsdp2"):
            for world in args.worlds:
                if world == 1 and mode == "fsdp2":
                    continue  # (one process: the same layer as tensor parallel's world 1)
                queue, port = context.Queue(), _free_port()
                ranks = [context.Process(target=_rank, args=(r, world, port, mode, folder, args.vocab, queue))
                         for r in range(world)]
                for p in ranks:
                    p.start()
                rows += sorted(queue.get() for _ in ranks)
                for p in ranks:
                    p.join()
    table = args.vocab * args.hidden * 4 / MB
    print(f"word table {args.vocab} x {args.hidden} float32: {table:.0f} MiB; torch {torch.__version__}, "
          f"{os.cpu_count()} cores; MiB per rank")
    print("| engine | world | rank | parameters | gradients | Adam state | at rest (RSS) | peak of a step (RSS) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, world, rank, params, grads, adam, rest, peak in rows:
        name = "one process" if world == 1 else {"tp": "tensor parallel", "fsdp2": "FSDP2"}[mode]
        print(f"| {name} | {world} | {rank} | {params / MB:.0f} | {grads / MB:.0f} | {adam / MB:.0f} | "
              f"{rest / MB:.0f} | {peak / MB:.0f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
