"""A LightningCLI `fit` config read as a spec: its sections, the Trainer arguments raytrain
maps or refuses, class paths in each form, and the name from the file."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrain.errors import SpecError
from raytrain.spec import DataModuleSpec, DataSpec, load_spec, normalize_class_path
from raytrain.spec.lightning_cli import OWNED_TRAINER_ARGUMENTS, TRAINER_ARGUMENTS, name_seed

BORING = "lightning.pytorch.demos.boring_classes"


def _cli_config(**changes: Any) -> dict[str, Any]:
    """A config as LightningCLI users write it (raytrain's sections beside it)."""
    config: dict[str, Any] = {
        "seed_everything": 7,
        "model": {"class_path": f"{BORING}.BoringModel"},
        "data": {"class_path": f"{BORING}.BoringDataModule", "init_args": None},
        "trainer": {
            "accelerator": "auto",
            "devices": "auto",
            "strategy": "auto",
            "num_nodes": 1,
            "precision": None,
            "max_epochs": 3,
            "val_check_interval": 0.5,
            "enable_checkpointing": None,
            "logger": None,
            "default_root_dir": None,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.EarlyStopping",
                    "init_args": {"monitor": "val_loss", "patience": 1},
                },
                "LearningRateMonitor",
            ],
        },
        "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}},
        "lr_scheduler": {"class_path": "StepLR", "init_args": {"step_size": 1}},
        "ckpt_path": None,
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            config[section][field] = value
        else:
            config[section] = value
    return config


def _load(tmp_path: Path, config: dict[str, Any], name: str = "boring.yaml") -> Any:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return load_spec(path)


def _problems(tmp_path: Path, config: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as excinfo:
        _load(tmp_path, config)
    return excinfo.value.problems


def test_a_lightning_cli_config_is_a_spec_named_after_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _load(tmp_path, _cli_config())
    assert spec.name == "boring"
    assert "has no name: the run is named 'boring'" in capsys.readouterr().err
    assert spec.model.class_path == f"{BORING}:BoringModel"
    assert isinstance(spec.data, DataModuleSpec) and spec.files is None
    assert spec.data.class_path == f"{BORING}:BoringDataModule" and spec.data.init_args == {}
    assert spec.trainer.seed == 7
    assert spec.trainer.max_epochs == 3
    assert spec.trainer.precision == "auto"  # null: the default
    assert spec.trainer.passthrough == {"val_check_interval": 0.5}
    assert [c.class_path for c in spec.trainer.callbacks] == [
        "lightning.pytorch.callbacks:EarlyStopping",
        "lightning.pytorch.callbacks:LearningRateMonitor",
    ]
    assert spec.trainer.callbacks[0].init_args == {"monitor": "val_loss", "patience": 1}
    assert spec.trainer.logger == []
    assert spec.optimizer is not None and spec.optimizer.class_path == "torch.optim:SGD"
    assert spec.lr_scheduler is not None
    assert spec.lr_scheduler.class_path == "torch.optim.lr_scheduler:StepLR"
    # the resolved spec reads back as itself, and a name given wins over the file's
    assert load_spec(spec) == spec
    assert load_spec(tmp_path / "boring.yaml", ["name=other"]).name == "other"


def test_seed_everything_true_draws_the_seed_from_the_name(tmp_path: Path) -> None:
    spec = _load(tmp_path, _cli_config(seed_everything=True))
    assert spec.trainer.seed == name_seed("boring")
    assert _load(tmp_path, _cli_config(seed_everything=False)).trainer.seed is None
    problems = _problems(tmp_path, {**_cli_config(), "trainer": {"seed": 3}})
    assert problems == ["seed_everything: trainer.seed is set too; give one of them"]


def test_accelerator_and_strategy_map_onto_raytrains_fields(tmp_path: Path) -> None:
    spec = _load(tmp_path, _cli_config(trainer__accelerator="gpu", trainer__strategy="fsdp"))
    assert spec.scaling.use_gpu is True and spec.strategy.name == "fsdp"
    assert _load(tmp_path, _cli_config(trainer__accelerator="cpu")).scaling.use_gpu is False
    config = _cli_config(trainer__accelerator="cpu")
    config["scaling"] = {"use_gpu": True}
    assert _problems(tmp_path, config) == [
        "trainer.accelerator: scaling.use_gpu is set too, to True; give one of them"
    ]


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("devices", 4, "scaling.num_workers"),
        ("num_nodes", 2, "scaling.num_workers"),
        ("strategy", "deepspeed", "strategy.name"),
        ("plugins", ["x"], "trainer.precision"),
        ("enable_checkpointing", False, "checkpoint.*"),
        ("default_root_dir", "/tmp/x", "checkpoint.storage"),
        ("use_distributed_sampler", False, "raytrain shards every dataset"),
        ("accelerator", "tpu", "scaling.use_gpu"),
    ],
)
def test_trainer_arguments_raytrain_owns_are_refused_naming_the_field_to_use(
    tmp_path: Path, key: str, value: Any, instead: str
) -> None:
    (problem,) = _problems(tmp_path, _cli_config(**{f"trainer__{key}": value}))
    assert problem.startswith(f"trainer.{key}: ") and instead in problem


