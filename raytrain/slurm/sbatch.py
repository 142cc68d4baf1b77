"""``raytrain submit SPEC --slurm``: the sbatch script of a run, and its submission.

The script asks Slurm for the allocation (``--nodes``, one task per node with its CPUs and
GPUs), for USR1 ``grace_s`` seconds before the job's end (``--signal=B:USR1@GRACE``: to
the batch process only, which is raytrain's), and for requeueing; it then runs
``raytrain.slurm.job`` on the first node with the run's description (``SlurmRun``, kept
beside it as ``job-STAMP.json``: each submission its own pair, so a pending job never
reads the next one's). Both live in the run's Slurm folder, ``.raytrain/slurm/{name}``
under the working directory, with each attempt's Ray token and the job's output
(``slurm-{jobid}.out``, every attempt appended).

Not in the run folder: ``--fresh`` deletes that folder, and with it the output and token
of the job that is running; and a run folder in object storage is no file Slurm can
write its output to. The working directory is on the cluster's shared filesystem, as the
code it holds must be.
"""

from __future__ import annotations

import secrets
import shlex
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

TOKEN_FILE = "ray_token-{job}"
OUTPUT = "slurm-%j.out"
DEFAULT_GRACE_S = 120


class SbatchOptions(BaseModel):
    """What ``submit --slurm`` asks Slurm for (its flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(1, ge=1, description="--nodes: the nodes of the Ray cluster")
    gpus_per_node: int = Field(0, ge=0, description="--gpus-per-node")
    cpus_per_node: int | None = Field(
        None, ge=1, description="--cpus-per-node (default: the spec's workers' CPUs per node)"
    )
    partition: str | None = Field(None, description="--partition")
    time: str | None = Field(None, description="--time: the job's limit, as sbatch reads it")
    account: str | None = Field(None, description="--account")
    grace_s: int = Field(
        DEFAULT_GRACE_S,
        ge=10,
        description="--grace: seconds of notice (USR1) before the job's end, to checkpoint",
    )
    sbatch_args: tuple[str, ...] = Field((), description="--sbatch-arg: more sbatch options")


class SlurmRun(BaseModel):
    """What ``raytrain.slurm.job`` runs inside the allocation (``job.json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: str = Field(description="the job spec's path, as given (relative to workdir)")
    overrides: tuple[str, ...] = Field((), description="dotted overrides of the spec")
    workdir: str = Field(description="where ``raytrain run`` runs (the submit's folder)")
    folder: str = Field(description="the run's Slurm folder: script, token, output")
    fresh: bool = Field(False, description="start over on the first attempt only")
    resume_anyway: bool = Field(False, description="resume even though the spec changed")
    force: bool = Field(False, description="take the run over from a live run holding it")
    cpus_per_node: int = Field(ge=1, description="Ray's CPUs on each node")
    gpus_per_node: int = Field(0, ge=0, description="Ray's GPUs on each node")
    python: str = Field(description="the Python that runs raytrain (the submitter's)")


def script(run: SlurmRun, name: str, options: SbatchOptions, script_path: Path) -> str:
    """The sbatch script of ``run``, to be written at ``script_path``: every value quoted
    for the shell."""
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# raytrain submit --slurm: run {name}; `raytrain status slurm:JOBID`",
        f"#SBATCH --job-name={q('raytrain-' + name)}",
        f"#SBATCH --nodes={options.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={run.cpus_per_node}",
        f"#SBATCH --signal=B:USR1@{options.grace_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={q(str(Path(run.folder) / OUTPUT))}",
    ]
    if options.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={options.gpus_per_node}")
    for flag in ("partition", "time", "account"):
        value = getattr(options, flag)
        if value is not None:
            lines.append(f"#SBATCH --{flag}={q(value)}")
    lines += [f"#SBATCH {q(arg)}" for arg in options.sbatch_args]
    lines += [
        "",
        f"cd {q(run.workdir)}",
        f"exec {q(run.python)} -m raytrain.slurm.job {q(str(described(script_path)))}",
        "",
    ]
    return "\n".join(lines)


def new_script_path(folder: Path) -> Path:
    """A new script's path in the Slurm folder: ``job-STAMP.sbatch``."""
    return folder / f"job-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}.sbatch"


def described(script_path: Path) -> Path:
    """Where the run a script runs is described: beside it, ``.json`` for ``.sbatch``."""
    return script_path.with_suffix(".json")


def write(run: SlurmRun, text: str, script_path: Path) -> None:
    """Write the script and its run's description (first: the script reads it)."""
    script_path.parent.mkdir(parents=True, exist_ok=True)
    described(script_path).write_text(run.model_dump_json(indent=1) + "\n")
    script_path.write_text(text)


def sbatch(path: Path) -> str:
    """Submit the script; Slurm's job id. ``SlurmError`` when sbatch is missing or refuses."""
    from raytrain.slurm.control import SlurmError, slurm_command

    done = slurm_command(["sbatch", "--parsable", str(path)])
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch {path}: answered {done.stdout.strip()[:200]!r}, not a job id")
    return job_id


def python() -> str:
    """The Python that runs raytrain here: the job runs the same on the nodes (a shared
    filesystem, as Slurm clusters have)."""
    return sys.executable
