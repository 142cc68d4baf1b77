"""SIGUSR1 to ``raytrain run``: stop the run at a committed checkpoint, as a preemption.

A scheduler that gives notice before it takes a job's machines tells the job's own process,
not Ray's workers: Slurm signals the batch script (``sbatch --signal=B:USR1@GRACE``), and
the batch script is where ``raytrain run`` runs (``raytrain.slurm.job``). So the driver
turns the signal into the workers' preemption path (``worker.preemption``): the handler
only sets a flag (``install``, at the CLI's start, so a signal during Ray's start is not
lost); while training, a thread hands it to the run's event sink (``forwarding``), which
rank 0 reads at its next preemption check (``failure.preemption_check_s``). The ranks save
a checkpoint, wait until Ray has committed it and raise ``PreemptedError``; the failure
policy, seeing the request, does not restart them, and the run ends with
``errors.RunPreempted`` (exit 4). The same command resumes it, as attempt N+1 of the same
MLflow run, with nothing trained twice.

Why a flag on the sink and not a SIGTERM to each worker: the driver knows neither the
workers' processes nor their nodes (Ray Train's controller does), and rank 0 already asks
the sink for the run's MTBF; the check costs one actor call per ``preemption_check_s``.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

    from ray.actor import ActorHandle

SIGNAL = signal.SIGUSR1

_asked = threading.Event()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _asked.set()  # nothing else in a handler: the forwarding thread does the rest


def install() -> bool:
    """Make SIGUSR1 a stop request for this process (main thread only); False elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(SIGNAL, _on_signal)
    return True


def requested() -> bool:
    """Whether this process was asked to stop at a checkpoint."""
    return _asked.is_set()


@contextmanager
def forwarding(sink: ActorHandle, every_s: float = 2.0) -> Iterator[None]:
    """While training: hand a stop request (now or later) to the run's ``sink``, and again
    every ``every_s`` until training ends: the sink is restarted if its process dies, and
    a restarted sink has forgotten the flag (setting it again is harmless)."""
    done = threading.Event()

    def forward() -> None:
        while not done.is_set() and not _asked.wait(timeout=0.5):
            pass
        if done.is_set():
            return
        print(
            "raytrain: SIGUSR1: saving a checkpoint, then stopping (the same command "
            "resumes the run)",
            file=sys.stderr,
            flush=True,
        )
        while True:
            with suppress(Exception):  # the sink is gone or restarting: the next try
                sink.request_preemption.remote()
            if done.wait(timeout=every_s):
                return

    thread = threading.Thread(target=forward, name="raytrain-preempt-request", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
