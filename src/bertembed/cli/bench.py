"""`bertembed bench`: the embedding layer against transformers eager, torch.compile and ONNX Runtime, timed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from bertembed.cli.app import app, console, make_console, user_errors


def _shape(text: str) -> tuple[int, int]:
    """"64x512" -> (64, 512); the error names the option and the bad value."""
    b, _, n = text.lower().partition("x")
    if not (b.strip().isdigit() and n.strip().isdigit() and int(b) >= 1 and 1 <= int(n) <= 512):
        raise typer.BadParameter(f"takes BxL, such as 64x512, with B >= 1 and L from 1 to 512 (the rows of BERT's "
                                 f"position table); got {text!r}")
    return int(b), int(n)


def _dtype(text: str) -> str:
    from bertembed.bench.candidates import DTYPES  # (torch is imported when a command needs it, not before)

    if text not in DTYPES:
        raise typer.BadParameter(f"takes one of {', '.join(DTYPES)}; got {text!r}")
    return text


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="hidden 768, (B, L) = (1, 11) and (32, 128), float32, short "
                                        "timers")] = False,
    threads: Annotated[int, typer.Option(min=1, help="torch / ORT / numba threads")] = 2,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="write every measurement as JSON")] = None,
    markdown_out: Annotated[Optional[Path], typer.Option("--markdown", help="write the markdown report")] = None,
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option(help="auto: CPU, plus CUDA when visible")] = "auto",
    hidden: Annotated[Optional[list[int]], typer.Option(min=1, help="hidden sizes (repeat the option); default 384, "
                                                        "768, 1024")] = None,
    shape: Annotated[Optional[list[str]], typer.Option(parser=_shape, metavar="BxL", help="shapes, e.g. 64x512 "
                                                       "(repeat); default 1x11, 32x128, 8x512, 64x512")] = None,
    dtype: Annotated[Optional[list[str]], typer.Option(parser=_dtype, help="float32 (forward and training step), "
                                                       "bfloat16, float16 (forward) (repeat); default float32 and "
                                                       "bfloat16, float32 with --quick")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="rounds per case, each candidate timed once a round, in rotated "
                                        "order")] = 3,
    reference: Annotated[bool, typer.Option("--reference", help="time bertembed's reference layer too")] = False,
) -> None:
    """Time BERT's embedding layer: transformers eager and torch.compile, ONNX Runtime's fused op and bertembed's
    fused layer, interleaved in one process, with ratios against eager and the layer's three guards."""
    with user_errors(json_out, markdown_out):  # (the output files checked before a run of minutes, not after it)
        import torch

        from bertembed.atomic import write_atomic
        from bertembed.bench import measure
        from bertembed.bench.candidates import plan

        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    cpus, load = len(os.sched_getaffinity(0)), os.getloadavg()[0]
    notes = make_console(stderr=True)  # (stdout: the report alone, for `bertembed bench > report.md`)
    if threads > cpus:
        notes.print(f"[yellow]warning:[/yellow] --threads {threads} is more than the {cpus} CPUs it may use")
    if load > 0.3:
        notes.print(f"[yellow]warning:[/yellow] load average {load:.2f} before starting: other processes are "
                    "running, so the timings will be disturbed")
    done = measure.run(plan(quick, hidden, shape, dtype, device), threads, repeat, quick, reference,
                       progress=lambda line: print(line, file=sys.stderr))
    text = measure.markdown(done)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    from bertembed.explain._common import to_jsonable

    strict = json.dumps(to_jsonable(done), indent=1, allow_nan=False)  # (a NaN or inf measured: null)
    for path, content in ((json_out, strict), (markdown_out, text)):
        if path is not None:
            notes.print(f"wrote {write_atomic(path, content.encode('utf-8'))}")
