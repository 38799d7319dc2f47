"""Conveyor's plumbing: config, wire types, queues, DataFlow graph, runner, CLI.

Nothing here imports model code; stages are named by import path.
"""

__version__ = "0.1.0"
