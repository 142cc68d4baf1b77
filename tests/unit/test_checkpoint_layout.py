"""A run folder's checkpoint layout without Ray: where a checkpoint's Lightning file is, and
what Ray Train's snapshot says was committed and will be restored.

The folders and the snapshot are written as Ray Train writes them (``checkpoint_<time>``
folders beside ``checkpoint_manager_snapshot.json``); which uncommitted folders may be
deleted is tested in test_run_folder_safety.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from raytrain.checkpoints.layout import (
    CKPT_FILE,
    SNAPSHOT_FILE,
    latest_committed,
    read_snapshot,
    restore_path,
)
from raytrain.errors import StorageError

FIRST, SECOND = (f"checkpoint_2026-12-02_03-{m}-00.000000" for m in ("10", "20"))


def _result(name: str, step: int) -> dict[str, Any]:
    return {"checkpoint_dir_name": name, "metrics": {"step": step, "val_acc": step / 100}}


def _snapshot(run: Path, tree: Any) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / SNAPSHOT_FILE).write_text(tree if isinstance(tree, str) else json.dumps(tree))


def test_restore_path_is_the_lightning_file_in_the_folder(tmp_path: Path) -> None:
    (tmp_path / CKPT_FILE).write_bytes(b"state")
    assert restore_path(str(tmp_path)) == str(tmp_path / CKPT_FILE)


def test_a_folder_without_the_lightning_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"state")
    with pytest.raises(StorageError, match=f"not a raytrain checkpoint \\(no {CKPT_FILE}\\)"):
        restore_path(str(tmp_path))
    with pytest.raises(StorageError, match="no such file or folder"):
        restore_path(str(tmp_path / "gone"))


def test_a_run_that_never_committed_has_no_snapshot(tmp_path: Path) -> None:
    (tmp_path / FIRST).mkdir()  # an upload that never committed
    assert read_snapshot(str(tmp_path)) is None
    assert latest_committed(str(tmp_path)) is None
    assert read_snapshot(str(tmp_path / "no-such-run")) is None


def test_the_snapshot_names_the_committed_folders_and_the_latest(tmp_path: Path) -> None:
    # Ray lists the kept checkpoints and, apart, the latest (which it may not keep)
    _snapshot(
        tmp_path,
        {
            "checkpoint_results": [_result(FIRST, 10)],
            "latest_checkpoint_result": _result(SECOND, 20),
        },
    )
    snapshot = read_snapshot(str(tmp_path))
    assert snapshot is not None
    assert snapshot.committed == {FIRST, SECOND}
    assert snapshot.latest == SECOND
    assert snapshot.latest_metrics == {"step": 20, "val_acc": 0.2}
    assert latest_committed(str(tmp_path)) == (str(tmp_path / SECOND), {"step": 20, "val_acc": 0.2})


def test_a_snapshot_with_no_latest_restores_nothing(tmp_path: Path) -> None:
    _snapshot(tmp_path, {"checkpoint_results": [], "latest_checkpoint_result": None})
    snapshot = read_snapshot(str(tmp_path))
    assert snapshot is not None and snapshot.latest is None and snapshot.committed == set()
    assert latest_committed(str(tmp_path)) is None


def test_a_file_uri_run_folder_reads_as_its_path(tmp_path: Path) -> None:
    _snapshot(tmp_path, {"checkpoint_results": [], "latest_checkpoint_result": _result(FIRST, 5)})
    found = latest_committed(f"file://{tmp_path}")
    assert found is not None and found[1] == {"step": 5, "val_acc": 0.05}
    assert found[0].endswith(FIRST)


@pytest.mark.parametrize(
    "text",
    [
        "",  # written but empty (a store that failed mid-PUT is not atomic here)
        '{"checkpoint_results": [',  # truncated
        "[]",  # not Ray's shape
        '{"latest_checkpoint_result": null}',  # no list of results
        '{"checkpoint_results": [{"metrics": {}}]}',  # a result without its folder
        '{"checkpoint_results": [], "latest_checkpoint_result": 3}',  # a latest of no shape
    ],
    ids=["empty", "truncated", "a-list", "no-results", "no-folder-name", "bad-latest"],
)
def test_an_unreadable_snapshot_names_itself_and_the_way_out(tmp_path: Path, text: str) -> None:
    _snapshot(tmp_path, text)
    with pytest.raises(StorageError) as caught:
        read_snapshot(str(tmp_path))
    message = str(caught.value)
    assert str(tmp_path / SNAPSHOT_FILE) in message
    assert "--fresh" in message
    with pytest.raises(StorageError):
        latest_committed(str(tmp_path))
