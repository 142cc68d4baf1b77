"""Checkpoints as files: the folder layout and Ray Train's commit record (driver and
workers), safe loading, and export of the weights (driver and the ``export`` command)."""
