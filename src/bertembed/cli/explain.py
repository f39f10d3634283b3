"""`bertembed explain TEXT [TEXT_B]`: one sentence taken apart by the embedding layer."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from bertembed.cli.app import MODEL_HELP, app, console, say_model, user_errors


@app.command()
def explain(
    text: Annotated[str, typer.Argument(help="the sentence to explain (segment A)")],
    text_b: Annotated[Optional[str], typer.Argument(help="an optional second sentence (segment B)")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of a table")] = False,
    use_torch: Annotated[bool, typer.Option("--torch", help="run the torch BertEmbeddings module "
                                            "(slower start) instead of the torch-free numpy path")] = False,
    report: Annotated[Optional[str], typer.Option("--report", help="also write a self-contained HTML report of "
                                                  "every analysis (needs torch and matplotlib)")] = None,
    plots: Annotated[Optional[str], typer.Option("--plots", help="also write every figure as a PNG into this "
                                                 "folder (needs matplotlib)")] = None,
    finetune: Annotated[bool, typer.Option("--finetune", help="with --report or --plots: also run the fine-tune "
                                           "demo (seconds, needs torch)")] = False,
) -> None:
    """Show how BERT's embedding layer builds each token's vector: word + position + segment, then LayerNorm."""
    with user_errors():
        from bertembed.explain.decompose import explain_text

        if report is not None:
            from bertembed.atomic import check_output

            check_output(report)
        if plots is not None:
            from bertembed.explain.report import check_folder

            check_folder(plots)
        dec = explain_text(text, text_b, model, engine="torch" if use_torch else "numpy")
        if finetune and report is None and plots is None:
            raise ValueError("--finetune adds the fine-tune demo to --report or --plots; give one of them (or run "
                             "bertembed finetune-demo)")
        if report is not None or plots is not None:
            _write_extras(text, text_b, model, report, plots, quiet=as_json, finetune=finetune)
    rows = dec.rows()
    if as_json:
        from bertembed.explain._common import to_jsonable

        print(json.dumps(to_jsonable({"model": dec.source.name, "source": dec.source.describe(), "engine": dec.engine,
                                      "tokens": rows, "max_abs_diff": dec.max_abs_diff}), allow_nan=False))
        return
    say_model(dec.source)
    console.print(_table(rows))
    verdict = "[green]equal[/green]" if dec.max_abs_diff < 1e-5 else "[red]NOT equal[/red]"
    console.print(f"check: LayerNorm(word + position + segment) by hand in float64 is {verdict} to the layer's "
                  f"output ({dec.engine}): max |diff| = {dec.max_abs_diff:.2e}")


def _table(rows: list[dict]):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="BERT embedding layer, one row per token", title_justify="left",
                  caption="|w| |p| |s|: norms of the word, position and segment vectors; mean, std: LayerNorm's "
                          "statistics of their sum; |out|: norm of the output", caption_justify="left")
    columns = [("pos", "position", "{}"), ("token", "token", "{}"), ("id", "id", "{}"), ("seg", "segment", "{}"),
               ("|w|", "word_norm", "{:.3f}"), ("|p|", "position_norm", "{:.3f}"), ("|s|", "segment_norm", "{:.3f}"),
               ("mean", "ln_mean", "{:+.4f}"), ("std", "ln_std", "{:.4f}"), ("|out|", "output_norm", "{:.2f}")]
    for header, _, _ in columns:
        table.add_column(header, justify="left" if header == "token" else "right", no_wrap=header != "token")
    for row in rows:
        table.add_row(*(escape(fmt.format(row[key])) for _, key, fmt in columns))  # tokens like [unused0]
    return table


def _write_extras(text: str, text_b: str | None, model: str | None, report: str | None, plots: str | None,
                  quiet: bool, finetune: bool) -> None:
    """Run every analysis (with a progress bar for the fine-tune), then write the report and/or the PNGs."""
    from bertembed.cli.finetune import rich_progress
    from bertembed.explain import report as reporting

    bar, progress = rich_progress()
    with bar:
        results = reporting.run_analyses(text, text_b, model, finetune=finetune,
                                         progress=None if quiet else progress)
    pngs = reporting.render_all(results)
    if plots is not None:
        written = reporting.write_plots(results, plots, pngs)
        if not quiet:
            console.print(f"{len(written)} figures written to {plots}")
    if report is not None:
        reporting.write_report(reporting.build_report(results, pngs=pngs), report)
        if not quiet:
            console.print(f"report written to {report}")
