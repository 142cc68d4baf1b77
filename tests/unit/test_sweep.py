"""Sweeps without Ray: the ``tune`` section's checks, the search space against the spec,
each trial's spec, the listener that reports to Tune, and the ranking of trials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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
from tests.unit.events import report

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
    optuna = _problems(
        _sweep(
            digits_dir,
            tmp_path,
            search_alg="optuna",
            search_space={"data.batch_size": {"grid": [16, 32]}},
        )
    )
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
        ({"model.init_args.lrr": {"uniform": [0.1, 0.2]}}, "model.init_args.lrr: Option 'lrr'"),
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
    space = {
        **SPACE,
        "data.batch_size": {"grid": [16, 64]},
        "trainer.max_epochs": {"randint": [1, 4]},
    }
    assert check_space(load_spec(_sweep(digits_dir, tmp_path, search_space=space))) == []


@pytest.mark.parametrize(
    ("tune", "expected"),
    [
        # Ray Tune's own rules for ASHA (its scheduler asserts them, after Ray started)
        (
            {"scheduler": {"name": "asha", "grace_period": 3, "max_t": 2}},
            "tune.scheduler: grace_period (3) is above max_t (2)",
        ),
        (
            {"scheduler": {"name": "asha", "grace_period": 3}},  # max_t: trainer.max_epochs, 2
            "tune.scheduler.grace_period: 3 is above max_t (2, trainer.max_epochs)",
        ),
        (
            {"scheduler": {"name": "asha", "max_t": 5}},
            "tune.scheduler.max_t: 5 is above trainer.max_epochs (2)",
        ),
        (
            {"scheduler": {"name": "asha", "reduction_factor": 1.0000001}},
            "tune.scheduler.reduction_factor: 1.0000001 is below 1.5: each rung",
        ),
        (
            {
                "scheduler": {
                    "name": "asha",
                    "time_attr": "step",
                    "max_t": 10**9,
                    "reduction_factor": 1.5,
                }
            },
            "tune.scheduler.max_t: 1000000000 is above trainer.max_steps",
        ),
        # ranges Tune can draw from, listed values a trial can train with
        (
            {"search_space": {"model.init_args.lr": {"uniform": [-1e308, 1e308]}}},
            "uniform: [-1e+308, 1e+308] is wider than a float holds",
        ),
        (
            {"search_space": {"trainer.seed": {"randint": [0, 2**64]}}},
            "randint: [0, 18446744073709551616] is outside the 64-bit integers",
        ),
        (
            {"search_space": {"model.init_args.lr": {"choice": [0.1, float("nan")]}}},
            "tune.search_space.model.init_args.lr: choice: nan is not a finite",
        ),
        (
            {"search_space": {"model.init_args": {"grid": [{"lr": [1, float("-inf")]}]}}},
            "grid: {'lr': [1, -inf]} holds -inf, which is not a finite number",
        ),
        # the trials a sweep runs, and the values it lists, counted with the grids
        (
            {
                "num_samples": 2,
                "search_space": {"a": {"grid": list(range(100))}, "b": {"grid": list(range(100))}},
            },
            "tune: num_samples: 2 x the grids' 100 x 100 combinations is 20,000",
        ),
        (
            {
                "search_space": {
                    "a": {"choice": list(range(6000))},
                    "b": {"choice": list(range(6000))},
                }
            },
            "tune: search_space lists 12,000 values in all, more than the limit",
        ),
        (
            {"search_space": {"a": {"choice": list(range(10_001))}}},
            "choice: 10,001 values, more than the limit of 10,000",
        ),
    ],
)
def test_sweep_settings_ray_tune_refuses_are_refused_before_ray(
    digits_dir: Path, tmp_path: Path, tune: dict[str, Any], expected: str
) -> None:
    tree = _sweep(digits_dir, tmp_path, **tune)
    tree["trainer"]["max_steps"] = 1000
    try:
        problems = check_space(load_spec(tree))
    except SpecError as exc:
        problems = exc.problems
    assert any(p.startswith(expected) or expected in p for p in problems), problems


def test_asha_settings_within_the_trainers_limits_pass(digits_dir: Path, tmp_path: Path) -> None:
    fits = [
        {"name": "asha", "grace_period": 2},  # max_t: trainer.max_epochs (2)
        {"name": "asha", "grace_period": 1, "max_t": 2, "reduction_factor": 1.5},
        {"name": "asha", "time_attr": "step", "grace_period": 10},  # max_steps unset: 100
    ]
    for scheduler in fits:
        assert check_space(load_spec(_sweep(digits_dir, tmp_path, scheduler=scheduler))) == []
    # max_t up to the largest max_epochs a trial can get, when the sweep samples it
    sampled = _sweep(
        digits_dir,
        tmp_path,
        scheduler={"name": "asha", "max_t": 6},
        search_space={"trainer.max_epochs": {"randint": [1, 7]}},
    )
    assert check_space(load_spec(sampled)) == []
    # Ray's own count of rungs is the one checked: 1 to 2**31 steps at 2 is 32 rungs
    many = _sweep(
        digits_dir, tmp_path, scheduler={"name": "asha", "time_attr": "step", "reduction_factor": 2}
    )
    many["trainer"]["max_steps"] = 2**31
    assert check_space(load_spec(many)) == []
    many["trainer"]["max_steps"] = 2**32
    (line,) = check_space(load_spec(many))
    assert line.startswith("tune.scheduler.reduction_factor: 2.0 makes 33 rungs"), line


def test_rung_count_is_rays(digits_dir: Path, tmp_path: Path) -> None:
    from ray.tune.schedulers.async_hyperband import _Bracket

    chosen = load_spec(_sweep(digits_dir, tmp_path, scheduler={"name": "asha"})).tune
    assert chosen is not None
    for grace, max_t, factor in [(1, 4, 2), (1, 100, 1.5), (3, 1000, 3), (7, 7, 4)]:
        schedule = chosen.scheduler.model_copy(
            update={"grace_period": grace, "reduction_factor": factor}
        )
        assert schedule.rungs(max_t) == len(_Bracket(grace, max_t, factor, 0)._rungs)


@pytest.mark.parametrize(
    "key",
    [
        "name",
        "tune",
        "tune.metric",
        "checkpoint",
        "checkpoint.storage",
        "checkpoint.keep",
        "tracking",
        "tracking.mlflow",
        "tracking.mlflow.tracking_uri",
        "tracking.mlflow.experiment",
        "tracking.mlflow.tags",
        "tracking.mlflow.tags.team",
    ],
)
def test_a_field_every_trial_sets_is_refused_naming_it(
    digits_dir: Path, tmp_path: Path, key: str
) -> None:
    problems = _problems(_sweep(digits_dir, tmp_path, search_space={key: {"choice": ["x"]}}))
    assert any(
        p.startswith("tune.search_space: ") and f"{key!r}: a sweep may not sample it" in p
        for p in problems
    ), problems


def test_the_refused_fields_are_the_ones_a_trial_sets(digits_dir: Path, tmp_path: Path) -> None:
    from raytrain.spec.tune import reserved_problem

    job = load_spec(_sweep(digits_dir, tmp_path))
    set_by_trials = trial_values(_plan(tmp_path, base_tree(job)), {}, "lr-sweep-000")
    assert all(reserved_problem(key) for key in [*set_by_trials, "name", "tune"])
    for free in ("tracking.mlflow.log_model", "tracking.timeline", "trainer.max_epochs"):
        assert reserved_problem(free) is None


def test_each_value_is_checked_in_microseconds_not_a_spec_parse_each(
    digits_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10,000 listed values: a whole spec parse for the first value of each type, the one
    section that holds the field for the others; the bad value last is still found."""
    from raytrain.sweep import space

    parses: list[Any] = []
    real = space.trial_spec
    monkeypatch.setattr(space, "trial_spec", lambda *a: parses.append(a) or real(*a))
    sizes = [*range(1, 9_999), 2.0, 0]  # ints, a float, and 0 (refused) last
    tree = _sweep(digits_dir, tmp_path, search_space={"data.batch_size": {"choice": sizes}})
    (line,) = check_space(load_spec(tree))
    expected = (
        "tune.search_space.data.batch_size: 0 is not a value the spec takes: "
        "data.batch_size: Input should be greater than"
    )
    assert line.startswith(expected), line
    assert len(parses) == 2  # 1 (an int) and 2.0 (a float)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("trainer.max_epochs", 0),
        ("trainer.max_epochs", True),
        ("trainer.max_epochs", 3),
        ("trainer.precision", "bogus"),
        ("trainer.precision", "bf16-mixed"),
        ("trainer.gradient_clip_val", float("nan")),
        ("trainer.epochs", 2),
        ("data.train.uri", "file://host/x"),
        ("data.train.uri", "/data/y"),
        ("data.val", None),
        ("data.val.uri", "/v"),
        ("data.columns", []),
        ("scaling.num_workers", [1, 2]),
        ("scaling.num_workers", 0),
        ("scaling.resources_per_worker.CPU", -1),
        ("model.class_path.x", 1),
        ("model.init_args.lr", 0.5),
        ("model.init_args", {"lr": "x"}),
        ("lr_scheduler", {"class_path": "torch.optim.lr_scheduler.StepLR"}),  # no optimizer
        ("storage.s3.endpoint_url", "http://user:pw@h:9000"),
        ("ckpt_path", "file://h/c"),
    ],
)
def test_checking_the_section_finds_what_parsing_the_whole_spec_finds(
    digits_dir: Path, tmp_path: Path, key: str, value: Any
) -> None:
    from raytrain.sweep.space import _section_problems

    job = load_spec(_sweep(digits_dir, tmp_path))
    base = base_tree(job)
    try:
        trial_spec(base, {key: value}, job.name)
        whole: list[str] = []
    except SpecError as exc:
        whole = exc.problems
    assert _section_problems(job, base, key, value) == whole


