"""The `bertembed` command line; its modules import heavy libraries only when a command runs."""

# each module registers its commands (or its group of them) on `app`
from bertembed.cli import bench, explain, export, surgery  # noqa: F401
from bertembed.cli.app import app

main = app  # the console script: runs the command line on sys.argv
