"""`bertembed surgery ...`: checkpoint SRC rewritten into a new folder DST with more positions, added tokens, or a
pruned vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bertembed.cli.app import JsonOpt, app, console, print_json, user_errors

surgery_app = typer.Typer(help="Rewrite a whole checkpoint: longer positions, added tokens, a pruned vocabulary.",
                          no_args_is_help=True)
app.add_typer(surgery_app, name="surgery")

SrcArg = Annotated[str, typer.Argument(help="the checkpoint to read: a folder or hub id (never changed)")]
DstArg = Annotated[Path, typer.Argument(help="the new checkpoint folder to write (must not exist)")]


def _report(result: dict, as_json: bool, lines: list[str]) -> None:
    if as_json:
        print_json(result)
        return
    if result["dropped_files"]:
        lines.append(f"left out of DST (copies of the old model in other formats, or files this cannot edit): "
                     f"{', '.join(result['dropped_files'])}")
    console.print(escape("\n".join(lines)), soft_wrap=True)


@surgery_app.command("extend-positions")
def extend_positions(src: SrcArg, dst: DstArg,
                     to: Annotated[int, typer.Option("--to", help="positions a sequence may use after")],
                     method: Annotated[str, typer.Option(help="copy, interpolate, repeat_last or sinusoidal")] = "copy",
                     as_json: JsonOpt = False) -> None:
    """Grow the position table so the model takes inputs of --to tokens (RoBERTa's reserved rows kept on top)."""
    with user_errors():
        from bertembed.checkpoint_surgery import extend_positions_checkpoint

        with console.status("reading, extending and writing the checkpoint"):
            result = extend_positions_checkpoint(src, dst, to, method)
        kept = "old rows moved by design (interpolate)" if method == "interpolate" else \
            "old rows and short inputs' outputs unchanged bit for bit"
        _report(result, as_json, [
            f"positions {result['positions_before']} -> {result['positions_after']} by {method} (table rows "
            f"{result['rows_before']} -> {result['rows_after']}); {kept}",
            f"wrote {result['destination']} (config.json and tokenizer_config.json's model_max_length updated)"])


@surgery_app.command("add-tokens")
def add_tokens(src: SrcArg, dst: DstArg,
               tokens: Annotated[Optional[list[str]], typer.Argument(help="the tokens to add")] = None,
               file: Annotated[Optional[Path], typer.Option("--file", help="a file of tokens, one a line")] = None,
               init: Annotated[str, typer.Option(help="pieces (mean of the rows it split into), mean or normal")] =
               "pieces",
               seed: Annotated[int, typer.Option(min=0, max=2**63 - 1, help="seeds the rows --init mean and normal "
                                                 "draw: the same seed writes the same DST")] = 0,
               as_json: JsonOpt = False) -> None:
    """Add tokens to the tokenizer and rows for them to the word table (and a tied or untied MLM decoder)."""
    with user_errors():
        import torch

        from bertembed.vocab_surgery import add_tokens_checkpoint, text_batches

        wanted = list(tokens or [])
        if file is not None:
            wanted += [line.strip() for batch in text_batches(file, "--file", "one token a line") for line in batch]
        if not wanted:
            raise ValueError(f"no tokens given{f' (--file {file} has none)' if file else ''}: name them after DST, or "
                             f"pass --file with one token a line")
        torch.manual_seed(seed)  # (the Python API draws from torch's global generator, as transformers' resize does)
        with console.status("reading, resizing and writing the checkpoint"):
            result = add_tokens_checkpoint(src, dst, wanted, init)
        how = {t: f"from the rows of pieces {p}" for t, p in result["pieces"].items()} if init == "pieces" else {}
        lines = [f"{token!r}: id {i}, {how.get(token, f'row by {init} (seed {seed})')}"
                 for token, i in result["added"].items()]
        if result["already_present"]:
            lines.append(f"already in the tokenizer, not added: {', '.join(result['already_present'])}")
        lines.append(f"rows {result['rows_before']} -> {result['rows_after']} in {', '.join(result['resized'])}; "
                     f"wrote {result['destination']}")
        _report(result, as_json, lines)


@surgery_app.command("prune-vocab")
def prune_vocab(src: SrcArg, dst: DstArg,
                keep_from: Annotated[list[Path], typer.Option("--keep-from", help="a corpus: a text file (one text a "
                                                              "line) or a folder of them; repeat for more")],
                target_size: Annotated[Optional[int], typer.Option(min=1, help="keep the N tokens the corpus uses "
                                                                   "most (and the specials)")] = None,
                min_frequency: Annotated[int, typer.Option(min=1, help="keep tokens the corpus uses K times or more")]
                = 1,
                held_out: Annotated[Optional[Path], typer.Option(help="a text file or folder: report the share of its "
                                                                 "tokens that become unknown")] = None,
                as_json: JsonOpt = False) -> None:
    """Keep only the special tokens and the tokens a corpus uses; ids renumbered in the tokenizer and every table."""
    with user_errors():
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        from bertembed.vocab_surgery import prune_vocab_checkpoint

        with Progress(TextColumn("tokenizing the corpus"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                      console=console, transient=True, disable=as_json or not console.is_terminal) as bar:
            task = bar.add_task("", total=None)
            result = prune_vocab_checkpoint(src, dst, keep_from, target_size=target_size, min_frequency=min_frequency,
                                            held_out=held_out, progress=lambda done, total: bar.update(
                                                task, completed=done, total=total))
        mb = {k: f"{result[f'bytes_{k}'] / 1e6:,.1f} MB" for k in ("before", "after")}
        lines = [f"vocabulary {result['rows_before']} -> {result['rows_after']} rows (from {result['corpus_tokens']:,} "
                 f"tokens in {result['corpus_lines']:,} corpus lines); parameters {result['parameters_before']:,} -> "
                 f"{result['parameters_after']:,}, {mb['before']} -> {mb['after']}"]
        if "held_out_tokens" in result:
            share = {k: "no unknown token" if (v := result[f"held_out_unknown_{k}"]) is None else f"{v:.3%}"
                     for k in ("before", "after")}
            lines.append(f"held-out text: {result['held_out_tokens']:,} tokens, unknown {share['after']} (before "
                         f"{share['before']})")
        _report(result, as_json, [*lines, f"wrote {result['destination']}"])
