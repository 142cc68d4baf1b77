"""What a raytrain checkpoint holds, and which one a run resumes from.

A checkpoint is a folder Ray Train committed under the run's folder: ``checkpoint.ckpt`` (the
full Lightning state) and ``raytrain.json`` (the metrics reported with it). This module needs
neither Lightning nor Ray, so the driver can read a run's checkpoints without importing them;
the Lightning callback that writes checkpoints is in ``worker.checkpointing``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain import storage
from raytrain.contract import events
from raytrain.contract.events import SCORE_KEY
from raytrain.errors import StorageError

if TYPE_CHECKING:
    from raytrain.spec import JobSpec, StorageSpec


def run_dir(spec: JobSpec) -> str:
    """The run's folder: ``{checkpoint.storage}/{name}``; Ray Train writes here too."""
    return storage.join(storage.resolve(spec.checkpoint.storage), spec.name)


CKPT_FILE = "checkpoint.ckpt"
# The run folder's folder of profiler reports (``trainer.profiler``), also their folder in
# MLflow's artifacts.
PROFILES = "profiles"
META_FILE = "raytrain.json"
# The score of a checkpoint taken while the monitored metric had no finite value (before
# the first validation, or a NaN): the worst a float can be and still be finite (see
# ``checkpoint_score``).
UNSCORED = {"max": -sys.float_info.max, "min": sys.float_info.max}
# The run folder's folder of hang reports, one folder per attempt that hung (``{token}``,
# the attempt's start as rank 0 gave it), one stacks file per rank; also their folder in
# MLflow's artifacts.
HANGS = "hangs"


# The file a sharded (torch distributed) checkpoint's folder is recognised by.
DCP_METADATA = ".metadata"


def checkpoint_score(value: object, mode: str) -> float:
    """The score Ray Train ranks a checkpoint by, for the monitored metric's ``value``.

    Invariant: finite, always. Ray Train writes its snapshot through pydantic, which writes
    an infinite or NaN float as ``null``; a driver that restores that snapshot then fails at
    its first new checkpoint (``float * None`` in Ray's ranking), and so does every rerun:
    the run can never be resumed. A checkpoint with no finite metric gets ``UNSCORED``, the
    worst finite score, so it never displaces a scored one, and equals rank by recency."""
    number_ = number(value)
    if number_ is None or not math.isfinite(number_):
        return UNSCORED[mode]
    return number_


def real_score(value: object) -> float | None:
    """A reported ``SCORE_KEY`` value as a float when it is a real score; None for
    ``UNSCORED``, the infinity an earlier raytrain reported, and the null Ray's snapshot
    made of it."""
    number_ = number(value)
    if number_ is None or not math.isfinite(number_) or abs(number_) >= sys.float_info.max:
        return None
    return number_


def lightning_checkpoint(location: str, label: str | None = None) -> tuple[str, str]:
    """The one recognition of a raytrain checkpoint: the Lightning checkpoint in the local
    ``location`` (a checkpoint's folder, or the ``checkpoint.ckpt`` inside it: a file, or
    under sharded FSDP a folder of shards), and its name for messages (under ``label``, the
    URI it came from). Anything else is a ``StorageError`` naming ``label``."""
    label = label or location
    if os.path.isdir(location) and not os.path.exists(os.path.join(location, DCP_METADATA)):
        path, name = os.path.join(location, CKPT_FILE), storage.join(label, CKPT_FILE)
    else:
        path, name = location, label
    if os.path.exists(path):
        return path, name
    if os.path.exists(location):
        raise StorageError(f"{label}: not a raytrain checkpoint (no {CKPT_FILE})")
    raise StorageError(f"{label}: no such file or folder")


def restore_path(checkpoint_dir: str) -> str:
    """The Lightning checkpoint inside a raytrain checkpoint folder, for Lightning's
    ``ckpt_path`` (see ``lightning_checkpoint``)."""
    return lightning_checkpoint(checkpoint_dir)[0]


# Ray Train's record of a run's committed checkpoints, beside them in the run's folder, and
# how it names a checkpoint's folder: ``checkpoint_`` and the time it was made, to the
# microsecond, so that names sort by age.
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
CHECKPOINT_PREFIX = "checkpoint_"
_TIMESTAMPED = re.compile(r"^checkpoint_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\.\d{6}$")


@dataclass(frozen=True)
class Snapshot:
    """What Ray Train's snapshot says of a run: the folders it committed, and the latest."""

    committed: frozenset[str]
    latest: str | None
    latest_metrics: dict[str, Any]


