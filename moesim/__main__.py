"""``python -m moesim``: the command line."""

from moesim.cli import main

main()
