"""A local Ray cluster that stays up between runs: ``raytrain up`` / ``down`` / ``up --status``.

``up`` starts a detached server process (``serve``) that starts an embedded cluster the way
``start_local`` does for a pipeline, with a warm pool of preloaded worker processes
(``driver.warm_pool``), writes the cluster's record (``ClusterRecord``) and waits for
SIGTERM. ``down`` sends it SIGTERM: the server shuts its cluster down (Ray stops the
processes it started, by their own ids) and removes the record. Every Ray process of the
cluster is the server's descendant and shares its fate, so nothing outlives it.

While the record names a live server, ``raytrain run``, ``tune`` and ``fit`` join that
cluster (``driver.ray_runtime.connect``) as they would one named by ``RAY_ADDRESS``; they
leave nothing in it (their actors and placement groups end with their job).

The record: ``driver.cluster_record``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from raytrain.contract import WARM_DIR_ENV
from raytrain.driver.cluster_record import (
    LOCK_NAME,
    LOG_NAME,
    UP_LOCK_NAME,
    ClusterRecord,
    home,
    lock,
    remove_record,
    running,
    write_record,
)
from raytrain.driver.ray_runtime import DATA_CPUS, EMBEDDED_ENV, start_local

# Ray's token authentication: its mode (``ray.init`` sets it for a new local cluster) and
# where the token is, when not in the default ~/.ray/auth_token.
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")

# How long the server waits for its pool to be warm before it says it is up (on 2 cores,
# 7 processes importing torch and Lightning took about 25 s).
WARM_WAIT_S = 120.0

# Processes a run takes besides its training workers: Ray Train's controller, its
# synchronization actor and placement-group cleaner, raytrain's metrics sink and state
# keeper (counted on a digits run).
RUN_HELPERS = 5


def default_warm(num_cpus: int) -> int:
    """Idle processes to keep: a run's helpers and one per CPU a training worker may take,
    plus as many spares for the group that replaces it after a failure (the pool refills
    only between runs)."""
    workers = max(1, num_cpus - DATA_CPUS)
    return 2 * workers + RUN_HELPERS


class UpError(RuntimeError):
    """``up`` could not start its cluster; the message says why (the server's log)."""


def up(
    num_cpus: int, num_gpus: int | None = None, warm: int | None = None, timeout_s: float = 300.0
) -> tuple[ClusterRecord, bool]:
    """Start the server unless one is up; (its record, whether it started now). Two
    ``up``s at once start one server: the second waits, then finds it up."""
    held = lock(UP_LOCK_NAME, wait=True)
    try:
        found = running()
        if found is not None:
            return found, False
        return _start_server(num_cpus, num_gpus, warm, timeout_s), True
    finally:
        os.close(held)  # type: ignore[arg-type]  # waited: never None


def _start_server(
    num_cpus: int, num_gpus: int | None, warm: int | None, timeout_s: float
) -> ClusterRecord:
    log = home() / LOG_NAME
    gpus = "auto" if num_gpus is None else str(num_gpus)
    cmd = [
        sys.executable,
        "-m",
        "raytrain.driver.local_cluster",
        str(num_cpus),
        gpus,
        str(default_warm(num_cpus) if warm is None else warm),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = running()
        if record is not None and record.pid == proc.pid:
            return record
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise UpError(
                f"the cluster did not start (exit {proc.returncode}); {log}:\n" + "\n".join(tail)
            )
        time.sleep(0.2)  # the server writes its record once its pool is warm
    os.killpg(proc.pid, signal.SIGKILL)
    raise UpError(f"the cluster did not start within {timeout_s:.0f} s; see {log}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def down(timeout_s: float = 60.0) -> ClusterRecord | None:
    """Stop the server ``up`` started and wait until every process of its session is
    gone (the server leads its own process group: ``up`` starts it in a new session, and
    the cluster's processes are its descendants); its record, or None when nothing was
    up. What is still there after ``timeout_s`` is killed."""
    record = running()
    if record is None:
        return None
    with contextlib.suppress(ProcessLookupError):  # it may end between the check and now
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _group_alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(record.pid):  # its cluster's shutdown hung: end the whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.pid, signal.SIGKILL)
    remove_record(record.pid)
    return record


def serve(num_cpus: int, num_gpus: int | None, warm: int) -> None:
    """The server: start the cluster, write its record, wait for SIGTERM or SIGINT, stop."""
    import ray

    server_lock = lock(LOCK_NAME, wait=False)
    if server_lock is None:
        raise SystemExit("another raytrain cluster server holds " + str(home() / LOCK_NAME))
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    marks = Path(tempfile.mkdtemp(prefix="raytrain-warm-"))
    os.environ[WARM_DIR_ENV] = str(marks)  # the cluster's processes inherit it
    handle = start_local(num_cpus, warm=warm, warm_marks=marks, num_gpus=num_gpus)
    # after ray.init, which installs its own SIGTERM handler (it exits at once)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        if handle.pool is not None:  # up returns once a run would find the pool warm
            handle.pool.fill(WARM_WAIT_S)
        started = handle.embedded_env or {}
        compared = {
            k: v for k, v in started.items() if k in EMBEDDED_ENV or k.startswith("RAY_TRAIN_")
        }
        for key in AUTH_ENV:  # how a joining driver finds the token; never the token itself
            if os.environ.get(key):
                compared[key] = os.environ[key]
        held = ray.cluster_resources()
        record = ClusterRecord(
            pid=os.getpid(),
            address=ray.get_runtime_context().gcs_address,
            num_cpus=num_cpus,
            num_gpus=int(held.get("GPU", 0)),
            warm=warm,
            embedded_env=compared,
            started_at=time.time(),
        )
        write_record(record)
        print(f"raytrain: cluster up at {record.describe()}", flush=True)
        while not stop.wait(1.0):  # a timed wait: the signal's handler runs between waits
            pass
    finally:
        remove_record(os.getpid())
        handle.shutdown()
        shutil.rmtree(marks, ignore_errors=True)
        os.close(server_lock)


if __name__ == "__main__":
    serve(int(sys.argv[1]), None if sys.argv[2] == "auto" else int(sys.argv[2]), int(sys.argv[3]))
