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

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TOKEN_FILE = "ray_token-{job}"
OUTPUT = "slurm-%j.out"
DEFAULT_GRACE_S = 120


# sbatch options raytrain's job depends on: an --sbatch-arg may not change them.
MANAGED = {
    **dict.fromkeys(("--signal",), "USR1 before the end: the checkpoint's notice"),
    **dict.fromkeys(("--requeue", "--no-requeue"), "the job requeues itself"),
    **dict.fromkeys(("--output", "-o", "--error", "-e", "--open-mode"), "logs slurm:JOBID"),
    **dict.fromkeys(("--nodes", "-N"), "--nodes"),
    **dict.fromkeys(("--ntasks-per-node", "--ntasks", "-n"), "one Ray node per Slurm node"),
    **dict.fromkeys(("--cpus-per-task", "-c"), "--cpus-per-node"),
    **dict.fromkeys(("--gpus-per-node",), "--gpus-per-node"),
}


def _check_directive(value: str) -> None:
    """sbatch reads ``#SBATCH`` lines itself, not a shell: a line break ends the directive
    and a backslash escapes even inside quotes, so neither may be in a value."""
    if any(ch in value for ch in "\\\n\r") or not value.isprintable():
        raise ValueError(f"{value!r}: a line break, backslash or control character")


def time_limit_s(text: str) -> int | None:
    """Seconds of an sbatch ``--time`` (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None for
    one this does not read (``UNLIMITED``, a typo: sbatch itself judges it)."""
    days_text, dash, rest = text.partition("-")
    if not dash:
        days_text, rest = "0", text
    try:
        days, parts = int(days_text), [int(p) for p in rest.split(":")]
    except ValueError:
        return None
    if len(parts) > 3:
        return None
    if dash:
        h, m, s = [*parts, 0, 0][:3]
    elif len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = 0, parts[0], 0
    return ((days * 24 + h) * 60 + m) * 60 + s


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

    @field_validator("partition", "time", "account")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        if value is not None:
            _check_directive(value)
        return value

    @field_validator("sbatch_args")
    @classmethod
    def _options(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            _check_directive(value)
            if not value.startswith("-"):
                raise ValueError(f"{value!r}: an sbatch option begins with '-'")
            # --long=value, or -x with its value attached (-N2, -o/path)
            name = value.split("=", 1)[0] if value.startswith("--") else value[:2]
            if name in MANAGED:
                raise ValueError(f"{name}: raytrain sets it ({MANAGED[name]})")
        return values

    @model_validator(mode="after")
    def _grace_within_time(self) -> SbatchOptions:
        limit = time_limit_s(self.time) if self.time is not None else None
        if limit is not None and self.grace_s >= limit:
            raise ValueError(
                f"--grace {self.grace_s} s: not shorter than --time {self.time} ({limit} s): "
                "every attempt would be told to stop at its start, and requeue forever"
            )
        return self


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
