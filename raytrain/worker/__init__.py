"""The Ray Train worker processes: the train loop and what runs inside its Lightning Trainer
(checkpoints, metric reports, guards, system metrics, strategy, preemption notices).

The worker never imports ``raytrain.driver``: it gets everything it needs in one
``raytrain.contract.WorkerConfig`` (``tests/unit/test_boundaries.py`` holds it).
"""