def test_an_unknown_trainer_argument_is_named_with_the_closest_one(tmp_path: Path) -> None:
    problems = _problems(tmp_path, _cli_config(trainer__val_check_intervl=0.5))
    assert problems[0].startswith("trainer.val_check_intervl: unknown field")
    assert "did you mean val_check_interval?" in problems[0]


def test_the_trainer_arguments_are_lightnings() -> None:
    import lightning.pytorch as pl

    arguments = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    assert arguments == TRAINER_ARGUMENTS
    assert set(OWNED_TRAINER_ARGUMENTS) <= TRAINER_ARGUMENTS


def test_class_paths_in_each_form_and_the_kinds_short_names() -> None:
    assert normalize_class_path("a.b.C") == normalize_class_path("a.b:C") == "a.b:C"
    assert normalize_class_path("a.b:C", "callback") == "a.b:C"
    assert normalize_class_path("ReduceLROnPlateau", "lr_scheduler") == (
        "lightning.pytorch.cli:ReduceLROnPlateau"  # LightningCLI's, which takes `monitor`
    )
    assert normalize_class_path("Adam", "optimizer") == "torch.optim:Adam"
    for value, kind in (("C", None), ("a.", None), ("a b.C", "callback"), ("1a.B", None)):
        with pytest.raises(ValueError, match="expected"):
            normalize_class_path(value, kind)
    for value in ("a.b.C", "Adam", "x.y:Z"):  # its own output normalizes to itself
        once = normalize_class_path(value, "optimizer")
        assert normalize_class_path(once, "optimizer") == once


def test_files_a_datamodule_or_nothing(tmp_path: Path) -> None:
    files = load_spec("jobs/digits.yaml")
    assert isinstance(files.data, DataSpec) and files.files is files.data
    config = _cli_config()
    del config["data"]
    assert _load(tmp_path, config).data is None  # the model's own loaders
    # each kind's own errors, under `data` as written
    assert _problems(tmp_path, _cli_config(data={"class_path": "x.Y", "train": {}})) == [
        "data.train: unknown field (allowed: class_path, dict_kwargs, init_args)"
    ]
    problems = _problems(tmp_path, _cli_config(data={"columns": ["a"]}))
    assert problems == ["data.train: required field is missing"]


def test_tuple_batches_need_columns_and_a_scheduler_needs_an_optimizer(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="batch_format tuple needs `columns`"):
        load_spec("jobs/digits.yaml", ["data.batch_format=tuple", "data.columns=null"])
    assert load_spec("jobs/digits.yaml", ["data.batch_format=tuple"]).files.batch_format == (
        "tuple"
    )
    (problem,) = _problems(tmp_path, _cli_config(optimizer=None))
    assert "lr_scheduler needs optimizer" in problem


def test_use_gpu_auto_is_gpus_when_the_cluster_has_one_per_worker() -> None:
    spec = load_spec("jobs/digits.yaml", ["scaling.use_gpu=auto"])
    assert spec.scaling.worker_resources() == {"CPU": 1.0}  # undecided: no GPU asked for
    on_gpus, said = spec.scaling.with_cluster_gpus(8)
    assert on_gpus.use_gpu is True and on_gpus.worker_resources()["GPU"] == 1.0
    assert said == "scaling.use_gpu: auto: 8 GPUs in the cluster: one per worker"
    on_cpus, said = spec.scaling.with_cluster_gpus(1)  # 2 workers, 1 GPU
    assert on_cpus.use_gpu is False and "CPU slots" in str(said)
    fixed = load_spec("jobs/digits.yaml").scaling  # the job says false
    assert fixed.with_cluster_gpus(8) == (fixed, None)


def test_the_profiler_is_lightnings_by_name() -> None:
    spec = load_spec("jobs/digits.yaml", ["trainer.profiler=pytorch"])
    assert spec.trainer.profiler == "pytorch" and spec.trainer.passthrough == {}
    with pytest.raises(SpecError, match=r"trainer\.profiler: Input should be"):
        load_spec("jobs/digits.yaml", ["trainer.profiler=fast"])


def test_profiling_logging_and_ckpt_path_do_not_make_another_run() -> None:
    base = load_spec("jobs/lightning_cli.yaml")
    same = ["trainer.profiler=simple", "trainer.logger=[CSVLogger]", "ckpt_path=/x.ckpt"]
    assert load_spec("jobs/lightning_cli.yaml", same).digest() == base.digest()
    other = load_spec("jobs/lightning_cli.yaml", ["trainer.callbacks=[]"])
    assert other.digest() != base.digest()  # callbacks change what is trained
