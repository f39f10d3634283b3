"""`bertembed inspect positions|segments|tokens TOKEN|onehot TEXT`, `drift A B` and `finetune-demo`: one analysis
each, as a table, JSON or a PNG."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from bertembed.cli.app import JsonOpt, ModelOpt, PlotOpt, app, console, print_json, say_model, user_errors

inspect_app = typer.Typer(help="Measure one part of the embedding layer: positions, segments, tokens, one-hot.",
                          no_args_is_help=True)
app.add_typer(inspect_app, name="inspect")


def emit(result: Any, as_json: bool, plot: str | None, extra_rows: list[dict] | None = None, title: str = "",
         sources: tuple = ()) -> None:
    """Name the checkpoint(s) measured (`sources`, default the result's), then print a result's summary (and rows,
    under `title`) as rich tables or JSON, and write its figures to `plot`."""
    from bertembed.explain._common import label

    summary = result.summary()
    if plot is not None:
        from bertembed.atomic import write_atomic
        from bertembed.explain.report import combined_png

        write_atomic(plot, combined_png(result))
    if as_json:
        print_json({"summary": summary, "rows": extra_rows or []})
        return
    for source in sources or (result.source,):
        say_model(source)
    verdict, warning = summary.pop("verdict", None), summary.pop("warning", None)
    rows = [{"measure": label(k), "value": ", ".join(map(str, v)) if isinstance(v, list) else v}
            for k, v in summary.items()]
    console.print(rows_table(result.question, rows))
    if extra_rows:
        console.print(rows_table(title, extra_rows))
    if verdict:
        console.print(f"[bold]verdict:[/bold] {escape(verdict)}")
    if warning:
        console.print(f"[bold yellow]warning:[/bold yellow] {escape(warning)}")
    for figure in result.figures():
        console.print(f"[dim]{figure.title}: {escape(figure.caption)}[/dim]")
    if plot is not None:
        console.print(f"figures written to {plot}")


def plotting(plot: str | None):
    """`user_errors` for a command with --plot: the PNG's folder, and matplotlib where a PNG is asked for, checked
    before any work."""
    return user_errors(plot, needs=("matplotlib",) if plot is not None else ())


def rows_table(title: str, rows: list[dict]):
    from rich.table import Table

    from bertembed.explain._common import label

    table = Table(title=title or None, title_justify="left")
    for col in rows[0]:
        table.add_column(label(str(col)), overflow="fold")
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else escape(str(v)) for v in row.values()))
    return table


@inspect_app.command()
def positions(model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
              k: Annotated[int, typer.Option("--k", "-k", min=1,
                                             help="how many low-frequency cosines to fit")] = 16) -> None:
    """Are the learned position embeddings sinusoidal? Similarity structure, spectrum, positions past 128."""
    with plotting(plot):
        from bertembed.explain.positions import analyze_positions

        emit(analyze_positions(model, k=k), as_json, plot)


@inspect_app.command()
def segments(text: Annotated[str, typer.Argument(help="a sentence to put in segment A, then in B")] =
             "The quick brown fox jumps over the lazy dog",
             text_b: Annotated[Optional[str], typer.Option("--text-b", help="a second text: also show the pair "
                                                           "TEXT + TEXT_B as one sequence")] = None,
             model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None) -> None:
    """What the two segment vectors are and what changes when a text moves from segment A to B."""
    with plotting(plot):
        from bertembed.explain.segments import analyze_segments

        result = analyze_segments(text, text_b, model)
        rows = [{"row": "AB"[i], **{f"[{j}]": v for j, v in enumerate(values)}}
                for i, values in enumerate(result.first_values)]
        emit(result, as_json, plot, rows, "the two rows' first values (not 0 and 1)")
        if result.pair_tokens and not as_json:
            console.print("the pair, one sequence (segment of each token): " + " ".join(
                escape(f"{t}/{'AB'[s]}") for t, s in zip(result.pair_tokens, result.pair_segments, strict=True)),
                soft_wrap=False)


@inspect_app.command()
def tokens(token: Annotated[str, typer.Argument(help="one vocabulary entry, e.g. king or ##ing")],
           model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
           k: Annotated[int, typer.Option("--k", "-k", min=1, help="how many neighbours")] = 10) -> None:
    """Nearest neighbours of a token, the [PAD] and special rows, and norms against vocabulary order."""
    with plotting(plot):
        from bertembed.explain.tokens import analyze_tokens

        result = analyze_tokens(token, model, k=k)
        emit(result, as_json, plot, result.neighbours, f"nearest neighbours of {result.token!r} by cosine")
        if not as_json:
            console.print(escape("special rows: " + ", ".join(f"{s['token']} (id {s['id']}) norm {s['norm']:.3f}"
                                                              for s in result.special)))


@inspect_app.command()
def onehot(text: Annotated[str, typer.Argument(help="the text whose ids are embedded both ways")],
           model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None) -> None:
    r"""Check that one_hot(ids) @ W equals the lookup W\[ids], and what each costs."""
    with plotting(plot):
        from bertembed.explain.onehot import analyze_onehot

        emit(analyze_onehot(text, model), as_json, plot)


@app.command("drift")
def drift_command(
    model_a: Annotated[str, typer.Argument(help="the first checkpoint (hub id, folder or weights file)")],
    model_b: Annotated[str, typer.Argument(help="the second checkpoint, same architecture")],
    as_json: JsonOpt = False, plot: PlotOpt = None,
    top: Annotated[int, typer.Option(min=0, help="how many most-changed rows to list per table")] = 10,
) -> None:
    """Relative change of each embedding tensor between two checkpoints, and the rows that changed most."""
    with plotting(plot):
        from bertembed.explain.drift import drift

        result = drift(model_a, model_b, top=top)
        rows = result.rows()  # (the table without the long lists of rows, which follow it one tensor a line)
        shown = rows if as_json else [{k: v for k, v in r.items() if k != "most_changed"} for r in rows]
        emit(result, as_json, plot, shown, "drift per tensor", (result.source_a, result.source_b))
        for row in [] if as_json else rows:
            if row["most_changed"]:
                console.print(f"{escape(row['table'])}, most changed rows: {escape(row['most_changed'])}")


def rich_progress():
    """A rich progress bar and the `progress(run, step, steps)` callback that advances it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True)
    tasks: dict[str, int] = {}

    def progress(run: str, step: int, steps: int) -> None:
        if run not in tasks:
            tasks[run] = bar.add_task(run, total=steps)
        bar.update(tasks[run], completed=step)

    return bar, progress


@app.command("finetune-demo")
def finetune_demo(
    model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="optimiser steps per run")] = 12,
    save: Annotated[Optional[str], typer.Option(help="save the Adam run's fine-tuned layer to this new (or empty) "
                                                "folder, whole or not at all (compare it with `bertembed "
                                                "drift`)")] = None,
) -> None:
    """Fine-tune the embedding layer on a few sentences with Adam, AdamW and a frozen table; count rows moved."""
    with plotting(plot):
        from bertembed.explain import finetune

        bar, progress = rich_progress()
        with bar:
            result = finetune.finetune_demo(model, steps=steps, progress=None if as_json else progress, save=save)
        emit(result, as_json, plot, result.rows(), "rows moved per run and table")
        if save and not as_json:
            console.print(f"fine-tuned layer saved to {save}; try: bertembed drift {result.model} {save}")
