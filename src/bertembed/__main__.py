"""`python -m bertembed` runs the command line."""

from bertembed.cli import main

main()