def test_listed_values_reach_tune_as_indices_and_trials_as_values(
    digits_dir: Path, tmp_path: Path
) -> None:
    from ray import tune

    from raytrain.sweep.space import listed_values, param_space, values_of

    signed = "s3://b/train?X-Amz-Signature=0123abcd"
    space = {
        "data.train.uri": {"choice": [signed, "/data/b"]},
        "data.batch_size": {"grid": [8, 16]},
        **SPACE,
    }
    sweep = load_spec(_sweep(digits_dir, tmp_path, search_space=space)).tune
    assert sweep is not None
    samplers = param_space(sweep)
    assert samplers["data.train.uri"].categories == [0, 1]
    assert samplers["data.batch_size"] == tune.grid_search([0, 1])
    assert signed not in repr(samplers)
    config = {"data.train.uri": 0, "data.batch_size": 1, "model.init_args.lr": 0.01}
    assert values_of(config, listed_values(sweep)) == {
        "data.train.uri": signed,
        "data.batch_size": 16,
        "model.init_args.lr": 0.01,
    }


def _plan(tmp_path: Path, base: dict[str, Any]) -> TrialPlan:
    return TrialPlan(
        base=base,
        sweep="lr-sweep",
        trials_storage=str(tmp_path / "trials"),
        tracking_uri="sqlite:///x.db",
        experiment="digits",
        parent_run_id="p123",
        metric="val_acc",
        mode="max",
        time_attr="epoch",
        cwd=str(tmp_path),
    )


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
    reporter.on_report(report(10, train_loss=1.0))  # no metric: none
    reporter.on_report(report(23, kind="epoch", val_acc=0.5, score=0.5))
    reporter.on_report(report(46, epoch=1, kind="epoch", val_acc=0.7))
    reporter.on_report(report(69, epoch=2, kind="epoch", val_acc=0.8))  # the end: held
    assert [(r["epoch"], r["step"], r["val_acc"]) for r in sent] == [(1, 23, 0.5), (2, 46, 0.7)]
    # max_steps ending the trial within its last epoch: held too, though short of the end
    cut = TuneReporter("val_acc", sent.append, "epoch", end=3)
    cut.on_report(report(60, epoch=2, kind="end", val_acc=0.8))
    assert len(sent) == 2 and cut.latest["step"] == 60
    assert "_score" not in sent[0] and "kind" not in sent[1]
    assert reporter.latest["epoch"] == 3  # what run_trial reports once the run is done


