"""How many intra-op threads a training worker's torch runs, decided as torchrun decides it.

torchrun gives each worker ``OMP_NUM_THREADS`` unless the user set it; Ray 2.60 does not
(its helper for it is never called), so without this every rank's pool is sized for the
whole machine and, on 2 cores, each rank's threads fight the other's. The worker takes the
CPUs Ray Train reserved for it (``scaling.resources_per_worker.CPU``), or the user's
``OMP_NUM_THREADS`` when it is a positive integer, and exports the number, so that
processes it starts inherit it (a DataLoader's workers still take 1: torch sets that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

OMP_ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """The threads a worker runs and why: ``reason`` ends the line rank 0 prints."""

    threads: int
    reason: str

    def describe(self) -> str:
        plural = "" if self.threads == 1 else "s"
        return f"{self.threads} intra-op thread{plural} per worker: {self.reason}"


def choose_threads(cpus: float, environ: Mapping[str, str]) -> ThreadChoice:
    """The threads for a worker given ``cpus`` CPUs, under ``environ``.

    Invariant: a positive integer ``OMP_NUM_THREADS`` in ``environ`` is the answer;
    otherwise the whole CPUs given, at least 1 (a fraction of a CPU still runs a thread).
    """
    given = max(1, math.floor(cpus))
    raw = environ.get(OMP_ENV)
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value > 0:
            return ThreadChoice(value, f"{OMP_ENV}={value}, as set")
        return ThreadChoice(
            given,
            f"{OMP_ENV}={raw!r} is not a positive integer, so the "
            f"{given} CPU(s) each worker was given",
        )
    return ThreadChoice(given, f"the CPU(s) each worker was given (set {OMP_ENV} to choose)")
