"""The typer application shared by all commands, and the one place that turns errors into messages."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from collections.abc import Iterator

import typer
from rich.console import Console

from bertembed.sources import DEFAULT_MODEL

app = typer.Typer(help="BERT's input embedding layer: exact, fast, and explained.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


def make_console(**options) -> Console:
    """A rich console. Into a pipe or a log (CI, `| tee`) rich assumes 80 columns, which cuts a wide table's numbers
    to "1…": there lines may run to 120 unless COLUMNS says otherwise."""
    made = Console(highlight=False, **options)
    if not made.is_terminal and "COLUMNS" not in os.environ:
        made.width = max(made.width, 120)
    return made


console = make_console()


@app.callback()
def _group() -> None:
    """BERT's input embedding layer: exact, fast, and explained."""

err_console = make_console(stderr=True)

MODEL_HELP = f"hub id, local folder or weights file; default: the bundled {DEFAULT_MODEL}"


def say_model(source, *, quiet: bool = False) -> None:
    """Name the checkpoint in use; when it is the bundled default, say how to pick bert-base-uncased instead."""
    if quiet:
        return
    console.print(f"model: {source.describe()}")
    if source.kind == "bundled":
        console.print("[dim]the bundled default is all-MiniLM-L6-v2 (BERT's architecture, fine-tuned for sentence "
                      "embeddings), not bert-base-uncased: for BERT itself pass --model bert-base-uncased (from the "
                      "Hugging Face cache or hub)[/dim]")


def _show_our_warnings() -> None:
    """bertembed's warnings (a fallback's reason) on stderr. Only bertembed's logger gets the handler: a root one would
    print again every library message that has its own handler (huggingface_hub's retries came out twice)."""
    ours = logging.getLogger("bertembed")
    if not any(getattr(h, "_bertembed", False) for h in ours.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler._bertembed = True
        ours.addHandler(handler)
        ours.setLevel(logging.WARNING)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Bad input ends the command with its message and exit status 2, not a traceback. Only input errors: a path or
    value the user gave, a checkpoint file that is broken, an optional package missing; anything else is a bug and
    keeps its traceback."""
    from rich.markup import escape

    from bertembed.config import NotInThisMember

    _show_our_warnings()
    try:
        yield
    except NotInThisMember as err:  # a fact about the member, not an input error: said, and the command succeeds
        console.print(escape(str(err)), soft_wrap=True)
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as err:
        _fail(str(err))
    except ImportError as err:  # an optional package the command needs (its message says which, and how to install)
        _fail(str(err))
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:
            raise
        name = str(err.filename or "a path")
        shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
        _fail(f"{shown} is too long for a file or folder name ({err.strerror}: a name may have at most 255 bytes "
              f"on most file systems); check the argument")


def _fail(message: str) -> None:
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)  # paths stay unbroken
    sys.exit(2)
