"""The run-state record: what may change between attempts of one run, and what may not."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain.errors import RunStateError
from raytrain.records import runstate
from raytrain.spec import load_spec, parse_spec
from tests.conftest import digits_spec


def test_state_round_trips_beside_the_checkpoints(tmp_path: Path) -> None:
    spec = parse_spec(digits_spec(tmp_path, tmp_path))
    assert runstate.load(spec) is None
    state = runstate.new_state(spec)
    state.mlflow_run_id, state.attempts = "abc", 2
    runstate.save(spec, state)
    assert (tmp_path / "runs" / "digits-test" / runstate.STATE_FILE).exists()
    loaded = runstate.load(spec)
    assert loaded is not None
    assert (loaded.mlflow_run_id, loaded.attempts) == ("abc", 2)


def test_longer_training_and_other_workers_resume(tmp_path: Path) -> None:
    spec = parse_spec(digits_spec(tmp_path, tmp_path))
    state = runstate.new_state(spec)
    runstate.check_resumable(state, load_spec(spec, ["trainer.max_epochs=50"]))
    runstate.check_resumable(state, load_spec(spec, ["scaling.num_workers=1"]))


def test_changed_model_is_refused_with_the_field_named(tmp_path: Path) -> None:
    spec = parse_spec(digits_spec(tmp_path, tmp_path))
    state = runstate.new_state(spec)
    with pytest.raises(RunStateError) as excinfo:
        runstate.check_resumable(state, load_spec(spec, ["model.init_args.lr=0.1"]))
    message = str(excinfo.value)
    assert "model.init_args.lr: 0.003 -> 0.1" in message
    assert "--fresh" in message
    assert excinfo.value.exit_code == 2
