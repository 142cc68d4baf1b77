"""The CLI's Slurm side: ``submit SPEC --slurm [...]`` and ``status|logs|stop slurm:JOBID``.

``submit --slurm`` checks the spec as ``run`` would (bad input: exit 2, nothing written),
writes the sbatch script and ``job.json`` into the run's Slurm folder
(``raytrain.slurm.sbatch``) and submits it; ``--dry-run`` prints the script instead. The
job's id is printed as ``slurm:NUMBER``, the form ``status``, ``logs`` and ``stop`` take.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from raytrain.errors import EXIT_FAILED, EXIT_OK, SpecError
from raytrain.util.terminal import JOB_OUTPUT, printable

if TYPE_CHECKING:
    from raytrain.slurm.control import SlurmJob
    from raytrain.slurm.sbatch import SbatchOptions
    from raytrain.spec import JobSpec

# ``submit``'s flags that belong to a Ray job, refused with ``--slurm``.
RAY_JOB_FLAGS = {
    "address": "--address",
    "supervise": "--supervise",
    "pip": "--pip",
    "env": "--env",
    "job_id": "--job-id",
    "include": "--include",
    "insecure": "--insecure",
}


# SbatchOptions' fields by the flag that sets them, where the two names differ.
FLAGS = {"grace_s": "--grace", "sbatch_args": "--sbatch-arg", "cpus_per_node": "--cpus-per-node"}
# The flags that mean something only with --slurm, and their defaults.
SLURM_ONLY: dict[str, object] = {
    "nodes": 1,
    "gpus_per_node": 0,
    "cpus_per_node": None,
    "partition": None,
    "time": None,
    "account": None,
    "grace": None,
    "sbatch_arg": [],
    "dry_run": False,
}


def refuse_slurm_flags(args: argparse.Namespace) -> None:
    """A Slurm flag without ``--slurm`` is bad input: ``--dry-run`` would otherwise submit
    a real Ray job."""
    given = [name for name, default in SLURM_ONLY.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise SpecError(f"{flags}: for a Slurm job; add --slurm")


def add_slurm_flags(submit: argparse.ArgumentParser) -> None:
    group = submit.add_argument_group(
        "Slurm", "with --slurm: an sbatch job that starts its own Ray cluster (docs/slurm.md)"
    )
    group.add_argument(
        "--slurm", action="store_true", help="submit to Slurm with sbatch, not to a Ray cluster"
    )
    group.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    group.add_argument("--gpus-per-node", type=int, default=0, metavar="G", help="default 0")
    group.add_argument(
        "--cpus-per-node",
        type=int,
        metavar="C",
        help="default: the spec's workers' CPUs, spread over the nodes",
    )
    group.add_argument("--partition", metavar="P")
    group.add_argument("--time", metavar="T", help="the job's time limit, as sbatch reads it")
    group.add_argument("--account", metavar="A")
    group.add_argument(
        "--grace",
        type=int,
        default=None,
        metavar="SECONDS",
        help="notice before the job's end, to save a checkpoint (default 120)",
    )
    group.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="another sbatch option, as one argument: --sbatch-arg=--qos=long",
    )
    group.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script; submit nothing"
    )


def _refuse_ray_flags(args: argparse.Namespace) -> None:
    given = [flag for name, flag in RAY_JOB_FLAGS.items() if getattr(args, name, None)]
    if given:
        raise SpecError(f"{', '.join(given)}: a Ray job's flags; --slurm starts its own cluster")


def _options(args: argparse.Namespace, cpus: int) -> SbatchOptions:
    from pydantic import ValidationError

    from raytrain.slurm.sbatch import DEFAULT_GRACE_S, SbatchOptions

    try:
        return SbatchOptions(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            cpus_per_node=cpus,
            partition=args.partition,
            time=args.time,
            account=args.account,
            grace_s=DEFAULT_GRACE_S if args.grace is None else args.grace,
            sbatch_args=tuple(args.sbatch_arg),
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = str(first["loc"][0]) if first["loc"] else ""
        flag = FLAGS.get(where, "--" + where.replace("_", "-"))
        message = str(first["msg"]).removeprefix("Value error, ")
        raise SpecError(f"{flag}: {message}" if where else message) from None


def default_cpus(job: JobSpec, nodes: int) -> int:
    """CPUs per node for the spec's workers spread over ``nodes``, at least 1; for an
    elastic run, its most workers (the allocation is what it can grow into)."""
    per_worker = job.scaling.worker_resources().get("CPU", 1.0)
    return max(1, math.ceil(job.scaling.max_workers * per_worker / nodes))


def submit_slurm(args: argparse.Namespace) -> int:
    """``submit SPEC --slurm``: the script written and submitted (or printed)."""
    from raytrain.driver.launcher import validate
    from raytrain.slurm import sbatch

    _refuse_ray_flags(args)
    if args.nodes < 1:
        raise SpecError(f"--nodes {args.nodes}: must be at least 1")
    workdir = Path(args.working_dir).resolve()
    if not workdir.is_dir():  # the job's cd would fail; a file was a traceback, a missing
        # folder made (as far as the script's own folder) before sbatch was asked
        raise SpecError(f"--working-dir {args.working_dir}: not a directory")
    job = validate(args.spec, args.overrides)
    cpus = default_cpus(job, args.nodes) if args.cpus_per_node is None else args.cpus_per_node
    options = _options(args, cpus)
    run = sbatch.SlurmRun(
        spec=args.spec,
        overrides=tuple(args.overrides),
        workdir=str(workdir),
        folder=str(workdir / ".raytrain" / "slurm" / job.name),
        fresh=args.fresh,
        resume_anyway=args.resume_anyway,
        force=args.force,
        cpus_per_node=cpus,
        gpus_per_node=args.gpus_per_node,
        python=sbatch.python(),
    )
    path = sbatch.new_script_path(Path(run.folder))
    text = sbatch.script(run, job.name, options, path)
    if args.dry_run:
        print(text, end="")
        return EXIT_OK
    sbatch.write(run, text, path)
    number = sbatch.sbatch(path)
    print(f"slurm:{number}")
    print(
        printable(
            f"raytrain: submitted {path} as Slurm job {number}; "
            f"raytrain logs slurm:{number} --follow"
        ),
        file=sys.stderr,
    )
    return _follow(number) if args.follow else EXIT_OK


def _shown(text: str) -> str:
    """The job's own output for this terminal: layout and colours kept, any other control
    sequence escaped (``util.terminal``)."""
    return printable(text, keep=JOB_OUTPUT, colours=True)


def _follow(number: str) -> int:
    from raytrain.slurm import control

    for text in control.follow(number):
        print(_shown(text), end="", flush=True)
    job = control.show(number)
    print(printable(f"raytrain: {job.describe()}"), file=sys.stderr)
    return EXIT_OK if job.state == "COMPLETED" else EXIT_FAILED


def slurm_job_command(args: argparse.Namespace) -> int:
    """``status``, ``logs`` or ``stop`` of ``slurm:NUMBER``."""
    from raytrain.slurm import control

    number = control.job_number(args.job_id)
    if args.command == "stop":
        if not control.stop(number):
            print(printable(f"raytrain: {control.show(number).describe()}: had already ended"))
            return EXIT_OK
        if args.wait:
            for _ in control.follow(number):  # until Slurm says it ended
                pass
            print(printable(control.show(number).describe()))
        else:
            print(f"raytrain: cancelling slurm:{number}")
        return EXIT_OK
    if args.command == "logs":
        if args.follow:
            return _follow(number)
        path = Path(control.show(number).output)
        if path.is_file():
            print(_shown(path.read_text(errors="replace")), end="")
        return EXIT_OK
    job = control.show(number)
    # with --json, stdout is the run's record alone
    print(printable(job.describe()), file=sys.stderr if args.json else sys.stdout)
    return _run_status(job, args.json)


def _run_status(job: SlurmJob, as_json: bool) -> int:
    """The run's own status record, by the spec in the job's ``job.json``."""
    from raytrain.cli.status import located, show
    from raytrain.slurm.sbatch import SlurmRun, described

    where = described(Path(job.command))
    try:
        run = SlurmRun.model_validate_json(where.read_text())
    except (OSError, ValueError):
        print(printable(f"raytrain: {where}: not readable: the run's record unknown"))
        return EXIT_OK
    spec = str(Path(run.workdir) / run.spec)
    named = argparse.Namespace(target=spec, overrides=list(run.overrides), storage=None)
    try:
        status, _ = located(named)
    except Exception as exc:  # the run has not started yet: Slurm's line is the answer
        print(printable(f"raytrain: {exc}"))
        return EXIT_OK
    show(status, as_json)
    return EXIT_OK
