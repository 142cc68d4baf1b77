"""Reading a spec has limits: size, expanded nodes, depth; duplicate keys and hostile values
are refused with one line naming the file or field (issue 15, items 10-13)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from raytrain.errors import SpecError
from raytrain.spec import (
    MAX_SPEC_BYTES,
    MAX_SPEC_DEPTH,
    MAX_SPEC_NODES,
    apply_overrides,
    load_spec,
    read_spec_file,
)

BASE = {"name": "x", "model": {"class_path": "a.b:C"}, "data": {"train": {"uri": "/tmp"}}}


def _bomb(levels: int = 9) -> str:
    """A billion-laughs document: 10**(levels+1) leaves from a few hundred bytes."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def _refused(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    with pytest.raises(SpecError) as info:
        read_spec_file(path)
    assert len(info.value.problems) == 1
    assert "\n" not in info.value.problems[0]
    return info.value.problems[0]


def test_alias_bomb_is_refused_by_its_expanded_size(tmp_path: Path) -> None:
    text = _bomb()
    assert len(text) < 1024
    problem = _refused(tmp_path / "bomb.yaml", text.encode())
    assert problem.startswith(f"{tmp_path / 'bomb.yaml'}: expands into more than")
    assert f"{MAX_SPEC_NODES:,}" in problem


def test_a_small_alias_reuse_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("a: &cols [pixels, label]\nb: *cols\n")
    assert read_spec_file(path) == {"a": ["pixels", "label"], "b": ["pixels", "label"]}


def test_oversized_deep_recursive_duplicate_and_undecodable_files(tmp_path: Path) -> None:
    big = _refused(tmp_path / "big.yaml", b"# " + b"x" * MAX_SPEC_BYTES)
    assert "larger than the limit" in big
    deep = _refused(tmp_path / "deep.yaml", ("a: " + "{b: " * 5000 + "1" + "}" * 5000).encode())
    assert f"nested deeper than the limit of {MAX_SPEC_DEPTH}" in deep
    flow = _refused(tmp_path / "flow.yaml", ("a: " + "[" * 5000 + "]" * 5000).encode())
    assert flow.startswith(str(tmp_path / "flow.yaml"))
    rec = _refused(tmp_path / "rec.yaml", b"a: &x [1, *x]\n")
    assert "recursive alias" in rec
    dup = _refused(tmp_path / "dup.yaml", b"name: a\nmodel: {}\nname: b\n")
    assert "line 3" in dup and "duplicate key 'name' (first at line 1)" in dup
    latin = _refused(tmp_path / "latin.yaml", "name: caf\xe9\n".encode("latin-1"))
    assert "not UTF-8" in latin
    utf16 = _refused(tmp_path / "u16.yaml", "name: x\n".encode("utf-16"))
    assert "not UTF-8" in utf16
    two = _refused(tmp_path / "two.yaml", b"a: 1\n---\nb: 2\n")
    assert "single document" in two


def test_spec_path_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(SpecError, match=r"notes\.txt/x\.yaml: spec file not found"):
        read_spec_file(tmp_path / "notes.txt" / "x.yaml")


def test_a_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes("\ufeffname: x\n".encode())
    assert read_spec_file(path) == {"name": "x"}


def test_libyaml_loader_is_used_when_present() -> None:
    from raytrain.spec import yaml_io as spec

    if getattr(yaml, "__with_libyaml__", False):
        assert issubclass(spec._SpecLoader, yaml.CSafeLoader)
    assert not issubclass(spec._SpecLoader, yaml.FullLoader)


