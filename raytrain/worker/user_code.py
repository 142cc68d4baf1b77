"""The parts of a LightningCLI config that become objects in each worker: the optimizer
and LR scheduler (LightningCLI's automatic ``configure_optimizers``), the user's loggers,
and the Lightning checkpoint a new run starts from (``ckpt_path``)."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from raytrain import storage
from raytrain.checkpoints.layout import PROFILES, run_dir
from raytrain.imports import import_object
from raytrain.spec import JobSpec

logger = logging.getLogger(__name__)


def configure_optimizers(spec: JobSpec, model: Any) -> None:
    """With ``optimizer`` (and ``lr_scheduler``), give ``model`` the ``configure_optimizers``
    LightningCLI gives it: the optimizer over the model's parameters, the scheduler over
    the optimizer, returned as LightningCLI's ``configure_optimizers`` returns them (a
    ReduceLROnPlateau with its ``monitor``). Set on the instance, as LightningCLI does."""
    if spec.optimizer is None:
        return
    from lightning.pytorch.cli import LightningCLI

    optimizer_spec, scheduler_spec = spec.optimizer, spec.lr_scheduler
    optimizer_class = import_object(optimizer_spec.class_path)
    scheduler_class = import_object(scheduler_spec.class_path) if scheduler_spec else None

    def configure() -> Any:
        optimizer = optimizer_class(model.parameters(), **optimizer_spec.init_args)
        scheduler = None
        if scheduler_class is not None and scheduler_spec is not None:
            scheduler = scheduler_class(optimizer, **scheduler_spec.init_args)
        return LightningCLI.configure_optimizers(model, optimizer, scheduler)

    model.configure_optimizers = configure


def user_loggers(spec: JobSpec) -> list[Any]:
    """The spec's ``trainer.logger`` entries, built; a relative ``save_dir`` (or none) is
    under the run's folder in ``checkpoint.storage``. Lightning's loggers write on rank 0."""
    out = []
    for entry in spec.trainer.logger:
        cls = import_object(entry.class_path)
        args = dict(entry.init_args)
        save_dir = str(args.get("save_dir", "logs"))
        if storage.is_relative_path(save_dir):
            args["save_dir"] = storage.join(run_dir(spec), save_dir)
        out.append(cls(**args))
    return out


def build_profiler(spec: JobSpec, rank: int) -> tuple[Any, str | None]:
    """Lightning's profiler named by ``trainer.profiler`` for this rank (rank 0, or every
    rank with ``profile_all_ranks``), writing into a local folder; (None, None) without."""
    name = spec.trainer.profiler
    if name is None or (rank != 0 and not spec.trainer.profile_all_ranks):
        return None, None
    from lightning.pytorch import profilers

    classes = {"simple": profilers.SimpleProfiler, "advanced": profilers.AdvancedProfiler,
               "pytorch": profilers.PyTorchProfiler}  # fmt: skip
    local = tempfile.mkdtemp(prefix="raytrain-profile-")
    return classes[name](dirpath=local, filename=f"rank{rank}"), local


def upload_profiles(spec: JobSpec, local: str | None) -> None:
    """Copy a profiler's reports into ``{run folder}/profiles/`` in checkpoint.storage."""
    if local is None or not os.listdir(local):
        return
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(storage.join(run_dir(spec), PROFILES), spec.storage)
    fs.create_dir(path, recursive=True)
    pafs.copy_files(local, path, destination_filesystem=fs)


def start_from(spec: JobSpec) -> str | None:
    """The local path of ``ckpt_path`` (a URI copied to a temp file first), for a run
    that has no checkpoint of its own yet; None without one."""
    if spec.ckpt_path is None:
        return None
    location = storage.resolve(spec.ckpt_path)
    if not storage.is_uri(location):
        return location
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(location, spec.storage)
    local = os.path.join(tempfile.mkdtemp(prefix="raytrain-ckpt-"), os.path.basename(path))
    pafs.copy_files(path, local, source_filesystem=fs)
    logger.info("ckpt_path %s copied to %s", location, local)
    return local
