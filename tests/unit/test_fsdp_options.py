"""FSDP options: validated in the spec, module class names resolved against the model, and
``raytrain export`` refusing what is not a checkpoint (no Ray, no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrain.checkpoints.export import export_checkpoint
from raytrain.cli.app import main
from raytrain.errors import EXIT_BAD_INPUT, SpecError
from raytrain.models.tinygpt import Block, TinyGPT
from raytrain.spec import load_spec
from raytrain.worker.strategy import module_classes


def test_fsdp_options_are_validated_by_name() -> None:
    spec = load_spec("jobs/tinygpt.yaml")
    assert spec.strategy.name == "fsdp" and spec.strategy.fsdp.auto_wrap == ["Block"]
    with pytest.raises(SpecError) as excinfo:
        load_spec("jobs/tinygpt.yaml", ["strategy.fsdp.sharding=everything"])
    assert any(p.startswith("strategy.fsdp.sharding:") for p in excinfo.value.problems)


def test_module_class_names_resolve_against_the_model() -> None:
    model = TinyGPT(layers=1, dim=16, heads=2)
    assert module_classes(model, ["Block"], "f") == [Block]
    assert module_classes(model, ["raytrain.models.tinygpt:Block"], "f") == [Block]
    with pytest.raises(SpecError) as excinfo:
        module_classes(model, ["Blok"], "strategy.fsdp.auto_wrap")
    (problem,) = excinfo.value.problems
    assert problem.startswith("strategy.fsdp.auto_wrap: no submodule of class 'Blok'")
    assert "Block" in problem  # the classes it does have are listed


def test_export_of_a_full_checkpoint_loads_into_a_plain_model(tmp_path: Path) -> None:
    model = TinyGPT(layers=1, dim=16, heads=2)
    ckpt = tmp_path / "checkpoint_1"
    ckpt.mkdir()
    prefixed = {f"_forward_module.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": prefixed, "epoch": 0}, ckpt / "checkpoint.ckpt")
    export_checkpoint(str(ckpt), str(tmp_path / "out" / "model.pt"))
    plain = TinyGPT(layers=1, dim=16, heads=2)
    plain.load_state_dict(torch.load(tmp_path / "out" / "model.pt"), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value)


def test_export_of_something_else_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "x.pt")]) == EXIT_BAD_INPUT
    assert f"{tmp_path}: not a raytrain checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()
