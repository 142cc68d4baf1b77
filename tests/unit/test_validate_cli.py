"""`raytrain validate` prints the resolved spec or every problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raytrain.cli.app import main
from tests.conftest import digits_spec, write_spec


def test_validate_prints_resolved_spec_with_overrides(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    path = write_spec(tmp_path / "job.yaml", digits_spec(digits_dir, tmp_path))
    assert main(["validate", str(path), "trainer.max_epochs=7"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["trainer"]["max_epochs"] == 7
    assert resolved["trainer"]["precision"] == "32-true"  # defaults are shown
    assert not (tmp_path / "runs").exists()


def test_overrides_may_follow_options(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    path = write_spec(tmp_path / "job.yaml", digits_spec(digits_dir, tmp_path))
    # the override after --fresh reaches validation (and fails it, before Ray starts)
    assert main(["run", str(path), "--fresh", "trainer.max_epochs=0"]) == 2
    assert capsys.readouterr().err.startswith("error: trainer.max_epochs:")
    with pytest.raises(SystemExit) as exc:  # an unknown option is still refused
        main(["run", str(path), "--fresh", "trainer.max_epochs=3", "--no-such-flag"])
    assert exc.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_validate_lists_every_problem(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    path = write_spec(tmp_path / "job.yaml", digits_spec(digits_dir, tmp_path))
    rc = main(["validate", str(path), "trainer.max_epochs=0", "data.batch_size=0", "x.y=1"])
    assert rc == 2
    lines = capsys.readouterr().err.strip().splitlines()
    fields = sorted(line.removeprefix("error: ").split(":")[0] for line in lines)
    assert fields == ["data.batch_size", "trainer.max_epochs", "x"]


def test_validate_accepts_missing_data_that_prepare_will_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    spec = digits_spec(tmp_path / "absent", tmp_path)
    spec["data"]["prepare"] = "raytrain.datasets.digits:write_splits"
    path = write_spec(tmp_path / "job.yaml", spec)
    assert main(["validate", str(path)]) == 0
    assert not (tmp_path / "absent").exists()  # validate writes nothing


def test_missing_val_is_an_error_when_prepare_will_not_run(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    spec = digits_spec(digits_dir, tmp_path)
    spec["data"]["prepare"] = "raytrain.datasets.digits:write_splits"
    spec["data"]["val"] = {"uri": str(tmp_path / "no-val")}
    path = write_spec(tmp_path / "job.yaml", spec)
    assert main(["validate", str(path)]) == 2  # train exists, so prepare will not write val
    assert "error: data.val.uri: no such file or folder" in capsys.readouterr().err


def test_every_subcommand_the_parser_knows_has_its_handler() -> None:
    """The CLI is table-driven (``app.COMMANDS``): a subcommand added to the parser
    without a handler, or a handler left for a removed one, fails here."""
    import argparse

    from raytrain.cli import app

    (subparsers,) = (
        action
        for action in app.build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    assert set(subparsers.choices) == set(app.COMMANDS)
