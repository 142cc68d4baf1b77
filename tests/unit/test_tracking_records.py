"""What raytrain puts in an MLflow run: params with credentials removed, the git commit of the
code that ran (from the checkout, or handed over by ``submit``), and what happens to a metric
or param key MLflow refuses (a real SQLite store): it drops alone, and the run's end says so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from raytrain.tracking.mlflow_tracker import MlflowTracker, redacted_params
from raytrain.util.provenance import GIT_COMMIT_ENV, git_commit
from raytrain.util.redaction import REDACTED, redact


def test_params_lose_credentials_and_keep_everything_else() -> None:
    params = redacted_params(
        {
            "tracking.mlflow.tracking_uri": "https://alice:s3cret@mlflow.example.com/",
            "model.init_args.password": "hunter2",
            "model.init_args.api_key": "k-123",
            "model.init_args.max_tokens": 512,
            "model.init_args.lr": 0.002,
            "data.train.uri": "s3://bucket/train",
        }
    )
    assert params == {
        "tracking.mlflow.tracking_uri": f"https://{REDACTED}@mlflow.example.com/",
        "model.init_args.password": REDACTED,
        "model.init_args.api_key": REDACTED,
        "model.init_args.max_tokens": "512",
        "model.init_args.lr": "0.002",
        "data.train.uri": "s3://bucket/train",
    }
    assert (
        redact("see http://u:p@h:5000 and http://h2")
        == f"see http://{REDACTED}@h:5000 and http://h2"
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="no git on this machine")
def test_the_commit_comes_from_the_checkout_or_from_submit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(GIT_COMMIT_ENV, raising=False)
    assert git_commit(str(tmp_path)) is None  # not a checkout

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    assert git_commit(str(tmp_path)) == (head, False)
    (tmp_path / "a.txt").write_text("two")
    assert git_commit(str(tmp_path)) == (head, True)  # uncommitted changes
    monkeypatch.setenv(GIT_COMMIT_ENV, "abc123+dirty")  # what submit hands a job
    assert git_commit(str(tmp_path)) == ("abc123", True)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite MLflow store for the module (its schema takes seconds to create)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _said(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """raytrain's lines on stderr (MLflow logs there too)."""
    return [x for x in capsys.readouterr().err.splitlines() if x.startswith("raytrain:")]


def _tracker(store: str, name: str) -> MlflowTracker:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    run = client.create_run(client.create_experiment(name))
    return MlflowTracker.attach(store, run.info.run_id)


def test_a_metric_mlflow_refuses_drops_alone_and_is_said_once(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mix source named ``..`` once made MLflow refuse ``data/rows/..`` and with it every
    metric batch of the run: a FINISHED run with no metrics. The batch is logged again key
    by key on a real store: the other metrics are kept, the refused key said once and not
    sent again, and the run's end names it."""
    tracker = _tracker(store, "refused-key")
    tracker.log_metrics({"train_loss": 0.5, "data/rows/..": 7, "data/rows/a": 3}, step=1)
    tracker.log_metrics({"train_loss": 0.4, "data/rows/..": 9, "data/rows/a": 6}, step=2)
    history = tracker.client.get_metric_history(tracker.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.4)]
    assert set(tracker.client.get_run(tracker.run_id).data.metrics) == {"train_loss", "data/rows/a"}
    (line,) = _said(capsys)  # once, not at each step
    assert line.startswith(
        "raytrain: warning: MLflow refused the metric 'data/rows/..', which is not recorded "
        "(the run's other metrics are): "
    ), line
    assert tracker.metrics_note(finished=True) == (
        "MLflow refused 'data/rows/..': those metrics are not recorded"
    )


def test_a_run_that_recorded_no_metrics_says_so(store: str) -> None:
    refused = _tracker(store, "all-refused")
    refused.log_metrics({"a/../b": 1.0, "/abs": 2.0}, step=1)
    assert refused.metrics_logged == 0
    note = refused.metrics_note(finished=False)
    assert (
        note == f"MLflow run {refused.run_id} recorded no metrics: MLflow refused 'a/../b', '/abs'"
    )
    silent = _tracker(store, "no-reports")
    assert silent.metrics_note(finished=False) is None  # a failed run: its error says why
    assert "recorded no metrics: no metric was reported" in (
        silent.metrics_note(finished=True) or ""
    )
    silent.log_metrics({"train_loss": 1.0}, step=1)
    assert silent.metrics_note(finished=True) is None
    # a resumed run whose steps were all logged before (replayed): it has its metrics
    again = MlflowTracker.attach(store, silent.run_id)
    again.log_metrics({"train_loss": 1.0}, step=1)
    assert again.metrics_logged == 0 and again.metrics_note(finished=True) is None


def test_a_param_mlflow_refuses_drops_alone(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A key inside ``model.init_args`` (a dict's) becomes a param key: one MLflow refuses
    cannot keep the run's MLflow record from opening, nor drop the other params."""
    tracker = _tracker(store, "refused-param")
    tracker.log_params({"model.init_args.lr": 0.1, "model.init_args.map.cat!": 1})
    assert tracker.client.get_run(tracker.run_id).data.params == {"model.init_args.lr": "0.1"}
    (line,) = _said(capsys)
    assert line.startswith("raytrain: warning: MLflow refused the param 'model.init_args.map.cat!'")


def test_the_end_of_a_run_says_what_its_metrics_lost_and_tags_it(
    tmp_path: Path, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The driver's end of the run (``RunRecord.finish``) says on stderr which metrics MLflow
    refused, or that the run recorded none, and the run keeps it as the tag
    ``raytrain.metrics_note``."""
    from raytrain.contract import Report
    from raytrain.driver.run_record import RunRecord
    from raytrain.spec import parse_spec
    from tests.conftest import digits_spec

    def finish(name: str, *events: Report) -> tuple[str, dict[str, str]]:
        spec = digits_spec(tmp_path, tmp_path / name, name=name)  # no data is read
        spec["tracking"]["mlflow"]["tracking_uri"] = store
        record = RunRecord(parse_spec(spec), None)
        record.start()
        for event in events:
            record.on_report(event)
        record.finish("FINISHED")
        tracker = record.tracker()
        return tracker.run_id, tracker.client.get_run(tracker.run_id).data.tags

    report = Report(
        step=1,
        epoch=0,
        kind="step",
        world_size=1,
        metrics={"train_loss": 0.5, "data/rows/..": 5, "data/rows/b": 5},
    )
    _, tags = finish("refused", report)
    note = "MLflow refused 'data/rows/..': those metrics are not recorded"
    assert _said(capsys)[-1] == f"raytrain: warning: {note}"
    assert tags["raytrain.metrics_note"] == note
    run_id, tags = finish("silent")
    note = (
        f"MLflow run {run_id} recorded no metrics: no metric was reported (no training "
        "step ran: see trainer.max_steps, max_epochs, the data)"
    )
    assert _said(capsys) == [f"raytrain: warning: {note}"]
    assert tags["raytrain.metrics_note"] == note
