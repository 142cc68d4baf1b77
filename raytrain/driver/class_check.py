"""Preflight for the classes a LightningCLI config names beside the model: the DataModule,
``trainer.callbacks``, ``trainer.logger``, ``optimizer`` and ``lr_scheduler``.

Each must import, be a class of its kind, and take its ``init_args``: checked against its
constructor's signature, with the arguments raytrain supplies itself (an optimizer's
parameters, a scheduler's optimizer) standing in. A ModelCheckpoint is refused: raytrain
owns checkpoints. Without a ``data`` section the model must make its own train loader.

These imports run Lightning on the driver (seconds), so ``check_classes`` imports only for
specs that name such classes (or no data); a file-data job without them costs nothing. A
DataModule's module is first looked for without running it (``source_check``), as the
model's is: a DataModule that cannot be found is refused without importing Lightning.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from raytrain.driver import source_check
from raytrain.imports import OLD_NAMESPACE_HINT, import_object, old_namespace
from raytrain.spec import ClassSpec, DataModuleSpec, JobSpec

# What the first positional parameter of each kind is given by raytrain, not the config.
SUPPLIED = {"optimizer": 1, "lr_scheduler": 1}


def _bases() -> dict[str, tuple[type, ...]]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import Logger

    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    return {
        "data": (pl.LightningDataModule,),
        "callback": (pl.Callback,),
        "logger": (Logger,),
        "optimizer": (torch.optim.Optimizer,),
        "lr_scheduler": schedulers,
    }


def named_classes(spec: JobSpec) -> list[tuple[str, str, ClassSpec]]:
    """Each class the spec names beside the model: (field path, kind, its section)."""
    out: list[tuple[str, str, ClassSpec]] = []
    if isinstance(spec.data, DataModuleSpec):
        out.append(("data", "data", spec.data))
    trainer = spec.trainer
    out += [(f"trainer.callbacks.{i}", "callback", c) for i, c in enumerate(trainer.callbacks)]
    out += [(f"trainer.logger.{i}", "logger", c) for i, c in enumerate(trainer.logger)]
    if spec.optimizer is not None:
        out.append(("optimizer", "optimizer", spec.optimizer))
    if spec.lr_scheduler is not None:
        out.append(("lr_scheduler", "lr_scheduler", spec.lr_scheduler))
    return out


def check_classes(spec: JobSpec) -> list[str]:
    """Every problem with the classes the spec names beside the model (see the module
    docstring), each naming its field."""
    problems = []
    named = []
    for field, kind, section in named_classes(spec):
        # A DataModule in the user's own package is found from its source first, as the
        # model is: a missing module costs no import of Lightning.
        missing = source_check.module_problem(section.class_path) if kind == "data" else None
        if missing:
            problems.append(f"{field}.class_path: {missing}")
        else:
            named.append((field, kind, section))
    if not named and spec.data is not None:
        return problems
    bases = _bases()
    for field, kind, section in named:
        cls, why = _import_class(section.class_path)
        if cls is None:
            problems.append(f"{field}.class_path: {why}")
            continue
        if not issubclass(cls, bases[kind]) and old_namespace(cls):
            problems.append(f"{field}.class_path: {section.class_path}: {OLD_NAMESPACE_HINT}")
            continue
        if not issubclass(cls, bases[kind]):
            expected = " or ".join(f"{b.__module__}.{b.__qualname__}" for b in bases[kind])
            problems.append(f"{field}.class_path: {section.class_path} is not a {expected}")
            continue
        problems += check_init_args(field, cls, section.init_args, SUPPLIED.get(kind, 0))
        if kind == "callback" and _is_model_checkpoint(cls):
            problems.append(f"{field}: raytrain owns checkpoints: use checkpoint.* (every_n_"
                            "epochs, every_n_steps, keep, monitor, mode) instead of a "
                            "ModelCheckpoint")  # fmt: skip
    if spec.data is None:
        problems += _check_own_loaders(spec)
    return problems


def _import_class(path: str) -> tuple[type | None, str]:
    try:
        value = import_object(path)
    except (ImportError, AttributeError) as exc:
        return None, f"cannot import {path!r}: {exc}"
    except Exception as exc:
        return None, f"importing {path!r} failed: {type(exc).__name__}: {exc}"
    if not isinstance(value, type):
        return None, f"{path!r} is not a class"
    return value, ""


def check_init_args(field: str, cls: type, init_args: dict[str, Any], supplied: int) -> list[str]:
    """``init_args`` bind to ``cls``'s constructor, after ``supplied`` positional
    arguments raytrain gives it."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return []  # a constructor without a readable signature: the workers will say
    parameters = signature.parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = [n for n, p in parameters.items() if p.kind in named][supplied:]
    takes = f"(it takes: {', '.join(accepted) or 'nothing'})"
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        unknown = [name for name in init_args if name not in accepted]
        if unknown:
            close = difflib.get_close_matches(unknown[0], accepted, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            return [f"{field}.init_args.{name}: {cls.__name__} takes no argument {name!r}; "
                    f"{hint}{takes}" for name in unknown]  # fmt: skip
    try:
        signature.bind(*[None] * supplied, **init_args)
    except TypeError as exc:
        return [f"{field}.init_args: {cls.__name__}: {exc} {takes}"]
    return []


def _is_model_checkpoint(cls: type) -> bool:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return issubclass(cls, ModelCheckpoint)


def _check_own_loaders(spec: JobSpec) -> list[str]:
    """No ``data``: the model must define ``train_dataloader``."""
    import lightning.pytorch as pl

    cls, _ = _import_class(spec.model.class_path)
    if cls is None or not issubclass(cls, pl.LightningModule):
        return []  # the model's own check says why
    if cls.train_dataloader is pl.LightningModule.train_dataloader:
        return [f"data: missing, and {spec.model.class_path} defines no train_dataloader: give "
                "data files (data.train), a LightningDataModule (data.class_path), or define "
                "the model's train_dataloader"]  # fmt: skip
    return []
