"""`bertembed bench`: the embedding layer against transformers eager, torch.compile and ONNX Runtime, timed."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from bertembed.cli.app import app, console, err_console, user_errors

_RESULT_STYLE = {"pass": "green", "miss": "red"}


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="hidden 768, (B, L) = (1, 11) and (32, 128), short timers, "
                                        "the steady allocator only: 25-30 s once compiled, 46-51 s on a fresh "
                                        "install (2 vCPUs)")] = False,
    threads: Annotated[int, typer.Option("--threads", help="torch / ORT / numba threads")] = 2,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="write every measurement as JSON")] = None,
    markdown_out: Annotated[Optional[Path], typer.Option("--markdown", help="write the markdown report "
                                                         "(for BENCHMARKS.md)")] = None,
    allocator: Annotated[Optional[str], typer.Option("--allocator", help="glibc malloc condition: steady (no trim, "
                                                     "no per-allocation mmap), default, or both (each in its own "
                                                     "process); default: steady with --quick, else both")] = None,
    device: Annotated[str, typer.Option("--device", help="auto (CPU, plus CUDA when visible), cpu, or cuda (the "
                                        "CUDA sweep alone, one allocator condition)")] = "auto",
    hidden: Annotated[Optional[list[int]], typer.Option("--hidden", help="only these hidden sizes (repeat the "
                                                         "option for several); default 384, 768, 1024")] = None,
    shape: Annotated[Optional[list[str]], typer.Option("--shape", help="only these BxL shapes, e.g. 64x512 (repeat "
                                                       "for several); default 1x11, 32x128, 8x512, 64x512")] = None,
    isolate: Annotated[Optional[bool], typer.Option("--isolate/--no-isolate", help="one process per candidate, "
                                                    "so no other thread pool is alive while one is timed; "
                                                    "default: on for the full run, off for --quick")] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="time everything this many times, the candidates' order "
                                        "rotated each round, and report the median round (for a machine whose "
                                        "speed drifts)")] = 1,
) -> None:
    """Time BERT's embedding layer: transformers eager and torch.compile, ONNX Runtime's fused op, bertembed's
    reference and fused paths, against the machine's copy bandwidth; check the issue's targets."""
    with user_errors():
        from bertembed.bench.runner import BenchOptions, count_steps, plan_cases

        options = BenchOptions(quick=quick, threads=threads, allocator=allocator, device=device, isolate=isolate,
                               rounds=rounds, hiddens=tuple(hidden) if hidden else None, shapes=_shapes(shape))
        cases = plan_cases(options)
        from bertembed.explain.report import check_output

        for path in (json_out, markdown_out):  # before a run of minutes, not after it
            if path is not None:
                check_output(path)
    for warning in disturbances(threads, os.getloadavg()[0], _usable_cpus()):
        console.print(f"[yellow]warning: {warning}[/yellow]")
    started = time.perf_counter()
    report: dict = {}
    stopped = _run_with_progress(options, cases, count_steps(options, cases), report)
    report["wall_seconds"] = time.perf_counter() - started
    _report(report, stopped, json_out, markdown_out)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as taskset or a container sets it), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def disturbances(threads: int, load: float, cpus: int) -> list[str]:
    """Why a run's timings would not be the machine's own: more threads than CPUs, or other processes running."""
    found = []
    if threads > cpus:
        found.append(f"--threads {threads} is more than the {cpus} CPUs this process may use, so threads will wait "
                     f"for time slices and the timings will not be the machine's")
    if load > 0.3:
        found.append(f"load average {load:.2f} before starting: other processes are running, so {threads}-thread "
                     f"timings will be disturbed (parallel regions wait for time slices)")
    return found


def _report(report: dict, stopped: str | None, json_out: Path | None, markdown_out: Path | None) -> None:
    """Save and print a run's report; exit with status 130 (interrupted) or 1 when the run stopped early or a file
    could not be written where asked."""
    status = 0 if not stopped else 130 if stopped.startswith("interrupted") else 1
    if stopped and not any(c["results"] for c in report.get("conditions", {}).values()):
        err_console.print(f"[bold red]error:[/bold red] {stopped}, before any result", soft_wrap=True)
        raise typer.Exit(status)
    saved = _save(report, json_out, markdown_out)
    _print_summary(report)
    if stopped:
        err_console.print(f"[bold red]error:[/bold red] {stopped}; the results measured before it are above"
                          + (" and in the files written" if json_out or markdown_out else ""), soft_wrap=True)
    if status or not saved:
        raise typer.Exit(status or 1)


def _save(report: dict, json_out: Path | None, markdown_out: Path | None) -> bool:
    """Write the JSON and the markdown report, each all or nothing. One that cannot be written (the disk filled up or
    the folder went away during the run) goes to a new file in the temporary folder instead, which is named: the run
    is never lost. Returns whether every file went where it was asked to."""
    from bertembed.bench.report import markdown
    from bertembed.explain.report import write_atomic

    saved = True
    for path, render in ((json_out, lambda: json.dumps(report, indent=1)), (markdown_out, lambda: markdown(report))):
        if path is None:
            continue
        text = render()
        try:
            console.print(f"wrote {write_atomic(path, text.encode('utf-8'))}")
        except (OSError, ValueError) as err:
            fd, spare = tempfile.mkstemp(prefix="bertembed-bench-", suffix=path.suffix)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            why = err if isinstance(err, ValueError) else f"cannot write {path}: {err.strerror or err}"
            err_console.print(f"[bold red]error:[/bold red] {why}; it is in {spare} instead", soft_wrap=True)
            saved = False
    return saved


def _shapes(given: list[str] | None) -> tuple[tuple[int, int], ...] | None:
    """"64x512" -> (64, 512), each; a ValueError that names the bad one."""
    if not given:
        return None
    shapes = []
    for text in given:
        parts = text.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--shape takes BxL, such as 64x512; got {text!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(shapes)


def _run_with_progress(options, cases, total: int, report: dict) -> str | None:
    """Run the bench into `report` under a progress bar. Returns None, or why it stopped early (Ctrl-C, a worker that
    failed), with `report` made a report of what was measured before (`runner.finish_partial`)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bertembed.bench.runner import finish_partial, run_bench

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("bench", total=total)

        def advance(record: dict) -> None:
            turn = f" (round {record.get('round', 0) + 1}/{options.rounds})" if options.rounds > 1 else ""
            progress.update(task, advance=1,
                            description=f"{record['condition']}{turn}: {record['key']} {record['candidate']}")

        try:
            run_bench(options, advance, report)
        except KeyboardInterrupt:
            stopped = "interrupted (Ctrl-C)"
        except RuntimeError as err:  # a worker process failed: its stderr's tail is in the message
            err_console.print(str(err), soft_wrap=True, markup=False)
            stopped = str(err).splitlines()[0].rstrip(":")
        else:
            return None
    finish_partial(report, stopped)
    return stopped


