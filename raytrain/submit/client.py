"""Sending a job spec to a Ray cluster's job server, and following it there.

``submit`` checks the spec here (its schema: nothing on the cluster is touched for a typo),
uploads the working directory (Ray's runtime environment: it honours ``.gitignore`` and
``.rayignore``; raytrain leaves secret-shaped files out too, says which, and refuses a link
that leads out of the directory), and starts ``python -m raytrain run SPEC ...`` as a Ray
job; the job's driver joins the cluster through the ``RAY_ADDRESS`` Ray sets for it. The
returned ``JobHandle`` follows the job by id, so a pipeline step can submit in one task and
wait or stop in another.

The cluster's token (Ray token authentication) comes from ``token=``, ``$RAY_AUTH_TOKEN``,
the file ``$RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, in that order. It travels in the
HTTP ``Authorization`` header only: it is never printed, logged, or put in the job's
runtime environment (the job's driver gets the cluster's own). It is not sent over plain
http to a host other than this machine unless asked (``insecure=True``, ``--insecure``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Json, ValidationError, field_validator

from raytrain import storage
from raytrain._compat.ray_core import NOISY_LOGGERS
from raytrain.checkpoints.layout import run_dir
from raytrain.errors import one_line
from raytrain.records.run_status import RunStatus, read_status
from raytrain.spec import StorageSpec
from raytrain.spec.fields import check_name
from raytrain.submit.connection import (
    JOB_ID_MAX_CHARS,
    TOKEN_ENV,
    JobsError,
    JobUnknown,
    ServerUnreachable,
    _find_token,
    _refused,
    check_job_id,
    check_transport,
    job_segment,
    resolve_address,
)
from raytrain.submit.uploads import upload_excludes
from raytrain.util.provenance import GIT_COMMIT_ENV, git_commit
from raytrain.util.redaction import is_secret_env, is_secret_name, masked_fields, redact
from raytrain.util.terminal import printable

if TYPE_CHECKING:
    from ray.job_submission import JobDetails

    from raytrain.spec import JobSpec

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _unreachable() -> tuple[type[BaseException], ...]:
    """What a request to a job server that is not there raises: Ray's version check raises
    the builtin ``ConnectionError``, its later calls let ``requests``' own through. Asked
    only when a call failed (an ``except`` clause's types are evaluated then): importing
    ``requests`` cost every ``import raytrain`` 80 ms."""
    import requests

    return (ConnectionError, requests.ConnectionError, requests.Timeout)


class JobServer:
    """A connection to one cluster's job server (``ray.job_submission.JobSubmissionClient``
    with the token in its headers), translating its failures into ``JobsError``."""

    def __init__(
        self, address: str | None = None, *, token: str | None = None, insecure: bool = False
    ):
        from ray.job_submission import JobSubmissionClient

        self.address = resolve_address(address)
        secret, self._token_source = _find_token(token)
        check_transport(self.address, secret, insecure)
        headers = {"Authorization": f"Bearer {secret}"} if secret else None
        try:
            self.client = JobSubmissionClient(self.address, headers=headers)
            # the version check above is open to all; this call needs the token
            self.client.list_jobs()
        except _unreachable():
            raise ServerUnreachable(
                f"{self.address}: no Ray job server answers there (is the head up, and "
                "is this its dashboard port, 8265 by default?)"
            ) from None
        except Exception as exc:
            refused = _refused(exc, self.address, self._token_source)
            raise (refused or JobsError(f"{self.address}: {exc}")) from None

    def call(
        self, what: str, job_id: str | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """``fn(*args)`` on the client; an unknown job id or a refusal is a ``JobsError``."""
        try:
            return fn(*args, **kwargs)
        except _unreachable():
            raise ServerUnreachable(f"{self.address}: the job server stopped answering") from None
        except Exception as exc:
            if job_id and "404" in str(exc):
                raise JobUnknown(f"job {job_id}: no such job on {self.address}") from None
            refused = _refused(exc, self.address, self._token_source)
            if refused:
                raise refused from None
            raise JobsError(f"{what} on {self.address}: {one_line(exc)}") from None

    def handle(self, job_id: str) -> JobHandle:
        """The handle of an existing job; an unknown id, or one that is not a job id's
        (``connection.check_job_id``), is a ``JobsError``."""
        self.call("status", job_id, self.client.get_job_status, job_segment(job_id))
        return JobHandle(job_id, self)

    def jobs(self) -> list[JobDetails]:
        """Every job the server knows, oldest first (Ray's ``JobDetails``)."""
        found = self.call("list", None, self.client.list_jobs)
        return sorted(found, key=lambda j: j.start_time or 0)


@dataclass
class JobHandle:
    """A job on a cluster, by id: what a pipeline keeps between steps."""

    job_id: str
    server: JobServer
    # a supervised job's (``supervisor.supervise``): the ids of the jobs it resubmitted
    earlier: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_job_id(self.job_id, "job id")  # the server's answer to a submission too

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        return self.server.call(what, self.job_id, fn, job_segment(self.job_id), *args)

    def status(self) -> str:
        """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
        return str(self._call("status", self.server.client.get_job_status).value)

    def info(self) -> JobDetails:
        """Ray's ``JobDetails``: status, message, entrypoint, times, metadata."""
        return self._call("info", self.server.client.get_job_info)

    def logs(self) -> str:
        """The job's driver output so far."""
        return self._call("logs", self.server.client.get_job_logs)

    def progress(self) -> RunStatus | None:
        """The run's live status record (``raytrain.records.run_status``), read from its storage as
        the job's driver writes it: how far along, its ETA, its last checkpoint, its
        restarts; its ``age()`` says how old, which keeps growing once a driver died. None
        until the driver wrote one. A job whose run folder cannot be read from here (a
        relative ``checkpoint.storage``, a sweep, a spec not read at submit) is a
        ``JobsError`` saying so, and so is metadata that is not what ``submit`` writes
        (``JobMetadata``)."""
        meta = self.metadata()
        if not meta.raytrain_run_dir:
            raise JobsError(
                f"job {self.job_id}: its status record cannot be read from here: its "
                "checkpoint.storage is not an object store or an absolute path (a sweep's "
                "trials each keep their own), so the run folder is on the cluster"
            )
        return read_status(meta.raytrain_run_dir, meta.raytrain_storage)

    def metadata(self) -> JobMetadata:
        """What raytrain wrote into the job's metadata, checked (``JobMetadata``)."""
        return JobMetadata.of(self.job_id, self.info().metadata)

    def follow(self) -> Iterator[str]:
        """The driver's output as it comes, until the job ends."""
        stream = self._call("logs", self.server.client.tail_job_logs)
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    yield loop.run_until_complete(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(stream.aclose())
            loop.close()

    def wait(self, timeout_s: float | None = None, poll_s: float = 1.0) -> str:
        """Block until the job ends and return its final status; ``TimeoutError`` after
        ``timeout_s`` (the job keeps running)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (status := self.status()) not in TERMINAL:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {status} after {timeout_s}s")
            time.sleep(poll_s)
        return status

    def stop(self) -> bool:
        """Ask the cluster to stop the job (SIGTERM to its driver, then SIGKILL); False
        when it had already ended."""
        return bool(self._call("stop", self.server.client.stop_job))


def entrypoint(
    spec_path: str, overrides: Iterable[str], flags: Sequence[str] = (), command: str = "run"
) -> str:
    """The job's command: raytrain's own CLI (``run``, or ``tune`` for a sweep), from the
    working directory's copy or the cluster's install."""
    return shlex.join(["python", "-m", "raytrain", command, spec_path, *overrides, *flags])


def _spec_in_working_dir(spec: str | os.PathLike[str], working_dir: Path) -> str:
    """``spec`` relative to ``working_dir``: the job reads it from the uploaded copy."""
    path = Path(spec).resolve()
    try:
        return path.relative_to(working_dir).as_posix()
    except ValueError:
        raise JobsError(
            f"{spec}: the spec is outside the working directory {working_dir}; the cluster "
            "only gets that directory (move the spec there or pass --working-dir)"
        ) from None


def _warnings(job: JobSpec, env: Mapping[str, str], overrides: Sequence[str] = ()) -> list[str]:
    """What a run on a cluster keeps only until its job's working dir is deleted, and
    credentials about to be recorded in the job's runtime environment or entrypoint."""
    notes = [
        f"--env {key}: the job's runtime environment is recorded and shown by the dashboard "
        "and `ray job list`; give the cluster this credential through its own environment "
        "(the node setup, a Kubernetes Secret)"
        for key, value in env.items()
        if is_secret_env(key, value)
    ]
    notes += [
        f"override {key}: the job's entrypoint, overrides and all, is recorded and shown by "
        "the dashboard and `ray job list`; give the cluster this credential through its own "
        "environment"
        for key, _, value in (item.partition("=") for item in overrides)
        if is_secret_name(key) or redact(value) != value
    ]
    masked = masked_fields(job.flat())
    if masked:
        notes.append(
            f"{', '.join(masked)}: credential-like values in the spec; raytrain masks them in "
            "what it records, but the spec file is uploaded with the working dir as it is"
        )
    if storage.is_relative_path(job.checkpoint.storage):
        notes.append(
            f"checkpoint.storage {job.checkpoint.storage!r} is a relative path: on the "
            "cluster it lands in the job's copy of the working dir and goes with it; use "
            "s3://, gs://, abfs:// or a path every node shares"
        )
    if not job.tracking.mlflow.tracking_uri and "MLFLOW_TRACKING_URI" not in env:
        notes.append(
            "no tracking.mlflow.tracking_uri and no --env MLFLOW_TRACKING_URI: the run's "
            "MLflow record lands in the job's working dir; point it at an MLflow server"
        )
    return notes


def _working_dir_env(
    spec: str | os.PathLike[str],
    working_dir: str | os.PathLike[str] | None,
    include: Sequence[str],
) -> tuple[dict[str, Any], str]:
    """The runtime env's upload of ``working_dir`` (none for None), secret-shaped files left
    out and named on stderr, and the spec's path as the job sees it."""
    if working_dir is None:
        return {}, str(spec)
    root = Path(working_dir).resolve()
    if not root.is_dir():
        raise JobsError(f"--working-dir {working_dir}: not a directory")
    spec_path = _spec_in_working_dir(spec, root)
    excludes, left_out = upload_excludes(root, include)
    if left_out:  # by name only: what they hold is never read
        print(
            printable(
                f"raytrain: left out of the upload (secret-shaped; --include PATTERN "
                f"sends one): {', '.join(left_out)}"
            ),
            file=sys.stderr,
        )
    return {"working_dir": str(root), "excludes": excludes}, spec_path


def _job_env(
    env: dict[str, str], pip: Sequence[str], working_dir: str | os.PathLike[str] | None
) -> dict[str, Any]:
    """The runtime env's packages and variables; the job's copy of the working dir has no
    .git, so the run's MLflow record gets the commit from here."""
    if working_dir is not None and GIT_COMMIT_ENV not in env:
        found = git_commit(str(working_dir))
        if found:
            env[GIT_COMMIT_ENV] = found[0] + ("+dirty" if found[1] else "")
    return {**({"pip": list(pip)} if pip else {}), **({"env_vars": env} if env else {})}


def submit(
    spec: str | os.PathLike[str],
    overrides: Iterable[str] = (),
    *,
    address: str | None = None,
    token: str | None = None,
    working_dir: str | os.PathLike[str] | None = ".",
    pip: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    job_id: str | None = None,
    fresh: bool = False,
    resume_anyway: bool = False,
    force: bool = False,
    warn: bool = True,
    insecure: bool = False,
    include: Sequence[str] = (),
) -> JobHandle:
    """Submit the job spec at ``spec`` (with dotted ``overrides``) to the cluster at
    ``address`` and return its handle at once (``supervisor.supervise`` follows it to its
    end and submits it again when the cluster loses it).

    ``working_dir`` (uploaded; the spec must be inside it) carries the job's code, raytrain's
    too when it is a raytrain checkout; with ``working_dir=None`` the spec path is taken as
    it is on the cluster. ``pip`` installs packages for the job (``["raytrain==0.3"]`` on a
    cluster without it). ``env`` sets the job's environment (an MLflow server's URI, ...).
    Secret-shaped files are left out of the upload (``upload_excludes``; ``include``: gitignore
    patterns to send anyway), and named on stderr. ``insecure``: send the cluster's token
    over plain http to another machine (refused otherwise).
    """
    if job_id is not None:
        check_job_id(job_id, "--job-id")
    overrides = list(overrides)
    env = dict(env or {})
    if TOKEN_ENV in env:
        raise JobsError(
            f"--env {TOKEN_ENV}: the job's driver uses the cluster's own token; sending it "
            "would put it in the job's recorded runtime environment"
        )
    runtime_env, spec_path = _working_dir_env(spec, working_dir, include)
    job = _checked_here(spec, overrides, env, working_dir, warn)
    runtime_env.update(_job_env(env, pip, working_dir))
    sweep = job is not None and job.tune is not None  # the job runs `raytrain tune`
    flags = _run_flags(sweep, fresh=fresh, resume_anyway=resume_anyway, force=force)
    # Ray warns on every upload that it leaves .git and .venv out; so does WORKING_DIR_EXCLUDES
    logging.getLogger(NOISY_LOGGERS["working_dir"]).setLevel(logging.ERROR)
    server = JobServer(address, token=token, insecure=insecure)
    submitted = server.call(
        "submit",
        None,
        server.client.submit_job,
        entrypoint=entrypoint(spec_path, overrides, flags, "tune" if sweep else "run"),
        runtime_env=runtime_env or None,
        submission_id=job_id,
        metadata={
            "raytrain_job": job.name if job else spec_path,
            **({"raytrain_sweep": "true"} if sweep else {}),
            **(_status_metadata(job) if job is not None and not sweep else {}),
        },
    )
    return JobHandle(submitted, server)


def _checked_here(
    spec: str | os.PathLike[str],
    overrides: list[str],
    env: dict[str, str],
    working_dir: str | os.PathLike[str] | None,
    warn: bool,
) -> JobSpec | None:
    """The spec, loaded and checked here when it is here (a typo fails before anything
    reaches the cluster), its warnings printed; None: the path is the cluster's."""
    from raytrain.spec import load_spec

    if working_dir is None and not Path(spec).is_file():
        return None
    job = load_spec(spec, overrides)
    if warn:
        for line in _warnings(job, env, overrides):
            print(f"raytrain: warning: {printable(line)}", file=sys.stderr)
    return job


def _run_flags(sweep: bool, *, fresh: bool, resume_anyway: bool, force: bool) -> list[str]:
    """The job's ``raytrain run``/``tune`` flags; a sweep takes ``--fresh`` only."""
    if sweep and (resume_anyway or force):
        raise JobsError(
            "--resume-anyway and --force are for one run; a sweep (the spec's "
            "tune section) takes --fresh only"
        )
    given = (("--fresh", fresh), ("--resume-anyway", resume_anyway), ("--force", force))
    return [flag for flag, on in given if on]


# The job's metadata keys that say where its run's status record is, and how to open it.
RUN_DIR_META = "raytrain_run_dir"
STORAGE_META = "raytrain_storage"


class JobMetadata(BaseModel):
    """What ``submit`` writes into a job's metadata and raytrain reads back: the job server
    returns it, so it is checked as a spec is. Other keys (``ray job submit
    --metadata-json``'s) are the job's own and are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    raytrain_job: str | None = Field(default=None, description="the spec's name (list shows it)")
    raytrain_sweep: Literal["true"] | None = Field(
        default=None, description="set when the job runs `raytrain tune`: its trials' lines"
    )
    raytrain_run_dir: str | None = Field(
        default=None,
        description="the run folder, `{checkpoint.storage}/{name}`: an object store's URI or "
        "an absolute path, which this machine reads too",
    )
    raytrain_storage: Json[StorageSpec] | None = Field(
        default=None, description="the spec's `storage` section (JSON): how to open the folder"
    )

    @field_validator("raytrain_run_dir")
    @classmethod
    def _a_run_folder(cls, value: str | None) -> str | None:
        """A location a run folder can be (what ``_status_metadata`` writes): a URI or an
        absolute path with no problem (``storage.location_problem``), ending in a run's
        name, so it names nothing but a run's ``raytrain-status.json``."""
        if value is None:
            return value
        problem = storage.location_problem(value)
        if problem is None and not (storage.is_uri(value) or os.path.isabs(value)):
            problem = "not an object store's URI or an absolute path"
        if problem is not None:
            raise ValueError(problem)
        check_name(value.rstrip("/").rsplit("/", 1)[-1])  # the run's name, as a spec's
        return value

    @classmethod
    def of(cls, job_id: str, metadata: object) -> JobMetadata:
        """The checked metadata of the job ``job_id``; malformed, a ``JobsError`` naming
        the key (exit 2, one line)."""
        try:
            return cls.model_validate(metadata or {})
        except ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(part) for part in first["loc"]) or "metadata"
            raise JobsError(
                f"job {job_id}: its metadata {key}: {one_line(first['msg'])} "
                f"({exc.error_count()} problem(s); not what raytrain submit "
                "writes)"
            ) from None


def again_id(job_id: str) -> str:
    """A resubmission's id: the first's, cut to fit, with a random suffix."""
    suffix = f"-{uuid.uuid4().hex[:6]}"
    return job_id[: JOB_ID_MAX_CHARS - len(suffix)] + suffix


def _status_metadata(job: JobSpec) -> dict[str, str]:
    """Where the job's run folder is, when this machine names the same place the job's
    driver will (an object store, or an absolute path); a relative ``checkpoint.storage``
    is under the job's working dir on the cluster. The spec's ``storage`` section holds no
    credential (they come from each provider's own chain), so it may travel."""
    location = job.checkpoint.storage
    if not (storage.is_uri(location) or os.path.isabs(location)):
        return {}
    return {RUN_DIR_META: run_dir(job), STORAGE_META: job.storage.model_dump_json()}


def attach(
    job_id: str, *, address: str | None = None, token: str | None = None, insecure: bool = False
) -> JobHandle:
    """The handle of a job submitted earlier (a pipeline's later step); ``JobsError`` for an
    unknown id (or one that is not a job id's, refused before any request)."""
    check_job_id(job_id, "job_id")
    return JobServer(address, token=token, insecure=insecure).handle(job_id)


def list_jobs(
    *, address: str | None = None, token: str | None = None, insecure: bool = False
) -> list[JobDetails]:
    """Every job on the cluster's job server, oldest first (Ray's ``JobDetails``)."""
    return JobServer(address, token=token, insecure=insecure).jobs()
