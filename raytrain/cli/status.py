"""``raytrain status``: a run's live status record (``raytrain.records.run_status``), found by a
submitted job's id, by its spec, or by its name and storage.

    raytrain status JOB_ID [--address URL]     the job's state, then its run's record
    raytrain status SPEC [a.b=value ...]       the run that spec names
    raytrain status NAME --storage URI         the run NAME under that checkpoint.storage
    raytrain doctor SPEC | NAME --storage URI  where the run's time went, what to do
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain import storage
from raytrain.errors import EXIT_OK, RaytrainError, RunStateError, SpecError
from raytrain.records.run_status import RunStatus, describe, read_status, status_path
from raytrain.util.terminal import printable

if TYPE_CHECKING:
    from raytrain.spec import JobSpec
    from raytrain.submit.client import JobHandle

SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def names_a_run(args: argparse.Namespace) -> bool:
    """Whether ``raytrain status``'s target is a run (a spec, or a name with ``--storage``)
    rather than a submitted job's id."""
    target = args.target
    if args.storage is not None or target.endswith(SPEC_SUFFIXES):
        return True
    try:
        return Path(target).is_file()
    except (OSError, ValueError):  # a name too long for a path, a NUL: not a file's
        return False


def located(args: argparse.Namespace) -> tuple[RunStatus, JobSpec | None]:
    """The record of the run ``args`` name (a spec, or ``target`` under ``--storage``), and
    the spec when one was given; a run without a record is a ``RunStateError`` (exit 2)."""
    job = None
    if args.storage is not None:
        from raytrain.spec.fields import check_name

        try:  # it names a folder under --storage, never one elsewhere
            check_name(args.target)
        except ValueError as exc:
            raise SpecError(
                f"NAME {exc}; with --storage, NAME is a run's name (the spec's "
                "rule), its folder there"
            ) from None
        where = storage.join(storage.resolve(args.storage), args.target)
        status = read_status(where)
    else:
        from raytrain.checkpoints.layout import run_dir
        from raytrain.spec import load_spec

        job = load_spec(args.target, args.overrides)
        where = run_dir(job)
        status = read_status(where, job.storage)
    if status is None:
        raise RunStateError(
            f"{status_path(where)}: no status record: the run has not started there (or ran "
            "before raytrain kept one)"
        )
    return status, job


def run_status_command(args: argparse.Namespace) -> int:
    """Print the record of the run the arguments name."""
    status, _ = located(args)
    show(status, args.json)
    return EXIT_OK


def doctor_command(args: argparse.Namespace) -> int:
    """Print where the run's time went (``tracking.doctor``), from its status record and
    its MLflow run (``--tracking-uri``, else the spec's, else MLflow's default)."""
    from raytrain.tracking.doctor import describe, diagnose, run_facts
    from raytrain.tracking.mlflow_tracker import default_tracking_uri

    status, job = located(args)
    uri = args.tracking_uri or (job.tracking.mlflow.tracking_uri if job else None)
    parts: dict[str, float] = {}
    tags: dict[str, Any] = {}
    if status.mlflow_run_id is not None:
        parts, tags = run_facts(uri or default_tracking_uri(), status.mlflow_run_id)
    for line in describe(diagnose(parts, status, tags), status.name):
        print(printable(line))
    return EXIT_OK


def show(status: RunStatus, as_json: bool, indent: str = "") -> None:
    """The record on stdout: as ``describe`` words it, or as its JSON."""
    if as_json:
        print(status.to_json())
        return
    for line in describe(status):
        print(indent + printable(line))


def show_job_run(handle: JobHandle) -> None:
    """After a job's state: its run's record, or why there is none to show."""
    try:
        status = handle.progress()
    except RaytrainError as exc:
        print(f"  run: {printable(exc.problems[0])}")
        return
    except Exception as exc:  # the store cannot be reached from here
        print(printable(f"  run: the status record cannot be read ({storage.describe(exc)})"))
        return
    if status is None:
        print("  run: no status record yet (the driver is starting)")
        return
    show(status, False, indent="  ")
