"""The driver process: checks a spec against the world, starts or joins Ray, keeps the run
folder's lease and records, builds the trainer and reports progress.

Nothing here imports Lightning at module level: a bad spec is refused before Ray or
Lightning load (``tests/unit/test_boundaries.py`` holds it).
"""
