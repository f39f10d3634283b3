"""`bertembed bench`: the embedding layer against transformers eager, torch.compile and ONNX Runtime, timed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from bertembed.cli.app import app, console, user_errors

Many = Optional[list[str]]
BENCH_NEEDS = ("numba", "onnx", "onnxruntime")  # bertembed's fused CPU layer; ONNX Runtime's fused op


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="hidden 768, (B, L) = (1, 11) and (32, 128), float32, short "
                                        "timers, the steady allocator only")] = False,
    threads: Annotated[int, typer.Option(help="torch / ORT / numba threads")] = 2,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="write every measurement as JSON")] = None,
    markdown_out: Annotated[Optional[Path], typer.Option("--markdown", help="write the markdown report")] = None,
    allocator: Annotated[Optional[str], typer.Option(help="glibc malloc condition: steady (no trim, no mmap), "
                                                     "default, or both; one this process was not started in runs "
                                                     "in a child process; default: steady with --quick, else "
                                                     "both")] = None,
    device: Annotated[str, typer.Option(help="auto (CPU, plus CUDA when visible), cpu or cuda")] = "auto",
    hidden: Annotated[Optional[list[int]], typer.Option(help="hidden sizes (repeat the option); default 384, 768, "
                                                        "1024")] = None,
    shape: Annotated[Many, typer.Option(help="BxL shapes, e.g. 64x512 (repeat); default 1x11, 32x128, 8x512, "
                                        "64x512")] = None,
    dtype: Annotated[Many, typer.Option(help="float32 (forward and training step), bfloat16, float16 (forward) "
                                        "(repeat); default float32 and bfloat16, float32 with --quick")] = None,
    repeat: Annotated[int, typer.Option(help="rounds per case, each candidate timed once a round, in rotated "
                                        "order")] = 3,
    reference: Annotated[bool, typer.Option("--reference", help="time bertembed's reference layer too")] = False,
) -> None:
    """Time BERT's embedding layer: transformers eager and torch.compile, ONNX Runtime's fused op and bertembed's
    fused layer, interleaved in one process, with ratios against eager (needs the bench extra)."""
    # the output files and packages checked before a run of minutes, not after it
    with user_errors(json_out, markdown_out, needs=BENCH_NEEDS, extra="bench"):
        from bertembed.atomic import write_atomic
        from bertembed.bench import measure, report

        options = measure.Options(quick=quick, threads=threads, allocator=allocator, device=device,
                                  hiddens=tuple(hidden) if hidden else None, shapes=shapes(shape),
                                  dtypes=tuple(dtype) if dtype else None, repeat=repeat, reference=reference)
    for warning in measure.disturbances(threads, os.getloadavg()[0], len(os.sched_getaffinity(0))):
        console.print(f"[yellow]warning: {warning}[/yellow]")
    started = time.perf_counter()
    done = report.finish(measure.run(options))
    done["wall_seconds"] = time.perf_counter() - started
    for line in report.summary(done):
        console.print(line, markup=False, soft_wrap=True)
    console.print(f"wall time {done['wall_seconds']:.0f} s; {done['machine']['cpu']}, {threads} threads")
    for path, text in ((json_out, lambda: json.dumps(done, indent=1)), (markdown_out, lambda: report.markdown(done))):
        if path is not None:
            console.print(f"wrote {write_atomic(path, text().encode('utf-8'))}")


def shapes(given: list[str] | None) -> tuple[tuple[int, int], ...] | None:
    """"64x512" -> (64, 512), each; a ValueError that names the bad one."""
    parsed = [text.lower().split("x") for text in given or ()]
    for text, parts in zip(given or (), parsed, strict=True):
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--shape takes BxL, such as 64x512; got {text!r}")
    return tuple((int(b), int(n)) for b, n in parsed) or None
