"""Checks against the world, before Ray starts or anything is written.

``spec.py`` validates a spec's shape; this module checks what it names: that the model class
imports and is a LightningModule, that the data exists with the columns the spec asks for,
and that the cluster can ever hold the workers. Every problem found is collected, so one run
shows the user all of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from raytrain import source_check, storage
from raytrain.errors import SpecError
from raytrain.spec import JobSpec


def import_object(path: str) -> Any:
    """Import ``package.module:Name`` and return the object."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


def check_model_located(spec: JobSpec) -> list[str]:
    """The model's module can be found and defines the class's name, read from its source
    without running it (``check_model`` imports it: Lightning and torch, seconds)."""
    path = spec.model.class_path
    module, _, attr = path.partition(":")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package is missing or broken
        return [f"model.class_path: cannot import {path!r}: {exc}"]
    if found is None:
        return [f"model.class_path: cannot import {path!r}: No module named {module!r}"]
    names = source_check.top_level_names(found.origin)
    if names is not None and attr not in names:
        return check_model(spec)  # the source does not bind it: confirm by importing
    return []


def check_model(spec: JobSpec) -> list[str]:
    """The model class imports and is a LightningModule subclass."""
    path = spec.model.class_path
    try:
        cls = import_object(path)
    except ModuleNotFoundError as exc:
        return [f"model.class_path: cannot import {path!r}: {exc}"]
    except AttributeError:
        module = path.partition(":")[0]
        return [f"model.class_path: module {module!r} has no attribute {path.partition(':')[2]!r}"]
    except Exception as exc:
        return [f"model.class_path: importing {path!r} failed: {type(exc).__name__}: {exc}"]
    import lightning.pytorch as pl

    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        return [f"model.class_path: {path!r} is not a lightning.pytorch.LightningModule subclass"]
    return []


def check_strategy(spec: JobSpec) -> list[str]:
    """The strategy is one this version can run."""
    if spec.strategy.name != "ddp":
        return [f"strategy.name: {spec.strategy.name!r} is not supported yet (supported: ddp)"]
    return []


def local_capacity(spec: JobSpec) -> dict[str, float]:
    """What an embedded local Ray cluster on this machine can ever give training workers.

    GPUs are counted (through torch, a second's import) only when ``spec`` asks for them."""
    capacity: dict[str, float] = {"CPU": float(os.cpu_count() or 1)}
    if not spec.scaling.use_gpu:
        return capacity
    try:
        import torch

        capacity["GPU"] = float(torch.cuda.device_count())
    except Exception:
        capacity["GPU"] = 0.0
    return capacity


def check_capacity(spec: JobSpec, capacity: dict[str, float]) -> list[str]:
    """``num_workers`` workers of ``resources_per_worker`` each fit into ``capacity``."""
    problems = []
    per_worker = spec.scaling.worker_resources()
    workers = spec.scaling.num_workers
    for resource, amount in per_worker.items():
        if amount <= 0:
            continue
        have = capacity.get(resource, 0.0)
        fits = int(have // amount)
        if fits < workers:
            field = "scaling.use_gpu" if resource == "GPU" and spec.scaling.use_gpu else None
            field = field or "scaling.num_workers"
            problems.append(
                f"{field}: {workers} workers need {workers * amount:g} {resource} "
                f"({amount:g} each) but the cluster can hold at most {have:g} "
                f"(room for {fits} worker{'s' if fits != 1 else ''})"
            )
    return problems


def check_local_cpus(spec: JobSpec) -> list[str]:
    """``$RAYTRAIN_LOCAL_CPUS``, if set, leaves Ray Data at least one CPU beside the workers."""
    from raytrain.ray_runtime import LOCAL_CPUS_ENV, workers_cpus

    requested = os.environ.get(LOCAL_CPUS_ENV)
    if not requested:
        return []
    need = workers_cpus(spec) + 1
    if not requested.isdigit() or int(requested) < need:
        return [
            f"scaling.num_workers: {LOCAL_CPUS_ENV}={requested} must be a whole number of at "
            f"least {need}: the workers' {need - 1} CPUs and one for Ray Data"
        ]
    return []


def dataset_schema_names(uri: str, fmt: str) -> list[str]:
    """The column names of the dataset at ``uri`` (read from file footers/headers only)."""
    import pyarrow.dataset as pads

    fs, path = storage.filesystem(uri)
    return list(pads.dataset(path, filesystem=fs, format=fmt).schema.names)


def check_data(spec: JobSpec, *, allow_prepare: bool = False) -> list[str]:
    """Each dataset exists and holds the columns the spec projects.

    With ``allow_prepare``, a missing train set that ``data.prepare`` will write is no problem.
    """
    problems = []
    # data.prepare runs when the train set is missing, and writes the val set too
    will_prepare = (
        allow_prepare
        and spec.data.prepare is not None
        and not storage.exists(storage.resolve(spec.data.train.uri))
    )
    sources = {"data.train": spec.data.train, "data.val": spec.data.val}
    for field, source in sources.items():
        if source is None:
            continue
        uri = storage.resolve(source.uri)
        if not storage.exists(uri):
            if will_prepare:
                continue
            problems.append(f"{field}.uri: no such file or folder: {uri}")
            continue
        try:
            names = dataset_schema_names(uri, source.format)
        except Exception as exc:
            problems.append(f"{field}.uri: cannot read {source.format} data at {uri}: {exc}")
            continue
        if not names:
            problems.append(f"{field}.uri: no {source.format} files found under {uri}")
            continue
        missing = [c for c in spec.data.columns or [] if c not in names]
        if missing:
            problems.append(
                f"data.columns: {', '.join(map(repr, missing))} not in {field} "
                f"({uri} has: {', '.join(names)})"
            )
    return problems


def raise_if(problems: list[str]) -> None:
    """Raise one ``SpecError`` listing every problem, if there are any."""
    if problems:
        raise SpecError(problems)
