"""``WarmPool.top_up``'s arithmetic against a raylet of the test's own: how many processes
it starts, and when it starts none."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raytrain._compat.ray_core import NodeWorkers
from raytrain.driver import warm_pool
from raytrain.driver.warm_pool import WarmPool


class Raylet:
    """Idle processes (``idle``, those of them marked ready in ``marks``) and actors; what
    the pool asked it to start."""

    def __init__(self, marks: Path, idle: int = 0, ready: int = 0, actors: int = 0):
        self.marks = marks
        self.idle = list(range(100, 100 + idle))
        self.actors = actors
        for pid in self.idle[:ready]:
            (marks / str(pid)).touch()
        self.started: list[int] = []

    def workers(self) -> NodeWorkers:
        return NodeWorkers(idle=list(self.idle), actors=self.actors)

    def prestart(self, count: int, keep_alive_s: int) -> None:
        self.started.append(count)

    def close(self) -> None:
        pass


def pool_on(raylet: Raylet, target: int) -> WarmPool:
    pool = WarmPool("127.0.0.1:1", target, marks=raylet.marks)
    pool._raylet.close()
    pool._raylet = raylet  # type: ignore[assignment]
    return pool


def test_one_process_imports_at_a_time_once_a_run_may_be_there(tmp_path: Path) -> None:
    importing = Raylet(tmp_path, idle=3, ready=2)  # one of them still importing
    assert pool_on(importing, target=9).top_up() == 3
    empty = Raylet(tmp_path, idle=0)
    pool_on(empty, target=9).top_up()
    assert importing.started == [] and empty.started == [1]


def test_no_refill_beside_a_run_and_none_past_the_target(tmp_path: Path) -> None:
    running = Raylet(tmp_path, idle=0, actors=2)
    pool_on(running, target=9).top_up()
    full = Raylet(tmp_path, idle=9, ready=9)
    pool_on(full, target=9).top_up()
    assert running.started == full.started == []


def test_the_first_filling_imports_one_per_core_then_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``up`` waited 55.6 s for 9 processes imported one at a time on 2 cores; ``fill``,
    before anyone can run, lets each core import one (34.0 s)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    raylet = Raylet(tmp_path)
    pool = pool_on(raylet, target=9)
    seen: list[int] = []

    def wait_ready(timeout_s: float) -> bool:
        seen.append(pool.top_up())
        return True

    monkeypatch.setattr(pool, "wait_ready", wait_ready)
    assert pool.fill(1.0)
    assert raylet.started == [2] and seen == [0]
    assert pool.at_once == warm_pool.IMPORTING_AT_ONCE == 1
