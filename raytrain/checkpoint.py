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


# Ray Train's record of a run's committed checkpoints, beside them in the run's folder, and
# how it names a checkpoint's folder.
_RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
CHECKPOINT_PREFIX = "checkpoint_"


def _snapshot(run_dir: str, options: StorageSpec | None) -> dict[str, Any]:
    text = storage.read_text(storage.join(run_dir, _RAY_SNAPSHOT), options)
    return json.loads(text) if text else {}


def uncommitted(run_dir: str, options: StorageSpec | None = None) -> list[str]:
    """The checkpoint folders in ``run_dir`` that Ray Train never committed: uploads that were
    interrupted (a killed driver or worker, a store that stopped answering). They may be
    partial; nothing resumes from them."""
    import pyarrow.fs as pafs

    snapshot = _snapshot(run_dir, options)
    results = [*snapshot.get("checkpoint_results", []), snapshot.get("latest_checkpoint_result")]
    committed = {r["checkpoint_dir_name"] for r in results if r}
    return [
        storage.join(run_dir, entry.base_name)
        for entry in storage.list_dir(run_dir, options)
        if entry.type == pafs.FileType.Directory
        and entry.base_name.startswith(CHECKPOINT_PREFIX)
        and entry.base_name not in committed
    ]


def latest_committed(
    run_dir: str, options: StorageSpec | None = None
) -> tuple[str, dict[str, Any]] | None:
    """The run's latest committed checkpoint (its URI and metrics), as Ray Train will restore.

    Ray writes its snapshot only after a checkpoint's upload completed, so a checkpoint
    named here is whole.
    """
    latest = _snapshot(run_dir, options).get("latest_checkpoint_result")
    if not latest:
        return None
    return storage.join(run_dir, latest["checkpoint_dir_name"]), dict(latest.get("metrics", {}))
