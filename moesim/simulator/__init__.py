"""moesim engine: scenario config, hardware and cost model, SimPy processes, metrics and CLI.

Import the pieces you need from their modules (``simulator.config``, ``simulator.engine``,
``simulator.results``); this package initialiser stays light so that ``traces`` and
``policies`` can import ``simulator.errors`` without pulling in the engine.
"""

__version__ = "0.1.0"
