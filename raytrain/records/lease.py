"""One live run per run folder: a lease file with its owner and a heartbeat. A sweep's
driver holds the same lease on its sweep folder (``kind="sweep"``), by the same rules.

Two drivers of the same ``name`` and ``checkpoint.storage`` would overwrite each other's
run state and Ray Train's checkpoint snapshot, and one's clean-up of uncommitted folders
would delete the other's uploads. So a driver holds ``{run folder}/raytrain-lease.json``
(owner host and pid, start time, heartbeat) while it runs:

- a lease whose heartbeat is older than ``STALE_S``, or whose owner is a process of this
  host that no longer exists, is stale: it is taken over with a warning (a killed driver
  never released its lease);
- a live lease refuses the new run (``RunStateError``, exit 2) naming its holder, unless
  the user passes ``--force``;
- the holder rewrites its heartbeat every ``HEARTBEAT_S`` and, before each, reads the file:
  a lease that now names another owner was taken over, and the holder stops its run.

Local storage creates the lease with ``O_EXCL``, so two starts cannot both win. Object
stores have no conditional write that pyarrow exposes: two drivers that start within the
same moment can both write a lease. The later write wins, and the other driver sees that
at its next heartbeat check and stops, so the overlap lasts at most ``HEARTBEAT_S``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from raytrain import storage
from raytrain.errors import RunStateError

if TYPE_CHECKING:
    from raytrain.spec import StorageSpec

LEASE_FILE = "raytrain-lease.json"
HEARTBEAT_S = 10.0
# No heartbeat for this long: the holder is gone (a lost node, a frozen process).
STALE_S = 120.0


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder's lease, as its lease file says."""

    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    token: str

    def describe(self, now: float) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return (
            f"pid {self.pid} on {self.host}, running since {started} "
            f"(last heartbeat {max(0.0, now - self.heartbeat_at):.0f} s ago)"
        )


def read_holder(run_dir: str, options: StorageSpec | None = None) -> Holder | None:
    """The lease's holder, or None when there is no lease. A lease file that cannot be read
    as one (truncated, edited) counts as stale: it names no process that could be alive."""
    text = storage.read_text(storage.join(run_dir, LEASE_FILE), options)
    if text is None:
        return None
    try:
        fields = json.loads(text)
        holder = Holder(
            host=str(fields["host"]),
            pid=int(fields["pid"]),
            started_at=float(fields["started_at"]),
            heartbeat_at=float(fields["heartbeat_at"]),
            token=str(fields["token"]),
        )
    except (ValueError, KeyError, TypeError, RecursionError):
        return _UNREADABLE
    # times a live holder could have written: finite, after 1970 and not far in the future
    # (a NaN or infinite heartbeat would never go stale; a started_at out of time_t's range
    # would fail to print)
    limit = time.time() + _FUTURE_S
    if not all(0.0 <= t <= limit for t in (holder.started_at, holder.heartbeat_at)):
        return _UNREADABLE
    return holder


# A lease that cannot be read as one: it names no process that could be alive.
_UNREADABLE = Holder(host="?", pid=-1, started_at=0.0, heartbeat_at=0.0, token="")
# How far ahead of this clock a heartbeat may be and still be a live holder's (clock skew).
_FUTURE_S = 86400.0


def is_stale(holder: Holder, now: float, host: str | None = None) -> bool:
    """Whether ``holder`` can no longer be running: no heartbeat for ``STALE_S``, or a
    process of this ``host`` (default: this machine) that does not exist."""
    if now - holder.heartbeat_at > STALE_S:
        return True
    return holder.host == (host or socket.gethostname()) and not _pid_alive(holder.pid)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no process has that pid
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def check_free(
    run_dir: str, options: StorageSpec | None = None, *, force: bool = False, kind: str = "run"
) -> None:
    """Refuse (``RunStateError``) when a live ``kind`` (run or sweep) holds ``run_dir``;
    writes nothing. Run before anything starts, so a second run is refused in a second, not
    after Ray starts."""
    _check_folder(run_dir, kind)
    holder = read_holder(run_dir, options)
    now = time.time()
    if holder is not None and not force and not is_stale(holder, now):
        raise _in_use(run_dir, holder, now, kind)


def _check_folder(run_dir: str, kind: str = "run") -> None:
    """Refuse (``RunStateError``) a local run folder that is a file, or is under one: the
    lease could not be made there, after Ray had started."""
    if storage.is_uri(run_dir):
        return
    path = folder = storage.resolve(run_dir)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    if path and not os.path.isdir(path):
        where = "is a file" if path == folder else f"would be under {path}, a file"
        raise RunStateError(
            f"name: {run_dir}: the {kind}'s folder {where}, not a folder; move it, or "
            "choose another name or checkpoint.storage"
        )


