"""`bertembed explain TEXT [TEXT_B]`: one sentence taken apart by the embedding layer; `bertembed walkthrough TEXT
[TEXT_B]` and `bertembed notebook OUT.ipynb`: the layer rebuilt by hand, step by step."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.markup import escape

from bertembed.cli.app import JsonOpt, ModelOpt, app, console, print_json, say_model, user_errors
from bertembed.cli.inspect import rich_progress, rows_table


@app.command()
def walkthrough(text: Annotated[str, typer.Argument(help="the text (segment A)")],
                text_b: Annotated[Optional[str], typer.Argument(
                    help="a second text (segment B), making a pair")] = None,
                model: ModelOpt = None, as_json: JsonOpt = False) -> None:
    """Rebuild the layer's output by hand, step by step, each step checked against the layer's own intermediate."""
    with user_errors():
        from bertembed.explain.walkthrough import check_walkthrough
        from bertembed.explain.walkthrough import walkthrough as run

        result = run(text, text_b, model)
        if as_json:
            print_json(result.summary())
        else:
            say_model(result.source)
            _show(result)
        failed = check_walkthrough(result)
        if failed:
            raise ValueError(f"the step(s) {failed} differ from the layer where they should be exact: a bug, please "
                             f"report it")


def _show(result) -> None:
    from rich.syntax import Syntax

    console.print(f"the layer's recipe: {result.member}'s")
    for step in result.steps:
        console.rule(f"[bold]{escape(step.title)}[/bold]")
        console.print(escape(step.why))
        console.print(Syntax(step.code, "python", theme="ansi_dark", background_color="default"))
        console.print(rows_table(f"shape {step.shape}; the first rows and values", step.preview))
        for note in step.notes:
            console.print(escape(note))
        console.print(f"check: {escape(step.check)}")


@app.command()
def notebook(out: Annotated[str, typer.Argument(help="the .ipynb file to write")], model: ModelOpt = None,
             text: Annotated[str, typer.Option(help="the text the notebook starts with")] =
             "The quick brown fox jumps over the lazy dog") -> None:
    """Write a Jupyter notebook that rebuilds the layer by hand in cells you can edit (needs nbformat)."""
    with user_errors(needs=("nbformat",)):
        from bertembed.explain.walkthrough import write_notebook

        written = write_notebook(out, model, text)
        say_model(model)
        console.print(f"wrote {written}")


@app.command()
def explain(
    text: Annotated[str, typer.Argument(help="the sentence to explain (segment A)")],
    text_b: Annotated[Optional[str], typer.Argument(help="an optional second sentence (segment B)")] = None,
    model: ModelOpt = None,
    as_json: JsonOpt = False,
    use_torch: Annotated[bool, typer.Option("--torch", help="run the torch BertEmbeddings module "
                                            "(slower start) instead of the torch-free numpy path")] = False,
    report: Annotated[Optional[str], typer.Option("--report", help="also write a self-contained HTML report of "
                                                  "every analysis (needs torch and matplotlib)")] = None,
    plots: Annotated[Optional[str], typer.Option("--plots", help="also write every figure as a PNG into this "
                                                 "folder (needs matplotlib)")] = None,
    finetune: Annotated[bool, typer.Option("--finetune", help="with --report or --plots: also run the fine-tune "
                                           "demo (seconds, needs torch)")] = False,
) -> None:
    """Show how the embedding layer builds each token's vector: the rows of its word, position and segment tables
    (those the member has) summed, then LayerNorm."""
    figures = report is not None or plots is not None
    with user_errors(report, needs=("matplotlib",) if figures else ()):
        from bertembed.atomic import write_atomic
        from bertembed.explain import report as reporting
        from bertembed.explain.decompose import explain_text

        if plots is not None:
            reporting.check_folder(plots)
        if finetune and not figures:
            raise ValueError("--finetune adds the fine-tune demo to --report or --plots; give one of them (or run "
                             "bertembed finetune-demo)")
        engine = "torch" if use_torch else "numpy"
        if not figures:
            dec = explain_text(text, text_b, model, engine=engine)
        else:  # every analysis, on the checkpoint read once (the torch engine reads its own tables)
            bar, progress = rich_progress()
            with bar:
                results = reporting.run_analyses(text, text_b, model, finetune=finetune,
                                                 progress=None if as_json else progress)
            dec = explain_text(text, text_b, results[0].source, engine=engine) if use_torch else results[0]
            drawn = [reporting.render_figures(r) for r in results]
            if plots is not None:
                written = reporting.write_plots(drawn, plots)
                if not as_json:
                    console.print(f"{len(written)} figures written to {plots}")
            if report is not None:
                write_atomic(report, reporting.report_html(results, drawn).encode("utf-8"))
                if not as_json:
                    console.print(f"report written to {report}")
    rows = dec.rows()
    if as_json:
        print_json({"model": dec.source.name, "source": dec.source.describe(), "engine": dec.engine, "tokens": rows,
                    "max_abs_diff": dec.max_abs_diff})
        return
    say_model(dec.source)
    console.print(_token_table(rows, dec))
    verdict = "[green]equal[/green]" if dec.max_abs_diff < 1e-5 else "[red]NOT equal[/red]"
    console.print(f"check: {dec.recipe} by hand in float64 is {verdict} to the layer's output ({dec.engine}): "
                  f"max |diff| = {dec.max_abs_diff:.2e}")


def _token_table(rows: list[dict], dec):
    """The rows as a table titled with the member's recipe, a column for each part it has (no |s| for DeBERTa v3)."""
    from rich.table import Table

    norms = [(f"|{part[0]}|", f"{part}_norm", "{:.3f}") for part in dec.parts]
    named = " and ".join(filter(None, (", ".join(dec.parts[:-1]), dec.parts[-1])))
    table = Table(title=f"{dec.recipe}, one row per token", title_justify="left", caption_justify="left",
                  caption=f"{' '.join(h for h, _, _ in norms)}: norms of the {named} vectors; mean, std: LayerNorm's "
                          f"statistics of their sum; |out|: norm of the output")
    columns = [("pos", "position", "{}"), ("token", "token", "{}"), ("id", "id", "{}"),
               *[("seg", "segment", "{}")] * ("segment" in dec.parts), *norms, ("mean", "ln_mean", "{:+.4f}"),
               ("std", "ln_std", "{:.4f}"), ("|out|", "output_norm", "{:.2f}")]
    for header, _, _ in columns:
        table.add_column(header, justify="left" if header == "token" else "right", no_wrap=header != "token")
    for row in rows:
        table.add_row(*(escape(fmt.format(row[key])) for _, key, fmt in columns))  # tokens like [unused0]
    return table