def test_a_metric_no_trial_reports_stops_the_trial_naming_what_is_reported() -> None:
    reporter = TuneReporter("val_accuracy", lambda result: None)
    with pytest.raises(StopRun) as caught:
        reporter.on_report(report(23, monitor_missing=("val_acc", "val_loss")))
    error = caught.value.error
    assert isinstance(error, SpecError)
    assert str(error) == (
        "tune.metric: 'val_accuracy' is not reported by the trials (they report: val_acc, val_loss)"
    )


def test_a_report_after_the_scheduler_stopped_the_trial_ends_the_run() -> None:
    # Tune's report raises SystemExit once the trial is stopped; in the report thread that
    # would end only the thread while training went on.
    def stopped(result: dict[str, Any]) -> None:
        raise SystemExit(0)

    reporter = TuneReporter("val_acc", stopped, "epoch", end=3)
    with pytest.raises(StopRun) as caught:
        reporter.on_report(report(23, kind="epoch", val_acc=0.5))
    assert isinstance(caught.value.error, TrialStopped)
    # Tune raises once; another report would wait for it forever: none is made
    reporter.report = lambda result: pytest.fail("reported after the stop")
    reporter.on_report(report(46, epoch=1, kind="epoch", val_acc=0.6))
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
        TrialRow(
            name="done",
            status="finished",
            values={},
            metrics={"val_acc": 0.9},
            epochs=3,
            mlflow_run_id=ids["done"],
        ),
        TrialRow(
            name="asha",
            status="stopped",
            values={},
            metrics={"val_acc": 0.4},
            epochs=1,
            mlflow_run_id=ids["asha"],
        ),
        TrialRow(
            name="bad",
            status="error",
            values={},
            metrics={},
            epochs=0,
            mlflow_run_id=ids["bad"],
            error="ValueError: lr",
        ),
        TrialRow(name="never", status="error", values={}, metrics={}, epochs=0),
    ]
    sweep = load_spec(_sweep(digits_dir, tmp_path, scheduler={"name": "asha"})).tune
    assert sweep is not None
    _close_trials(rows, uri, sweep)
    runs = {name: client.get_run(run_id) for name, run_id in ids.items()}
    assert {name: run.info.status for name, run in runs.items()} == {
        "done": "FINISHED",
        "asha": "FINISHED",
        "bad": "FAILED",
    }
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
        "c",
        "a",
        "d",
        "b",
    ]
    assert best_of([_row("x", None)], "val_loss", "min") is None


