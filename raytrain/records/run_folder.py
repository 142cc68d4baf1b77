"""The run folder, before and around training: its recorded state, its lease, its
checkpoints.

A rerun of a name continues the run recorded in its folder, or is refused before anything
starts: a changed spec, an unreadable state or snapshot, another live run holding the lease,
a sweep's folder (a run and a sweep of one name and storage would share it). A run already
trained to its limits returns at once. Before training, checkpoint folders Ray never
committed that are provably partial uploads are deleted; a run resumes only from a
committed checkpoint. ``--fresh`` deletes only a folder that is provably the run's own: it
holds the run's record (``check_kind``, ``delete_own``); a sweep's driver keeps its folder
by the same two functions.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from raytrain import storage
from raytrain.checkpoints.layout import (
    epochs_done,
    latest_committed,
    read_snapshot,
    repair_snapshot_scores,
    uncommitted,
)
from raytrain.driver.results import FitResult, user_metrics
from raytrain.errors import RunStateError
from raytrain.records import runstate
from raytrain.records.lease import Lease, check_free
from raytrain.spec import JobSpec, StorageSpec
from raytrain.util.redaction import redact

# What makes a folder provably a run's or a sweep's: the record each writes first.
SWEEP_RECORD = "raytrain-sweep.json"
RECORDS = {"run": runstate.STATE_FILE, "sweep": SWEEP_RECORD}


def check_kind(folder: str, options: StorageSpec | None, kind: str) -> bool:
    """Whether ``folder`` holds ``kind``'s record (``RECORDS``: a run's or a sweep's), so
    that ``--fresh`` may delete it. A folder that holds the other kind's record is refused
    (``RunStateError``, exit 2), before anything is written: a run and a sweep of one name
    and storage would share it, and the ``--fresh`` of one would delete the other."""
    for other, record in RECORDS.items():
        if other != kind and storage.exists(storage.join(folder, record), options):
            raise RunStateError(
                f"name: {folder} holds a {other} ({record}), not a {kind}: a {kind} of this "
                f"name and checkpoint.storage would write into it, and --fresh would delete "
                "it; choose another name or checkpoint.storage"
            )
    return storage.exists(storage.join(folder, RECORDS[kind]), options)


def delete_own(folder: str, options: StorageSpec | None, kind: str, held: Lease) -> None:
    """``--fresh``: delete ``folder``, which ``check_kind`` found to hold ``kind``'s record,
    write the lease it held again, and say what was deleted."""
    storage.delete_dir(folder, options)
    held.rewrite()
    print(
        f"raytrain: --fresh: deleted {redact(folder)}, the {kind}'s folder (with its "
        f"{RECORDS[kind]})",
        file=sys.stderr,
    )


def check_resumable(spec: JobSpec, fresh: bool, resume_anyway: bool) -> runstate.RunState | None:
    """The run's recorded state; refuses, before anything starts, to continue a run whose
    spec changed, or whose state file cannot be read. With ``fresh`` the state file may hold
    anything: a placeholder state stands for it, so that ``open_run`` deletes the folder."""
    try:
        state = runstate.load(spec)
    except RunStateError:
        if not fresh:
            raise
        return runstate.new_state(spec)
    if state is not None and not fresh and not resume_anyway:
        runstate.check_resumable(state, spec)
    return state


def check_run_folder(spec: JobSpec, fresh: bool, force: bool) -> None:
    """Refuse, before anything starts, a run folder that another live run holds (see
    ``lease``), that is a sweep's (``check_kind``), or whose checkpoint snapshot cannot be
    read (unless ``fresh`` deletes it)."""
    check_kind(runstate.run_dir(spec), spec.storage, "run")
    check_free(runstate.run_dir(spec), spec.storage, force=force)
    if not fresh:
        read_snapshot(runstate.run_dir(spec), spec.storage)


def open_run(
    spec: JobSpec, state: runstate.RunState | None, fresh: bool, held: Lease
) -> runstate.RunState | None:
    """The run's recorded ``state`` to continue; with ``fresh``, its folder is deleted when
    it holds the run's record (``delete_own``; a state means it does)."""
    if state is not None and fresh:
        delete_own(runstate.run_dir(spec), spec.storage, "run", held)
        return None
    return state


