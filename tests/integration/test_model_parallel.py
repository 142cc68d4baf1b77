"""Tensor parallelism on 2 CPU workers (gloo), Lightning's ModelParallelStrategy under Ray
Train: the tiny GPT's tensor-parallel plan trains, from the same initial weights it reaches
the probe loss an FSDP run reaches on the same rows, its DTensor checkpoint resumes on the
same mesh and on others (tp 2 → tp 1 with FSDP2 over 2 replicas → 1 worker), and the export loads
into a plain model with the same probe loss. One test: each run starts a Ray Train run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import raytrain
from raytrain.checkpoints.export import export_checkpoint
from raytrain.checkpoints.layout import CKPT_FILE
from raytrain.datasets.text import write_splits
from raytrain.models.tinygpt import TinyGPT
from tests.integration.models import probe_loss

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GPT = {"block": 128, "layers": 2, "heads": 2, "dim": 32, "lr": 0.003}
# The first tp 2 run and the FSDP run train on the same rows: 32 a step, one replica of
# batch 32 under tp 2, two of 16 under FSDP (the cached set's order is cut into steps of
# replicas x batch rows, data.order.step_slices). The batch stays 32 when the tp run is
# resharded onto 2 replicas: a changed data.batch_size would be another run.
TP2 = {"name": "model_parallel", "model_parallel": {"tensor_parallel_size": 2}}
TP1 = {"name": "model_parallel", "model_parallel": {"tensor_parallel_size": 1}}
FSDP = {"name": "fsdp"}
# fp32 on both sides; the sums are only ordered differently (a reduce-scatter of halves
# against a whole matmul), which after 12 AdamW steps moves the loss by well under this
PARITY = 1e-4


# max_epochs 3: every tp run here stops (max_steps) within epoch 0, four times, and each
# resume goes on in that epoch. Lightning alone counts an epoch that max_steps ends as
# done, and the fourth run trained nothing (worker.checkpointing saves it as unfinished).
def _spec(root: Path, out: Path, strategy: dict, steps: int, batch: int) -> dict:
    out.mkdir(exist_ok=True)
    return {
        "name": "gpt-fsdp" if strategy == FSDP else "gpt-tp",
        "model": {
            "class_path": "tests.integration.models:ProbedGPT",
            "init_args": {"out_dir": str(out), **GPT},
        },
        "data": {
            "train": {"uri": str(root / "text" / "train")},
            "val": {"uri": str(root / "text" / "val")},
            "columns": ["tokens"],
            "batch_size": batch,
        },
        "scaling": {"num_workers": 2},
        "strategy": strategy,
        "trainer": {
            "max_steps": steps,
            "max_epochs": 3,
            "log_every_n_steps": 1,
            "gradient_clip_val": 1.0,
            "precision": "32-true",
            "seed": 3,
        },
        "checkpoint": {"storage": str(root / "runs"), "keep": 1},
        "tracking": {
            "mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "log_model": False}
        },
    }


def _probes(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]


def test_tensor_parallel_trains_as_fsdp_does_resumes_reshards_and_exports(
    ray_cluster: None, tmp_path: Path, clean_env: None
) -> None:
    write_splits(str(tmp_path / "text" / "train"), str(tmp_path / "text" / "val"), 60_000)

    tp_out, fsdp_out = tmp_path / "tp", tmp_path / "fsdp"
    tp = raytrain.fit(_spec(tmp_path, tp_out, TP2, steps=12, batch=32), progress=False)
    fsdp = raytrain.fit(_spec(tmp_path, fsdp_out, FSDP, steps=12, batch=16), progress=False)
    (tp_start, tp_end), (fsdp_start, fsdp_end) = _probes(tp_out), _probes(fsdp_out)
    assert tp_start["loss"] == pytest.approx(fsdp_start["loss"], abs=1e-6)  # same weights
    assert tp_end["loss"] < tp_start["loss"] - 0.5  # it learnt
    assert tp_end["step"] == fsdp_end["step"] == 12
    assert tp_end["loss"] == pytest.approx(fsdp_end["loss"], abs=PARITY)
    assert tp.metrics["global_batch"] == fsdp.metrics["global_batch"] == 32
    shards = {p.name for p in (Path(tp.latest_checkpoint_uri) / CKPT_FILE).iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= shards

    # the same mesh: the resumed run starts from the weights the first ended with
    same = raytrain.fit(_spec(tmp_path, tp_out, TP2, steps=16, batch=32), progress=False)
    _, _, resumed, ended = _probes(tp_out)
    assert (resumed["step"], ended["step"]) == (12, 16) and same.resumed_from is not None
    assert resumed["loss"] == pytest.approx(tp_end["loss"], abs=1e-6)

    # export of the tensor-parallel shards: one state dict a plain TinyGPT loads strictly,
    # with the probe loss of the run
    state = export_checkpoint(same.latest_checkpoint_uri, str(tmp_path / "gpt.pt"))
    plain = TinyGPT(**GPT)
    plain.load_state_dict(torch.load(tmp_path / "gpt.pt"), strict=True)
    assert set(state) == set(plain.state_dict())
    assert probe_loss(plain.eval(), GPT["block"]) == pytest.approx(ended["loss"], abs=1e-5)

    # other meshes, resharded by torch's DCP: tp 2 → tp 1 (FSDP2 over 2 replicas), then one
    # worker (a mesh of 1: FSDP2 over it still makes the state DTensors, which Lightning's
    # model-parallel restore looks for)
    raytrain.fit(_spec(tmp_path, tp_out, TP1, steps=19, batch=32), progress=False)
    alone = _spec(tmp_path, tp_out, TP1, steps=22, batch=32)
    alone["scaling"]["num_workers"] = 1
    raytrain.fit(alone, progress=False)
    resharded, end, single, single_end = _probes(tp_out)[4:]
    assert [p["step"] for p in (resharded, end, single, single_end)] == [16, 19, 19, 22]
    assert resharded["loss"] == pytest.approx(ended["loss"], abs=1e-5)
    assert end["loss"] < resharded["loss"]
    assert single["world_size"] == 1
    assert single["loss"] == pytest.approx(end["loss"], abs=1e-5)