def _in_use(run_dir: str, holder: Holder, now: float, kind: str) -> RunStateError:
    return RunStateError(
        f"name: {run_dir} is in use by another {kind}: {holder.describe(now)}. Wait for it "
        f"to end; if it is gone, its lease is taken over once it has had no heartbeat for "
        f"{STALE_S:.0f} s, or now with --force"
    )


class Lease:
    """This driver's hold on a run folder, or a sweep's (see module docstring)."""

    def __init__(self, run_dir: str, options: StorageSpec | None = None, kind: str = "run"):
        self.run_dir = run_dir
        self.options = options
        self.kind = kind
        self.path = storage.join(run_dir, LEASE_FILE)
        self.holder = Holder(
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.time(),
            heartbeat_at=time.time(),
            token=uuid.uuid4().hex,
        )
        # The live lease this one displaced with --force: its run may still be uploading.
        self.displaced: Holder | None = None
        self.lost_to: Holder | None = None
        # Called once, with the new holder, if another run takes the lease over.
        self.on_lost: Callable[[Holder], None] | None = None
        self._made_folder = False  # the lease made the (local) run folder: a new run
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, *, force: bool = False) -> Lease:
        """Take the lease; raises ``RunStateError`` when a live run holds it (not ``force``).
        A stale lease is taken over, with a warning naming its holder."""
        now = time.time()
        if self._create_exclusive():
            return self
        holder = read_holder(self.run_dir, self.options)
        if holder is not None and not is_stale(holder, now):
            if not force:
                raise _in_use(self.run_dir, holder, now, self.kind)
            self.displaced = holder
            print(
                f"raytrain: warning: --force: taking over {self.path} from {holder.describe(now)}",
                file=sys.stderr,
            )
        elif holder is not None:
            print(
                f"raytrain: taking over the stale lease {self.path} of {holder.describe(now)}",
                file=sys.stderr,
            )
        self._write()
        return self

    def _create_exclusive(self) -> bool:
        """Create the lease file only if there is none (local storage); False otherwise, and
        always False on object stores (the caller then reads and writes)."""
        if storage.is_uri(self.path):
            return False
        _check_folder(self.run_dir, self.kind)
        path = storage.resolve(self.path)
        self._made_folder = not os.path.exists(os.path.dirname(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(self._text())
        return True

    def _text(self) -> str:
        return json.dumps(asdict(self.holder), indent=2)

    def _write(self) -> None:
        storage.write_text(self.path, self._text(), self.options)

    def rewrite(self) -> None:
        """Write the lease again (after ``--fresh`` emptied the folder)."""
        self._write()

    def start_heartbeat(self) -> None:
        """Renew the heartbeat every ``HEARTBEAT_S`` in a daemon thread; if another run took
        the lease over, record it in ``lost_to`` and call ``on_lost``."""

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S) and self.beat():
                pass

        self._thread = threading.Thread(target=beat, name="raytrain-lease", daemon=True)
        self._thread.start()

    def beat(self) -> bool:
        """One heartbeat: False (and ``on_lost`` called) if another run now holds the lease;
        else the heartbeat is renewed. A store that fails to answer is retried next beat."""
        try:
            current = read_holder(self.run_dir, self.options)
            if current is not None and current.token != self.holder.token:
                self.lost_to = current
                print(
                    f"raytrain: error: {self.path} was taken over by "
                    f"{current.describe(time.time())}; stopping",
                    file=sys.stderr,
                )
                if self.on_lost is not None:
                    self.on_lost(current)
                return False
            self.holder = _renewed(self.holder)
            self._write()
        except Exception as exc:
            print(f"raytrain: warning: lease heartbeat failed: {exc}", file=sys.stderr)
        return True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        """However the run ended, the lease is let go (``release``)."""
        self.release()

    def release(self) -> None:
        """Stop the heartbeat and delete the lease file, if it is still this run's. A second
        call finds the file gone, or another run's, and leaves it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S)
        try:
            current = read_holder(self.run_dir, self.options)
            if current is not None and current.token == self.holder.token:
                storage.delete_file(self.path, self.options)
                folder = os.path.dirname(storage.resolve(self.path))
                if self._made_folder and not os.listdir(folder):
                    os.rmdir(folder)  # a run that wrote nothing leaves nothing
        except Exception as exc:  # the next run takes a leftover lease over as stale
            print(f"raytrain: warning: could not release {self.path}: {exc}", file=sys.stderr)


def _renewed(holder: Holder) -> Holder:
    return replace(holder, heartbeat_at=time.time())
