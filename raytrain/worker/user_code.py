"""The parts of a spec that become objects in each worker beside the LightningCLI config's
(which ``lightning_config.instantiate`` builds): the profiler, and the Lightning
checkpoint a new run starts from (``ckpt_path``)."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from raytrain import storage
from raytrain.checkpoints.layout import PROFILES, run_dir
from raytrain.spec import JobSpec

logger = logging.getLogger(__name__)


def build_profiler(spec: JobSpec, rank: int) -> tuple[Any, str | None]:
    """Lightning's profiler named by ``trainer.profiler`` for this rank (rank 0, or every
    rank with ``profile_all_ranks``), writing into a local folder; (None, None) without."""
    name = spec.trainer.profiler
    if name is None or (rank != 0 and not spec.trainer.profile_all_ranks):
        return None, None
    from lightning.pytorch import profilers

    classes = {
        "simple": profilers.SimpleProfiler,
        "advanced": profilers.AdvancedProfiler,
        "pytorch": profilers.PyTorchProfiler,
    }
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
