"""Noticing, during a run, that the cluster ``raytrain up`` started went away.

A run joined to that cluster (``ray_runtime.join_up``) watches its record. When the server
removes it (``raytrain down`` from another shell: the record goes before the cluster) or
dies (its lock is free), Ray's own reaction
is a wait on a dead GCS, or the driver's core worker ending the process from C++ once its
raylet is dead: neither says what happened or what to do. The watch says it first, on
stderr, in one line, and marks itself ``lost``; the launcher then ends the run with
``ClusterLost`` (exit 1) if Ray lets it, and the next run of the same command resumes.
"""

from __future__ import annotations

import sys
import threading

from raytrain.driver.cluster_record import ClusterRecord, running

# How often the record and the server's lock are checked (a file read and a flock).
CHECK_EVERY_S = 0.2


def lost_line(record: ClusterRecord) -> str:
    """The one line that says what happened and what to do."""
    return (
        f"the cluster `raytrain up` started ({record.address}) went away during the "
        "run; run the same command again: it resumes from the last committed "
        "checkpoint"
    )


class ClusterWatch:
    """Watches the server of ``record`` from a daemon thread until ``stop``."""

    def __init__(self, record: ClusterRecord, every_s: float = CHECK_EVERY_S):
        self.record = record
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._every_s = every_s
        self._thread = threading.Thread(
            target=self._run, name="raytrain-cluster-watch", daemon=True
        )

    def start(self) -> ClusterWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            if running() != self.record:  # its server stopping (record gone) or dead
                self.lost.set()
                print(f"raytrain: {lost_line(self.record)}", file=sys.stderr, flush=True)
                return

    def stop(self) -> None:
        self._stop.set()