def test_trials_of_equal_score_are_listed_in_one_order_by_the_summary_and_the_report() -> None:
    """Equal val_acc is common (a few hundred validation images); the summary sorted Tune's
    trials and ``raytrain report`` MLflow's runs, each stably, so CI saw 001 and 002 swapped."""
    from raytrain.sweep.results import SweepResult
    from raytrain.tracking.report import sweep_table

    rows = [_row("t-002", 0.5), _row("t-000", 0.2), _row("t-001", 0.5), _row("t-003", None)]
    result = SweepResult(
        name="t",
        metric="val_loss",
        mode="min",
        best=None,
        best_spec_path=None,
        best_checkpoint_uri=None,
        trials=rows,
        mlflow_run_id="0",
        tracking_uri="",
        sweep_dir="",
    )
    runs = [
        {"name": r.name, "status": "FINISHED", "run_id": "0" * 8, "tags": {}, "metrics": r.metrics}
        for r in reversed(rows)
    ]
    _, report = sweep_table(runs, "val_loss", "min")
    order = ["t-000", "t-001", "t-002", "t-003"]
    assert [row["trial"] for row in result.table()] == order
    assert [row[0] for row in report] == order


def test_optunas_tpe_draws_every_trial_inside_the_space_and_repeats_with_its_seed(
    digits_dir: Path, tmp_path: Path
) -> None:
    from raytrain.sweep.runner import search_alg
    from raytrain.sweep.space import listed_values, param_space, values_of

    space = {
        "model.init_args.lr": {"loguniform": [1e-4, 1e-1]},
        "trainer.gradient_clip_val": {"uniform": [0.5, 2.0]},
        "trainer.accumulate_grad_batches": {"randint": [1, 4]},
        "data.batch_size": {"choice": [16, 32]},
    }
    sweep = load_spec(
        _sweep(digits_dir, tmp_path, search_alg="optuna", search_space=space, seed=7)
    ).tune
    assert sweep is not None

    def draws() -> list[dict[str, Any]]:
        searcher = search_alg(sweep, concurrency=2)
        assert type(searcher).__name__ == "OptunaSearch"
        assert searcher.set_search_properties("val_acc", "max", param_space(sweep))
        drawn = [searcher.suggest(f"trial_{n}") for n in range(6)]
        assert {c["data.batch_size"] for c in drawn} <= {0, 1}  # an index into the choice
        return [values_of(config, listed_values(sweep)) for config in drawn]

    first = draws()
    for config in first:
        assert set(config) == set(space)
        assert 1e-4 <= config["model.init_args.lr"] <= 1e-1
        assert 0.5 <= config["trainer.gradient_clip_val"] <= 2.0
        assert config["trainer.accumulate_grad_batches"] in (1, 2, 3)
        assert config["data.batch_size"] in (16, 32)
    assert len({c["model.init_args.lr"] for c in first}) == len(first)  # drawn, not fixed
    assert draws() == first  # tune.seed makes a sweep's draws repeat


