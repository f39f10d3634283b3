"""The typer application shared by all commands, and the one place that turns errors into messages."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import typer
from rich.console import Console

from bertembed.sources import DEFAULT_MODEL

app = typer.Typer(help="BERT's input embedding layer: exact, fast, and explained.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
console = Console(highlight=False)


@app.callback()
def _group() -> None:
    """BERT's input embedding layer: exact, fast, and explained."""

err_console = Console(stderr=True, highlight=False)

MODEL_HELP = f"hub id, local folder or weights file; default: the bundled {DEFAULT_MODEL}"


def say_model(source, *, quiet: bool = False) -> None:
    """Name the checkpoint in use; when it is the bundled default, say how to pick bert-base-uncased instead."""
    if quiet:
        return
    console.print(f"model: {source.describe()}")
    if source.kind == "bundled":
        console.print("[dim]using the bundled default model; for BERT itself pass --model bert-base-uncased "
                      "(from the Hugging Face cache or hub)[/dim]")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Bad input ends the command with its message and exit status 2, not a traceback."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        yield
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as err:
        err_console.print(f"[bold red]error:[/bold red] {err}", soft_wrap=True)  # paths stay unbroken
        sys.exit(2)
