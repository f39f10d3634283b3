"""`bertembed inspect positions|segments|tokens TOKEN|onehot TEXT`: one analysis each, as a table, JSON or a PNG."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from bertembed.cli.app import MODEL_HELP, app, console, say_model, user_errors

inspect_app = typer.Typer(help="Measure one part of the embedding layer: positions, segments, tokens, one-hot.",
                          no_args_is_help=True)
app.add_typer(inspect_app, name="inspect")

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]
PlotOpt = Annotated[Optional[str], typer.Option("--plot", help="also write the figures to this PNG file "
                                                "(needs matplotlib: pip install 'bertembed\\[viz]')")]


def check_plot_path(plot: str | None) -> None:
    """Fail before any work when the PNG cannot be written."""
    if plot is not None:
        from bertembed.atomic import check_output

        check_output(plot)


def emit(result: Any, as_json: bool, plot: str | None, extra_rows: list[dict] | None = None,
         title: str = "", models: tuple = (None,)) -> None:
    """Print which checkpoint(s) were measured (`models`, as the command got them), then a result's summary (and rows,
    under `title`) as rich tables or JSON; write its figures to `plot`."""
    from bertembed.explain._common import label, to_jsonable
    from bertembed.explain.figures import specs_for
    from bertembed.sources import resolve

    summary = result.summary()
    if plot is not None:
        from bertembed.atomic import write_atomic
        from bertembed.explain.report import combined_png

        write_atomic(plot, combined_png(result))
    if as_json:
        print(json.dumps(to_jsonable({"summary": summary, "rows": extra_rows or []}), allow_nan=False))
        return
    for model in models:
        say_model(resolve(model))
    verdict, warning = summary.pop("verdict", None), summary.pop("warning", None)
    rows = [{"measure": label(k), "value": ", ".join(map(str, v)) if isinstance(v, list) else v}
            for k, v in summary.items()]
    console.print(_table(type(result).__name__, rows))
    if extra_rows:
        console.print(_table(title, extra_rows))
    if verdict:
        console.print(f"[bold]verdict:[/bold] {escape(verdict)}")
    if warning:
        console.print(f"[bold yellow]warning:[/bold yellow] {escape(warning)}")
    for spec in specs_for(result):
        console.print(f"[dim]{spec.title}: {escape(spec.caption(result))}[/dim]")
    if plot is not None:
        console.print(f"figures written to {plot}")


def _table(title: str, rows: list[dict]):
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
    with user_errors():
        from bertembed.explain.positions import analyze_positions

        check_plot_path(plot)
        emit(analyze_positions(model, k=k), as_json, plot, models=(model,))


@inspect_app.command()
def segments(text: Annotated[str, typer.Argument(help="a sentence to put in segment A, then in B")] =
             "The quick brown fox jumps over the lazy dog",
             text_b: Annotated[Optional[str], typer.Option("--text-b", help="a second text: also show the pair "
                                                           "TEXT + TEXT_B as one sequence")] = None,
             model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None) -> None:
    """What the two segment vectors are and what changes when a text moves from segment A to B."""
    with user_errors():
        from bertembed.explain.segments import analyze_segments

        check_plot_path(plot)
        result = analyze_segments(text, text_b, model)
        rows = [{"row": "AB"[i], **{f"[{j}]": v for j, v in enumerate(values)}}
                for i, values in enumerate(result.first_values)]
        emit(result, as_json, plot, rows, "the two rows' first values (not 0 and 1)", models=(model,))
        if result.pair_tokens and not as_json:
            console.print("the pair, one sequence (segment of each token): " + " ".join(
                escape(f"{t}/{'AB'[s]}") for t, s in zip(result.pair_tokens, result.pair_segments, strict=True)),
                soft_wrap=False)


@inspect_app.command()
def tokens(token: Annotated[str, typer.Argument(help="one vocabulary entry, e.g. king or ##ing")],
           model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
           k: Annotated[int, typer.Option("--k", "-k", min=1, help="how many neighbours")] = 10) -> None:
    """Nearest neighbours of a token, the [PAD] and special rows, and norms against vocabulary order."""
    with user_errors():
        from bertembed.explain.tokens import analyze_tokens

        check_plot_path(plot)
        result = analyze_tokens(token, model, k=k)
        emit(result, as_json, plot, result.neighbours, f"nearest neighbours of {result.token!r} by cosine",
             models=(model,))
        if not as_json:
            console.print(escape("special rows: " + ", ".join(f"{s['token']} (id {s['id']}) norm {s['norm']:.3f}"
                                                              for s in result.special)))


@inspect_app.command()
def onehot(text: Annotated[str, typer.Argument(help="the text whose ids are embedded both ways")],
           model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None) -> None:
    r"""Check that one_hot(ids) @ W equals the lookup W\[ids], and what each costs."""
    with user_errors():
        from bertembed.explain.onehot import analyze_onehot

        check_plot_path(plot)
        emit(analyze_onehot(text, model), as_json, plot, models=(model,))
