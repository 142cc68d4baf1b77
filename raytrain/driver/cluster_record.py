"""The record of the cluster ``raytrain up`` started (``driver.local_cluster``): where it
is, what it holds, and whether its server still lives.

A JSON file in ``$RAYTRAIN_HOME`` (default ``~/.raytrain``), mode 0600, written whole. It
holds the address and the few variables the cluster's processes were started with that
Ray Train compares, never the whole environment: that may hold credentials.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

HOME_ENV = "RAYTRAIN_HOME"
RECORD_NAME = "cluster.json"
LOG_NAME = "cluster.log"
# Held (flock, exclusive) by the server for its whole life: the test of whether it lives,
# which a reused process id cannot fool, and what keeps a second server from starting.
LOCK_NAME = "cluster.lock"
# Held by `raytrain up` from its check to the record's writing: two `up`s at once start
# one server, and the second says it is up.
UP_LOCK_NAME = "up.lock"


def home() -> Path:
    """Where ``up`` keeps its record and log."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".raytrain")


@dataclass(frozen=True)
class ClusterRecord:
    """What ``up`` started: the server's process id, the cluster's GCS address, its size,
    the idle processes it keeps warm, and the variables its processes were started with
    that a run compares (``embedded_env``)."""

    pid: int
    address: str
    num_cpus: int
    num_gpus: int
    warm: int
    embedded_env: dict[str, str]
    started_at: float

    def describe(self) -> str:
        gpus = f", {self.num_gpus} GPU(s)" if self.num_gpus else ""
        return (
            f"{self.address} (pid {self.pid}): {self.num_cpus} CPU(s){gpus}, "
            f"{self.warm} warm worker process(es)"
        )


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (of this user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process under a reused id: not ours
        return False
    return True


def lock(name: str, *, wait: bool) -> int | None:
    """An exclusive flock on ``home()/name``: the open descriptor (closing it releases the
    lock), or None when another process holds it and ``wait`` is false."""
    folder = home()
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _server_holds_lock() -> bool:
    path = home() / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # a lock taken here is released with it
    return False


def running() -> ClusterRecord | None:
    """The cluster ``up`` started, while its server lives (it holds ``LOCK_NAME``); None
    otherwise: never up, or its server died (a stale record, whatever now has its pid)."""
    path = home() / RECORD_NAME
    try:
        record = ClusterRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return record if _server_holds_lock() and alive(record.pid) else None


def _up_in_progress() -> bool:
    """Whether an ``up`` holds ``UP_LOCK_NAME``: its server runs before its record is
    written (once its pool is warm)."""
    held = lock(UP_LOCK_NAME, wait=False)
    if held is None:
        return True
    os.close(held)
    return False


def lost_record() -> str | None:
    """The problem, one line naming the record, when a server holds ``LOCK_NAME`` (it lives)
    but its record is there and cannot be read (written whole, it was damaged since):
    ``running`` says nothing is up, yet ``down`` cannot stop it, and an ``up`` would start a
    second that fails on the lock (its log replacing the live one's). None else. A missing
    record is not one: a server removes its own as it stops, then shuts its cluster down."""
    path = home() / RECORD_NAME
    try:
        ClusterRecord(**json.loads(path.read_text()))
        return None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        why = f"not a cluster record ({type(exc).__name__})"
    if not _server_holds_lock() or _up_in_progress():  # none, or one that is starting
        return None
    return (
        f"{path}: {why}, yet the cluster `raytrain up` started still runs (its server holds "
        f"{home() / LOCK_NAME}); stop it with kill PID, its pid in {home() / LOG_NAME}'s "
        "'cluster up' line"
    )


def write_record(record: ClusterRecord) -> None:
    """Write the record whole (a reader never sees half of it) and readable by its owner
    only."""
    folder = home()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{RECORD_NAME}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f)
    os.replace(tmp, folder / RECORD_NAME)


def remove_record(pid: int) -> None:
    """Remove the record if it is still this server's."""
    path = home() / RECORD_NAME
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass
