"""``python -m raytrain ...``: the CLI, for a Ray job's entrypoint (from a working dir that is
a raytrain checkout, or a cluster with raytrain installed)."""

from raytrain.cli.app import run

run()
