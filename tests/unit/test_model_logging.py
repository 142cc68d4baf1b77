"""Every trained model reaches MLflow: its input example from the model or the data, else
the format that needs none; ``register_as`` that fails ends the run with exit 1. A local
SQLite MLflow store, no Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain.errors import EXIT_FAILED, ModelNotRegistered
from raytrain.models.digits import DigitsCNN
from raytrain.spec import JobSpec
from tests.conftest import digits_spec
from tests.integration.models import PlainCNN, WideLinear


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One MLflow store for the module: creating a SQLite store's schema takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _job(digits_dir: Path, work: Path, store: str, model: str, **mlflow: Any) -> JobSpec:
    spec = digits_spec(digits_dir, work)
    spec["model"] = {"class_path": model}
    spec["tracking"]["mlflow"].update({"log_model": True, "tracking_uri": store, **mlflow})
    return JobSpec.model_validate(spec)


def test_the_input_example_comes_from_the_model_else_the_data(
    digits_dir: Path, tmp_path: Path, store: str
) -> None:
    from raytrain.tracking.model_example import input_example

    job = _job(digits_dir, tmp_path, store, "tests.integration.models:PlainCNN")
    example, source = input_example(DigitsCNN(), job)
    assert source == "example_input_array" and example.shape == (2, 64)
    example, source = input_example(PlainCNN(), job)
    assert source == f"data.val ({digits_dir / 'val'}), column 'pixels'"
    assert example.shape == (2, 64) and example.dtype == torch.float32
    example, source = input_example(WideLinear(features=64), job)
    assert example is None and source == "the model defines no forward"


def _tags(tracker: Any) -> dict[str, str]:
    return tracker.client.get_run(tracker.run_id).data.tags


def test_a_model_without_example_input_array_is_logged_and_registered(
    digits_dir: Path, tmp_path: Path, store: str
) -> None:
    import mlflow.pytorch

    from raytrain.tracking.mlflow_tracker import MlflowTracker
    from raytrain.tracking.model_logging import log_model

    job = _job(
        digits_dir, tmp_path, store, "tests.integration.models:PlainCNN", register_as="plain"
    )
    uri = job.tracking.mlflow.tracking_uri
    tracker, _ = MlflowTracker.open(job, uri)
    model = PlainCNN().eval()
    log_model(tracker, model, register_as="plain", job=job)
    tags = _tags(tracker)
    assert tags["raytrain.model_format"] == "pt2"
    assert tags["raytrain.model_input_example"].endswith("column 'pixels'")
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pytorch.load_model("models:/plain/1")
    pixels = torch.rand(3, 64) * 16
    with torch.no_grad():
        assert torch.allclose(loaded(pixels), model(pixels), atol=1e-5)

    # no forward to trace: logged (and registered) in the format that needs no example
    log_model(tracker, WideLinear(features=64).eval(), register_as="wide", job=job)
    tags = _tags(tracker)
    assert tags["raytrain.model_format"].startswith("pickle (no input example")
    assert tags["raytrain.model_input_example"] == "the model defines no forward"
    assert mlflow.pytorch.load_model("models:/wide/1") is not None


class _WrongExample(DigitsCNN):
    """A declared example that does not fit forward (14 values, not 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 7)


class _Bfloat16Example(DigitsCNN):
    """A bfloat16 example: numpy has no such type."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 64, dtype=torch.bfloat16)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return super().forward(pixels.float())


class _TupleOutput(DigitsCNN):
    def forward(self, pixels: torch.Tensor) -> Any:
        logits = super().forward(pixels)
        return logits, logits.sum()


@pytest.mark.parametrize("cls", [_WrongExample, _Bfloat16Example, _TupleOutput])
def test_a_declared_example_that_cannot_be_traced_still_logs_the_model(
    digits_dir: Path, tmp_path: Path, store: str, cls: type
) -> None:
    """Each raised out of log_model before (the model was not logged)."""
    from raytrain.tracking.mlflow_tracker import MlflowTracker
    from raytrain.tracking.model_logging import log_model

    job = _job(digits_dir, tmp_path, store, "tests.integration.models:PlainCNN")
    tracker, _ = MlflowTracker.open(job, job.tracking.mlflow.tracking_uri)
    assert log_model(tracker, cls().eval(), job=job)
    tags = _tags(tracker)
    assert tags["raytrain.model_format"].startswith("pickle (pt2 failed: ")
    assert tags["raytrain.model_input_example"] == "example_input_array"


def test_register_as_that_fails_ends_the_run_with_exit_1(
    digits_dir: Path, tmp_path: Path, store: str
) -> None:
    from raytrain.driver.run_record import RunRecord

    # a checkpoint that does not fit the spec's model: the model cannot be built from it
    folder = tmp_path / "checkpoint_000001"
    folder.mkdir()
    torch.save({"state_dict": WideLinear(features=3).state_dict()}, folder / "checkpoint.ckpt")
    for register_as in (None, "digits"):
        job = _job(
            digits_dir,
            tmp_path / str(register_as),
            store,
            "raytrain.models.digits:DigitsCNN",
            register_as=register_as,
        )
        record = RunRecord(job, None)
        record.start()
        assert record.model.log(str(folder)) is None
        record.finish("FINISHED", best=str(folder))
        tags = _tags(record.tracker())
        assert "raytrain.model_error" in tags
        assert record.tracker().client.get_run(record.state.mlflow_run_id).info.status == (
            "FINISHED"
        )
        if register_as is None:  # a warning and a tag only
            record.model.raise_if_unregistered(record.state.mlflow_run_id)
            continue
        with pytest.raises(ModelNotRegistered) as excinfo:
            record.model.raise_if_unregistered(record.state.mlflow_run_id)
        assert excinfo.value.exit_code == EXIT_FAILED
        (line,) = excinfo.value.problems
        assert line.startswith("tracking.mlflow.register_as: the model was not registered as ")
        assert str(folder) in line
