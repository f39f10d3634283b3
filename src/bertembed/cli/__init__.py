"""The `bertembed` command line. Each command lives in its own module and imports heavy libraries only when run."""

from __future__ import annotations

from bertembed.cli import explain  # noqa: F401  (registers the command)
from bertembed.cli.app import app


def main() -> None:
    app()
