"""What each ``raytrain._compat`` entry relies on, pinned on the installed releases: an
upgrade of Ray, Lightning, MLflow or torch that moves one of these internals fails here,
in seconds, and not in a user's run. Outside the supported releases raytrain refuses to
start, naming the versions.
"""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain._compat import versions

ROOT = Path(__file__).resolve().parents[2]


# -- versions ---------------------------------------------------------------------------------


def test_the_supported_ranges_are_pyprojects() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in ("ray", "lightning"):
        low, high = versions.SUPPORTED[name]
        assert any(d.startswith(name) and f">={low}" in d and f"<{high}" in d for d in deps), name


def test_the_installed_releases_are_supported() -> None:
    assert versions.unsupported(versions.installed_versions()) == []
    versions.check_supported()


@pytest.mark.parametrize(
    ("name", "version"),
    [("ray", "2.61.0"), ("ray", "2.59.2"), ("lightning", "2.7.0rc1"), ("torch", "3.1.0+cu130")],
)
def test_a_release_outside_the_range_is_refused_by_name(name: str, version: str) -> None:
    (problem,) = versions.unsupported({name: version})
    low, high = versions.SUPPORTED[name]
    assert f"{name} {version} is installed" in problem and f"{name}>={low},<{high}" in problem


def test_releases_inside_the_range_pass() -> None:
    assert (
        versions.unsupported({"ray": "2.60.0", "lightning": "2.6.9", "torch": "2.13.0+cpu"}) == []
    )
    assert "is not installed" in versions.unsupported({"mlflow": None})[0]


def test_raytrain_refuses_to_start_on_another_ray(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from raytrain.cli.app import main

    installed = {**versions.installed_versions(), "ray": "2.61.0"}
    monkeypatch.setattr(versions, "installed_versions", lambda: installed)
    assert main(["validate", str(ROOT / "jobs" / "digits.yaml")]) == 2
    err = capsys.readouterr().err
    assert "ray 2.61.0 is installed" in err and "ray>=2.60,<2.61" in err
    assert "Traceback" not in err


# -- Lightning --------------------------------------------------------------------------------


def _fit_with(callback: Any, batches: int = 6, val_check_interval: int | None = None) -> Any:
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.seen = 0

        def training_step(self, batch: Any, idx: int) -> Any:
            self.seen += 1
            return self.layer(batch).sum()

        def validation_step(self, batch: Any, idx: int) -> Any:
            return self.layer(batch).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        num_sanity_val_steps=0,
        val_check_interval=val_check_interval,
    )
    loader = torch.utils.data.DataLoader(torch.randn(batches, 2), batch_size=1)
    val = torch.utils.data.DataLoader(torch.randn(2, 2), batch_size=1)
    trainer.fit(model, loader, val if val_check_interval else None)
    return model


def test_the_sigterm_broadcast_is_skipped_on_a_real_trainer() -> None:
    import lightning.pytorch as pl

    from raytrain._compat.lightning import skip_sigterm_broadcast

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    loop = trainer.fit_loop.epoch_loop
    assert callable(loop._broadcast_sigterm_tensor)  # what Lightning calls before each batch
    skip_sigterm_broadcast(trainer)
    assert loop._broadcast_sigterm_tensor() is None


def test_a_validation_is_known_to_follow_at_the_batch_before_it() -> None:
    import lightning.pytorch as pl

    from raytrain._compat.lightning import validation_may_follow

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[bool, int]] = []  # (may follow, validations so far)
            self.validations = 0

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.seen.append((validation_may_follow(trainer), self.validations))

        def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            self.validations += 1

    record = Record()
    _fit_with(record, batches=6, val_check_interval=2)
    # validations after batches 2, 4 and 6: each announced at the batch before it
    assert [may for may, _ in record.seen] == [False, True, False, True, False, True]
    assert [done for _, done in record.seen] == [0, 0, 1, 1, 2, 2]


