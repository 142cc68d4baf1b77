"""The only place raytrain touches private APIs of Ray, Lightning, MLflow and torch.

One module per library (``ray_train``, ``ray_core``, ``lightning``, ``mlflow``,
``torch``); each says which release it was written for and what it relies on, and
``tests/unit/test_compat.py`` pins each of those, so an upgrade fails a fast test and not a
user's run. ``versions.check_supported`` refuses to start on releases outside the ranges.
``tests/unit/test_boundaries.py`` holds that no module outside this package names a private
API of another library.
"""
