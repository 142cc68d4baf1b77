"""The job spec: loading, defaults, dotted overrides and the messages for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain.errors import SpecError
from raytrain.spec import apply_overrides, dump_spec, flatten, load_spec, parse_spec
from tests.conftest import digits_spec, write_spec


def _problems(excinfo: pytest.ExceptionInfo[SpecError]) -> str:
    return "\n".join(excinfo.value.problems)


def test_bundled_job_loads_with_defaults() -> None:
    spec = load_spec("jobs/digits.yaml")
    assert spec.name == "digits-cnn"
    assert spec.scaling.num_workers == 2
    assert spec.strategy.name == "ddp"
    assert spec.checkpoint.monitor == "val_acc"
    assert spec.failure.max_failures == 1
    assert spec.trainer.max_steps == -1  # default filled in


def test_overrides_are_parsed_as_yaml_and_applied() -> None:
    spec = load_spec(
        "jobs/digits.yaml",
        ["trainer.max_epochs=2", "scaling.num_workers=1", "data.shuffle=null", "name=other"],
    )
    assert spec.trainer.max_epochs == 2
    assert spec.scaling.num_workers == 1
    assert spec.data.shuffle is None
    assert spec.name == "other"


def test_override_creates_missing_sections() -> None:
    tree = apply_overrides({"a": {"b": 1}}, ["a.c.d=[1, 2]", "x=y"])
    assert tree == {"a": {"b": 1, "c": {"d": [1, 2]}}, "x": "y"}


def test_override_without_equals_is_rejected() -> None:
    with pytest.raises(SpecError) as excinfo:
        load_spec("jobs/digits.yaml", ["trainer.max_epochs"])
    assert "expected KEY.PATH=VALUE" in _problems(excinfo)


def test_override_into_a_scalar_names_the_field() -> None:
    with pytest.raises(SpecError) as excinfo:
        load_spec("jobs/digits.yaml", ["name.first=x"])
    assert "name.first: cannot set inside name" in _problems(excinfo)


def test_unknown_key_names_its_path_and_the_allowed_keys() -> None:
    with pytest.raises(SpecError) as excinfo:
        load_spec("jobs/digits.yaml", ["trainer.max_epoch=3"])
    text = _problems(excinfo)
    assert "trainer.max_epoch: unknown field" in text
    assert "max_epochs" in text  # the hint lists the real field


def test_wrong_type_names_field_and_value() -> None:
    with pytest.raises(SpecError) as excinfo:
        load_spec("jobs/digits.yaml", ["data.batch_size=lots"])
    text = _problems(excinfo)
    assert text.startswith("data.batch_size:")
    assert "'lots'" in text


def test_out_of_range_numbers_are_rejected() -> None:
    with pytest.raises(SpecError) as excinfo:
        load_spec("jobs/digits.yaml", ["scaling.num_workers=0", "trainer.max_epochs=-1"])
    problems = excinfo.value.problems
    assert any(p.startswith("scaling.num_workers:") and "at least 1" in p for p in problems)
    assert any(p.startswith("trainer.max_epochs:") for p in problems)
    assert len(problems) == 2  # every problem, not just the first


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write_spec(tmp_path / "s.yaml", {"name": "bad name!", "model": {}, "data": {}})
    with pytest.raises(SpecError) as excinfo:
        load_spec(path)
    text = _problems(excinfo)
    assert "name:" in text
    assert "model.class_path: required field is missing" in text
    assert "data.train: required field is missing" in text


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmodel: {class_path: a:B\n")
    with pytest.raises(SpecError) as excinfo:
        load_spec(path)
    text = _problems(excinfo)
    assert str(path) in text
    assert "malformed YAML at line" in text


def test_missing_file_is_named() -> None:
    with pytest.raises(SpecError) as excinfo:
        load_spec("no/such/spec.yaml")
    assert _problems(excinfo) == "no/such/spec.yaml: spec file not found"


def test_spec_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(path)


def test_class_path_is_dotted_or_colon_and_read_as_colon() -> None:
    dotted = load_spec("jobs/digits.yaml", ["model.class_path=raytrain.models.digits.DigitsCNN"])
    assert dotted.model.class_path == "raytrain.models.digits:DigitsCNN"
    assert dotted == load_spec("jobs/digits.yaml")  # one spec, one digest, either way
    for bad in ("DigitsCNN", "digits.", "1digits.DigitsCNN"):
        with pytest.raises(SpecError) as excinfo:
            load_spec("jobs/digits.yaml", [f"model.class_path={bad}"])
        assert _problems(excinfo).startswith("model.class_path: expected")


def test_resolved_spec_round_trips_through_yaml(tmp_path: Path) -> None:
    spec = load_spec("jobs/digits.yaml")
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_spec(spec))
    assert load_spec(path) == spec


def test_digest_ignores_training_length_but_not_the_model(tmp_path: Path) -> None:
    base = parse_spec(digits_spec(tmp_path, tmp_path))
    longer = load_spec(base, ["trainer.max_epochs=20", "scaling.num_workers=1"])
    other_lr = load_spec(base, ["model.init_args.lr=0.5"])
    assert base.digest() == longer.digest()
    assert base.digest() != other_lr.digest()


def test_flatten_keeps_lists_and_empty_maps_as_leaves() -> None:
    assert flatten({"a": {"b": [1, 2], "c": {}}, "d": 1}) == {"a.b": [1, 2], "a.c": {}, "d": 1}


def test_storage_endpoints_never_carry_credentials() -> None:
    with pytest.raises(SpecError) as excinfo:
        load_spec(
            "jobs/digits.yaml",
            [
                "storage.s3.endpoint_url=http://key:secret@minio:9000",
                "storage.azure.endpoint_url=minio:9000",
            ],
        )
    problems = excinfo.value.problems
    assert any(p.startswith("storage.s3.endpoint_url: credentials do not belong") for p in problems)
    assert any(p.startswith("storage.azure.endpoint_url: expected http(s)://") for p in problems)
    assert "secret" not in str(excinfo.value)  # a refused credential is not echoed


def test_storage_options_and_image_size() -> None:
    spec = load_spec(
        "jobs/digits.yaml",
        [
            "storage.s3.endpoint_url=http://127.0.0.1:9000/",
            "storage.s3.region=eu-west-1",
            "data.cache=never",
        ],
    )
    assert spec.storage.s3.endpoint_url == "http://127.0.0.1:9000"
    assert spec.storage.max_attempts == 3
    # where the stores are may change between attempts without making another experiment
    assert spec.digest() == load_spec("jobs/digits.yaml", ["data.cache=never"]).digest()
    with pytest.raises(SpecError, match=r"data\.train\.image_size: height and width"):
        load_spec("jobs/digits.yaml", ["data.train.format=images", "data.train.image_size=[0, 8]"])


def test_an_elastic_worker_range() -> None:
    spec = load_spec("jobs/digits.yaml", ["scaling.num_workers=[1, 3]"])
    assert spec.scaling.elastic
    assert (spec.scaling.min_workers, spec.scaling.max_workers) == (1, 3)
    with pytest.raises(SpecError) as excinfo:
        load_spec("jobs/digits.yaml", ["scaling.num_workers=[3, 1]"])
    assert any(
        p.startswith("scaling.num_workers:") and "max >= min" in p for p in excinfo.value.problems
    )
