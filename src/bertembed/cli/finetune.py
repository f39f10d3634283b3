"""`bertembed finetune-demo`: a short, deterministic fine-tune that shows which rows of each table move."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from bertembed.cli.app import app, console, user_errors
from bertembed.cli.inspect import JsonOpt, ModelOpt, PlotOpt, check_plot_path, emit


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
    with user_errors():
        from bertembed.explain import finetune

        check_plot_path(plot)
        if save is not None:
            finetune.check_save_folder(save)  # before the demo's seconds of work, not after them
        bar, progress = rich_progress()
        with bar:
            result = finetune.finetune_demo(model, steps=steps, progress=None if as_json else progress, save=save)
        emit(result, as_json, plot, result.rows(), "rows moved per run and table", models=(model,))
        if save and not as_json:
            console.print(f"fine-tuned layer saved to {save}; try: bertembed drift {result.model} {save}")
