"""The profiler's reports (``trainer.profiler``), from the run's folder to MLflow.

The workers copy each profiled rank's reports into ``{run folder}/profiles/`` in
checkpoint.storage when fit ends (``worker.user_code.upload_profiles``); the driver then
logs that folder as the MLflow run's ``profiles/`` artifacts.
"""

from __future__ import annotations

import tempfile
from typing import TYPE_CHECKING

from raytrain import storage
from raytrain.checkpoints.layout import PROFILES, run_dir
from raytrain.spec import JobSpec

if TYPE_CHECKING:
    from raytrain.tracking.mlflow_tracker import MlflowTracker


def log_profiles(job: JobSpec, tracker: MlflowTracker) -> list[str]:
    """Log the run's profiler reports to ``tracker`` (an ``MlflowTracker``); their names."""
    if job.trainer.profiler is None:
        return []
    import pyarrow.fs as pafs

    location = storage.join(run_dir(job), PROFILES)
    names = [info.base_name for info in storage.list_dir(location, job.storage)]
    if not names:
        return []
    fs, path = storage.filesystem(location, job.storage)
    with tempfile.TemporaryDirectory(prefix="raytrain-profiles-") as local:
        pafs.copy_files(path, local, source_filesystem=fs)
        tracker.log_folder(local, PROFILES)
    return sorted(names)