@pytest.mark.parametrize(
    ("override", "field", "says"),
    [
        (".".join(["validate"] * 3000) + "=1", "override validate.", "limit of 32"),
        ("x=&a [1, *a]", "x: override value", "recursive alias"),
        ("x={a: 1, a: 2}", "x: override value", "duplicate key 'a'"),
        ("x=" + "[" * 100 + "]" * 100, "x: override value", "nested deeper"),
    ],
)
def test_override_values_have_the_same_limits(override: str, field: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        apply_overrides({}, [override])
    (problem,) = info.value.problems
    assert problem.startswith(field) and says in problem, problem


@pytest.mark.parametrize(
    ("override", "field", "says"),
    [
        ("scaling.resources_per_worker={CPU: .nan}", "scaling.resources_per_worker.CPU", "finite"),
        ("scaling.resources_per_worker={CPU: .inf}", "scaling.resources_per_worker.CPU", "finite"),
        ("scaling.resources_per_worker={CPU: true}", "scaling.resources_per_worker", "boolean"),
        ("trainer.gradient_clip_val=.nan", "trainer.gradient_clip_val", "finite"),
        ('checkpoint.storage="/tmp/a\\0b"', "checkpoint.storage", "NUL"),
        ('data.train.uri="s3://b/\\0"', "data.train.uri", "NUL"),
        ('tracking.mlflow.tags={a: "x\\0"}', "tracking.mlflow.tags", "NUL"),
        ("trainer.seed=18446744073709551616", "trainer.seed", "less than or equal to 4294967295"),
        ("trainer.seed=-1", "trainer.seed", "greater than or equal to 0"),
        ("data.columns=[]", "data.columns", "at least 1 item"),
        ("scaling.num_workers=true", "scaling.num_workers", "boolean"),
        ("scaling.num_workers=[true, 2]", "scaling.num_workers", "boolean"),
        ("data.batch_size=false", "data.batch_size", "boolean"),
        ("trainer.max_epochs=true", "trainer.max_epochs", "boolean"),
        ("checkpoint.storage=file://runs", "checkpoint.storage", "file:///absolute/path"),
        ("data.train.uri=file://tmp/x", "data.train.uri", "host part ('tmp')"),
        ("tracking.mlflow.experiment=../../etc", "tracking.mlflow.experiment", "pattern"),
        ("tracking.mlflow.experiment=a/b", "tracking.mlflow.experiment", "pattern"),
        ("tracking.mlflow.experiment=a..b", "tracking.mlflow.experiment", "'..'"),
        ("name=a..b", "name", "'..'"),
        # names that become metric, param or tag keys, file names or labels: one rule
        ("tracking.mlflow.tags={../x: y}", "tracking.mlflow.tags", "'../x' cannot name"),
        ("tracking.mlflow.tags={/abs: y}", "tracking.mlflow.tags", "'/abs' cannot name"),
        ("tracking.mlflow.tags={a/./b: y}", "tracking.mlflow.tags", "'a/./b' cannot name"),
        ('tracking.mlflow.tags={"a!": y}', "tracking.mlflow.tags", "'a!' cannot name"),
        ("tracking.mlflow.tags={" + "k" * 251 + ": y}", "tracking.mlflow.tags", "longer than 250"),
        ("tracking.mlflow.register_as=a/b", "tracking.mlflow.register_as", "'a/b' cannot name"),
        ("tracking.mlflow.register_as=..", "tracking.mlflow.register_as", "'..' cannot name"),
        # sizes past their bounds, with the reason
        ("trainer.accumulate_grad_batches=1000000", "trainer.accumulate_grad_batches", "1024"),
        ("scaling.num_workers=[1, 1000000000]", "scaling.num_workers", "limit of 10000"),
        ("scaling.num_workers=20000", "scaling.num_workers", "limit of 10000"),
        ("checkpoint.storage=s3://u:hunter2@bucket/x", "checkpoint.storage", "credentials"),
        ("data.train.uri=s3://AKIAX:pw@b/x", "data.train.uri", "credentials"),
        ("data.val.uri=gs://user@bucket/x", "data.val.uri", "credentials"),
        (
            "checkpoint.storage=abfs://c:key@acct.dfs.core.windows.net/x",
            "checkpoint.storage",
            "credentials",
        ),
    ],
)
def test_hostile_values_are_refused_naming_the_field(override: str, field: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(copy.deepcopy(BASE), [override])
    (problem,) = info.value.problems
    assert problem.startswith(f"{field}: ") and says in problem, problem
    assert not any(secret in problem for secret in ("hunter2", ":pw@", ":key@"))


@pytest.mark.parametrize(
    "override",
    [
        "scaling.use_gpu=false",
        "strategy.fsdp.cpu_offload=false",
        "checkpoint.storage=file:///tmp/x",
        "checkpoint.storage=file://localhost/tmp/x",
        "checkpoint.storage=abfs://container@acct.dfs.core.windows.net/runs",
        "data.train.uri=s3://bucket/key@v2/x",
        "tracking.mlflow.experiment=My experiment 2",
        "model.init_args={flag: true}",
        "trainer.seed=4294967295",
        "scaling.num_workers=[1, 2]",
        "tracking.mlflow.tags={team/vision.core: v, mlflow.note.content: text}",
        "tracking.mlflow.register_as=Digits CNN v2",
        "trainer.accumulate_grad_batches=1024",
        "scaling.num_workers=10000",
    ],
)
def test_ordinary_values_still_pass(override: str) -> None:
    load_spec(copy.deepcopy(BASE), [override])


def test_file_uris_with_a_host_are_refused_by_storage_too() -> None:
    """``resolve`` is also reached by paths that are not in a spec (``raytrain export``)."""
    from raytrain import storage
    from raytrain.errors import StorageError

    assert storage.resolve("file:///tmp/x") == "/tmp/x"
    assert storage.resolve("file://localhost/tmp/x") == "/tmp/x"
    for uri in ("file://runs", "file://tmp/x"):
        with pytest.raises(StorageError, match="file:///absolute/path or a plain path"):
            storage.resolve(uri)
