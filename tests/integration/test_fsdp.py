"""FSDP on 2 CPU workers (gloo): the tiny GPT trains, each rank writes its own shard of one
checkpoint, a worker SIGKILLed mid-epoch resumes from the shards kept in memory (not the
epoch's checkpoint in storage) with the weights it had, a resume on another world size
(2 → 1 → 2) restores the same weights, and the exported state dict loads into a plain
model that gives the same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import raytrain
from raytrain.checkpoints.export import export_checkpoint
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from raytrain.datasets.text import write_splits
from raytrain.models.tinygpt import TinyGPT
from raytrain.records.run_status import read_status
from tests.integration.models import probe_loss

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GPT = {"block": 128, "layers": 2, "heads": 2, "dim": 32, "lr": 0.003}


KILL_AT = 100  # in the second epoch (78 steps each)


def _spec(
    tmp_path: Path,
    workers: int,
    epochs: int,
    kill_at: int | None = KILL_AT,
    memory: int | str = "auto",
) -> dict:
    return {
        "name": "fsdp-gpt",
        "model": {
            "class_path": "tests.integration.models:ProbedGPT",
            "init_args": {"out_dir": str(tmp_path), "kill_at": kill_at, **GPT},
        },
        "data": {
            "train": {"uri": str(tmp_path / "text" / "train")},
            "val": {"uri": str(tmp_path / "text" / "val")},
            "columns": ["tokens"],
            "batch_size": 16,
        },
        "scaling": {"num_workers": workers},
        "strategy": {
            "name": "fsdp",
            "fsdp": {"auto_wrap": ["Block"], "activation_checkpointing": ["Block"]},
        },
        "trainer": {
            "max_epochs": epochs,
            "log_every_n_steps": 10,
            "gradient_clip_val": 1.0,
            "precision": "32-true",
        },
        # one restart allowed (the kill)
        "checkpoint": {
            "storage": str(tmp_path / "runs"),
            "keep": 1,
            "memory_every_n_steps": memory,
        },
        "failure": {"max_failures": 1},
        "tracking": {
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "log_model": False}
        },
    }


def _probes(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "probes.jsonl").read_text().splitlines()]


def test_fsdp_shards_resumes_on_another_world_size_and_exports(
    ray_cluster: None, tmp_path: Path, clean_env: None
) -> None:
    write_splits(str(tmp_path / "text" / "train"), str(tmp_path / "text" / "val"), 200_000)

    # the shards kept in memory every step (a resume may change it: the others keep auto)
    first = raytrain.fit(_spec(tmp_path, workers=2, epochs=2, memory=1), progress=False)
    assert first.metrics["val_bpc"] < first.metrics["val_unigram_bpc"] - 0.2
    shards = sorted(p.name for p in (Path(first.latest_checkpoint_uri) / CKPT_FILE).iterdir())
    assert [s for s in shards if s.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    assert ".metadata" in shards

    # The kill: the restart resumed from the shards kept in memory, at the last step kept
    # (the one before the kill, or one a busy send skipped), with the weights of that step,
    # newer than the first epoch's checkpoint in storage
    probes = _probes(tmp_path)
    (killed,) = [p for p in probes if p["when"] == "killed"]
    kept = killed["kept"]
    before = {p["step"]: p["loss"] for p in probes if p["when"] == "step"}
    restarted = [p for p in probes if p["when"] == "start"][1]
    assert killed["step"] == KILL_AT and KILL_AT - 3 <= kept <= KILL_AT
    assert restarted["step"] == kept
    assert restarted["loss"] == pytest.approx(before[kept], abs=1e-5)
    status = read_status(first.run_dir)
    assert status is not None and len(status.restarts) == 1
    assert status.restarts[0].step == kept and status.restarts[0].lost_steps <= KILL_AT - kept
    per_epoch = first.metrics["step"] // 2  # storage's last checkpoint then: epoch 1's end
    assert per_epoch < kept
    print(f"fsdp: killed at step {KILL_AT}, resumed at {kept} from memory")

    # 2 → 1 worker, then 1 → 2: each resume starts from the weights the last run ended with
    # (the same spec: the model kills once)
    second = raytrain.fit(_spec(tmp_path, workers=1, epochs=3), progress=False)
    third = raytrain.fit(_spec(tmp_path, workers=2, epochs=4), progress=False)
    probes = [p for p in _probes(tmp_path) if p["when"] in ("start", "end")]
    assert [(p["when"], p["world_size"]) for p in probes] == [
        ("start", 2),
        ("start", 2),
        ("end", 2),
        ("start", 1),
        ("end", 1),
        ("start", 2),
        ("end", 2),
    ]
    probes = [probes[0], *probes[2:]]  # the kill's restart: above
    for ended, resumed in ((probes[1], probes[2]), (probes[3], probes[4])):
        assert resumed["step"] == ended["step"] > 0
        assert resumed["loss"] == pytest.approx(ended["loss"], abs=1e-5)
    assert probes[2]["loss"] < probes[0]["loss"]  # it did learn
    assert second.metrics["step"] < third.metrics["step"]

    # export: one state dict that a plain model loads strictly, with the same outputs
    meta = json.loads((Path(third.latest_checkpoint_uri) / META_FILE).read_text())
    assert meta["step"] == probes[5]["step"]
    state = export_checkpoint(third.latest_checkpoint_uri, str(tmp_path / "gpt.pt"))
    plain = TinyGPT(**GPT)
    plain.load_state_dict(torch.load(tmp_path / "gpt.pt"), strict=True)
    assert set(state) == set(plain.state_dict())
    assert probe_loss(plain.eval(), GPT["block"]) == pytest.approx(probes[5]["loss"], abs=1e-5)


# 32-true is the precision of the test above
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_fsdp_trains_in_each_precision(
    ray_cluster: None, tmp_path: Path, clean_env: None, precision: str
) -> None:
    """Each precision Lightning maps onto FSDP's mixed-precision policy trains (the loss
    falls over a short epoch) and checkpoints its shards."""
    write_splits(str(tmp_path / "text" / "train"), str(tmp_path / "text" / "val"), 60_000)
    spec = _spec(tmp_path, workers=2, epochs=1, kill_at=None)
    spec["trainer"] = {**spec["trainer"], "precision": precision, "log_every_n_steps": 1}
    probes = tmp_path / "probes.jsonl"
    result = raytrain.fit(spec, progress=False)
    start, end = (json.loads(x) for x in probes.read_text().splitlines())
    assert end["loss"] < start["loss"]  # it learnt on the probe text's bytes
    assert result.metrics["val_bpc"] < result.metrics["val_unigram_bpc"] + 1.0
    shards = {p.name for p in (Path(result.latest_checkpoint_uri) / CKPT_FILE).iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp"} <= shards
