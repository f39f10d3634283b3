"""`bertembed walkthrough TEXT [TEXT_B]` and `bertembed notebook OUT.ipynb`: the layer rebuilt by hand, step by step."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bertembed.cli.app import app, console, say_model, user_errors
from bertembed.cli.inspect import JsonOpt, ModelOpt, _table

TextArg = Annotated[str, typer.Argument(help="the text (segment A)")]
TextBArg = Annotated[Optional[str], typer.Argument(help="a second text (segment B), making a pair")]


@app.command()
def walkthrough(text: TextArg, text_b: TextBArg = None, model: ModelOpt = None, as_json: JsonOpt = False) -> None:
    """Rebuild the layer's output by hand, step by step, each step checked against the layer's own intermediate."""
    with user_errors():
        from bertembed.explain._common import to_jsonable
        from bertembed.explain.walkthrough import check_walkthrough
        from bertembed.explain.walkthrough import walkthrough as run
        from bertembed.sources import resolve

        result = run(text, text_b, model)
        if as_json:
            print(json.dumps(to_jsonable(result.summary()), allow_nan=False))
        else:
            say_model(resolve(model))
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
        console.print(_table(f"shape {step.shape}; the first rows and values", step.preview))
        for note in step.notes:
            console.print(escape(note))
        console.print(f"check: {escape(step.check)}")


@app.command()
def notebook(out: Annotated[str, typer.Argument(help="the .ipynb file to write")], model: ModelOpt = None,
             text: Annotated[str, typer.Option(help="the text the notebook starts with")] =
             "The quick brown fox jumps over the lazy dog") -> None:
    """Write a Jupyter notebook that rebuilds the layer by hand in cells you can edit (needs nbformat)."""
    with user_errors():
        from bertembed.explain.walkthrough import write_notebook
        from bertembed.sources import resolve

        say_model(resolve(model))
        console.print(f"wrote {write_notebook(out, model, text)}")
