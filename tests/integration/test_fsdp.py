"""FSDP on 2 CPU workers (gloo): the tiny GPT trains, each rank writes its own shard of one
checkpoint, a resume on another world size (2 → 1 → 2) restores the same weights, and the
exported state dict loads into a plain model that gives the same outputs."""

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
from tests.integration.models import probe_loss

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GPT = {"block": 128, "layers": 2, "heads": 2, "dim": 32, "lr": 0.003}


def _spec(tmp_path: Path, workers: int, epochs: int) -> dict:
    return {
        "name": "fsdp-gpt",
        "model": {"class_path": "tests.integration.models:ProbedGPT",
                  "init_args": {"out_dir": str(tmp_path), **GPT}},
        "data": {"train": {"uri": str(tmp_path / "text" / "train")},
                 "val": {"uri": str(tmp_path / "text" / "val")},
                 "columns": ["tokens"], "batch_size": 16},
        "scaling": {"num_workers": workers},
        "strategy": {"name": "fsdp", "fsdp": {"auto_wrap": ["Block"],
                                              "activation_checkpointing": ["Block"]}},
        "trainer": {"max_epochs": epochs, "log_every_n_steps": 10, "gradient_clip_val": 1.0,
                    "precision": "32-true"},
        "checkpoint": {"storage": str(tmp_path / "runs"), "keep": 1},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                "log_model": False}},
    }  # fmt: skip


def _probes(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "probes.jsonl").read_text().splitlines()]


def test_fsdp_shards_resumes_on_another_world_size_and_exports(
    ray_cluster: None, tmp_path: Path, clean_env: None
) -> None:
    write_splits(str(tmp_path / "text" / "train"), str(tmp_path / "text" / "val"), 200_000)

    first = raytrain.fit(_spec(tmp_path, workers=2, epochs=2), progress=False)
    assert first.metrics["val_bpc"] < first.metrics["val_unigram_bpc"] - 0.2
    shards = sorted(p.name for p in (Path(first.latest_checkpoint_uri) / CKPT_FILE).iterdir())
    assert [s for s in shards if s.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    assert ".metadata" in shards

    # 2 → 1 worker, then 1 → 2: each resume starts from the weights the last run ended with
    second = raytrain.fit(_spec(tmp_path, workers=1, epochs=3), progress=False)
    third = raytrain.fit(_spec(tmp_path, workers=2, epochs=4), progress=False)
    probes = _probes(tmp_path)
    assert [(p["when"], p["world_size"]) for p in probes] == [
        ("start", 2), ("end", 2), ("start", 1), ("end", 1), ("start", 2), ("end", 2)]  # fmt: skip
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
    spec = _spec(tmp_path, workers=2, epochs=1)
    spec["trainer"] = {**spec["trainer"], "precision": precision, "log_every_n_steps": 1}
    probes = tmp_path / "probes.jsonl"
    result = raytrain.fit(spec, progress=False)
    start, end = (json.loads(x) for x in probes.read_text().splitlines())
    assert end["loss"] < start["loss"]  # it learnt on the probe text's bytes
    assert result.metrics["val_bpc"] < result.metrics["val_unigram_bpc"] + 1.0
    shards = {p.name for p in (Path(result.latest_checkpoint_uri) / CKPT_FILE).iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp"} <= shards
