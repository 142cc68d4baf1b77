"""Checkpoints are read without running code from them, and ``raytrain export`` refuses what
is not a checkpoint with one line naming the file (exit 2), writing nothing. No Ray."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain.checkpoints.export import checkpoint_weights, trained_model
from raytrain.cli.app import main
from raytrain.errors import EXIT_BAD_INPUT, EXIT_OK, StorageError
from raytrain.models.digits import DigitsCNN
from raytrain.spec import JobSpec


def _safe_load():
    from raytrain.checkpoints import (
        safe_load,  # imported here: the CLI cases run against any version
    )

    return safe_load


class Payload:
    """Unpickled, it would create ``marker``: what an attacker's checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _state() -> dict[str, torch.Tensor]:
    return {f"_forward_module.{k}": v for k, v in DigitsCNN().state_dict().items()}


def _checkpoint(folder: Path, content: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(content, folder / "checkpoint.ckpt")
    return folder


def _sharded(folder: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    shards = folder / "checkpoint.ckpt"
    dcp.save(state, checkpoint_id=str(shards), no_dist=True)
    torch.save({"epoch": 0, "global_step": 1}, shards / "meta.pt")
    return folder


def _export(capsys: pytest.CaptureFixture[str], source: Path, out: Path) -> tuple[int, str]:
    code = main(["export", str(source), str(out)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_lightning_checkpoint_exports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = _checkpoint(
        tmp_path / "checkpoint_1",
        {"state_dict": _state(), "epoch": 3, "hyper_parameters": {"lr": 0.1}},
    )
    for source in (folder, folder / "checkpoint.ckpt"):  # the folder, or the file in it
        out = tmp_path / "out" / "model.pt"
        code, _ = _export(capsys, source, out)
        assert code == EXIT_OK
        DigitsCNN().load_state_dict(torch.load(out, weights_only=True), strict=True)


def test_a_checkpoint_carrying_a_payload_is_refused_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    folder = _checkpoint(tmp_path / "checkpoint_1", {"state_dict": _state(), "x": Payload(marker)})
    out = tmp_path / "model.pt"
    code, err = _export(capsys, folder, out)
    assert code == EXIT_BAD_INPUT
    line = _one_line(err)
    assert f"{folder / 'checkpoint.ckpt'}: refused" in line
    assert "system" in line  # what it tried to call is named
    assert not marker.exists() and not out.exists()


def test_the_model_logging_path_refuses_a_payload(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    folder = _checkpoint(tmp_path / "checkpoint_1", {"state_dict": _state(), "x": Payload(marker)})
    job = JobSpec.model_validate(
        {
            "name": "x",
            "model": {"class_path": "raytrain.models.digits:DigitsCNN"},
            "data": {"train": {"uri": str(tmp_path)}},
        }
    )
    with pytest.raises(StorageError, match="refused"):
        trained_model(job, str(folder))
    with pytest.raises(StorageError, match="refused"):
        checkpoint_weights(str(folder))
    assert not marker.exists()


def test_a_sharded_checkpoint_exports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    opt = {"state": {0: {"step": 3, "exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1}]}
    folder = _sharded(tmp_path / "checkpoint_1", {"model": _state(), "optimizer_0": opt})
    code, _ = _export(capsys, folder, tmp_path / "model.pt")
    assert code == EXIT_OK
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    DigitsCNN().load_state_dict(weights, strict=True)
    _safe_load().verify_dcp(str(folder / "checkpoint.ckpt"))  # what a worker checks at resume


def test_sharded_metadata_carrying_a_payload_is_refused_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    folder = _sharded(tmp_path / "checkpoint_1", {"model": _state()})
    metadata = folder / "checkpoint.ckpt" / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    code, err = _export(capsys, folder, tmp_path / "model.pt")
    assert code == EXIT_BAD_INPUT
    assert f"{metadata}: refused" in _one_line(err)
    with pytest.raises(StorageError, match="refused"):
        _safe_load().verify_dcp(str(folder / "checkpoint.ckpt"))
    assert not marker.exists() and not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize(
    "target",
    [b"cpathlib\nPosixPath\n", b"ctorch.distributed.checkpoint.metadata\nMetadata\n"],
    ids=["PosixPath", "Metadata"],
)
def test_sharded_metadata_cannot_rewrite_an_allowed_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: bytes
) -> None:
    """pickle's BUILD of a class (not an instance) with a slot state sets attributes on the
    class itself: an allowed class would be rewritten for the whole driver process."""
    import pathlib

    from torch.distributed.checkpoint.metadata import Metadata

    folder = _sharded(tmp_path / "checkpoint_1", {"model": _state()})
    metadata = folder / "checkpoint.ckpt" / ".metadata"
    # push the class, BUILD it with (None, {"raytrain_hacked": 1}), drop it; then the real one
    metadata.write_bytes(target + b"N}S'raytrain_hacked'\nI1\ns\x86b0" + metadata.read_bytes())
    try:
        code, err = _export(capsys, folder, tmp_path / "model.pt")
        assert code == EXIT_BAD_INPUT
        assert f"{metadata}: refused" in _one_line(err)
        with pytest.raises(StorageError, match="refused"):
            _safe_load().verify_dcp(str(folder / "checkpoint.ckpt"))
        assert not hasattr(pathlib.PosixPath, "raytrain_hacked")
        assert not hasattr(Metadata, "raytrain_hacked")
        assert not (tmp_path / "model.pt").exists()
    finally:
        for cls in (pathlib.PosixPath, Metadata):
            if "raytrain_hacked" in vars(cls):
                delattr(cls, "raytrain_hacked")


def test_a_sharded_entry_carrying_a_payload_is_refused_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A non-tensor entry: torch's own DCP planner reads it with weights_only=False."""
    marker = tmp_path / "marker"
    folder = _sharded(tmp_path / "checkpoint_1", {"model": {**_state(), "x": Payload(marker)}})
    code, err = _export(capsys, folder, tmp_path / "model.pt")
    assert code == EXIT_BAD_INPUT
    assert "refused" in _one_line(err) and "entry model.x" in err
    with pytest.raises(StorageError, match="refused"):  # the workers' check before a resume
        _safe_load().verify_dcp(str(folder / "checkpoint.ckpt"))
    assert not marker.exists()


def test_lightning_meta_file_carrying_a_payload_is_refused_at_resume(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    folder = _sharded(tmp_path / "checkpoint_1", {"model": _state()})
    torch.save({"epoch": 0, "x": Payload(marker)}, folder / "checkpoint.ckpt" / "meta.pt")
    with pytest.raises(StorageError, match=r"meta\.pt: refused"):
        _safe_load().verify_dcp(str(folder / "checkpoint.ckpt"))
    assert not marker.exists()


def _rewrite_shards(metadata: Path, **fields: Any) -> None:
    """Set ``fields`` (``relative_path``, ``length``...) on every storage entry of a DCP
    ``.metadata`` (the test's own file: plain pickle is fine here)."""
    import dataclasses

    loaded = pickle.loads(metadata.read_bytes())
    loaded.storage_data = {
        k: dataclasses.replace(v, **fields) for k, v in loaded.storage_data.items()
    }
    metadata.write_bytes(pickle.dumps(loaded))


@pytest.mark.parametrize("where", ["../../outside.bin", "ABSOLUTE", "sub/../../../outside.bin"])
def test_shard_paths_out_of_the_checkpoint_are_refused_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """A ``.metadata`` whose entries' ``relative_path`` leaves the folder (torch's reader
    joins it to the folder as written) once exported tensors taken from a file outside it;
    ``verify_dcp``, the workers' check before a resume, read it too."""
    folder = _sharded(tmp_path / "checkpoint_1", {"model": _state()})
    shards = folder / "checkpoint.ckpt"
    (shard,) = shards.glob("*.distcp")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(shard.read_bytes())  # a readable copy: only the path is wrong
    path = str(outside) if where == "ABSOLUTE" else where
    _rewrite_shards(shards / ".metadata", relative_path=path)
    out = tmp_path / "out" / "model.pt"
    code, err = _export(capsys, folder, out)
    assert code == EXIT_BAD_INPUT
    line = _one_line(err)
    assert line.startswith(f"error: {shards} (entry model.") and repr(path) in line, line
    assert "not a path relative to" in line or "leads out of the checkpoint folder" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(StorageError, match="checkpoint folder"):
        _safe_load().verify_dcp(str(shards))


def test_shards_that_are_links_out_devices_or_overlong_are_refused(tmp_path: Path) -> None:
    """A shard that is a link out of the folder (to ``/dev/zero``, or a file), a FIFO, a
    byte range past its file's end, and a non-tensor entry past ``MAX_BYTES_ENTRY`` (read
    whole into memory) are each refused before anything is read."""
    safe_load = _safe_load()

    def sharded(name: str) -> tuple[Path, Path]:
        folder = _sharded(tmp_path / name, {"model": _state(), "loops": {"step": 3}})
        shards = folder / "checkpoint.ckpt"
        return shards, next(shards.glob("*.distcp"))

    shards, shard = sharded("zero")
    shard.unlink()
    shard.symlink_to("/dev/zero")
    with pytest.raises(StorageError, match="leads out of the checkpoint folder"):
        safe_load.verify_dcp(str(shards))
    shards, shard = sharded("fifo")
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(StorageError, match=f"its shard {shard.name}: not a regular file"):
        safe_load.verify_dcp(str(shards))
    shards, shard = sharded("past_end")
    _rewrite_shards(shards / ".metadata", offset=0, length=shard.stat().st_size + 1)
    with pytest.raises(StorageError, match="are not within its shard"):
        safe_load.verify_dcp(str(shards))
    shards, shard = sharded("huge_entry")
    with shard.open("r+b") as grow:  # a sparse file: the entry lies within it
        grow.truncate(safe_load.MAX_BYTES_ENTRY + 2)
    _rewrite_shards(shards / ".metadata", offset=0, length=safe_load.MAX_BYTES_ENTRY + 1)
    with pytest.raises(StorageError, match=r"entry loops\.step\): a non-tensor entry of"):
        safe_load.verify_dcp(str(shards))
    shards, _ = sharded("nul")
    _rewrite_shards(shards / ".metadata", relative_path="a\x00b")
    with pytest.raises(StorageError, match="is not a path relative to the checkpoint folder"):
        safe_load.verify_dcp(str(shards))
    shards, _ = sharded("metadata_fifo")
    (shards / ".metadata").unlink()
    os.mkfifo(shards / ".metadata")
    with pytest.raises(StorageError, match=r"\.metadata: not a regular file"):
        safe_load.verify_dcp(str(shards))


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each case: (what is exported, the file the error must name)."""
    random = tmp_path / "random" / "checkpoint.ckpt"
    random.parent.mkdir()
    random.write_bytes(os.urandom(4096))
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    empty = tmp_path / "empty_checkpoint"
    empty.mkdir()
    (empty / "raytrain.json").write_text("{}")
    no_state = _checkpoint(tmp_path / "no_state", {"epoch": 1, "weights": _state()})
    not_dict = _checkpoint(tmp_path / "not_dict", [1, 2, 3])
    truncated = _checkpoint(tmp_path / "truncated", {"state_dict": _state()})
    data = (truncated / "checkpoint.ckpt").read_bytes()
    (truncated / "checkpoint.ckpt").write_bytes(data[: len(data) // 2])
    return {
        "random bytes": (random.parent, str(random)),
        "a text file": (text, str(text)),
        "a folder without checkpoint.ckpt": (empty, str(empty)),
        "a checkpoint without state_dict": (no_state, str(no_state / "checkpoint.ckpt")),
        "a checkpoint that is a list": (not_dict, str(not_dict / "checkpoint.ckpt")),
        "a truncated checkpoint": (truncated, str(truncated / "checkpoint.ckpt")),
        "a missing path": (tmp_path / "nowhere", str(tmp_path / "nowhere")),
    }


@pytest.mark.parametrize(
    "case",
    [
        "random bytes",
        "a text file",
        "a folder without checkpoint.ckpt",
        "a checkpoint without state_dict",
        "a checkpoint that is a list",
        "a truncated checkpoint",
        "a missing path",
    ],
)
def test_export_of_what_is_not_a_checkpoint_is_one_line_exit_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, named = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out" / "model.pt"
    code, err = _export(capsys, source, out)
    assert code == EXIT_BAD_INPUT
    assert _one_line(err).startswith(f"error: {named}: ")
    assert not (tmp_path / "out").exists()


def test_export_to_a_folder_or_under_a_file_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _checkpoint(tmp_path / "checkpoint_1", {"state_dict": _state()})
    target = tmp_path / "target"
    target.mkdir()
    code, err = _export(capsys, folder, target)
    assert code == EXIT_BAD_INPUT
    assert _one_line(err).startswith(f"error: {target}: is a folder")
    assert list(target.iterdir()) == []
    code, err = _export(capsys, folder, tmp_path / "target" / "x" / ".." / "..")
    assert code == EXIT_BAD_INPUT
    assert main(["export", str(folder), f"{tmp_path / 'new'}/"]) == EXIT_BAD_INPUT
    assert "is a folder" in _one_line(capsys.readouterr().err)
    note = tmp_path / "notes.txt"
    note.write_text("x")
    code, err = _export(capsys, folder, note / "model.pt")
    assert code == EXIT_BAD_INPUT
    assert _one_line(err).startswith(f"error: {note / 'model.pt'}: ")
    assert note.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1", "notes.txt", "target"]


def test_export_never_writes_into_the_checkpoint_or_over_a_special_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT naming the checkpoint's own file replaced a committed checkpoint by its weights;
    OUT a FIFO (or /dev/null, as root) was replaced by a regular file."""
    folder = _checkpoint(tmp_path / "checkpoint_1", {"state_dict": _state()})
    ckpt = folder / "checkpoint.ckpt"
    before = ckpt.read_bytes()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.pt"
    link.symlink_to(ckpt)
    cases = [
        (folder, ckpt),
        (ckpt, ckpt),
        (folder, folder / "model.pt"),
        (ckpt, folder / "model.pt"),
        (folder, link),
        (folder, fifo),
    ]
    for source, out in cases:
        code, err = _export(capsys, source, out)
        assert code == EXIT_BAD_INPUT, (source, out)
        assert _one_line(err).startswith(f"error: {out}: "), err
    assert ckpt.read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.ckpt"]
    assert fifo.is_fifo() and link.is_symlink()


def test_a_resume_checks_the_checkpoint_then_lightning_restores_it_weights_only(
    tmp_path: Path,
) -> None:
    """What a worker does (worker.train_loop): ``verify_checkpoint``, then Lightning's
    restore with ``weights_only=True`` and the allow-list; a real Lightning checkpoint of a
    model with saved hyperparameters passes both; one with a payload is refused first."""
    import lightning.pytorch as pl

    rows = [{"pixels": torch.rand(64) * 16, "label": torch.tensor(i % 10)} for i in range(32)]
    loader = torch.utils.data.DataLoader(rows, batch_size=16)

    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
        )

    first = trainer(2)
    first.fit(DigitsCNN(lr=0.01), loader)
    path = tmp_path / "checkpoint.ckpt"
    first.save_checkpoint(path)
    _safe_load().verify_checkpoint(str(path))
    second = trainer(3)
    with _safe_load().lightning_globals():
        second.fit(DigitsCNN(lr=0.01), loader, ckpt_path=path, weights_only=True)
    assert second.global_step == 3

    marker = tmp_path / "marker"
    evil = _checkpoint(
        tmp_path / "evil", {**torch.load(path, weights_only=True), "x": Payload(marker)}
    )
    with pytest.raises(StorageError, match="refused"):
        _safe_load().verify_checkpoint(str(evil / "checkpoint.ckpt"))
    assert not marker.exists()


def test_export_into_a_folder_it_cannot_write_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/proc takes no new files, even from root (whom a folder's mode does not stop): torch's
    own open raised a RuntimeError there, a traceback and exit 1."""
    folder = _checkpoint(tmp_path / "checkpoint_1", {"state_dict": _state()})
    out = "/proc/raytrain-export-test.pt"
    code, err = _export(capsys, folder, Path(out))
    assert code == EXIT_BAD_INPUT
    assert _one_line(err).startswith(f"error: {out}: ")
    assert not os.path.exists(out)
