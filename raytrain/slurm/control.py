"""``raytrain status|logs|stop slurm:JOBID``: a Slurm job of ``submit --slurm``, through
Slurm's own commands (``scontrol``, ``scancel``).

A job is found by its id; the run's description (``job-STAMP.json``) by the script Slurm
runs (``Command=``), beside it: ``status`` prints Slurm's state of the job, then the run's
own status record; ``logs`` prints its output file (every attempt, appended);
``stop`` cancels it (Slurm signals its processes, then kills them after ``KillWait``: the
run resumes from its last committed checkpoint when submitted again).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from raytrain.errors import EXIT_BAD_INPUT, RaytrainError

PREFIX = "slurm:"
_ID = re.compile(r"[0-9]{1,12}")
# States after which a job runs no more, unless requeued (``scontrol show job``).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")


class SlurmError(RaytrainError):
    """Slurm's commands are missing, refused, or do not know the job (exit 2)."""

    exit_code = EXIT_BAD_INPUT


def is_slurm(target: str) -> bool:
    """Whether a job id names a Slurm job (``slurm:12345``)."""
    return target.startswith(PREFIX)


def job_number(target: str) -> str:
    """The number of ``slurm:NUMBER``; a ``SlurmError`` naming the argument otherwise."""
    number = target.removeprefix(PREFIX)
    if not _ID.fullmatch(number):
        raise SlurmError(f"JOB_ID {target[:40]!r}: a Slurm job id is slurm:NUMBER")
    return number


def slurm_command(argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run one of Slurm's commands; ``SlurmError`` with what it said when it fails."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(
            f"{argv[0]}: not found on PATH: run this where Slurm's commands are (a login node)"
        )
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]}: no answer in {timeout_s:.0f} s (slurmctld down?)") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"{' '.join(argv[:2])}: {said[-1] if said else 'failed'}")
    return done


@dataclass(frozen=True)
class SlurmJob:
    """What ``scontrol show job`` says of a job."""

    number: str
    state: str
    reason: str
    restarts: int
    run_time: str
    nodes: str
    command: str  # the batch script's path
    output: str  # its output file, %j filled in

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self) -> str:
        why = f" ({self.reason})" if self.reason not in ("", "None") else ""
        attempt = f", attempt {self.restarts + 1}" if self.restarts else ""
        where = f" on {self.nodes}" if self.nodes not in ("", "(null)") else ""
        return f"slurm:{self.number} {self.state}{why}{where}, ran {self.run_time}{attempt}"


def fields(text: str) -> dict[str, str]:
    """``scontrol -o``'s one line of ``Key=Value`` pairs. A value may hold a space (a path
    under a folder with one): a pair ends only where the next ``Key=`` begins."""
    pairs = re.split(r"\s+(?=[A-Za-z][A-Za-z/:_]*=)", text.strip())
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def show(number: str) -> SlurmJob:
    """The job, as Slurm's controller knows it now; ``SlurmError`` when it does not (a job
    that ended more than ``MinJobAge`` ago)."""
    said = fields(slurm_command(["scontrol", "-o", "show", "job", number]).stdout)
    return SlurmJob(
        number=number,
        state=said.get("JobState", "UNKNOWN"),
        reason=said.get("Reason", ""),
        restarts=int(said.get("Restarts", "0") or 0),
        run_time=said.get("RunTime", ""),
        nodes=said.get("NodeList", ""),
        command=said.get("Command", ""),
        output=said.get("StdOut", ""),
    )


def stop(number: str) -> bool:
    """Cancel the job; False when it had already ended."""
    if show(number).ended:
        return False
    slurm_command(["scancel", number])
    return True


def follow(number: str, poll_s: float = 1.0) -> Iterator[str]:
    """The job's output as it grows, until the job has ended (a requeued job is followed
    through its next attempt: it is pending, not ended)."""
    offset = 0
    while True:
        job = show(number)
        path = Path(job.output)
        if path.is_file():
            with path.open(errors="replace") as f:
                f.seek(offset)
                text = f.read()
                offset = f.tell()
            if text:
                yield text
        if job.ended:
            return
        time.sleep(poll_s)