def test_an_epoch_length_set_at_epoch_start_is_the_one_lightning_runs() -> None:
    import lightning.pytorch as pl

    from raytrain._compat.lightning import set_epoch_length

    class Shorten(pl.Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            assert trainer.fit_loop.max_batches == 6  # read from the loader at setup
            set_epoch_length(trainer, 4)

    assert _fit_with(Shorten()).seen == 4


def test_the_fsdp_strategy_overrides_what_rays_strategy_has() -> None:
    import lightning.pytorch.strategies.fsdp as lightning_fsdp
    from ray.train.lightning import RayFSDPStrategy

    from raytrain._compat.lightning import fsdp_strategy_class

    strategy_class = fsdp_strategy_class()
    assert issubclass(strategy_class, RayFSDPStrategy)
    assert "_setup_model" in vars(strategy_class) and hasattr(RayFSDPStrategy, "_setup_model")
    assert callable(lightning_fsdp._move_torchmetrics_to_device)
    assert callable(lightning_fsdp._setup_activation_checkpointing)
    strategy = strategy_class()
    assert isinstance(strategy._activation_checkpointing_kwargs, dict)
    assert hasattr(strategy.precision_plugin, "clip_grad_by_norm")


# -- torch ------------------------------------------------------------------------------------


def test_grad_norms_are_each_tensors_norm() -> None:
    from raytrain._compat.torch import grad_norms

    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, float("nan")]])]
    norms = grad_norms(grads)
    assert norms[0].item() == pytest.approx(5.0) and torch.isnan(norms[1])


def test_a_pickled_layout_names_the_rebuilder() -> None:
    from raytrain._compat.torch import LAYOUT_REBUILDER, layout_rebuilder

    data = pickle.dumps(torch.strided, protocol=2)
    assert all(part.encode() in data for part in LAYOUT_REBUILDER)
    assert layout_rebuilder()("torch.strided") is torch.strided


