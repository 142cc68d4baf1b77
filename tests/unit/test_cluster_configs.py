"""The cluster definitions in cluster/: each autoscaler config passes Ray's own validation
(what ``ray up`` runs: defaults merged, then the JSON schema), and keeps the promises the
README makes for it: a CPU head, autoscaling GPU groups, a spot group, raytrain installed,
token authentication, the dashboard off the network, no credentials in the file."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

from raytrain.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
CLOUDS = ("aws", "gcp", "azure")

# What a credential in a file looks like: key names and AWS access key ids.
SECRET = re.compile(
    r"aws_secret_access_key|aws_access_key_id|AKIA[0-9A-Z]{16}|AccountKey=|account_key"
    r"|client_secret|private_key_id|BEGIN (RSA )?PRIVATE KEY|RAY_AUTH_TOKEN\s*[:=]\s*\w",
    re.IGNORECASE,
)


def cluster_config(name: str) -> dict:
    return yaml.safe_load((ROOT / "cluster" / f"{name}.yaml").read_text())


def ray_validated(config: dict) -> dict:
    """The config as ``ray up`` checks it: provider defaults merged, then the schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.mark.parametrize("cloud", CLOUDS)
def test_cloud_config_passes_rays_validation(cloud: str) -> None:
    prepared = ray_validated(cluster_config(cloud))
    assert prepared["provider"]["type"] == cloud


def test_rays_validation_catches_a_misspelt_field() -> None:
    config = cluster_config("aws")
    config["available_node_types"]["gpu"]["min_worker"] = 1
    with pytest.raises(Exception, match="min_worker"):
        ray_validated(config)


def _spot(cloud: str, node_config: dict) -> bool:
    if cloud == "aws":
        return node_config.get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    if cloud == "gcp":
        sched = node_config.get("scheduling", [{}])[0]
        return sched.get("provisioningModel") == "SPOT" or sched.get("preemptible") is True
    return node_config["azure_arm_parameters"].get("priority") == "Spot"


def _gpus(cloud: str, node_type: dict) -> bool:
    """Whether a node type offers GPUs (declared, or implied by its instance type)."""
    if "GPU" in node_type.get("resources", {}):
        return node_type["resources"]["GPU"] > 0
    node_config = node_type["node_config"]
    kind = node_config.get("InstanceType") or node_config.get("machineType") or ""
    return kind.startswith(("g4", "g5", "g6", "p3", "p4", "p5", "a2", "a3", "g2"))


@pytest.mark.parametrize("cloud", CLOUDS)
def test_cloud_config_keeps_its_promises(cloud: str) -> None:
    config = cluster_config(cloud)
    text = (ROOT / "cluster" / f"{cloud}.yaml").read_text()
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU") == 0  # no training worker lands on the head
    workers = {n: t for n, t in types.items() if n != config["head_node_type"]}
    gpu_groups = {n: t for n, t in workers.items() if _gpus(cloud, t)}
    assert gpu_groups, "an autoscaling GPU worker group"
    for node_type in gpu_groups.values():
        assert 0 <= node_type["min_workers"] < node_type["max_workers"] <= config["max_workers"]
    assert any(_spot(cloud, t["node_config"]) for t in gpu_groups.values()), "a spot group"
    assert any("pip install" in c and "raytrain" in c for c in config["setup_commands"])
    assert config["file_mounts"]["~/raytrain"] == "."
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        assert any("RAY_AUTH_MODE=token" in c for c in commands)
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    assert not SECRET.search(text), SECRET.search(text)


def test_cloud_configs_reach_storage_through_roles() -> None:
    aws, gcp, azure = (cluster_config(c) for c in CLOUDS)
    for node_type in aws["available_node_types"].values():
        assert node_type["node_config"]["IamInstanceProfile"]["Arn"].startswith("arn:aws:iam::")
    for node_type in gcp["available_node_types"].values():
        assert node_type["node_config"]["serviceAccounts"][0]["email"].endswith(
            ".iam.gserviceaccount.com"
        )
    assert azure["provider"]["msi_name"]


def test_local_config_is_a_fake_multinode_cluster_ray_accepts() -> None:
    from ray.autoscaler._private.util import validate_config

    config = cluster_config("local")
    validate_config(config)  # complete as it is: Ray ships no defaults for this provider
    assert config["provider"]["type"] == "fake_multinode"
    head = config["available_node_types"][config["head_node_type"]]
    trainer = config["available_node_types"]["trainer"]
    assert "trainer_slot" not in head["resources"] and trainer["resources"]["trainer_slot"] == 1
    assert trainer["min_workers"] == 0 < trainer["max_workers"]


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _pod_specs(cluster_spec: dict) -> list[dict]:
    groups = [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]
    return [group["template"]["spec"] for group in groups]


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayjob.yaml"])
def test_kuberay_manifests_autoscale_with_token_auth_and_no_secrets(manifest: str) -> None:
    path = ROOT / "cluster" / "kuberay" / manifest
    docs = _documents(path)
    kinds = {doc["kind"]: doc for doc in docs}
    assert all(doc["apiVersion"] in ("ray.io/v1", "v1") for doc in docs)
    resource = kinds.get("RayCluster") or kinds["RayJob"]
    cluster_spec = resource["spec"].get("rayClusterSpec", resource["spec"])
    assert cluster_spec["enableInTreeAutoscaling"] is True
    assert cluster_spec["headGroupSpec"]["serviceType"] == "ClusterIP"
    for group in cluster_spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] < group["maxReplicas"]
    for pod in _pod_specs(cluster_spec):
        assert pod["serviceAccountName"] == "raytrain"
        for container in pod["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]
    assert not SECRET.search(path.read_text())


def test_the_rayjob_runs_a_valid_job_spec() -> None:
    (job,) = _documents(ROOT / "cluster" / "kuberay" / "rayjob.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "raytrain", "run"]
    spec = load_spec(ROOT / argv[4], argv[5:])
    assert spec.checkpoint.storage.startswith("s3://") and spec.scaling.use_gpu
