"""Datasets: ``sources`` reads splits on the driver (or into Ray Data), ``loaders`` cuts each
worker's batches from them in the order ``order`` decides (pure, importing nothing else of
this package)."""
