"""A finished run's command run again says it is complete, before Ray (issue 15, item 13);
a run-state file that cannot be read blocks a resume with exit 2 but never ``--fresh``
(item 11). No Ray here: the CLI runs in a fresh interpreter where importing Ray fails."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from raytrain.errors import RunStateError
from raytrain.records import run_folder, runstate
from raytrain.spec import load_spec
from tests.conftest import digits_spec, write_spec
from tests.fresh_process import run_fresh

# Importing Ray fails in the driver: a command that would start it fails instead.
_DRIVER = r"""
import contextlib, io, json, sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("this test forbids importing ray")
sys.meta_path.insert(0, NoRay())
from raytrain.cli.app import main
err, out = io.StringIO(), io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
    try:
        rc = main(json.loads(sys.argv[1]))
    except BaseException as exc:
        rc = f"raised {type(exc).__name__}: {exc}"
print(json.dumps({"rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue(),
                  "ray": "ray" in sys.modules, "lightning": "lightning" in sys.modules}))
"""


def _cli(argv: list[str], cwd: Path) -> dict[str, Any]:
    return run_fresh(_DRIVER, argv, cwd, pythonpath=os.getcwd(), timeout=120)


def _finished_run(work: Path, digits_dir: Path, metrics: dict[str, Any]) -> Path:
    """A run folder as a finished run leaves it: a FINISHED state and Ray's snapshot of
    its last checkpoint, reported with ``metrics``."""
    spec = digits_spec(digits_dir, work, trainer={"max_epochs": 2})
    path = write_spec(work / "job.yaml", spec)
    job = load_spec(path)
    state = runstate.new_state(job)
    state.status, state.mlflow_run_id, state.attempts = "FINISHED", "abc123", 1
    runstate.save(job, state)
    name = "checkpoint_2026-01-01_00-00-00.000001"
    (Path(runstate.run_dir(job)) / name).mkdir()
    result = {"checkpoint_dir_name": name, "metrics": metrics}
    snapshot = {"checkpoint_results": [result], "latest_checkpoint_result": result}
    Path(runstate.run_dir(job), "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    return path


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def test_rerun_of_a_complete_run_starts_nothing(digits_dir: Path, tmp_path: Path) -> None:
    metrics = {"epoch": 1, "step": 72, "kind": "epoch", "val_acc": 0.9, "_score": 0.9}
    spec = _finished_run(tmp_path, digits_dir, metrics)
    before = _tree(tmp_path)
    got = _cli(["run", str(spec)], tmp_path)
    assert got["rc"] == 0, got
    assert "is complete" in got["stderr"], got
    assert "checkpoint_2026-01-01_00-00-00.000001 is at epoch 2, step 72" in got["stderr"]
    assert "raise trainer.max_epochs or trainer.max_steps" in got["stderr"]
    assert "--fresh" in got["stderr"]
    assert "already complete" in got["stdout"]
    assert not got["ray"] and not got["lightning"]
    assert _tree(tmp_path) == before  # nothing written: no attempt counted, no MLflow store


@pytest.mark.parametrize(
    ("metrics", "overrides", "complete"),
    [
        ({"epoch": 1, "step": 72, "kind": "epoch"}, {"max_epochs": 2}, True),
        ({"epoch": 0, "step": 36, "kind": "epoch"}, {"max_epochs": 2}, False),
        ({"epoch": 2, "step": 72, "kind": "end"}, {"max_epochs": 2}, True),
        ({"epoch": 1, "step": 50, "kind": "end"}, {"max_epochs": 2}, False),
        ({"epoch": 1, "step": 50, "kind": "step"}, {"max_epochs": 2}, False),
        ({"epoch": 1, "step": 50, "kind": "step"}, {"max_epochs": 9, "max_steps": 50}, True),
        ({"epoch": 1, "step": 72, "kind": "epoch"}, {"max_epochs": 3}, False),
        ({"epoch": 1, "step": 72, "kind": "epoch"}, {"max_epochs": None}, False),
        ({"epoch": 1, "step": 72}, {"max_epochs": 2}, False),  # no kind: not known
    ],
)
def test_complete_means_lightning_would_train_nothing(
    metrics: dict[str, Any], overrides: dict[str, Any], complete: bool, tmp_path: Path
) -> None:
    tree = {
        "name": "x",
        "model": {"class_path": "a.b:C"},
        "data": {"train": {"uri": str(tmp_path)}},
        "trainer": overrides,
    }
    assert run_folder.trained_to_limits(metrics, load_spec(tree)) is complete


def test_a_run_whose_last_attempt_failed_is_resumed_not_called_complete(
    digits_dir: Path, tmp_path: Path
) -> None:
    spec = _finished_run(tmp_path, digits_dir, {"epoch": 1, "step": 72, "kind": "epoch"})
    job = load_spec(spec)
    state = runstate.load(job)
    state.status = "FAILED"  # e.g. the driver died logging the model: the rerun logs it
    runstate.save(job, state)
    assert run_folder.already_complete(job, runstate.load(job), 0.0) is None


@pytest.mark.parametrize(
    "content",
    [
        b'{"name": "digits-test", "spec_dig',
        b'{"name": "digits-test", "spec_digest": "x", "spec": {}, "future_key": 1}',
        b"\xff\xfe not text",
        b"[]",
    ],
)
def test_broken_state_file_blocks_a_resume_but_not_fresh(
    content: bytes, digits_dir: Path, tmp_path: Path
) -> None:
    job = load_spec(digits_spec(digits_dir, tmp_path))
    folder = Path(runstate.run_dir(job))
    folder.mkdir(parents=True)
    (folder / runstate.STATE_FILE).write_bytes(content)
    with pytest.raises(RunStateError, match=r"raytrain-run\.json: the run's state file cannot"):
        run_folder.check_resumable(job, fresh=False, resume_anyway=False)
    with pytest.raises(RunStateError):
        run_folder.check_resumable(job, fresh=False, resume_anyway=True)
    # --fresh: a state stands for the file, so that the run's folder is deleted and started
    # over (``_open_run`` deletes it when there is a state to start over from)
    assert run_folder.check_resumable(job, fresh=True, resume_anyway=False) is not None
