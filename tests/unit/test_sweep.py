"""Sweeps without Ray: the ``tune`` section's checks, the search space against the spec,
each trial's spec, the listener that reports to Tune, and the ranking of trials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raytrain.checkpoints.layout import MONITOR_MISSING
from raytrain.driver.progress import StopRun
from raytrain.errors import SpecError
from raytrain.spec import load_spec
from raytrain.sweep.results import TrialRow, best_of, rank_key
from raytrain.sweep.space import base_tree, check_space, trial_spec
from raytrain.sweep.trial import (
    TrialPlan,
    TrialStopped,
    TuneReporter,
    trial_name,
    trial_values,
)
from tests.conftest import digits_spec

SPACE = {"model.init_args.lr": {"loguniform": [1e-4, 1e-1]}}


def _sweep(digits_dir: Path, tmp_path: Path, **tune: Any) -> dict[str, Any]:
    section = {"search_space": SPACE, "metric": "val_acc", "mode": "max", **tune}
    return digits_spec(digits_dir, tmp_path, tune=section)


def _problems(tree: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_spec(tree)
    return caught.value.problems


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        ({"x": {"loguniform": [0, 1]}}, "loguniform: low must be above 0"),
        ({"x": {"uniform": [2, 1]}}, "uniform: low must be below high"),
        ({"x": {"randint": [3, 3]}}, "randint: low must be below high"),
        ({"x": {"choice": []}}, "tune.search_space.x.choice"),
        ({"x": {"uniform": [0, 1], "choice": [1]}}, "exactly one of"),
        ({"x": {"normal": [0, 1]}}, "tune.search_space.x.normal: unknown field"),
        ({"name": {"choice": ["a"]}}, "each trial's name is the sweep's"),
    ],
)
def test_a_distribution_with_bad_bounds_is_refused_naming_it(
    digits_dir: Path, tmp_path: Path, space: dict[str, Any], expected: str
) -> None:
    problems = _problems(_sweep(digits_dir, tmp_path, search_space=space))
    assert any(p.startswith("tune.search_space") and expected in p for p in problems), problems


def test_the_sections_own_checks(digits_dir: Path, tmp_path: Path) -> None:
    fifo = _problems(_sweep(digits_dir, tmp_path, scheduler={"name": "fifo", "max_t": 3}))
    assert any("max_t: only for name: asha" in p for p in fifo), fifo
    optuna = _problems(_sweep(digits_dir, tmp_path, search_alg="optuna",
                              search_space={"data.batch_size": {"grid": [16, 32]}}))  # fmt: skip
    assert any("search_alg: optuna" in p and "grid" in p for p in optuna), optuna
    missing = _problems({**_sweep(digits_dir, tmp_path), "tune": {"search_space": SPACE}})
    required = {f"tune.{k}: required field is missing" for k in ("metric", "mode")}
    assert required <= set(missing)


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        # a field the spec does not have
        ({"trainer.epochs": {"choice": [2]}}, "tune.search_space.trainer.epochs: 2 is not a value"),
        # a bound the spec's own validation refuses
        ({"trainer.max_epochs": {"randint": [0, 3]}}, "trainer.max_epochs: Input should be"),
        ({"data.batch_size": {"choice": [32, -1]}}, "tune.search_space.data.batch_size: -1"),
        # a constructor argument the model does not take
        ({"model.init_args.lrr": {"uniform": [0.1, 0.2]}}, "DigitsCNN takes no argument 'lrr'"),
        # inside a value that is not a section
        ({"model.class_path.x": {"choice": [1]}}, "cannot set inside model.class_path"),
    ],
)
def test_every_value_a_trial_can_get_is_checked_against_the_spec(
    digits_dir: Path, tmp_path: Path, space: dict[str, Any], expected: str
) -> None:
    job = load_spec(_sweep(digits_dir, tmp_path, search_space=space))
    problems = check_space(job)
    assert any(expected in p for p in problems), problems
    assert all(p.startswith("tune.search_space.") for p in problems), problems


def test_a_space_the_spec_takes_has_no_problems(digits_dir: Path, tmp_path: Path) -> None:
    space = {**SPACE, "data.batch_size": {"grid": [16, 64]},
             "trainer.max_epochs": {"randint": [1, 4]}}  # fmt: skip
    assert check_space(load_spec(_sweep(digits_dir, tmp_path, search_space=space))) == []


def _plan(tmp_path: Path, base: dict[str, Any]) -> TrialPlan:
    return TrialPlan(base=base, sweep="lr-sweep", trials_storage=str(tmp_path / "trials"),
                     tracking_uri="sqlite:///x.db", experiment="digits", parent_run_id="p123",
                     metric="val_acc", mode="max", time_attr="epoch",
                     cwd=str(tmp_path))  # fmt: skip


def test_a_trial_is_the_spec_with_its_values_its_folder_and_its_parent_run(
    digits_dir: Path, tmp_path: Path
) -> None:
    job = load_spec(_sweep(digits_dir, tmp_path))
    base = base_tree(job.model_copy(update={"tune": None}))
    plan = _plan(tmp_path, base)
    name = trial_name(plan.sweep, "a1b2c_00007")
    assert name == "lr-sweep-007"
    spec = trial_spec(base, trial_values(plan, {"model.init_args.lr": 0.01}, name), name)
    assert spec.name == name and spec.tune is None
    assert spec.model.init_args["lr"] == 0.01
    assert spec.checkpoint.storage == str(tmp_path / "trials")
    assert (spec.checkpoint.monitor, spec.checkpoint.mode) == ("val_acc", "max")
    tags = spec.tracking.mlflow.tags
    assert tags["mlflow.parentRunId"] == "p123" and tags["raytrain.trial"] == name
    assert tags["raytrain.sampled.model.init_args.lr"] == "0.01"
    assert spec.data == job.data and spec.trainer == job.trainer  # the rest is the spec's


def test_the_reporter_sends_the_metric_with_epochs_done_and_holds_the_end_back() -> None:
    sent: list[dict[str, Any]] = []
    reporter = TuneReporter("val_acc", sent.append, "epoch", end=3)
    reporter({"step": 10, "epoch": 0, "kind": "step", "train_loss": 1.0})  # no metric: none
    reporter({"step": 23, "epoch": 0, "kind": "epoch", "val_acc": 0.5, "_score": 0.5})
    reporter({"step": 46, "epoch": 1, "kind": "epoch", "val_acc": 0.7, "kind2": "x"})
    reporter({"step": 69, "epoch": 2, "kind": "epoch", "val_acc": 0.8})  # the end: held
    assert [(r["epoch"], r["step"], r["val_acc"]) for r in sent] == [(1, 23, 0.5), (2, 46, 0.7)]
    # max_steps ending the trial within its last epoch: held too, though short of the end
    cut = TuneReporter("val_acc", sent.append, "epoch", end=3)
    cut({"step": 60, "epoch": 2, "kind": "end", "val_acc": 0.8})
    assert len(sent) == 2 and cut.latest["step"] == 60
    assert "_score" not in sent[0] and "kind2" not in sent[1]
    assert reporter.latest["epoch"] == 3  # what run_trial reports once the run is done


def test_a_metric_no_trial_reports_stops_the_trial_naming_what_is_reported() -> None:
    reporter = TuneReporter("val_accuracy", lambda result: None)
    with pytest.raises(StopRun) as caught:
        reporter({"step": 23, "epoch": 0, MONITOR_MISSING: ["val_acc", "val_loss"]})
    error = caught.value.error
    assert isinstance(error, SpecError)
    assert str(error) == ("tune.metric: 'val_accuracy' is not reported by the trials (they "
                          "report: val_acc, val_loss)")  # fmt: skip


def test_a_report_after_the_scheduler_stopped_the_trial_ends_the_run() -> None:
    # Tune's report raises SystemExit once the trial is stopped; in the report thread that
    # would end only the thread while training went on.
    def stopped(result: dict[str, Any]) -> None:
        raise SystemExit(0)

    reporter = TuneReporter("val_acc", stopped, "epoch", end=3)
    with pytest.raises(StopRun) as caught:
        reporter({"step": 23, "epoch": 0, "kind": "epoch", "val_acc": 0.5})
    assert isinstance(caught.value.error, TrialStopped)
    # Tune raises once; another report would wait for it forever: none is made
    reporter.report = lambda result: pytest.fail("reported after the stop")
    reporter({"step": 46, "epoch": 1, "kind": "epoch", "val_acc": 0.6})
    assert reporter.latest["step"] == 46


def test_the_driver_closes_each_unfinished_trials_run_with_how_it_ended(
    digits_dir: Path, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from raytrain.sweep.runner import _close_trials

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("sweep")
    ids = {name: client.create_run(experiment).info.run_id for name in ("done", "asha", "bad")}
    client.set_terminated(ids["done"], "FINISHED")
    rows = [
        TrialRow(name="done", status="finished", values={}, metrics={"val_acc": 0.9},
                 epochs=3, mlflow_run_id=ids["done"]),
        TrialRow(name="asha", status="stopped", values={}, metrics={"val_acc": 0.4},
                 epochs=1, mlflow_run_id=ids["asha"]),
        TrialRow(name="bad", status="error", values={}, metrics={}, epochs=0,
                 mlflow_run_id=ids["bad"], error="ValueError: lr"),
        TrialRow(name="never", status="error", values={}, metrics={}, epochs=0),
    ]  # fmt: skip
    sweep = load_spec(_sweep(digits_dir, tmp_path, scheduler={"name": "asha"})).tune
    assert sweep is not None
    _close_trials(rows, uri, sweep)
    runs = {name: client.get_run(run_id) for name, run_id in ids.items()}
    assert {name: run.info.status for name, run in runs.items()} == {
        "done": "FINISHED", "asha": "FINISHED", "bad": "FAILED"}  # fmt: skip
    assert runs["asha"].data.tags["raytrain.stopped"].startswith("asha: stopped after 1 epoch")
    assert "val_acc 0.4" in runs["asha"].data.tags["raytrain.stopped"]
    assert "ValueError: lr" in runs["bad"].data.tags["raytrain.error"]
    assert "raytrain.stopped" not in runs["done"].data.tags


def _row(name: str, value: float | None, status: str = "finished") -> TrialRow:
    metrics = {} if value is None else {"val_loss": value}
    return TrialRow(name=name, status=status, values={"lr": 0.1}, metrics=metrics, epochs=1)


def test_the_best_trial_is_by_metric_and_mode_and_trials_without_it_rank_last() -> None:
    rows = [_row("a", 0.5), _row("b", None, "error"), _row("c", 0.2, "stopped"), _row("d", 0.9)]
    assert best_of(rows, "val_loss", "min").name == "c"
    assert best_of(rows, "val_loss", "max").name == "d"
    assert [r.name for r in sorted(rows, key=lambda r: rank_key(r, "val_loss", "min"))] == [
        "c", "a", "d", "b"]  # fmt: skip
    assert best_of([_row("x", None)], "val_loss", "min") is None


def test_optunas_tpe_draws_every_trial_inside_the_space_and_repeats_with_its_seed(
    digits_dir: Path, tmp_path: Path
) -> None:
    from raytrain.sweep.runner import search_alg
    from raytrain.sweep.space import param_space

    space = {
        "model.init_args.lr": {"loguniform": [1e-4, 1e-1]},
        "trainer.gradient_clip_val": {"uniform": [0.5, 2.0]},
        "trainer.accumulate_grad_batches": {"randint": [1, 4]},
        "data.batch_size": {"choice": [16, 32]},
    }
    sweep = load_spec(_sweep(digits_dir, tmp_path, search_alg="optuna", search_space=space,
                             seed=7)).tune  # fmt: skip
    assert sweep is not None

    def draws() -> list[dict[str, Any]]:
        searcher = search_alg(sweep, concurrency=2)
        assert type(searcher).__name__ == "OptunaSearch"
        assert searcher.set_search_properties("val_acc", "max", param_space(sweep))
        return [searcher.suggest(f"trial_{n}") for n in range(6)]

    first = draws()
    for config in first:
        assert set(config) == set(space)
        assert 1e-4 <= config["model.init_args.lr"] <= 1e-1
        assert 0.5 <= config["trainer.gradient_clip_val"] <= 2.0
        assert config["trainer.accumulate_grad_batches"] in (1, 2, 3)
        assert config["data.batch_size"] in (16, 32)
    assert len({c["model.init_args.lr"] for c in first}) == len(first)  # drawn, not fixed
    assert draws() == first  # tune.seed makes a sweep's draws repeat
