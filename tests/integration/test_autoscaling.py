"""Autoscaling, shown on one machine: cluster/local.yaml's fake multi-node provider under a
real ``ray start --head --autoscaling-config``. The head holds no training slot, as a cloud
head holds no GPU, so a submitted job's workers exist only once the autoscaler adds nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import raytrain
from tests.conftest import digits_spec, write_spec
from tests.integration.cli_runs import ROOT
from tests.integration.ray_head import ray_head
from tests.integration.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLOT = "trainer_slot"


def node_slots(head) -> list[float]:
    """Each node's training slots, for every node the cluster has had: Ray's state API
    lists dead nodes too (the autoscaler removes idle ones after a minute)."""
    nodes = head.request("/api/v0/nodes?detail=true&limit=1000")["data"]["result"]["result"]
    return [node["resources_total"].get(SLOT, 0) for node in nodes]


def test_a_job_bigger_than_the_head_makes_the_autoscaler_add_nodes(
    digits_dir: Path, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    config = yaml.safe_load((ROOT / "cluster" / "local.yaml").read_text())
    gcs_port = free_port()
    config["provider"]["gcs_address"] = f"127.0.0.1:{gcs_port}"
    config_path = tmp_path / "local.yaml"
    config_path.write_text(yaml.safe_dump(config))
    head_cpus = config["available_node_types"]["ray.head.default"]["resources"]["CPU"]
    fake_cluster = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    with ray_head(
        tmp_path,
        num_cpus=head_cpus,
        gcs_port=gcs_port,
        env=fake_cluster,
        args=("--autoscaling-config", str(config_path)),
    ) as head:
        assert node_slots(head) == [0]  # the head alone
        wd = tmp_path / "wd"
        wd.mkdir()
        spec = digits_spec(
            digits_dir,
            tmp_path,
            name="autoscaled",
            trainer={"max_epochs": 1},
            scaling={"num_workers": 2, "resources_per_worker": {"CPU": 1, SLOT: 1}},
        )
        write_spec(wd / "spec.yaml", spec)
        # No uploaded working dir: the fake provider's nodes share the head's temp dir, and a
        # trainer node unpacking the job's package into the shared runtime_resources once
        # deleted the driver's working dir under it (FileNotFoundError at its next import).
        # This machine is the cluster, so the spec's own path works on it.
        handle = raytrain.submit(
            wd / "spec.yaml", address=head.dashboard_url, token=head.token, working_dir=None
        )
        assert handle.wait(timeout_s=600) == "SUCCEEDED", handle.logs()
        assert node_slots(head).count(1) >= 2, node_slots(head)  # a trainer node per worker

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`raytrain.ray_job_id` = '{handle.job_id}'",
    )
    assert run.info.status == "FINISHED" and "val_acc" in run.data.metrics