# --- a sweep's folder: its own kind, under a lease (issue 33) ---

SMALL = {
    "search_space": {"data.batch_size": {"choice": [16, 32]}},
    "metric": "val_acc",
    "mode": "max",
}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_sweep_and_a_run_of_one_name_never_share_a_folder_nor_delete_it(
    digits_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`raytrain tune copy.yaml --fresh` of a sweep named as a run deleted the run's folder
    (checkpoints and all); `raytrain run` of a sweep's name wrote into the sweep's. Both
    are refused before Ray, exit 2, naming the folder and what it holds; nothing changes."""
    from raytrain.cli.app import main
    from raytrain.records import runstate
    from raytrain.sweep.runner import sweep_dir, write_record
    from tests.conftest import write_spec

    # an address Ray refuses at once: a refusal that regressed fails here, fast, rather than
    # running the sweep
    monkeypatch.setenv("RAY_ADDRESS", "no-cluster")
    run_tree = digits_spec(digits_dir, tmp_path, name="digits-cnn")
    run_job = load_spec(run_tree)
    runstate.save(run_job, runstate.new_state(run_job))  # the run's record, as a run writes it
    sweep_yaml = write_spec(tmp_path / "copy.yaml", {**run_tree, "tune": SMALL})
    sweep_job = load_spec(sweep_yaml, ["name=digits-sweep"])
    write_record(sweep_dir(sweep_job), sweep_job, "0123456789abcdef")  # as a sweep writes it
    run_yaml = write_spec(tmp_path / "run.yaml", {**run_tree, "name": "digits-sweep"})
    before = _files(tmp_path)
    cases = [
        (
            ["tune", str(sweep_yaml)],
            runstate.run_dir(run_job),
            "a run (raytrain-run.json), not a sweep: a sweep",
        ),
        (
            ["run", str(run_yaml)],
            sweep_dir(sweep_job),
            "a sweep (raytrain-sweep.json), not a run: a run",
        ),
    ]
    for argv, folder, holds in cases:
        for flags in (["--fresh"], []):
            assert main([*argv, *flags]) == 2, (argv, flags)
            err = capsys.readouterr().err
            assert err == (
                f"error: name: {folder} holds {holds} of this name and "
                "checkpoint.storage would write into it, and --fresh would delete "
                "it; choose another name or checkpoint.storage\n"
            )
    assert _files(tmp_path) == before


def test_a_sweeps_own_folder_is_what_fresh_deletes_saying_so(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from raytrain.records import run_folder
    from raytrain.records.lease import LEASE_FILE, Lease
    from raytrain.sweep.runner import sweep_dir, write_record

    job = load_spec(_sweep(digits_dir, tmp_path))
    folder = sweep_dir(job)
    assert run_folder.check_kind(folder, job.storage, "sweep") is False  # none yet
    write_record(folder, job, "0123456789abcdef")
    (Path(folder) / "trials").mkdir()
    assert run_folder.check_kind(folder, job.storage, "sweep") is True
    held = Lease(folder, job.storage, kind="sweep").acquire()
    run_folder.delete_own(folder, job.storage, "sweep", held)
    assert sorted(p.name for p in Path(folder).iterdir()) == [LEASE_FILE]  # held still
    held.release()
    assert capsys.readouterr().err == (
        f"raytrain: --fresh: deleted {folder}, the sweep's folder (with its raytrain-sweep.json)\n"
    )


def test_a_sweep_holds_a_runs_lease_and_stops_when_another_takes_it(tmp_path: Path) -> None:
    """A second live sweep is refused, naming the holder; ``--force`` takes the lease, and
    the first sees it lost: its gate stops Tune, also as the copy Tune keeps with its
    experiment (a restored sweep's gate)."""
    import pickle

    from raytrain.errors import RunStateError
    from raytrain.records.lease import Lease, check_free
    from raytrain.sweep.tune_callbacks import LOST_LEASES, MetricGate

    folder = str(tmp_path / "runs" / "lr-sweep")
    first = Lease(folder, kind="sweep").acquire()
    first.on_lost = lambda holder: LOST_LEASES.add(folder)
    for attempt in (
        lambda: check_free(folder, kind="sweep"),
        lambda: Lease(folder, kind="sweep").acquire(),
    ):
        with pytest.raises(RunStateError, match=r"in use by another sweep: pid \d+ .*--force"):
            attempt()
    kept = pickle.loads(pickle.dumps(MetricGate(folder)))
    assert not kept.stop_all()
    second = Lease(folder, kind="sweep").acquire(force=True)
    try:
        assert first.beat() is False and first.lost_to is not None
        assert kept.stop_all() and MetricGate(folder).stop_all()
        assert not MetricGate(str(tmp_path / "other")).stop_all()
    finally:
        LOST_LEASES.discard(folder)
        second.release()


def test_the_sweep_plot_draws_dollar_signs_as_written(tmp_path: Path) -> None:
    """A metric or a listed value holding ``$`` (bad mathtext) is drawn as text: the
    sweep's end would fail on it otherwise, after every trial ran."""
    from raytrain.sweep.plot import plot_sweep

    rows = [
        TrialRow(
            name=f"t-{i}",
            status="finished",
            values={"model.init_args.act": v},
            metrics={r"$\foo$": 0.5 + i / 10},
            epochs=1,
        )
        for i, v in enumerate([r"$\bar$", "relu"])
    ]
    out = tmp_path / "sweep.png"
    assert plot_sweep(rows, r"$\foo$", "max", str(out)) == ["model.init_args.act"]
    assert out.read_bytes().startswith(b"\x89PNG")
