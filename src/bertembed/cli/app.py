"""The typer application, the options its commands share, and the one place that turns errors into messages."""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from bertembed import __version__
from bertembed.sources import DEFAULT_MODEL, HubRequestFailed

# the commands in the order of a first tour (the README's): one text taken apart, each part, then the tools
TOUR = ("explain", "walkthrough", "notebook", "inspect", "drift", "finetune-demo", "export", "surgery", "bench")


class _Tour(TyperGroup):
    def list_commands(self, ctx) -> list[str]:  # (not in the order their modules happened to register them)
        return sorted(super().list_commands(ctx), key=lambda name: TOUR.index(name) if name in TOUR else len(TOUR))


app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=_Tour)


def _version(asked: bool) -> None:
    if asked:
        print(f"bertembed {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                   help="print bertembed's version and exit")] = False) -> None:
    """BERT's input embedding layer: exact, fast, and explained."""

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="hub id, local folder or weights file; "
                                                 f"default: the bundled {DEFAULT_MODEL}")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]
PlotOpt = Annotated[Optional[str], typer.Option("--plot", help="also write the figures to this PNG file "
                                                "(needs matplotlib: pip install -e \".\\[viz]\")")]
# the optional packages the commands use, each with the extra that installs it (".[cli]" installs them all)
EXTRAS = {"matplotlib": "viz", "plotly": "viz", "nbformat": "notebook", "numba": "fast", "onnx": "onnx",
          "onnxscript": "onnx", "onnxruntime": "onnx", "triton": "gpu"}


def make_console(**options) -> Console:
    """A rich console, 120 columns wide into a pipe unless COLUMNS says otherwise (rich's 80 cuts tables' numbers)."""
    made = Console(highlight=False, **options)
    if not made.is_terminal and "COLUMNS" not in os.environ:
        made.width = max(made.width, 120)
    return made


console = make_console()


def print_json(value: Any) -> None:
    """`value` as one line of strict JSON (no NaN) on stdout."""
    from bertembed.explain._common import to_jsonable

    print(json.dumps(to_jsonable(value), allow_nan=False))


def say_model(model) -> None:
    """Name the checkpoint in use (a `Source`, or --model as given), and for the bundled default how to get BERT's."""
    from bertembed.sources import resolve

    source = resolve(model)
    console.print(f"model: {source.describe()}")
    if source.kind == "bundled":
        console.print("[dim]the bundled default is all-MiniLM-L6-v2 (BERT's architecture, fine-tuned for sentence "
                      "embeddings), not bert-base-uncased: for BERT itself pass --model bert-base-uncased (from the "
                      "Hugging Face cache or hub)[/dim]")


def missing(names: list[str]) -> str:
    """The one line that says optional packages are missing, and which extra installs them."""
    extra = EXTRAS.get(names[0], "cli")
    return (f'this command needs {", ".join(names)}, not installed here: pip install -e ".[{extra}]" (the {extra} '
            f'extra; ".[cli]" installs what every command needs)')


@contextlib.contextmanager
def user_errors(*outputs: str | Path | None, needs: Iterable[str] = (), as_json: bool = False) -> Iterator[None]:
    """Bad input (a path or value, a broken checkpoint, a missing package) ends the command with its message and exit
    status 2, anything else keeps its traceback; `outputs` are checked writable first, then the `needs` imported. A
    table the member lacks is said (`as_json`: as {"summary": {"not_measured": ...}, "rows": []}), with the `outputs`
    left unwritten, and exits 0."""
    from bertembed.atomic import check_output
    from bertembed.config import NotInThisMember

    # bertembed's warnings on stderr, through its own logger only: a root handler would repeat other libraries' lines
    ours = logging.getLogger("bertembed")
    if not any(getattr(h, "_bertembed", False) for h in ours.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler._bertembed = True
        ours.addHandler(handler)
        ours.setLevel(logging.WARNING)
    try:
        for path in outputs:
            if path is not None:
                check_output(path)
        gone = []
        for name in needs:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as err:  # (the package itself, or one it needs: onnxscript needs onnx)
                gone.append(err.name or name)
        if gone:
            raise ImportError(missing(list(dict.fromkeys(gone))))
        yield
    except ModuleNotFoundError as err:  # (one that `needs` did not name: said the same way)
        _fail(missing([err.name]) if err.name in EXTRAS else str(err))
    except NotInThisMember as err:  # a fact about the member, not an input error: said, and the command succeeds
        unwritten = ", ".join(str(path) for path in outputs if path is not None)
        said = f"{err}; nothing written to {unwritten}" if unwritten else str(err)
        if as_json:
            print_json({"summary": {"not_measured": said}, "rows": []})
        else:
            console.print(escape(said), soft_wrap=True)
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ImportError,
            HubRequestFailed) as err:
        if isinstance(err, ImportError) and err.name is not None:  # ("cannot import name": a bug, shown as one)
            raise
        _fail(str(err))
    except OSError as err:
        if str(err).startswith("cannot save to "):  # (a full disk, an I/O error: `atomic.save_error` names the target)
            _fail(str(err))
        if err.errno != errno.ENAMETOOLONG:
            raise
        name = str(err.filename or "a path")
        shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
        _fail(f"{shown} is too long for a file or folder name ({err.strerror}: a name may have at most 255 bytes "
              f"on most file systems); check the argument")


def _fail(message: str) -> None:
    make_console(stderr=True).print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)  # paths unbroken
    sys.exit(2)
