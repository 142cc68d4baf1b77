"""Preflight for the classes a LightningCLI config names: the model's arguments, the
DataModule, ``trainer.callbacks``, ``trainer.logger``, ``optimizer`` and ``lr_scheduler``.

They are parsed by LightningCLI's own parser (``raytrain.spec.lightning_config``): each class
must import, be of its kind and take its ``init_args``, nested ``class_path`` blocks too,
and a problem is jsonargparse's reason after the full field path. Without a ``data``
section the model must make its own train loader.

Parsing imports Lightning and the classes' modules on the driver (seconds), so
``check_classes`` parses before Ray only for specs that name classes beside a plain model
(``lightning_config.needs_lightning``); a plain model's arguments are parsed while Ray
starts (``preflight.check_model``). A DataModule's module is first looked for without
running it (``source_check``), as the model's is: a DataModule that cannot be found is
refused without importing Lightning.
"""

from __future__ import annotations

from raytrain.driver import source_check
from raytrain.spec import DataModuleSpec, JobSpec
from raytrain.util.imports import import_object


def check_classes(spec: JobSpec) -> list[str]:
    """Every problem with the classes the spec names (see the module docstring), each
    naming its field."""
    if isinstance(spec.data, DataModuleSpec):
        missing = source_check.module_problem(spec.data.class_path)
        if missing:
            return [f"data.class_path: {missing}"]
    problems: list[str] = []
    from raytrain.spec import lightning_config

    if lightning_config.needs_lightning(spec):
        problems += lightning_config.config_problems(spec)
    if spec.data is None and not problems:
        problems += _check_own_loaders(spec)
    return problems


def _import_class(path: str) -> type | None:
    try:
        value = import_object(path)
    except (Exception, SystemExit):
        return None
    return value if isinstance(value, type) else None


def _check_own_loaders(spec: JobSpec) -> list[str]:
    """No ``data``: the model must define ``train_dataloader``."""
    import lightning.pytorch as pl

    cls = _import_class(spec.model.class_path)
    if cls is None or not issubclass(cls, pl.LightningModule):
        return []  # the model's own check says why
    if cls.train_dataloader is pl.LightningModule.train_dataloader:
        return [
            f"data: missing, and {spec.model.class_path} defines no train_dataloader: give "
            "data files (data.train), a LightningDataModule (data.class_path), or define "
            "the model's train_dataloader"
        ]
    return []
