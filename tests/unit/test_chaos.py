"""``failure.chaos``'s injector (``driver.chaos``) without Ray: the ``ChaosMonkey`` kills a
real process of a whole registered group after a seeded exponential wait, records what the
ranks' marks tell it, and each kill is claimed once; the summary's arithmetic."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from raytrain.driver.chaos import ChaosMonkey, Fault, chaos_summary


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_the_monkey_kills_a_rank_of_a_whole_group_and_records_its_cost() -> None:
    ranks = [_sleeper(), _sleeper()]
    monkey = ChaosMonkey(mtbf_s=0.05, seed=3, node_id="here")
    try:
        monkey.register(0, ranks[0].pid, "here", 2, step=0)
        assert monkey.faults == []  # half a group: nothing is killed
        monkey.step(7)
        monkey.register(1, ranks[1].pid, "here", 2, step=0)
        deadline = time.monotonic() + 60
        while not monkey.faults and time.monotonic() < deadline:
            time.sleep(0.01)
        [fault] = monkey.faults
        killed = ranks[fault.rank]
        assert killed.wait(timeout=30) == -9  # SIGKILL
        assert ranks[1 - fault.rank].poll() is None  # one rank at a time
        assert (fault.pid, fault.last_step) == (killed.pid, 7)
        assert monkey.claim() and not monkey.claim()  # claimed once
        # the hit group is never hit again; the next group's marks complete the fault
        new = _sleeper()
        ranks.append(new)
        monkey.register(0, new.pid, "here", 1, step=4)
        monkey.first_step(5, at=fault.at + 2.5)
        assert (fault.restored_step, fault.lost_steps) == (4, 3)
        assert fault.recovery_s == pytest.approx(2.5)
        assert [entry["pid"] for entry in monkey.ledger()] == [killed.pid]
    finally:
        monkey.stop()
        for proc in ranks:
            proc.kill()
            proc.wait()


def test_the_summary_counts_recovery_and_retrained_steps() -> None:
    faults = [
        Fault(at=100.0, rank=1, pid=1, last_step=30, restored_step=20, first_step_at=106.0),
        Fault(at=200.0, rank=0, pid=2, last_step=50, restored_step=48, first_step_at=204.0),
    ]
    # 100 steps ended the run in 122 s: 10 s recovering, 112 s over 112 steps trained
    summary = chaos_summary(faults, mtbf_s=15, seed=0, wall_s=122.0, steps=100)
    assert summary.step_s == pytest.approx(1.0)
    assert summary.overhead_s == pytest.approx(10 + 12)
    assert summary.overhead == pytest.approx(22 / 100)
    metrics = summary.metrics()
    assert metrics["chaos/faults"] == 2 and metrics["chaos/lost_steps_median"] == 6
    assert metrics["chaos/recovery_s_median"] == pytest.approx(5.0)
    lines = summary.lines()
    assert lines[0].startswith("chaos: 2 fault(s) injected (MTBF 15 s")
    assert "22%" in lines[-1]
    incomplete = chaos_summary([Fault(at=1.0, rank=0, pid=3, last_step=None)], 15, 0, 10.0, 5)
    assert incomplete.metrics()["chaos/faults"] == 1 and "-" in incomplete.lines()[2]
