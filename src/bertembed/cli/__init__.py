"""The `bertembed` command line; its modules import heavy libraries only when a command runs."""

import os

# numpy's OpenBLAS on one thread for every command (before numpy loads; a user's setting wins): the matrices are
# small, even `explain --projector`'s [V, V] cosines. Medians of 9 runs at load 3.4-4.3 on 2 cores, against 2 threads:
# `inspect positions` 1.39 -> 0.95 s wall, `inspect onehot` 1.50 -> 0.81 s wall.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# each module registers its commands (or its group of them) on `app`
from bertembed.cli import bench, explain, export, surgery  # noqa: E402, F401
from bertembed.cli.app import app  # noqa: E402

main = app  # the console script: runs the command line on sys.argv