def trained_to_limits(metrics: Mapping[str, Any], job: JobSpec) -> bool:
    """Whether a checkpoint reported with ``metrics`` is where Lightning's fit loop stops
    under ``job``'s limits, so that resuming from it trains nothing.

    Lightning stops when ``global_step >= max_steps`` (unless -1), or when the epochs it has
    processed reach ``max_epochs`` (None: 1000 without max_steps, else unbounded). The
    checkpoint's ``epoch`` is ``trainer.current_epoch`` when it was taken: at an epoch's
    end (``kind: epoch``) that epoch is processed but not yet counted, so it is one more;
    at the end of training (``kind: end``) it counts every epoch; a mid-epoch checkpoint
    (``kind: step``) has not finished its epoch. Any other report is not called complete.
    """
    kind, epoch, step = metrics.get("kind"), metrics.get("epoch"), metrics.get("step")
    if kind not in ("epoch", "end", "step") or not isinstance(epoch, int | float):
        return False
    if not isinstance(step, int | float):
        return False
    t = job.trainer
    if t.max_steps != -1 and step >= t.max_steps:
        return True
    max_epochs = t.max_epochs if t.max_epochs is not None else (1000 if t.max_steps == -1 else -1)
    processed = int(epoch) + 1 if kind == "epoch" else int(epoch)
    return max_epochs != -1 and processed >= max_epochs


def already_complete(
    job: JobSpec, state: runstate.RunState | None, start: float
) -> FitResult | None:
    """A finished run's command run again, with nothing left to train: say so, and how to
    train more, before Ray starts (it would start the workers, restore, train nothing and
    log the model again). None when there is something to train, or the last attempt did
    not finish (it resumes, and logs the model it may not have logged)."""
    if state is None or state.status != "FINISHED":
        return None
    latest = latest_committed(runstate.run_dir(job), job.storage)
    if latest is None or not trained_to_limits(latest[1], job):
        return None
    uri, metrics = latest
    epochs = epochs_done(metrics)
    t = job.trainer
    print(
        f"raytrain: run {job.name} is complete: its latest checkpoint {uri} is at epoch "
        f"{epochs}, step {int(metrics['step'])} (trainer.max_epochs={t.max_epochs}, "
        f"trainer.max_steps={t.max_steps}); nothing was trained or logged. To train further, "
        "raise trainer.max_epochs or trainer.max_steps; to start over, pass --fresh",
        file=sys.stderr,
    )
    shown = user_metrics(metrics)
    return FitResult(
        name=job.name,
        metrics=shown,
        best_checkpoint_uri=None,
        latest_checkpoint_uri=uri,
        mlflow_run_id=state.mlflow_run_id,
        tracking_uri=redact(state.tracking_uri) if state.tracking_uri else None,
        run_dir=runstate.run_dir(job),
        wall_time_s=time.time() - start,
        already_complete=True,
    )


def drop_uncommitted(spec: JobSpec, held: Lease) -> None:
    """Delete checkpoint folders that are provably partial uploads (see ``uncommitted``),
    and say which uncommitted ones stay and why. Nothing is deleted when the lease was
    taken with --force from a live run: that run may still be uploading."""
    left = uncommitted(runstate.run_dir(spec), spec.storage)
    if held.displaced is not None and left.partial:
        print(
            f"raytrain: kept {len(left.partial)} uncommitted checkpoint folder(s): the run "
            "this one displaced with --force may still be uploading them",
            file=sys.stderr,
        )
        return
    for uri in left.partial:
        storage.delete_dir(uri, spec.storage)
        print(f"raytrain: removed {uri}: its upload never completed", file=sys.stderr)
    if left.kept:
        print(
            f"raytrain: kept {len(left.kept)} checkpoint folder(s) Ray Train's snapshot does "
            f"not list ({left.why}): {', '.join(left.kept)}",
            file=sys.stderr,
        )


def resume_point(spec: JobSpec, held: Lease) -> str | None:
    """Say which checkpoint the run resumes from, if any; returns its URI. Uploads that
    never completed are removed first: a run resumes only from a committed checkpoint."""
    if spec.checkpoint.monitor:
        repaired = repair_snapshot_scores(
            runstate.run_dir(spec), spec.checkpoint.mode, spec.storage
        )
        if repaired:
            print(
                f"raytrain: gave {repaired} unscored checkpoint(s) in Ray Train's snapshot "
                "a finite score (an earlier version wrote none: the run could not "
                "resume)",
                file=sys.stderr,
            )
    drop_uncommitted(spec, held)
    latest = latest_committed(runstate.run_dir(spec), spec.storage)
    if latest is None:
        return None
    uri, metrics = latest
    print(
        f"raytrain: resuming {spec.name} from {uri} "
        f"(epoch {int(metrics.get('epoch', 0)) + 1}, step {metrics.get('step', '?')})",
        file=sys.stderr,
    )
    return uri
