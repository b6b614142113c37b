"""``python -m moesim``: the command line."""

from moesim.simulator.cli import main

main()
