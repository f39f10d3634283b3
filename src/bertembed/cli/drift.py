"""`bertembed drift A B`: per table, how far two checkpoints of the same architecture differ."""

from __future__ import annotations

from typing import Annotated

import typer

from bertembed.cli.app import app, user_errors
from bertembed.cli.inspect import JsonOpt, PlotOpt, check_plot_path, emit


@app.command("drift")
def drift_command(
    model_a: Annotated[str, typer.Argument(help="the first checkpoint (hub id, folder or weights file)")],
    model_b: Annotated[str, typer.Argument(help="the second checkpoint, same architecture")],
    as_json: JsonOpt = False, plot: PlotOpt = None,
    top: Annotated[int, typer.Option(min=0, help="how many most-changed rows to list per table")] = 10,
) -> None:
    """Relative change of each embedding tensor between two checkpoints, and the rows that changed most."""
    with user_errors():
        from bertembed.explain.drift import drift

        check_plot_path(plot)
        result = drift(model_a, model_b, top=top)
        emit(result, as_json, plot, result.rows(), "drift per tensor", models=(model_a, model_b))