def read_snapshot(run_dir: str, options: StorageSpec | None = None) -> Snapshot | None:
    """The run's snapshot, or None when it has none (no checkpoint was ever committed).

    A snapshot that is there but cannot be read (empty, truncated, not Ray's shape) raises
    ``StorageError`` naming it: Ray Train would fail on it in the middle of starting, and
    nothing can be known of which checkpoints are whole.
    """
    path = storage.join(run_dir, SNAPSHOT_FILE)
    text = storage.read_text(path, options)
    if text is None:
        return None
    try:
        tree = json.loads(text)
        results = [*tree["checkpoint_results"], tree.get("latest_checkpoint_result")]
        committed = frozenset(_folder_name(r["checkpoint_dir_name"]) for r in results if r)
        latest = tree.get("latest_checkpoint_result")
        metrics = dict(latest.get("metrics") or {}) if latest else {}
        for key in ("epoch", "step"):  # printed and compared as numbers by the driver
            value = metrics.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"the latest checkpoint's {key} is {value!r}, not a number")
            if not math.isfinite(value):
                raise ValueError(f"the latest checkpoint's {key} is {value!r}")
        return Snapshot(
            committed=committed,
            latest=_folder_name(latest["checkpoint_dir_name"]) if latest else None,
            latest_metrics=metrics,
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise StorageError(
            f"{path}: Ray Train's checkpoint snapshot cannot be read "
            f"({type(exc).__name__}: {str(exc)[:200] or 'empty'}); which checkpoints are "
            "complete is unknown. Restore the file, or pass --fresh to start the run over"
        ) from None


def repaired_scores(tree: dict[str, Any], mode: str) -> int:
    """Give every checkpoint result in a parsed Ray Train snapshot whose ``SCORE_KEY`` is not
    a finite number (``null``: an infinity Ray's pydantic wrote so) the ``UNSCORED`` score,
    in place; returns how many checkpoints (folder names) it changed. See
    ``checkpoint_score`` for why a null score must never reach Ray again."""
    results = [
        *(tree.get("checkpoint_results") or []),
        tree.get("latest_checkpoint_result"),
        *(tree.get("pending_training_results") or []),
    ]
    changed: set[str] = set()
    for result in results:
        metrics = result.get("metrics") if isinstance(result, dict) else None
        if not isinstance(metrics, dict) or SCORE_KEY not in metrics:
            continue
        value = metrics[SCORE_KEY]
        score = checkpoint_score(value, mode)
        if score != value or isinstance(value, bool):
            metrics[SCORE_KEY] = score
            changed.add(str(result.get("checkpoint_dir_name")))
    return len(changed)


def repair_snapshot_scores(run_dir: str, mode: str, options: StorageSpec | None = None) -> int:
    """Rewrite the run's snapshot with every unscored checkpoint's score finite (see
    ``repaired_scores``), before Ray Train restores it; returns how many were repaired. A
    snapshot written by an earlier raytrain (a step checkpoint taken before the first
    validation, then a lost driver) is resumable again. The caller holds the run's lease:
    no live run writes the snapshot meanwhile, and ``storage.write_text`` replaces it whole."""
    path = storage.join(run_dir, SNAPSHOT_FILE)
    text = storage.read_text(path, options)
    if text is None:
        return 0
    tree = json.loads(text)  # read_snapshot has checked it parses (check_run_folder)
    changed = repaired_scores(tree, mode)
    if changed:
        storage.write_text(path, json.dumps(tree), options)
    return changed


def _folder_name(name: object) -> str:
    """A checkpoint folder's name as the snapshot gives it: one name inside the run folder
    (``..`` or a separator would name a folder elsewhere, to resume from or keep)."""
    if not isinstance(name, str) or name in ("", ".", "..") or re.search(r"[/\\\0]", name):
        raise ValueError(f"checkpoint_dir_name {str(name)[:80]!r} is not a folder name")
    return name


@dataclass(frozen=True)
class Leftovers:
    """Checkpoint folders Ray Train never committed: ``partial`` may be deleted; ``kept``
    are not provably partial, with ``why`` they stay."""

    partial: list[str]
    kept: list[str]
    why: str | None = None


def uncommitted(run_dir: str, options: StorageSpec | None = None) -> Leftovers:
    """The checkpoint folders in ``run_dir`` that the snapshot does not list, split into
    those provably partial and the rest.

    Invariant: a folder is called partial only if a readable snapshot exists, does not list
    it, names a latest checkpoint, and the folder's time-stamped name is newer than it:
    an upload begun after the last commit that never completed (a killed driver or worker,
    a store that stopped answering). A folder older than the latest commit may have been
    committed by a snapshot since overwritten; with no snapshot at all nothing is known to
    be partial. Either way nothing is deleted. The caller must hold the run's lease, so no
    live run is uploading into ``run_dir``.
    """
    import pyarrow.fs as pafs

    snapshot = read_snapshot(run_dir, options)
    folders = sorted(
        entry.base_name
        for entry in storage.list_dir(run_dir, options)
        if entry.type == pafs.FileType.Directory and entry.base_name.startswith(CHECKPOINT_PREFIX)
    )
    if snapshot is None or snapshot.latest is None:
        reason = "is missing" if snapshot is None else "lists no checkpoint"
        return Leftovers(
            [],
            [storage.join(run_dir, f) for f in folders],
            f"{SNAPSHOT_FILE} {reason}: no checkpoint is known to be committed",
        )
    latest = snapshot.latest
    partial: list[str] = []
    kept: list[str] = []
    for name in folders:
        if name in snapshot.committed:
            continue
        provable = name > latest and bool(_TIMESTAMPED.match(name) and _TIMESTAMPED.match(latest))
        (partial if provable else kept).append(storage.join(run_dir, name))
    why = "older than the latest committed checkpoint, or not named by Ray" if kept else None
    return Leftovers(partial, kept, why)


def number(value: object) -> float | None:
    """A reported value as a float when it is a number (a bool is not), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def epochs_done(metrics: dict[str, Any]) -> int:
    """Epochs completed as of a checkpoint's metrics (``Report.for_ray``): see
    ``contract.events.epochs_done``."""
    return events.epochs_done(int(metrics.get("epoch", 0)), str(metrics.get("kind", "")))


def latest_committed(
    run_dir: str, options: StorageSpec | None = None
) -> tuple[str, dict[str, Any]] | None:
    """The run's latest committed checkpoint (its URI and metrics), as Ray Train will restore.

    Ray writes its snapshot only after a checkpoint's upload completed, so a checkpoint
    named here is whole.
    """
    snapshot = read_snapshot(run_dir, options)
    if snapshot is None or snapshot.latest is None:
        return None
    return storage.join(run_dir, snapshot.latest), snapshot.latest_metrics
