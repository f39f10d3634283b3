"""The `bertembed` command line. Each command lives in its own module and imports heavy libraries only when run."""

from __future__ import annotations

import bertembed.cli.bench  # noqa: F401  (registers bench)
import bertembed.cli.drift  # noqa: F401  (registers drift)
import bertembed.cli.export  # noqa: F401  (registers the export group)
import bertembed.cli.finetune  # noqa: F401  (registers finetune-demo)
import bertembed.cli.inspect  # noqa: F401  (registers the inspect group)
import bertembed.cli.surgery  # noqa: F401  (registers the surgery group)
import bertembed.cli.walkthrough  # noqa: F401  (registers walkthrough and notebook)
from bertembed.cli import explain  # noqa: F401  (registers the command)
from bertembed.cli.app import app


def main() -> None:
    app()
