"""Bad input stops before anything is written: exit 2, field named.

All cases run through the real CLI entry point in a fresh interpreter (a subprocess), so the
test can see that Ray was never even imported there and that no run folder, data or MLflow
store was created. A model class that exists but fails on import or is no LightningModule
is found by importing it, which ``fit`` does while Ray starts: those cases (``LATE``) may
start Ray, and still write nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import digits_spec, write_spec
from tests.fresh_process import run_fresh

_TINYGPT = "model.class_path=raytrain.models.tinygpt:TinyGPT"
_MP = "strategy.name=model_parallel"
_TP = "strategy.model_parallel.tensor_parallel_size"
_PP = "strategy.model_parallel.pipeline_parallel_size"
_PIPE = "strategy.model_parallel.pipeline"
_BLOCKS = "model.class_path=tests.integration.models:DigitsBlocks"

CASES = {
    # name: (overrides, the field path the message must start with)
    "unknown_key": (["trainer.epochs=3"], "trainer.epochs"),
    "wrong_type": (["data.batch_size=big"], "data.batch_size"),
    "out_of_range": (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches"),
    "class_does_not_import": (["model.class_path=nosuch_pkg.mod:Model"], "model.class_path"),
    "class_attr_missing": (["model.class_path=raytrain.models.digits:Nope"], "model.class_path"),
    "data_uri_missing": (["data.train.uri=/nonexistent/raytrain/train"], "data.train.uri"),
    "column_missing": (["data.columns=[pixels, colour]"], "data.columns"),
    "too_many_workers": (["scaling.num_workers=4096"], "scaling.num_workers"),
    "gpu_without_gpus": (["scaling.use_gpu=true"], "scaling.use_gpu"),
    "fsdp_options_without_fsdp": (["strategy.fsdp.sharding=grad_op"], "strategy.fsdp"),
    "hybrid_sharding_on_cpu": (
        ["strategy.name=fsdp", "strategy.fsdp.sharding=hybrid", "scaling.use_gpu=false"],
        "strategy.fsdp.sharding",
    ),
    # torch's SyncBatchNorm refuses CPU tensors (found in every worker, after Ray started)
    "sync_batchnorm_on_cpu": (
        ["trainer.sync_batchnorm=true", "scaling.use_gpu=false"],
        "trainer.sync_batchnorm",
    ),
    # strategy model_parallel (a model with a configure_model, so only the mesh is wrong)
    "model_parallel_options_without_it": ([f"{_TP}=2"], "strategy.model_parallel"),
    "mesh_does_not_hold_the_workers": (
        [_TINYGPT, _MP, f"{_TP}=2", "strategy.model_parallel.data_parallel_size=2"],
        "strategy.model_parallel",
    ),
    "tensor_parallel_does_not_divide_workers": ([_TINYGPT, _MP, f"{_TP}=3"], _TP),
    "model_parallel_elastic": (
        [_TINYGPT, _MP, "scaling.num_workers=[1, 2]"],
        "scaling.num_workers",
    ),
    "model_parallel_fp16_mixed": (
        [_TINYGPT, _MP, "trainer.precision=16-mixed"],
        "trainer.precision",
    ),
    # pipeline parallelism: sizes, options, and splits the model cannot take (found on the
    # model, built before Ray starts)
    "pipeline_sizes_do_not_divide_workers": (
        [_TINYGPT, _MP, f"{_PP}=3"],
        "strategy.model_parallel",
    ),
    "pipeline_options_without_a_pipeline": ([_TINYGPT, _MP, f"{_PIPE}.schedule=gpipe"], _PIPE),
    "pipeline_fewer_microbatches_than_stages": (
        [_TINYGPT, _MP, f"{_PP}=2", f"{_PIPE}.microbatches=1"],
        f"{_PIPE}.microbatches",
    ),
    "pipeline_elastic": ([_TINYGPT, _MP, f"{_PP}=2", "scaling.num_workers=[1, 2]"], "scaling."),
    "pipeline_split_point_missing": (
        [_BLOCKS, _MP, f"{_PP}=2", f"{_PIPE}.split_points=[blocks.9]"],
        f"{_PIPE}.split_points",
    ),
    # the digits CNN's forward reshapes its input before its first child: not a chain
    "pipeline_forward_not_a_chain": ([_MP, f"{_PP}=2"], f"{_PIPE}.split_points"),
    "pipeline_model_that_shards_itself_but_does_not_cut_itself": (
        [_BLOCKS.replace("DigitsBlocks", "ShardedBlocks"), _MP, f"{_PP}=2"],
        "model.class_path",
    ),
    "pipeline_split_points_for_a_model_that_cuts_itself": (
        [_TINYGPT, _MP, f"{_PP}=2", f"{_PIPE}.split_points=[blocks.1]"],
        f"{_PIPE}.split_points",
    ),
    # read from the source: the digits model has none
    "model_parallel_without_configure_model": ([_MP], "model.class_path"),
    # a LightningCLI config's classes, checked before Ray starts
    "datamodule_missing": (["data={class_path: nosuch_pkg.Data}"], "data.class_path"),
    "datamodule_not_one": (["data={class_path: collections.OrderedDict}"], "data.class_path"),
    "unknown_trainer_argument": (["trainer.val_check_intervl=0.5"], "trainer.val_check_intervl"),
    "owned_trainer_argument": (["trainer.devices=4"], "trainer.devices"),
    "callback_missing": (["trainer.callbacks=[NoSuchCallback]"], "trainer.callbacks.0.class_path"),
    "logger_missing": (["trainer.logger=[nosuch_pkg.Logger]"], "trainer.logger.0.class_path"),
    "optimizer_missing": (["optimizer=torch.optim.Adamm"], "optimizer.class_path"),
    "scheduler_missing": (["optimizer=Adam", "lr_scheduler=NoSuchLR"], "lr_scheduler.class_path"),
    "init_args_refused": (
        ["trainer.callbacks=[{class_path: EarlyStopping, init_args: {monitr: val_acc}}]"],
        "trainer.callbacks.0.init_args.monitr",
    ),
    # image folders ({images}: a folder the fixture writes), listed before Ray starts
    "image_class_folder_empty": (
        ["data.train={uri: '{images}/empty-class', format: images}", "data.columns=null"],
        "data.train.uri",
    ),
    "transform_does_not_import": (
        [
            "data.train={uri: '{images}/good', format: images}",
            "data.columns=null",
            "data.transform=nosuch_pkg.aug:flip",
        ],
        "data.transform",
    ),
    "transform_not_in_its_module": (
        [
            "data.train={uri: '{images}/good', format: images}",
            "data.columns=null",
            "data.transform=raytrain.data.image_files:nosuch",
        ],
        "data.transform",
    ),
    "csv_row_with_the_wrong_field_count": (
        ["data.train={uri: '{images}/bad.csv', format: csv}", "data.columns=null"],
        "data.train.uri",
    ),
    "image_labels_file_without_labels": (
        [
            "data.train={uri: '{images}/good/a', format: images, labels: '{images}/bad.csv'}",
            "data.columns=null",
        ],
        "data.train.labels",
    ),
    "image_does_not_decode": (
        ["data.train={uri: '{images}/bad-file', format: images}", "data.columns=null"],
        "data.train.uri",
    ),
    "two_model_checkpoints_refused": (
        ["trainer.callbacks=[ModelCheckpoint, ModelCheckpoint]"],
        "trainer.callbacks: two ModelCheckpoints",
    ),
}


def test_local_cpus_that_starve_ray_data_are_refused(
    digits_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raytrain.driver.launcher import validate
    from raytrain.errors import SpecError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = digits_spec(digits_dir, tmp_path)
    for value in ("2", "lots"):
        monkeypatch.setenv("RAYTRAIN_LOCAL_CPUS", value)
        with pytest.raises(SpecError, match=f"RAYTRAIN_LOCAL_CPUS={value} must be .* at least 3"):
            validate(spec)
    monkeypatch.setenv("RAYTRAIN_LOCAL_CPUS", "16")
    assert validate(spec).scaling.num_workers == 2


LATE = {
    "not_a_lightning_module": (["model.class_path=collections:OrderedDict"], "model.class_path"),
    "model_module_raises": (["model.class_path=raising_model:Model"], "model.class_path"),
    "older_namespace": (["model.class_path=old_pl_model:Model"], "model.class_path"),
}

# `raytrain tune` of a spec whose sweep is wrong: (overrides, the field path named)
_SWEEP = (
    "tune={metric: val_acc, mode: max, "
    "search_space: {model.init_args.lr: {uniform: [0.001, 0.01]}}}"
)
TUNE_CASES = {
    "tune_unknown_field": (
        [_SWEEP, "tune.search_space={trainer.epochs: {choice: [2]}}"],
        "tune.search_space.trainer.epochs",
    ),
    "tune_bad_bounds": (
        [_SWEEP, "tune.search_space={model.init_args.lr: {loguniform: [0, 1]}}"],
        "tune.search_space.model.init_args.lr",
    ),
    "tune_value_the_spec_refuses": (
        [_SWEEP, "tune.search_space={trainer.max_epochs: {randint: [0, 3]}}"],
        "tune.search_space.trainer.max_epochs",
    ),
    "tune_missing": ([], "tune"),
    "run_of_a_sweep": ([_SWEEP], "tune"),
}

_DRIVER = r"""
import contextlib, io, json, sys
from raytrain.cli.app import main
cases = json.loads(sys.argv[1])
out = {}
for name, argv in cases.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    out[name] = {"rc": rc, "stderr": err.getvalue()}
out["__ray_imported__"] = "ray" in sys.modules
out["__lightning_imported__"] = "lightning" in sys.modules
print(json.dumps(out))
"""


def _run_cases(argvs: dict[str, list[str]], cwd: Path) -> dict:
    # the repository's root after the work folder: the cases' models in tests/ import
    path = os.pathsep.join((str(cwd), str(Path(__file__).resolve().parents[2])))
    return run_fresh(_DRIVER, argvs, cwd, pythonpath=path, timeout=300)


def write_image_folders(root: Path) -> Path:
    """``good`` (two class folders of a PNG each), ``empty-class`` (one without images),
    ``bad-file`` (a text file named .png among good ones), and ``bad.csv`` (a row of three
    fields under a header of two)."""
    from PIL import Image

    for name, classes in (("good", "ab"), ("empty-class", "ab"), ("bad-file", "ab")):
        for c in classes:
            (root / name / c).mkdir(parents=True)
            if not (name == "empty-class" and c == "b"):
                Image.new("L", (4, 4)).save(root / name / c / "0.png")
    (root / "bad-file" / "b" / "1.png").write_text("not an image")
    (root / "bad.csv").write_text("x,label\n1,0\n2,1,3\n")
    return root


def _argv(overrides: list[str], images: Path) -> list[str]:
    return [o.replace("{images}", str(images)) for o in overrides]


@pytest.fixture(scope="module")
def outcomes(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("bad-input")
    spec_path = write_spec(work / "job.yaml", digits_spec(digits_dir, work))
    broken = work / "broken.yaml"
    broken.write_text("name: x\nmodel: [unclosed\n")
    images = write_image_folders(tmp_path_factory.mktemp("images"))
    argvs = {
        name: ["run", str(spec_path), *_argv(overrides, images)]
        for name, (overrides, _) in CASES.items()
    }
    for name, (overrides, _) in TUNE_CASES.items():
        command = "run" if name == "run_of_a_sweep" else "tune"
        argvs[name] = [command, str(spec_path), *overrides]
    argvs["malformed_yaml"] = ["run", str(broken)]
    argvs["missing_file"] = ["run", str(work / "absent.yaml")]
    result = _run_cases(argvs, work)
    result["__work__"] = work
    return result


@pytest.fixture(scope="module")
def late_outcomes(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("bad-model")
    spec_path = write_spec(work / "job.yaml", digits_spec(digits_dir, work))
    (work / "raising_model.py").write_text("raise RuntimeError('broken on purpose')\n")
    (work / "old_pl_model.py").write_text(
        "import pytorch_lightning as pl\n\nclass Model(pl.LightningModule):\n    pass\n"
    )
    images = write_image_folders(tmp_path_factory.mktemp("images"))
    argvs = {
        name: ["run", str(spec_path), *_argv(overrides, images)]
        for name, (overrides, _) in LATE.items()
    }
    result = _run_cases(argvs, work)
    result["__work__"] = work
    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_field_exits_2_naming_the_field(outcomes: dict, case: str) -> None:
    got = outcomes[case]
    assert got["rc"] == 2, got
    lines = got["stderr"].strip().splitlines()
    assert lines, got
    assert lines[0].startswith(f"error: {CASES[case][1]}"), got["stderr"]


def test_a_missing_datamodule_is_found_from_source_without_importing_lightning(
    digits_dir: Path, tmp_path: Path
) -> None:
    spec_path = write_spec(tmp_path / "job.yaml", digits_spec(digits_dir, tmp_path))
    overrides = CASES["datamodule_missing"][0]
    got = _run_cases({"case": ["run", str(spec_path), *overrides]}, tmp_path)
    assert got["case"]["rc"] == 2
    assert got["case"]["stderr"].startswith("error: data.class_path: cannot import"), got
    assert got["__lightning_imported__"] is False


@pytest.mark.parametrize("case", sorted(TUNE_CASES))
def test_a_bad_sweep_exits_2_naming_the_field(outcomes: dict, case: str) -> None:
    got = outcomes[case]
    assert got["rc"] == 2, got
    assert got["stderr"].startswith(f"error: {TUNE_CASES[case][1]}"), got["stderr"]


def test_malformed_yaml_names_the_file(outcomes: dict) -> None:
    got = outcomes["malformed_yaml"]
    assert got["rc"] == 2
    assert "broken.yaml: malformed YAML at line 3" in got["stderr"]


def test_missing_file_names_the_file(outcomes: dict) -> None:
    got = outcomes["missing_file"]
    assert got["rc"] == 2
    assert "absent.yaml: spec file not found" in got["stderr"]


def test_nothing_was_started_or_written(outcomes: dict) -> None:
    work: Path = outcomes["__work__"]
    assert outcomes["__ray_imported__"] is False
    assert not (work / "runs").exists()
    assert not (work / "mlflow.db").exists()
    assert sorted(p.name for p in work.iterdir()) == ["broken.yaml", "job.yaml"]


@pytest.mark.parametrize("case", sorted(LATE))
def test_bad_model_exits_2_and_writes_nothing(late_outcomes: dict, case: str) -> None:
    got = late_outcomes[case]
    assert got["rc"] == 2, got
    assert got["stderr"].startswith(f"error: {LATE[case][1]}"), got["stderr"]
    work: Path = late_outcomes["__work__"]
    assert sorted(p.name for p in work.iterdir() if p.name != "__pycache__") == [
        "job.yaml",
        "old_pl_model.py",
        "raising_model.py",
    ]


def test_broken_model_module_shows_its_error(late_outcomes: dict) -> None:
    assert "RuntimeError: broken on purpose" in late_outcomes["model_module_raises"]["stderr"]


def test_a_pytorch_lightning_module_is_told_the_one_line_change(late_outcomes: dict) -> None:
    assert (
        "change `import pytorch_lightning as pl` to `import lightning.pytorch as pl`"
        in (late_outcomes["older_namespace"]["stderr"])
    )


def test_a_model_without_configure_model_is_told_what_it_must_do(outcomes: dict) -> None:
    says = outcomes["model_parallel_without_configure_model"]["stderr"]
    assert "defines no configure_model" in says
    assert "parallelize_module" in says and "fully_shard" in says and "device_mesh" in says
