"""The ``raytrain`` command line (the user's process): argument parsing, then the public API."""

from raytrain.cli.app import main, run

__all__ = ["main", "run"]
