"""What a raytrain checkpoint holds, and which one a run resumes from.

A checkpoint is a folder Ray Train committed under the run's folder: ``checkpoint.ckpt`` (the
full Lightning state) and ``raytrain.json`` (the metrics reported with it). This module needs
neither Lightning nor Ray, so the driver can read a run's checkpoints without importing them;
the Lightning callback that writes checkpoints is in ``report_callback``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from raytrain import storage

if TYPE_CHECKING:
    from raytrain.spec import StorageSpec

CKPT_FILE = "checkpoint.ckpt"
META_FILE = "raytrain.json"
# The reported key Ray Train ranks checkpoints by: the value of ``checkpoint.monitor``.
SCORE_KEY = "_score"


def restore_path(checkpoint_dir: str) -> str:
    """The Lightning checkpoint file inside a raytrain checkpoint folder."""
    path = os.path.join(checkpoint_dir, CKPT_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{checkpoint_dir}: not a raytrain checkpoint (no {CKPT_FILE})")
    return path


# Ray Train's record of a run's committed checkpoints, beside them in the run's folder.
_RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def latest_committed(
    run_dir: str, options: StorageSpec | None = None
) -> tuple[str, dict[str, Any]] | None:
    """The run's latest committed checkpoint (its URI and metrics), as Ray Train will restore.

    Ray writes its snapshot only after a checkpoint's upload completed, so a checkpoint
    named here is whole.
    """
    text = storage.read_text(storage.join(run_dir, _RAY_SNAPSHOT), options)
    if not text:
        return None
    latest = json.loads(text).get("latest_checkpoint_result")
    if not latest:
        return None
    return storage.join(run_dir, latest["checkpoint_dir_name"]), dict(latest.get("metrics", {}))
