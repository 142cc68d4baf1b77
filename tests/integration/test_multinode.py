"""Node failures on a multi-node Ray cluster on this machine: a node holding a worker is
drained for a preemption and then another removed (its raylet, object store and workers
killed), in one run; and nodes come and go under an elastic worker range. Each run must
finish having trained on every row exactly once per epoch (counted in a buffer saved with
the model), on the nodes that were left, with a metric history that only moves forward.
Last, a CPU-only data node beside the training nodes: ``data.preprocess`` runs there."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch

import raytrain
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from tests.conftest import digits_spec
from tests.integration.multinode import (
    WORKER_RESOURCES,
    add_slot_node,
    fresh_slot_nodes,
    multinode_cluster,
    node_by_id,
    read_events,
    run_with_actions,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """One multi-node cluster for the module; each test gives it the worker nodes it needs."""
    with multinode_cluster() as running:
        yield running


def _spec(
    digits_dir: Path, tmp_path: Path, name: str, epochs: int = EPOCHS, **init_args: Any
) -> dict[str, Any]:
    ids = pq.read_table(digits_dir / "train", columns=["id"]).column("id").to_pylist()
    val = pq.read_table(digits_dir / "val", columns=["id"]).column("id").to_pylist()
    return digits_spec(
        digits_dir,
        tmp_path,
        name=name,
        model={
            "class_path": "tests.integration.models:NodeEventsCNN",
            "init_args": {
                "out_dir": str(tmp_path),
                "num_ids": max(ids + val) + 1,
                "run_dir": str(tmp_path / "runs" / name),
                **init_args,
            },
        },
        data={"columns": ["id", "pixels", "label"], "shuffle": {"seed": 5}},
        scaling={"num_workers": 2, "resources_per_worker": WORKER_RESOURCES},
        trainer={"max_epochs": epochs, "log_every_n_steps": 5},
        checkpoint={"every_n_steps": 10, "keep": 20},
        failure={"max_failures": 1},
    )


def _assert_every_row_once_per_epoch(digits_dir: Path, result: Any, epochs: int = EPOCHS) -> None:
    ids = pq.read_table(digits_dir / "train", columns=["id"]).column("id").to_pylist()
    seen = _final_state(result)["seen"]
    assert seen[ids].tolist() == [epochs] * len(ids)
    assert int(seen.sum()) == epochs * len(ids)


def _final_state(result: Any) -> dict[str, Any]:
    """The model's state dict in the run's last checkpoint."""

    def step(checkpoint: str) -> int:
        return json.loads((Path(checkpoint) / META_FILE).read_text())["step"]

    final = max(result.checkpoints, key=step)
    return torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)["state_dict"]


def _assert_history_forward(result: Any) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result.tracking_uri)
    assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    for key in ("train_loss", "val_acc"):
        logged = [m.step for m in client.get_metric_history(result.mlflow_run_id, key)]
        assert logged == sorted(set(logged)), (key, logged)
    # and nothing lost with the nodes: every log_every_n_steps step is there
    logged = {m.step for m in client.get_metric_history(result.mlflow_run_id, "train_loss")}
    assert set(range(5, result.metrics["step"] + 1, 5)) <= logged


def _groups(out_dir: Path) -> list[dict[int, str]]:
    """Each worker group's {rank: node}, in start order (a group: its world size and the
    step it started from; no test here restarts twice from one checkpoint)."""
    groups: dict[tuple[int, int], dict[int, str]] = {}
    for event in read_events(out_dir):
        if event["event"] == "worker":
            key = (event["world_size"], event["step"])
            groups.setdefault(key, {})[event["rank"]] = event["node"]
    return list(groups.values())


def drain_for_preemption(node_id: str, deadline_s: int) -> None:
    """Ask the GCS to drain a node for a preemption with a deadline, as a cloud autoscaler
    does when a spot node is reclaimed (`ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION`). Nothing kills the node: Ray Train acts on the notice."""
    import time

    import ray
    from ray.core.generated import autoscaler_pb2

    deadline_ms = time.time_ns() // 1_000_000 + deadline_s * 1000
    accepted, why = ray._private.worker.global_worker.gcs_client.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot instance reclaimed (test)",
        deadline_ms,
    )
    assert accepted, why


# The elastic test runs first: Ray Train sizes an elastic group from its autoscaling
# coordinator's view of the nodes, refreshed every 20 s, and after the nodes of a test before
# it are replaced that view can still lack the new ones (a group of 1 where 2 fit). The
# fixed-size drain test does not read it.


def test_elastic_range_shrinks_on_a_lost_node_and_grows_back_keeping_its_global_batch(
    cluster: Any, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    """num_workers [1, 2] with keep_global_batch: a node lost → the run goes on with 1
    worker accumulating 2 batches a step; a node added → it grows back to 2 accumulating 1.
    Every row is still trained on exactly once per epoch across the resizes, and every
    optimizer step trains on 64 rows (2 x 32) but each epoch's last, which takes the
    remaining 30 of its 1438 rows, whatever the worker count: an epoch is 23 steps on 1 and
    on 2 workers. The 1-worker group restores from step 15, an odd batch count its
    accumulation of 2 does not divide (Lightning alone would step after 1 batch there)."""
    fresh_slot_nodes(cluster, 2)

    def remove(event: dict[str, Any]) -> None:
        cluster.remove_node(node_by_id(cluster, event["node"]), allow_graceful=False)

    spec = _spec(digits_dir, tmp_path, "elastic", doomed_at=15, grow_at=40)
    spec["scaling"] = {
        **spec["scaling"],
        "num_workers": [1, 2],
        "resize_check_s": 1,
        "keep_global_batch": True,
    }
    spec["checkpoint"] = {**spec["checkpoint"], "every_n_steps": 5}
    actions = {"doomed": remove, "shrunk": lambda event: add_slot_node(cluster)}
    result, done = run_with_actions(tmp_path, lambda: raytrain.fit(spec, progress=False), actions)
    assert done == ["doomed", "shrunk"]

    groups = _groups(tmp_path)
    assert [len(g) for g in groups] == [2, 1, 2]
    starts = [e["step"] for e in read_events(tmp_path) if e["event"] == "worker"]
    assert starts == [0, 0, 15, 40, 40]  # from the step-15, then the step-40 checkpoint
    _assert_every_row_once_per_epoch(digits_dir, result)
    _assert_history_forward(result)

    # the samples of each optimizer step, as the final model counted them
    assert result.metrics["step"] == 2 * 23
    step_rows = _final_state(result)["step_rows"][: 2 * 23].tolist()
    assert step_rows == ([64] * 22 + [30]) * 2, step_rows
    # and the global batch reported before, during and after the 1-worker group
    from mlflow.tracking import MlflowClient

    history = MlflowClient(result.tracking_uri).get_metric_history(
        result.mlflow_run_id, "global_batch"
    )
    assert {m.value for m in history} == {64}
    logged = sorted(m.step for m in history)
    assert logged[0] <= 15 and any(15 < s <= 40 for s in logged) and logged[-1] > 40, logged


def test_a_drained_then_a_removed_node_move_the_workers_to_the_nodes_left(
    cluster: Any, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    """A fixed 2-worker run on 4 one-slot nodes. A node drained for a preemption: the
    workers checkpoint on the notice, train on to the deadline and restart elsewhere from
    the last checkpoint before it, uncharged. Then a node removed: they restart from the
    last committed checkpoint on the nodes left, charged. ``max_failures: 1``, so a drain
    charged too would have failed the run."""
    fresh_slot_nodes(cluster, 4)

    def remove(event: dict[str, Any]) -> None:
        cluster.remove_node(node_by_id(cluster, event["node"]), allow_graceful=False)

    spec = _spec(
        digits_dir,
        tmp_path,
        "nodes-lost",
        epochs=3,
        doomed_at=35,
        notice_wait=True,
        hold_at=40,
        lost_at=55,
    )
    spec["failure"] = {"max_failures": 1, "preemption_check_s": 0}
    # storage only: the restore steps asserted are the committed checkpoints' (with the
    # state in memory every step, one CI run resumed at 55 and the next at 50: not yet
    # understood, so not asserted here)
    spec["checkpoint"] = {**spec["checkpoint"], "memory_every_n_steps": "off"}
    actions = {
        "doomed": lambda event: drain_for_preemption(event["node"], deadline_s=6),
        "lost": remove,
    }
    result, done = run_with_actions(tmp_path, lambda: raytrain.fit(spec, progress=False), actions)
    assert done == ["doomed", "lost"]

    events = read_events(tmp_path)
    drained = next(e["node"] for e in events if e["event"] == "doomed")
    lost = next(e["node"] for e in events if e["event"] == "lost")
    groups = _groups(tmp_path)
    assert len(groups) == 3 and all(len(g) == 2 for g in groups)
    assert groups[0][1] == drained and drained not in groups[1].values()
    assert groups[1][1] == lost and not {drained, lost} & set(groups[2].values())
    metas = [json.loads((Path(c) / META_FILE).read_text()) for c in result.checkpoints]
    noticed = [m["step"] for m in metas if m["kind"] == "preemption (node drain)"]
    assert len(noticed) == 1 and noticed[0] > 35  # saved once the notice came, then trained on
    # from the last checkpoint before the deadline (40), then from the step-50 checkpoint,
    # mid-epoch, the last committed before the node was lost
    starts = [e["step"] for e in events if e["event"] == "worker"]
    assert starts == [0, 0, 40, 40, 50, 50]
    assert result.metrics["step"] == 3 * 23
    _assert_every_row_once_per_epoch(digits_dir, result, epochs=3)
    _assert_history_forward(result)


def test_preprocessing_runs_on_the_data_node_not_the_training_nodes(
    cluster: Any, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    """2 one-slot training nodes and a CPU-only node labelled ``raytrain.io/role=data``;
    ``data.preprocess_on`` names the label: every batch ``data.preprocess`` made was made
    there, and no worker trained there."""
    import ray

    from tests.integration.models import NODE_LOG

    fresh_slot_nodes(cluster, 2)
    data_node = cluster.add_node(num_cpus=2, labels={"raytrain.io/role": "data"})
    cluster.wait_for_nodes()

    @ray.remote(num_cpus=0)
    class NodeLog:
        def __init__(self) -> None:
            self.rows: dict[str, int] = {}

        def record(self, node: str, rows: int) -> None:
            self.rows[node] = self.rows.get(node, 0) + rows

        def seen(self) -> dict[str, int]:
            return self.rows

    log = NodeLog.options(name=NODE_LOG[0], namespace=NODE_LOG[1]).remote()  # type: ignore[attr-defined]
    spec = _spec(digits_dir, tmp_path, "placed", epochs=1)
    spec["data"] |= {
        "preprocess": "tests.integration.models:pixels_where_they_ran",
        "preprocess_on": {"raytrain.io/role": "data"},
    }
    result = raytrain.fit(spec, progress=False)
    assert result.data_paths == {"train": "ray_data", "val": "ray_data"}
    rows = ray.get(log.seen.remote())
    ray.kill(log)
    train = pq.read_table(digits_dir / "train", columns=["id"]).num_rows
    assert set(rows) == {data_node.node_id} and rows[data_node.node_id] >= train
    trained_on = {node for group in _groups(tmp_path) for node in group.values()}
    assert len(trained_on) == 2 and data_node.node_id not in trained_on
