"""LightningCLI's keys read by LightningCLI's own parser (``raytrain.spec.lightning_config``) and a
user's ModelCheckpoint read as ``checkpoint.*`` (``spec.model_checkpoint``): parsed,
refused and built in this process, no Ray."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrain.cli.app import main
from raytrain.errors import SpecError
from raytrain.spec import load_spec
from raytrain.spec.lightning_config import config_problems, explain, instantiate
from raytrain.spec.model_checkpoint import as_written

EXAMPLES = "tests.integration.lightning_examples"


def _backbone_config(tmp_path: Path, **backbone_args: Any) -> dict[str, Any]:
    """Lightning's backbone example as a LightningCLI config: the backbone nested, and its
    activation nested in it (two levels of class_path)."""
    return {
        "name": "backbone",
        "model": {
            "class_path": f"{EXAMPLES}.LitClassifier",
            "init_args": {
                "learning_rate": 0.01,
                "backbone": {
                    "class_path": f"{EXAMPLES}.Backbone",
                    "init_args": {
                        "hidden_dim": 16,
                        "activation": {"class_path": "torch.nn.Tanh"},
                        **backbone_args,
                    },
                },
            },
        },
        "data": {
            "class_path": "lightning.pytorch.demos.mnist_datamodule.MNISTDataModule",
            "init_args": {"data_dir": str(tmp_path / "mnist"), "num_workers": 0},
        },
        "trainer": {
            "max_epochs": 1,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"monitor": "valid_loss_epoch", "mode": "min"},
                },
                {"class_path": "EarlyStopping", "init_args": {"monitor": "valid_loss_epoch"}},
            ],
        },
        "checkpoint": {"storage": str(tmp_path / "runs")},
    }


def _cli(tmp_path: Path, config: dict[str, Any], *args: str) -> tuple[int, str, str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([args[0], str(path), *args[1:]])
    return rc, out.getvalue(), err.getvalue()


def test_nested_class_paths_two_levels_deep_are_built(tmp_path: Path) -> None:
    import torch

    spec = load_spec(_backbone_config(tmp_path))
    assert config_problems(spec) == []
    built = instantiate(spec)
    backbone = built.model.backbone
    assert type(backbone).__name__ == "Backbone" and backbone.l1.out_features == 16
    assert isinstance(backbone.activation, torch.nn.Tanh)  # the second level
    assert type(built.datamodule).__name__ == "MNISTDataModule"
    assert [type(c).__name__ for c in built.callbacks] == ["EarlyStopping"]
    assert built.model.hparams.learning_rate == 0.01


def test_a_wrong_nested_key_is_refused_before_ray_naming_its_path(tmp_path: Path) -> None:
    rc, _, err = _cli(tmp_path, _backbone_config(tmp_path, hiden_dim=64), "validate")
    assert rc == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: model.init_args.backbone.init_args.hiden_dim: Option 'hiden_dim' is not accepted"
    ], err
    assert "Traceback" not in err
    # a wrong type two levels down: jsonargparse's reason, after the full path
    config = _backbone_config(tmp_path)
    config["model"]["init_args"]["backbone"]["init_args"]["activation"] = {
        "class_path": "torch.nn.Linear",
        "init_args": {"in_features": "x"},
    }
    (problem,) = config_problems(load_spec(config))
    assert problem.startswith("model.init_args.backbone.init_args.activation"), problem


def test_a_cli_subclass_links_the_datamodules_num_classes_into_the_model(tmp_path: Path) -> None:
    config = {
        "name": "linked",
        "lightning_cli": f"{EXAMPLES}:LinkedCLI",
        "model": {"class_path": f"{EXAMPLES}.ClassesModel", "init_args": {"hidden": 4}},
        "data": {"class_path": f"{EXAMPLES}.ClassesData", "init_args": {"num_classes": 7}},
        "checkpoint": {"storage": str(tmp_path / "runs")},
    }
    built = instantiate(load_spec(config))
    assert built.model.head.out_features == 7 and built.model.hparams.num_classes == 7
    # without the CLI class, num_classes is missing: jsonargparse says so
    plain = {k: v for k, v in config.items() if k != "lightning_cli"}
    (problem,) = config_problems(load_spec(plain))
    assert problem.startswith("model") and "num_classes" in problem, problem
    # --cli names the class on the command line instead
    rc, out, _ = _cli(tmp_path, plain, "validate", "--cli", f"{EXAMPLES}:LinkedCLI")
    assert rc == 0 and f"lightning_cli: {EXAMPLES}:LinkedCLI" in out
    rc, _, err = _cli(tmp_path, plain, "validate", "--cli", "torch.nn:Linear")
    assert rc == 2 and "error: lightning_cli: 'torch.nn:Linear' is not a" in err


def test_model_checkpoint_becomes_raytrains_checkpoint_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _backbone_config(tmp_path)
    config["trainer"]["callbacks"][0]["init_args"].update(
        save_top_k=2, every_n_train_steps=5, save_last=True
    )
    spec = load_spec(config)
    assert (spec.checkpoint.monitor, spec.checkpoint.mode) == ("valid_loss_epoch", "min")
    assert (spec.checkpoint.keep, spec.checkpoint.every_n_steps) == (2, 5)
    assert [c.class_path for c in spec.trainer.callbacks] == [
        "lightning.pytorch.callbacks:EarlyStopping"
    ]
    err = capsys.readouterr().err
    assert err.count("ModelCheckpoint becomes raytrain's checkpoint settings") == 1
    assert "warning" not in err
    # the spec's checkpoint section wins, and says so; what has no counterpart is named
    config["checkpoint"]["keep"] = 4
    config["trainer"]["callbacks"][0]["init_args"].update(
        dirpath="/elsewhere", filename="{epoch}-{valid_loss_epoch:.2f}"
    )
    spec = load_spec(config)
    assert spec.checkpoint.keep == 4
    err = capsys.readouterr().err
    assert "checkpoint.keep set in the spec win" in err
    assert "ignored: dirpath '/elsewhere'" in err and "filename '{epoch}" in err
    # save_weights_only: refused; two ModelCheckpoints: refused naming both
    config["trainer"]["callbacks"][0]["init_args"]["save_weights_only"] = True
    with pytest.raises(SpecError, match=r"callbacks\.0\.init_args\.save_weights_only"):
        load_spec(config)
    twice = _backbone_config(tmp_path)
    twice["trainer"]["callbacks"][1] = "ModelCheckpoint"
    with pytest.raises(SpecError, match=r"trainer\.callbacks\.0 and trainer\.callbacks\.1"):
        load_spec(twice)
    # a ModelCheckpoint subclass: its checkpoints would be neither committed nor resumed
    own = _backbone_config(tmp_path)
    own["trainer"]["callbacks"][0]["class_path"] = f"{EXAMPLES}.EveryEpochCheckpoint"
    (problem,) = config_problems(load_spec(own))
    assert problem.startswith("trainer.callbacks.0.class_path: ") and "subclass" in problem


def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path: Path) -> None:
    config = _backbone_config(tmp_path)
    config["tracking"] = {"mlflow": {"tracking_uri": "https://user:hunter2@mlflow.example"}}
    rc, out, _ = _cli(tmp_path, config, "run", "--print_config")
    assert rc == 0
    printed = yaml.safe_load(out)
    backbone = printed["model"]["init_args"]["backbone"]
    assert backbone["init_args"]["activation"] == {"class_path": "torch.nn.Tanh"}
    # the DataModule's defaults from its signature, resolved as jsonargparse resolves them
    assert printed["data"]["init_args"]["batch_size"] == 32
    assert printed["checkpoint"]["monitor"] == "valid_loss_epoch"  # raytrain's, beside
    assert "hunter2" not in out
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_explain_names_a_list_entry_and_a_missing_class() -> None:
    tree = {"trainer": {"callbacks": [{"class_path": "a.B"}, {"class_path": "a.C"}]}}
    message = (
        'Parser key "trainer.callbacks":\n  Errors:\n'
        "    - Problem with given class_path 'a.C':\n        Option 'x' is not accepted\n"
    )
    assert explain(message, tree) == "trainer.callbacks.1.init_args.x: Option 'x' is not accepted"
    message = 'Parser key "data":\n  Import path a.D does not correspond to a subclass of X'
    assert explain(message, tree).startswith("data.class_path: Import path a.D")


ROOT = Path(__file__).resolve().parents[2]


def _shipped_configs() -> list[tuple[str, dict[str, Any]]]:
    """Every LightningCLI config shipped: jobs/*.yaml, and the YAML blocks of the README and
    the docs pages that name a model."""
    import re

    out = [
        (str(p.relative_to(ROOT)), yaml.safe_load(p.read_text()))
        for p in sorted((ROOT / "jobs").glob("*.yaml"))
    ]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        blocks = re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)
        for index, block in enumerate(blocks):
            tree = yaml.safe_load(block)
            if isinstance(tree, dict) and isinstance(tree.get("model"), dict):
                where = f"{page.relative_to(ROOT)} yaml block {index}"
                out.append((where, {"name": "readme", **tree}))
    return out


@pytest.mark.parametrize(("where", "tree"), _shipped_configs(), ids=lambda v: str(v)[:40])
def test_every_shipped_config_parses_with_lightning_clis_parser(
    where: str, tree: dict[str, Any]
) -> None:
    tree.pop("tune", None)
    assert config_problems(load_spec({"name": "shipped", **tree})) == [], where


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"save_top_k": "lots"}, "trainer.callbacks.0.init_args.save_top_k: a whole number"),
        ({"save_top_k": float("inf")}, "trainer.callbacks.0.init_args.save_top_k: a whole"),
        ({"save_top_k": 0}, "trainer.callbacks.0.init_args.save_top_k: 0 saves nothing"),
        ({"save_top_k": -5}, "trainer.callbacks.0.init_args.save_top_k: -1 (all) or 1 to"),
        ({"save_top_k": 10**20}, "trainer.callbacks.0.init_args.save_top_k: -1 (all) or 1 to"),
        ({"every_n_train_steps": -3}, "trainer.callbacks.0.init_args.every_n_train_steps: 0"),
        ({"every_n_epochs": "x"}, "trainer.callbacks.0.init_args.every_n_epochs: a whole"),
        ({"mode": "sideways"}, "trainer.callbacks.0.init_args.mode: 'min' or 'max'"),
        ({"monitor": 5}, "trainer.callbacks.0.init_args.monitor: a metric name"),
        (
            {"monitr": "x"},
            "trainer.callbacks.0.init_args: ModelCheckpoint takes no monitr (did "
            "you mean monitor?)",
        ),
        ([1, 2], "trainer.callbacks.0.init_args: a mapping of ModelCheckpoint's arguments"),
    ],
)
def test_a_model_checkpoint_value_lightning_would_refuse_is_refused_naming_its_own_field(
    tmp_path: Path, args: Any, expected: str
) -> None:
    """Each was a traceback (``save_top_k: lots``, a list of init_args), a silent ``keep: 1``
    (``save_top_k`` 0, -5), a warning (a typo) or an error naming ``checkpoint.*``, a field
    the user never wrote."""
    config = _backbone_config(tmp_path)
    config["trainer"]["callbacks"][0]["init_args"] = args
    rc, _, err = _cli(tmp_path, config, "validate")
    assert rc == 2 and err.startswith(f"error: {expected}") and err.count("\n") == 1, err


def test_user_code_that_exits_is_an_error_not_a_silent_pass(tmp_path: Path) -> None:
    """A module or a CLI class that calls ``sys.exit`` ended ``raytrain validate`` with its
    code and no word (``SystemExit(0)``: a validation that looked passed)."""
    import sys

    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "exiting_cli.py").write_text(
        "from lightning.pytorch.cli import LightningCLI\n"
        "class CLI(LightningCLI):\n"
        "    def add_arguments_to_parser(self, parser):\n"
        "        raise SystemExit(0)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        config = _backbone_config(tmp_path)
        config["trainer"]["callbacks"] = []
        config["lightning_cli"] = "exiting_cli:CLI"
        rc, _, err = _cli(tmp_path, config, "validate")
        assert rc == 2 and err.startswith("error: lightning_cli: setting up CLI's parser"), err
        config["lightning_cli"] = "exits_at_import:CLI"
        rc, _, err = _cli(tmp_path, config, "validate")
        assert rc == 2 and err.startswith("error: lightning_cli: cannot import"), err
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("exits_at_import", None)
        sys.modules.pop("exiting_cli", None)


def test_validate_prints_the_resolved_spec_with_credentials_masked(tmp_path: Path) -> None:
    """``validate`` printed the spec as written: a tracking URI's password, a tag's token."""
    config = _backbone_config(tmp_path)
    config["tracking"] = {
        "mlflow": {
            "tracking_uri": "https://alice:s3cr3tpw@mlflow.example",
            "tags": {"api_key": "tok-abcdef123456"},
        }
    }
    rc, out, _ = _cli(tmp_path, config, "validate")
    assert rc == 0 and "tracking_uri:" in out
    assert "s3cr3tpw" not in out and "tok-abcdef123456" not in out


def test_more_than_100_callbacks_are_refused_before_jsonargparse_parses_them(
    tmp_path: Path,
) -> None:
    """Each is parsed by jsonargparse: 3,000 ran for over a minute without a word."""
    config = _backbone_config(tmp_path)
    config["trainer"]["callbacks"] = [
        {"class_path": "EarlyStopping", "init_args": {"monitor": "m"}}
    ] * 101
    rc, _, err = _cli(tmp_path, config, "validate")
    assert rc == 2 and err.startswith("error: trainer.callbacks: ") and "100" in err, err


def test_a_refused_value_is_shown_once() -> None:
    """A check whose message shows the value had it repeated: "got 'a:b:c', got 'a:b:c'"."""
    with pytest.raises(SpecError) as excinfo:
        load_spec({"name": "x", "model": {"class_path": "a:b:c"}})
    assert any(p.startswith("model.class_path: ") for p in excinfo.value.problems)
    assert all(p.count("'a:b:c'") == 1 for p in excinfo.value.problems), excinfo.value.problems


def test_a_class_whose_module_fails_to_import_is_named_by_its_field(tmp_path: Path) -> None:
    """jsonargparse said only ``trainer.callbacks: boom at import``: not which entry, not
    which class, not that an import failed."""
    import sys

    (tmp_path / "boom_at_import.py").write_text("raise RuntimeError('boom at import')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        config = _backbone_config(tmp_path)
        config["trainer"]["callbacks"] = [{"class_path": "boom_at_import.X"}]
        rc, _, err = _cli(tmp_path, config, "validate")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("boom_at_import", None)
    assert rc == 2 and err == (
        "error: trainer.callbacks.0.class_path: importing "
        "'boom_at_import.X' failed: RuntimeError: boom at import\n"
    ), err


def test_a_reason_quoting_a_deeply_nested_value_is_cut_to_one_readable_line() -> None:
    message = 'Parser key "model":\n  Problem with given class_path "a.B":\n    - ' + "x" * 2000
    line = explain(message, {"model": {"class_path": "a.B"}})
    assert line.startswith("model") and len(line) < 400 and line.endswith("..."), line


def test_a_callback_given_by_its_bare_name_is_named_by_its_index(tmp_path: Path) -> None:
    """jsonargparse turned the parsed tree's entries into Namespaces, so the error said
    ``trainer.callbacks.init_args``, no index."""
    config = _backbone_config(tmp_path)
    config["trainer"]["callbacks"] = "EarlyStopping"
    rc, _, err = _cli(tmp_path, config, "validate")
    assert rc == 2 and err.startswith("error: trainer.callbacks.0.init_args: "), err


def test_arguments_only_a_constructor_refuses_are_refused_before_ray_naming_the_field(
    tmp_path: Path,
) -> None:
    """jsonargparse checks types, not values: a negative learning rate or an EarlyStopping
    mode Lightning does not know passed ``validate`` and failed on every rank after Ray had
    started. The driver now builds the optimizer (on a stand-in parameter), the scheduler on
    it, and Lightning's own callbacks, without the model."""
    config = _backbone_config(tmp_path)
    config["optimizer"] = {"class_path": "torch.optim.Adam", "init_args": {"lr": -1}}
    (problem,) = config_problems(load_spec(config))
    assert problem.startswith(
        "optimizer.init_args: torch.optim.Adam refused them: ValueError: Invalid learning rate"
    ), problem

    config["optimizer"]["init_args"]["lr"] = 0.1
    steps = {"step_size": 1, "gamma": 0.5, "last_epoch": 3}  # resuming: needs initial_lr
    config["lr_scheduler"] = {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": steps}
    (problem,) = config_problems(load_spec(config))
    assert problem.startswith(
        "lr_scheduler.init_args: torch.optim.lr_scheduler.StepLR refused them: KeyError"
    ), problem

    del config["lr_scheduler"]
    config["trainer"]["callbacks"][1]["init_args"]["mode"] = "maxx"
    (problem,) = config_problems(load_spec(config))
    refused = "trainer.callbacks.1.init_args: lightning.pytorch.callbacks.EarlyStopping refused"
    assert problem.startswith(refused), problem
    assert "maxx" in problem
    rc, _, err = _cli(tmp_path, config, "validate")
    assert rc == 2 and err.count("error:") == 1 and "Traceback" not in err

    config["trainer"]["callbacks"][1]["init_args"]["mode"] = "max"
    assert config_problems(load_spec(config)) == []


def test_a_constructor_a_worker_runs_that_refuses_is_one_line_naming_the_field(
    tmp_path: Path,
) -> None:
    """What only the workers build (the model, the DataModule) and refuses reaches the user
    as one line naming the field: jsonargparse's was 9 lines of union alternatives, printed
    with literal \\n by the driver."""
    config = _backbone_config(tmp_path)
    config["data"] = {"class_path": f"{EXAMPLES}.RefusingData", "init_args": {"rows": -3}}
    with pytest.raises(SpecError) as caught:
        instantiate(load_spec(config))
    (problem,) = caught.value.problems
    assert problem == "data.init_args: ValueError: rows must be positive, got -3", problem


def test_a_callback_after_a_model_checkpoint_is_named_by_the_index_the_user_wrote(
    tmp_path: Path,
) -> None:
    """The ModelCheckpoint read as ``checkpoint.*`` is taken out of ``trainer.callbacks``:
    every entry after it moved down by one, and its problems named the entry before it
    (the ModelCheckpoint itself) instead of it."""
    assert as_written("trainer.callbacks.0: a; trainer.callbacks.2.init_args: b", 1) == (
        "trainer.callbacks.0: a; trainer.callbacks.3.init_args: b"
    )
    assert as_written("trainer.callbacks.1: a", None) == "trainer.callbacks.1: a"
    assert as_written("trainer.callbacks.1: a", 0) == "trainer.callbacks.2: a"

    config = _backbone_config(tmp_path)  # ModelCheckpoint at 0, EarlyStopping at 1
    config["trainer"]["callbacks"][1] = {"class_path": "not a path!"}  # the spec's own check
    with pytest.raises(SpecError) as caught:
        load_spec(config)
    assert any(p.startswith("trainer.callbacks.1") for p in caught.value.problems), caught.value
    # a typo jsonargparse finds
    config["trainer"]["callbacks"][1] = {"class_path": "EarlyStopping", "init_args": {"monitr": 1}}
    (problem,) = config_problems(load_spec(config))
    assert problem.startswith("trainer.callbacks.1.init_args"), problem


def test_dict_kwargs_reach_a_constructors_kwargs(tmp_path: Path) -> None:
    """LightningCLI's ``dict_kwargs``: a ``**kwargs`` constructor's extra arguments, given
    as written; in ``init_args`` the same key is refused (not in the signature)."""
    config = {
        "name": "kw",
        "model": {
            "class_path": f"{EXAMPLES}.ExtraArgsModel",
            "init_args": {"width": 3},
            "dict_kwargs": {"depth": 4},
        },
        "checkpoint": {"storage": str(tmp_path / "runs")},
    }
    assert config_problems(load_spec(config)) == []
    built = instantiate(load_spec(config))
    assert (built.model.width, built.model.extra) == (3, {"depth": 4})
    rc, out, _ = _cli(tmp_path, config, "run", "--print_config")
    assert rc == 0 and yaml.safe_load(out)["model"]["dict_kwargs"] == {"depth": 4}

    config["model"]["init_args"]["depth"] = config["model"].pop("dict_kwargs")["depth"]
    (problem,) = config_problems(load_spec(config))
    assert problem.startswith("model.init_args.depth"), problem


def test_the_model_logged_and_exported_is_built_with_its_nested_classes(tmp_path: Path) -> None:
    """``trained_model`` (MLflow's logged model, serving) built the model by hand as
    ``cls(**init_args)``: a nested backbone arrived as a dict, and the weights did not load."""
    import torch

    from raytrain.checkpoints.export import trained_model

    config = _backbone_config(tmp_path)
    trained = instantiate(load_spec(config)).model
    folder = tmp_path / "checkpoint_000001"
    folder.mkdir()
    torch.save({"state_dict": trained.state_dict()}, folder / "checkpoint.ckpt")
    model = trained_model(load_spec(config), str(folder))
    assert isinstance(model.backbone.activation, torch.nn.Tanh)
    pixels = torch.rand(2, 1, 28, 28)
    assert torch.equal(model(pixels), trained.eval()(pixels))
