"""Fixtures shared by unit and integration tests: a small real dataset and spec writing."""

from __future__ import annotations

import contextlib
import os
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from raytrain.datasets.digits import write_splits


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scikit-learn's digits as train/val Parquet folders (written once per session)."""
    root = tmp_path_factory.mktemp("digits")
    write_splits(str(root / "train"), str(root / "val"))
    return root


def digits_spec(digits_dir: Path, work: Path, **sections: Any) -> dict[str, Any]:
    """A valid digits job spec whose storage and tracking live under ``work``."""
    spec: dict[str, Any] = {
        "name": "digits-test",
        "model": {"class_path": "raytrain.models.digits:DigitsCNN", "init_args": {"lr": 0.003}},
        "data": {
            "train": {"uri": str(digits_dir / "train")},
            "val": {"uri": str(digits_dir / "val")},
            "columns": ["pixels", "label"],
            "batch_size": 32,
        },
        "scaling": {"num_workers": 2},
        # 32-true, not auto: the suite's time must not depend on the CPU having native bf16
        "trainer": {"max_epochs": 2, "log_every_n_steps": 5, "precision": "32-true"},
        "checkpoint": {"storage": str(work / "runs"), "keep": 2},
        # logging the model costs each run seconds; the tests of it turn it back on
        "tracking": {
            "mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "log_model": False}
        },
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(spec.get(section), dict):
            spec[section] = {**spec[section], **values}
        else:
            spec[section] = values
    return spec


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="session", autouse=True)
def no_standing_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A cluster a developer has up (``raytrain up``) is not joined by the tests: its
    record is looked for in an empty folder of the session's own."""
    before = os.environ.get("RAYTRAIN_HOME")
    os.environ["RAYTRAIN_HOME"] = str(tmp_path_factory.mktemp("raytrain-home"))
    yield
    if before is None:
        os.environ.pop("RAYTRAIN_HOME", None)
    else:
        os.environ["RAYTRAIN_HOME"] = before


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No inherited cluster or tracking server: tests run against what they start."""
    for var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    os.environ.setdefault("PYTHONHASHSEED", "0")


_Server = TypeVar("_Server", bound=socketserver.BaseServer)


@contextlib.contextmanager
def serving(server: _Server) -> Iterator[_Server]:
    """``server`` (a stdlib HTTP server on a free loopback port) answering from a thread
    until the block ends, then shut and closed."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
