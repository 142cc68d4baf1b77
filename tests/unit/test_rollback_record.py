"""The spike score and the run's record of rollbacks (``rollback_record``)."""

from __future__ import annotations

import random
from pathlib import Path

from raytrain.records.rollback_record import Rollback, read_rollbacks, robust_z, write_rollbacks


def test_a_spike_scores_far_above_a_falling_noisy_curve_and_the_curve_does_not() -> None:
    rng = random.Random(3)
    curve = [0.3 + 2 * 0.97**i + rng.gauss(0, 0.03) for i in range(300)]
    window = 100
    scores = [robust_z(curve[i - window : i], curve[i]) for i in range(window, len(curve))]
    assert max(scores) < 6  # the curve's own noise and descent
    assert robust_z(curve[-window:], curve[-1] * 50) > 100  # a batch 50x the loss
    # the score is the spike's, not dragged by it: one huge value in the window barely moves it
    dragged = robust_z([*curve[-window + 1 :], 1e6], curve[-1] * 50)
    assert dragged > 0.8 * robust_z(curve[-window:], curve[-1] * 50)


def test_a_flat_window_takes_a_deviation_of_a_hundredth_of_its_median() -> None:
    assert robust_z([1.0] * 10, 1.0) == 0
    assert robust_z([1.0] * 10, 1.001) < 1  # a stuck or quantized loss's small rise
    assert robust_z([1.0] * 10, 1.2) > 8  # 20% over a flat curve
    assert robust_z([2.0] * 6 + [2.5] * 4, 2.1) < 8  # over half alike: the MAD is 0
    assert robust_z([0.0] * 10, -1.0) < 0


def test_the_record_round_trips_and_describes_a_rollback(tmp_path: Path) -> None:
    assert read_rollbacks(str(tmp_path)) == []
    spike = Rollback(
        step=51,
        epoch=0,
        batch=50,
        loss=812.5,
        median=0.31,
        z=4321.0,
        window=10,
        position={"epoch": 0, "steps": 51, "left": [[408, 719]]},
    )
    write_rollbacks(str(tmp_path), [spike])
    done = spike.restored(40, 176, "a note")
    write_rollbacks(str(tmp_path), [done])
    assert read_rollbacks(str(tmp_path)) == [done]
    line = done.describe()
    assert "loss 812.5 at step 51" in line and "rolled back to step 40, 176 rows skipped" in line
