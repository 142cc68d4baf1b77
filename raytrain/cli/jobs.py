"""The CLI's job commands, ``raytrain submit|status|logs|stop|list``, over ``jobs_client``.

``submit --follow`` and ``logs --follow`` exit with the job's outcome: 0 when it SUCCEEDED,
1 when it FAILED or was STOPPED. Ctrl-C stops following, never the job.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from typing import Any

from raytrain.errors import EXIT_FAILED, EXIT_OK, RunStateError
from raytrain.submit import client as jobs_client
from raytrain.submit.connection import check_job_id
from raytrain.util.redaction import redact
from raytrain.util.terminal import JOB_OUTPUT, printable

EXIT_INTERRUPTED = 130


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` flags as a mapping. A malformed one is named by its position and
    never echoed: it may be a credential given without its name."""
    env = {}
    for number, pair in enumerate(pairs, 1):
        key, sep, value = pair.partition("=")
        if not sep:
            raise jobs_client.JobsError(
                f"--env #{number}: expected KEY=VALUE, got a value without '=' (not shown)"
            )
        if not key:
            raise jobs_client.JobsError(f"--env #{number}: expected KEY=VALUE, the KEY is empty")
        env[key] = value
    return env


def _follow(handle: jobs_client.JobHandle) -> int:
    """Print the job's output until it ends; its outcome as an exit code."""
    try:
        for chunk in handle.follow():
            print(_own_output(chunk), end="", flush=True)
    except KeyboardInterrupt:
        print(
            "\n"
            + printable(
                f"raytrain: stopped following; job {handle.job_id} keeps "
                f"running (raytrain stop {handle.job_id} to stop it)"
            ),
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return _outcome(handle, handle.wait())


def _outcome(handle: jobs_client.JobHandle, status: str) -> int:
    info = handle.info()
    message = f": {redact(info.message)}" if info.message else ""
    print(printable(f"raytrain: job {handle.job_id} {status}{message}"), file=sys.stderr)
    return EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED


def sweep_lines(logs: str) -> list[str]:
    """What a sweep's job said of its trials so far: one line per trial that ended (its
    driver prints them as ``raytrain: trial NAME finished|stopped|failed after ...``)."""
    return [
        line.removeprefix("raytrain: trial ")
        for line in logs.splitlines()
        if line.startswith("raytrain: trial ")
    ]


def _own_output(text: str) -> str:
    """A job's own driver output for this terminal: its layout and colours kept, every other
    control sequence escaped (``raytrain.util.terminal``: it is the cluster's data)."""
    return printable(text, keep=JOB_OUTPUT, colours=True)


def _when(seconds_ms: int | None) -> str:
    if not seconds_ms:
        return "-"
    return datetime.fromtimestamp(seconds_ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def run_job_command(args: argparse.Namespace) -> int:
    """Run one job command; ``JobsError`` (exit 2) for a bad address, token or job id."""
    from raytrain.cli.slurm import refuse_slurm_flags, slurm_job_command, submit_slurm

    if args.command == "submit" and args.slurm:
        return submit_slurm(args)
    if args.command == "submit":
        refuse_slurm_flags(args)
    if args.command not in ("submit", "list") and args.job_id.startswith("slurm:"):
        return slurm_job_command(args)
    if args.command == "submit" and args.supervise:
        return _supervise(args)
    if args.command == "submit":
        _no_supervise_flags(args)
        handle = jobs_client.submit(args.spec, args.overrides, **_submit_options(args))
        print(printable(handle.job_id))
        print(
            printable(
                f"raytrain: submitted job {handle.job_id} to {handle.server.address}; "
                f"raytrain logs {handle.job_id} --follow"
            ),
            file=sys.stderr,
        )
        return _follow(handle) if args.follow else EXIT_OK
    if args.command != "list":  # before any request: it becomes part of a URL
        check_job_id(args.job_id)
    server = jobs_client.JobServer(args.address, insecure=args.insecure)
    if args.command == "list":
        print(f"{'JOB ID':<34} {'STATUS':<10} {'STARTED':<19}  JOB")
        for job in server.jobs():
            name = (job.metadata or {}).get("raytrain_job") or job.entrypoint
            print(
                printable(
                    f"{job.submission_id or job.job_id:<34} {job.status.value:<10} "
                    f"{_when(job.start_time):<19}  {name}"
                )
            )
        return EXIT_OK
    handle = server.handle(args.job_id)
    if args.command == "status":
        return _status(handle, args.json)
    if args.command == "logs":
        if args.follow:
            return _follow(handle)
        print(_own_output(handle.logs()), end="")
        return EXIT_OK
    stopped = handle.stop()
    if not stopped:
        print(printable(f"raytrain: job {handle.job_id} had already ended: {handle.status()}"))
        return EXIT_OK
    if args.wait:
        print(printable(handle.wait()))
    else:
        print(printable(f"raytrain: stopping job {handle.job_id}"))
    return EXIT_OK


def _supervise(args: argparse.Namespace) -> int:
    """``submit --supervise``: the first job's id on stdout, then follow it and its
    resubmissions to the end; ``SupervisionError`` (exit 1, 2 or 3) when it did not end in
    success."""
    from raytrain.submit.supervisor import SupervisionError, supervise

    if args.follow:
        raise jobs_client.JobsError(
            "--follow and --supervise: a supervised job's output is "
            "`raytrain logs JOB_ID --follow`, job by job"
        )
    try:
        handle = supervise(
            args.spec,
            args.overrides,
            **_submit_options(args),
            **{key: value for _, key, value in _supervise_flags(args) if value is not None},
        )
    except SupervisionError as exc:
        if exc.result is not None:
            print("\n".join(map(printable, exc.result.job_ids)), flush=True)
        raise
    print("\n".join(map(printable, [*handle.earlier, handle.job_id])), flush=True)
    return EXIT_OK


def _supervise_flags(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    """``supervise``'s own keyword arguments from their flags: (flag, keyword, value), the
    value None where not given (``supervise``'s defaults apply)."""
    return [
        ("--max-resubmits", "max_resubmits", args.max_resubmits),
        ("--head-wait", "head_wait_s", args.head_wait),
    ]


def _no_supervise_flags(args: argparse.Namespace) -> None:
    """Refuse ``--max-resubmits``/``--head-wait`` without ``--supervise``: they would be
    ignored, and a user who gave them expects a supervised job."""
    given = [flag for flag, _, value in _supervise_flags(args) if value is not None]
    if given:
        raise jobs_client.JobsError(
            f"{' and '.join(given)}: only with --supervise (how a "
            "supervised job is resubmitted); add it, or drop "
            f"{'them' if len(given) > 1 else 'it'}"
        )


def _submit_options(args: argparse.Namespace) -> dict[str, Any]:
    """``submit``'s keyword arguments from the command line's."""
    return {
        "address": args.address,
        "working_dir": args.working_dir,
        "pip": args.pip,
        "env": _env_pairs(args.env),
        "job_id": args.job_id,
        "fresh": args.fresh,
        "resume_anyway": args.resume_anyway,
        "force": args.force,
        "insecure": args.insecure,
        "include": args.include,
    }


def _status(handle: jobs_client.JobHandle, as_json: bool) -> int:
    """A job's state and message; then its run's status record (``--json``: the record
    alone), or for a sweep the trials that ended."""
    from raytrain.cli.status import show, show_job_run

    if as_json:
        status = handle.progress()
        if status is None:
            raise RunStateError(f"job {handle.job_id}: no status record yet")
        show(status, True)
        return EXIT_OK
    info = handle.info()
    print(printable(info.status.value))
    if info.message:
        print(f"  {printable(redact(info.message))}")
    if jobs_client.JobMetadata.of(handle.job_id, info.metadata).raytrain_sweep:
        trials = sweep_lines(handle.logs())
        print(f"  trials ended: {len(trials)}")
        for line in trials:
            print(f"    {printable(redact(line))}")
    else:
        show_job_run(handle)
    return EXIT_OK