def _print_summary(report: dict) -> None:
    from rich.table import Table

    from bertembed.bench.report import by_case

    for name, condition in report["conditions"].items():
        bandwidth = condition["meta"].get("bandwidth_bytes_per_s", {})
        table = Table(title=f"allocator {name}; copy bandwidth "
                      + ", ".join(f"{d} {b / 1e9:.1f} GB/s" for d, b in bandwidth.items()), title_justify="left")
        for column in ("case", "candidate", "ms", "IQR ms", "GB/s", "peak/out"):
            table.add_column(column, justify="left" if column in ("case", "candidate") else "right", no_wrap=True)
        notes: dict[str, str] = {}
        for r in by_case(condition["results"]):
            c = r["case"]
            case = (f"{'' if c['device'] == 'cpu' else c['device'] + ' '}H{c['hidden']} {c['batch']}x{c['length']} "
                    f"{c['mode']}{'' if c['dtype'] == 'float32' else ' ' + c['dtype']}")
            if r["status"] != "ok":
                notes[f"{r['candidate']} {r['status']}"] = r.get("note", "")
                table.add_row(case, r["candidate"], r["status"], "", "", "")
                continue
            gbs, peak = r.get("achieved_bytes_per_s"), r.get("peak_bytes")
            peak_text = "" if peak is None else f"{peak / r['output_bytes']:.2f}x"
            table.add_row(case, r["candidate"], f"{r['median_s'] * 1e3:.3f}", f"{r['iqr_s'] * 1e3:.3f}",
                          f"{gbs / 1e9:.1f}" if gbs else "", peak_text)
        console.print(table)  # the long lines below are left whole (soft wrap), for the terminal or log to wrap
        for what, note in notes.items():
            console.print(f"  [dim]{what}: {note}[/dim]", soft_wrap=True)
        console.print(f"targets ({name}):")
        for row in report["targets"][name]:
            style = _RESULT_STYLE.get(row["result"], "yellow")
            value = "" if row["value"] is None else row["shown"] + " "
            why = f" ({row['why']})" if row["why"] else ""
            console.print(f"  [{style}]{row['result']}[/{style}] {row['target']}: {value}(goal {row['goal']}){why}",
                          soft_wrap=True)
    console.print(f"[dim]wall time {report['wall_seconds']:.0f} s; machine {report['machine']['cpu']}, "
                  f"{report['threads']} threads[/dim]")
