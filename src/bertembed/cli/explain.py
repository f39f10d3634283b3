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
) -> None:
    """Show how BERT's embedding layer builds each token's vector: word + position + segment, then LayerNorm."""
    with user_errors():
        from bertembed.explain.decompose import explain_text

        dec = explain_text(text, text_b, model, engine="torch" if use_torch else "numpy")
    rows = dec.rows()
    if as_json:
        print(json.dumps({"model": dec.source.name, "source": dec.source.describe(), "engine": dec.engine,
                          "tokens": rows, "max_abs_diff": dec.max_abs_diff}))
        return
    say_model(dec.source)
    console.print(_table(rows))
    verdict = "[green]equal[/green]" if dec.max_abs_diff < 1e-5 else "[red]NOT equal[/red]"
    console.print(f"check: LayerNorm(word + position + segment) by hand in float64 is {verdict} to the layer's "
                  f"output ({dec.engine}): max |diff| = {dec.max_abs_diff:.2e}")


def _table(rows: list[dict]):
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
        table.add_row(*(fmt.format(row[key]) for _, key, fmt in columns))
    return table
