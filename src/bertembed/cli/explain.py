"""The commands of `bertembed.explain`: `explain TEXT [TEXT_B]` (one text taken apart), `walkthrough` and `notebook`
(the layer rebuilt by hand), `inspect positions|segments|tokens|onehot`, `drift A B` and `finetune-demo` (one
analysis each, as a table, JSON or a PNG)."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from bertembed.cli.app import JsonOpt, ModelOpt, PlotOpt, app, console, print_json, say_model, user_errors

inspect_app = typer.Typer(help="Measure one part of the embedding layer: positions, segments, tokens, one-hot.",
                          no_args_is_help=True)
app.add_typer(inspect_app, name="inspect")
FOX = "The quick brown fox jumps over the lazy dog"


def plotting(plot: str | None, as_json: bool):
    """`user_errors` for a command with --plot: matplotlib is needed only where a PNG is asked for."""
    return user_errors(plot, needs=("matplotlib",) if plot is not None else (), as_json=as_json)


def emit(result: Any, as_json: bool, plot: str | None, rows: list[dict] | None = None, title: str = "",
         sources: tuple = ()) -> None:
    """Print a result (the checkpoints `sources`, its summary, `rows` under `title`): tables or JSON; PNGs to `plot`."""
    from bertembed.explain._common import label

    summary = result.summary()
    if plot is not None:
        from bertembed.atomic import write_atomic
        from bertembed.explain.report import combined_png

        write_atomic(plot, combined_png(result))
    if as_json:
        return print_json({"summary": summary, "rows": rows or []})
    for source in sources or (result.source,):
        say_model(source)
    verdict, warning = summary.pop("verdict", None), summary.pop("warning", None)
    console.print(f"[bold]{escape(result.question)}[/bold] [dim]({result.tag})[/dim]")
    console.print(rows_table("", [{"measure": label(k), "value": ", ".join(map(str, v)) if isinstance(v, list) else
                                   v} for k, v in summary.items()]))
    if rows:
        console.print(rows_table(title, rows))
    if verdict:
        console.print(f"[bold]verdict:[/bold] {escape(verdict)}")
    if warning:
        console.print(f"[bold yellow]warning:[/bold yellow] {escape(warning)}")
    for figure in result.figures():
        console.print(f"[dim]{figure.title}: {escape(figure.caption)}[/dim]")
    if plot is not None:
        console.print(f"figures written to {plot}")


def rows_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]] | None = None, caption: str = ""):
    """`rows` as a rich table, a column a key and numbers to 4 digits; or the `columns` as (header, key, format)."""
    from rich.table import Table

    from bertembed.explain._common import label

    table = Table(title=title or None, title_justify="left", caption=caption or None, caption_justify="left")
    for header, _, _ in columns or []:  # (folded on a narrow terminal: a cut token or number loses what it says)
        table.add_column(header, justify="left" if header == "token" else "right", overflow="fold")
    for col in [] if columns else rows[0]:
        table.add_column(label(str(col)), overflow="fold")
    for row in rows:  # (escaped: tokens like [unused0] are not rich markup)
        table.add_row(*(escape(fmt.format(row[key])) for _, key, fmt in columns) if columns else
                      (f"{v:.4g}" if isinstance(v, float) else escape(str(v)) for v in row.values()))
    return table


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


@app.command()
def explain(
    text: Annotated[str, typer.Argument(help="the sentence to explain (segment A)")],
    text_b: Annotated[Optional[str], typer.Argument(help="an optional second sentence (segment B)")] = None,
    model: ModelOpt = None,
    as_json: JsonOpt = False,
    use_torch: Annotated[bool, typer.Option("--torch", help="run the torch BertEmbeddings module "
                                            "(slower start) instead of the torch-free numpy path")] = False,
    report: Annotated[Optional[str], typer.Option("--report", help="also write a self-contained HTML report of "
                                                  "every analysis, its figures interactive (needs plotly)")] = None,
    plots: Annotated[Optional[str], typer.Option("--plots", help="also write every figure as a PNG into this "
                                                 "folder (needs matplotlib)")] = None,
    token: Annotated[Optional[str], typer.Option("--token", help="with --report or --plots: the word whose nearest "
                                                 "rows are shown (default: the text's first word)")] = None,
    projector: Annotated[bool, typer.Option("--projector", help="with --report or --plots: also the whole word "
                                            "table in 2-D, searchable in the report (its neighbours found once per "
                                            "checkpoint, ~20 s, then cached)")] = False,
    finetune: Annotated[bool, typer.Option("--finetune", help="with --report or --plots: also run the fine-tune "
                                           "demo (seconds, needs torch)")] = False,
) -> None:
    """Show how the embedding layer builds each token's vector: the rows of its word, position and segment tables
    (those the member has) summed, then LayerNorm."""
    figures = report is not None or plots is not None
    needs = ("plotly",) * (report is not None) + ("matplotlib",) * (plots is not None)
    with user_errors(report, needs=needs):
        from bertembed.atomic import write_atomic
        from bertembed.explain import report as reporting
        from bertembed.explain.decompose import explain_text

        folder = reporting.check_folder(plots) if plots is not None else None
        for flag, given, what in (("--finetune", finetune, "the fine-tune demo"), ("--token", token, "a word's "
                                  "nearest rows"), ("--projector", projector, "the word table's projector")):
            if given is not None and given is not False and not figures:
                raise ValueError(f"{flag} adds {what} to --report or --plots; give one of them")
        engine = "torch" if use_torch else "numpy"
        if not figures:
            dec = explain_text(text, text_b, model, engine=engine)
        else:  # every analysis, on the checkpoint read once (the torch engine reads its own tables)
            bar, progress = rich_progress()
            with bar:
                results = reporting.run_analyses(text, text_b, model, token=token, projector=projector,
                                                 finetune=finetune, progress=None if as_json else progress)
            dec = explain_text(text, text_b, results[0].source, engine=engine) if use_torch else results[0]
            if report is not None:  # (first: the one file, so a report that cannot be saved leaves no PNGs behind)
                write_atomic(report, reporting.report_html(results).encode("utf-8"))
                if not as_json:
                    console.print(f"report written to {report}")
            if folder is not None:  # one PNG per figure, named after it (e.g. position_similarity.png)
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                except OSError as err:  # (a dangling link on the way, a parent made read-only since the check)
                    raise ValueError(f"--plots {plots}: cannot create the folder ({err.strerror})") from err
                written = [write_atomic(folder / f"{f.name}.png", f.png()) for r in results for f in r.figures()]
                if not as_json:
                    console.print(f"{len(written)} figures written to {plots}")
    rows = dec.rows()
    if as_json:
        return print_json({"model": dec.source.name, "source": dec.source.describe(), "engine": dec.engine,
                           "tokens": rows, "max_abs_diff": dec.max_abs_diff, "warning": dec.warning})
    say_model(dec.source)
    # a column for each part the member has (no |s| for DeBERTa v3)
    norms = [(f"|{part[0]}|", f"{part}_norm", "{:.3f}") for part in dec.parts]
    named = " and ".join(filter(None, (", ".join(dec.parts[:-1]), dec.parts[-1])))
    columns = [("pos", "position", "{}"), ("token", "token", "{}"), ("id", "id", "{}"),
               *[("seg", "segment", "{}")] * ("segment" in dec.parts), *norms, ("mean", "ln_mean", "{:+.4f}"),
               ("std", "ln_std", "{:.4f}"), ("|out|", "output_norm", "{:.2f}")]
    console.print(f"[bold]{escape(dec.question)}[/bold] [dim]({dec.tag})[/dim]")
    console.print(rows_table(f"{dec.recipe}, one row per token", rows, columns, f"{' '.join(h for h, _, _ in norms)}: "
                             f"norms of the {named} vectors; mean, std: LayerNorm's statistics of their sum; |out|: "
                             f"norm of the output"))
    verdict = "[green]equal[/green]" if dec.max_abs_diff < 1e-5 else "[red]NOT equal[/red]"
    console.print(f"check: {dec.recipe} by hand in float64 is {verdict} to the layer's output ({dec.engine}): "
                  f"max |diff| = {dec.max_abs_diff:.2e}")
    if dec.warning:
        console.print(f"[bold yellow]warning:[/bold yellow] {escape(dec.warning)}")


@app.command()
def walkthrough(text: Annotated[str, typer.Argument(help="the text (segment A)")],
                text_b: Annotated[Optional[str], typer.Argument(
                    help="a second text (segment B), making a pair")] = None,
                model: ModelOpt = None, as_json: JsonOpt = False,
                rows: Annotated[int, typer.Option(min=1, help="how many tokens' rows each step shows")] = 16) -> None:
    """Rebuild the layer's output by hand, step by step, each step checked against the member's own transformers
    module (or, without transformers, bertembed's numpy reference)."""
    with user_errors():
        from rich.syntax import Syntax

        from bertembed.explain.walkthrough import check_walkthrough
        from bertembed.explain.walkthrough import walkthrough as run

        result = run(text, text_b, model)
        if as_json:
            print_json(result.summary())
        else:
            say_model(result.source)
            console.print(f"the layer's recipe: {result.member}'s; each step checked against {result.reference} "
                          f"(ref: its intermediates)")
            if result.warning:
                console.print(f"[bold yellow]warning:[/bold yellow] {escape(result.warning)}")
            for step in result.steps:
                console.rule(f"[bold]{escape(step.title)}[/bold]")
                console.print(escape(step.why))
                console.print(Syntax(step.code, "python", theme="ansi_dark", background_color="default"))
                console.print(rows_table("", step.preview[:rows]))
                shown = "every token" if len(step.preview) <= rows else f"the first {rows} tokens (--rows N for more)"
                console.print(f"shape {step.shape}; {shown}")
                for note in step.notes:
                    console.print(escape(note))
                console.print(f"check: {escape(step.check)}")
        if failed := check_walkthrough(result):
            raise ValueError(f"the step(s) {failed} differ from the layer where they should be exact: a bug, please "
                             f"report it")


@app.command()
def notebook(out: Annotated[str, typer.Argument(help="the .ipynb file to write")], model: ModelOpt = None,
             text: Annotated[str, typer.Option(help="the text the notebook starts with")] = FOX,
             text_b: Annotated[Optional[str], typer.Option("--text-b", help="a second text (segment B), making a "
                                                           "pair")] = None) -> None:
    """Write a Jupyter notebook that rebuilds the layer by hand in cells you can edit (needs nbformat)."""
    with user_errors(needs=("nbformat",)):
        from bertembed.explain.walkthrough import write_notebook

        written = write_notebook(out, model, text, text_b)
        say_model(model)
        console.print(f"wrote {written}")


@inspect_app.command()
def positions(model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
              k: Annotated[int, typer.Option("--k", "-k", min=1,
                                             help="how many low-frequency cosines to fit")] = 16) -> None:
    """Are the learned position embeddings sinusoidal? Similarity structure, components, spectrum, seams."""
    with plotting(plot, as_json):
        from bertembed.explain.positions import analyze_positions

        emit(analyze_positions(model, k=k), as_json, plot)


@inspect_app.command()
def segments(text: Annotated[str, typer.Argument(help="a sentence to put in segment A, then in B")] = FOX,
             text_b: Annotated[Optional[str], typer.Option("--text-b", help="a second text: also show the pair "
                                                           "TEXT + TEXT_B as one sequence")] = None,
             model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None) -> None:
    """What the two segment vectors are and what changes when a text moves from segment A to B."""
    with plotting(plot, as_json):
        from bertembed.explain.segments import analyze_segments

        result = analyze_segments(text, text_b, model)
        rows = [{"row": "AB"[i], **{f"[{j}]": v for j, v in enumerate(values)}}
                for i, values in enumerate(result.first_values)]
        what = "zeros and ones" if result.zeros_and_ones else "not 0 and 1"
        emit(result, as_json, plot, rows, f"the two rows' first values ({what})")
        if result.pair_tokens and not as_json:
            console.print("the pair, one sequence (segment of each token): " + escape(" ".join(  # (once: a span
                f"{t}/{'AB'[s]}" for t, s in zip(result.pair_tokens, result.pair_segments, strict=True))))  # of tokens)


@inspect_app.command()
def tokens(token: Annotated[str, typer.Argument(help="a vocabulary entry (king, ##ing), or a word of up to 16 pieces")],
           model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
           k: Annotated[int, typer.Option("--k", "-k", min=1, help="how many neighbours")] = 10) -> None:
    """Nearest neighbours of a token, the [PAD] and special rows, and norms against vocabulary order."""
    with plotting(plot, as_json):
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
    with plotting(plot, as_json):
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
    with plotting(plot, as_json):
        from bertembed.explain.drift import drift

        result = drift(model_a, model_b, top=top)
        rows = result.rows()  # (the table without the long lists of rows, which follow it one tensor a line)
        shown = rows if as_json else [{k: v for k, v in r.items() if k != "most_changed"} for r in rows]
        emit(result, as_json, plot, shown, "drift per tensor", (result.source_a, result.source_b))
        for row in [] if as_json else rows:
            if row["most_changed"]:
                console.print(f"{escape(row['table'])}, most changed rows: {escape(row['most_changed'])}")


@app.command("finetune-demo")
def finetune_demo(
    model: ModelOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="optimiser steps per run")] = 12,
    save: Annotated[Optional[str], typer.Option(help="save the Adam run's fine-tuned layer to this new (or empty) "
                                                "folder, whole or not at all (compare it with `bertembed "
                                                "drift`)")] = None,
) -> None:
    """Fine-tune the embedding layer on a few sentences with Adam, AdamW and a frozen table; count rows moved."""
    with plotting(plot, as_json):
        from bertembed.explain import finetune

        bar, progress = rich_progress()
        with bar:
            result = finetune.finetune_demo(model, steps=steps, progress=None if as_json else progress, save=save)
        emit(result, as_json, plot, result.rows(), "rows moved per run and table")
        if save and not as_json:
            console.print(f"fine-tuned layer saved to {save}; try: bertembed drift {result.model} {save}")