def test_dcp_loads_whole_without_a_process_group(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from raytrain._compat.torch import load_without_process_group, whole_load_planner

    dcp.save({"model": {"w": torch.arange(3.0)}, "step": 7}, checkpoint_id=str(tmp_path))
    state: dict[str, Any] = {}
    reader = dcp.FileSystemReader(str(tmp_path))
    read: list[str] = []

    def load(fqn: str, value: Any) -> Any:  # the caller's loader reads each non-tensor
        read.append(fqn)
        return torch.load(value, weights_only=True)

    load_without_process_group(state, reader, whole_load_planner(load))
    assert torch.equal(state["model"]["w"], torch.arange(3.0)) and state["step"] == 7
    assert read == ["step"]


# -- MLflow -----------------------------------------------------------------------------------


def test_last_steps_are_each_metrics_highest_step(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from raytrain._compat.mlflow import last_steps

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("compat"))
    run_id = run.info.run_id
    for step, value in ((5, 1.0), (9, 0.5), (7, 0.7)):
        client.log_metric(run_id, "loss", value, step=step)
    client.log_metric(run_id, "val_acc", 0.9, step=3)
    assert last_steps(client, run_id) == {"loss": 9, "val_acc": 3}


# -- Ray Train --------------------------------------------------------------------------------


def test_ray_trains_internals_are_where_the_trainer_expects_them() -> None:
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    from raytrain._compat import ray_train, ray_train_controller

    for method in (
        "_create_default_callbacks",
        "_initialize_and_run_controller",
        "_register_sigint_handler",
    ):
        assert callable(getattr(TorchTrainer, method)), method
    params = inspect.signature(ray_train.TrainController.__init__).parameters
    assert {"scaling_policy", "failure_policy"} <= set(params)
    for hook in (
        "after_controller_start",
        "_maybe_send_resource_request",
        "before_controller_shutdown",
    ):
        assert callable(getattr(ray_train.FixedScalingPolicy, hook)), hook
    assert callable(ray_train_controller.WorkerGroupCallback.after_worker_group_start)
    assert {"RAISE", "RETRY"} <= {d.name for d in ray_train_controller.FailureDecision}
    env = ray_train.controller_env()
    assert ray_train_controller.RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR in env
    assert isinstance(ray_train.RAY_NODE_ID_KEY, str) and ray_train.RAY_NODE_ID_KEY


def test_an_inheriting_worker_group_passes_no_runtime_env_of_ray_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from raytrain._compat import ray_train, ray_train_controller

    # Ray's controller builds its groups from this class attribute, and Ray's group gives
    # each worker the propagated variables as a runtime env: what the subclass drops
    assert ray_train.TrainController.worker_group_cls is ray_train_controller.WorkerGroup
    assert (
        ray_train.InheritingController.worker_group_cls
        is ray_train_controller.InheritedEnvWorkerGroup
    )
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    rays = ray_train_controller.WorkerGroup._get_worker_runtime_env({})
    assert rays["env_vars"]["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"
    assert ray_train_controller.InheritedEnvWorkerGroup._get_worker_runtime_env({}) == {}


def test_a_trimmed_trainer_drops_only_the_helpers_a_local_run_never_uses() -> None:
    from ray.train.v2.api.config import ScalingConfig

    from raytrain._compat import ray_train, ray_train_controller
    from raytrain.driver.failure_policy import FailurePolicy

    def loop() -> None:
        return None

    def trainer(trimmed: bool, ends_with_run: bool = True) -> Any:
        return ray_train.ControllerTrainer(
            train_loop_per_worker=loop,
            scaling_config=ScalingConfig(num_workers=1),
            policy=FailurePolicy(0),
            trimmed=trimmed,
            ends_with_run=ends_with_run,
            group_callbacks=[ray_train_controller.OnWorkerGroupStart(loop)],
        )

    stock = [type(c) for c in trainer(False)._create_default_callbacks()]
    trimmed = [type(c) for c in trainer(True)._create_default_callbacks()]
    # on an embedded cluster that outlives the run (a sweep's, a pipeline's), a controller
    # killed with its caller would leave its placement group holding the CPUs: cleaned
    shared = [type(c) for c in trainer(True, ends_with_run=False)._create_default_callbacks()]
    assert set(shared) == set(stock) - {ray_train.DatasetsCallback}
    # ...by a cleaner that asks the GCS, not the dashboard an embedded cluster lacks
    assert ray_train.GcsPlacementGroupCleanerCallback in shared
    assert ray_train.PlacementGroupCleanerCallback not in shared
    helpers = {ray_train.GcsPlacementGroupCleanerCallback, ray_train.DatasetsCallback}
    chdir = ray_train.WorkingDirectorySetupCallback
    # Ray Train still adds them by default; raytrain drops the chdir either way
    plain = ray_train.TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1))
    rays = {ray_train.PlacementGroupCleanerCallback, ray_train.DatasetsCallback, chdir}
    assert rays <= {type(c) for c in plain._create_default_callbacks()}
    assert helpers <= set(stock) and chdir not in stock
    assert (
        ray_train_controller.OnWorkerGroupStart in stock
        and ray_train_controller.OnWorkerGroupStart in trimmed
    )
    assert set(trimmed) == set(stock) - helpers


def test_a_worker_notice_outside_ray_train_is_none() -> None:
    from raytrain._compat.ray_train import worker_preemption_info

    assert worker_preemption_info() is None


# -- Ray's upload rules -----------------------------------------------------------------------


def test_rays_upload_rules_are_read_from_ray() -> None:
    from raytrain._compat.ray_core import upload_matchers

    rules = upload_matchers()
    assert ".git" in rules.default_excludes
    spec = rules.path_spec.from_lines("gitwildmatch", ["/" + rules.escape("a[1]*.txt")])
    assert spec.match_file("a[1]*.txt") and not spec.match_file("a1x.txt")
    assert rules.reads_gitignore is True


def test_the_preloaded_ray_train_worker_module_is_where_ray_keeps_its_worker() -> None:
    import importlib

    from raytrain._compat.ray_core import RAY_TRAIN_WORKER_MODULE

    assert hasattr(importlib.import_module(RAY_TRAIN_WORKER_MODULE), "RayTrainWorker")


def test_the_placement_group_cleaners_process_imports_no_torch() -> None:
    """Ray imports an actor's class's module in the actor's process. The cleaner's came
    with torch (through ``TorchTrainer``): about 4 s of CPU, not 2, for a process that only
    polls the GCS, in every run on a cluster that outlives it (a pipeline's, a sweep's,
    the tests')."""
    from raytrain._compat.ray_train_controller import GcsPlacementGroupCleaner

    module = GcsPlacementGroupCleaner.__module__
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
