"""Hostile and careless input, swept through the real CLI in one fresh interpreter.

Every case must end with exit 2 and exactly one line on stderr, ``error: ...``, naming the
field or file at fault; none may print a traceback, write anything (the work folder and the
data are compared before and after), or import Ray or Lightning (so none started Ray). The
cases cover the spec file itself (encodings, sizes, depths, aliases, duplicate keys, paths),
its values (types, ranges, NaN, NUL, URIs, names), the data's column types, the run's state
and checkpoint records, ``raytrain report`` and ``raytrain export``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import digits_spec, write_spec
from tests.fresh_process import run_fresh

_DRIVER = r"""
import contextlib, io, json, sys, time, traceback
from raytrain.cli.app import main
cases = json.loads(sys.argv[1])
out = {}
for name, argv in cases.items():
    err, std = io.StringIO(), io.StringIO()
    began = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            rc = main(argv)
        except BaseException:
            rc = "raised"
            err.write(traceback.format_exc())
    loaded = sorted(m for m in ("ray", "lightning", "pytorch_lightning") if m in sys.modules)
    out[name] = {"rc": rc, "stderr": err.getvalue(), "stdout": std.getvalue(), "modules": loaded,
                 "seconds": round(time.perf_counter() - began, 3)}
print(json.dumps(out))
"""


def _bomb(levels: int = 8, flow: bool = False) -> str:
    """A billion-laughs YAML: 10**(levels+1) leaves from a few hundred bytes."""
    parts = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    parts += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    if flow:
        return "[" + ", ".join(parts) + "]"
    return "".join(f"k{i}: {part}\n" for i, part in enumerate(parts))


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: its size and modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            info = path.lstat()
            out[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns)
    return out


def _files(work: Path, digits_dir: Path) -> dict[str, list[str]]:
    """Write the hostile files under ``work``; returns the spec-file cases' argv."""
    spec = digits_spec(digits_dir, work)
    job = write_spec(work / "job.yaml", spec)
    raw = {
        "alias_bomb": _bomb().encode(),
        "oversized": b"# " + b"x" * (2 * 1024 * 1024),
        "nested_5000": ("a: " + "{b: " * 5000 + "1" + "}" * 5000).encode(),
        "brackets_5000": ("a: " + "[" * 5000 + "]" * 5000).encode(),
        "duplicate_key": job.read_bytes() + b"name: again\n",
        "latin1": "name: caf\xe9\n".encode("latin-1"),
        "utf16": job.read_text().encode("utf-16"),
        "binary": bytes(range(256)) * 4,
        "recursive_alias": b"name: &x [1, *x]\n",
        "two_documents": job.read_bytes() + b"---\nname: y\n",
        "a_list": b"- name: x\n",
        "empty": b"",
        "control_char": b"name: \x07\n",
        "tab_indent": b"name:\n\t- x\n",
    }
    argvs = {}
    for name, data in raw.items():
        path = work / f"{name}.yaml"
        path.write_bytes(data)
        argvs[f"spec_{name}"] = ["run", str(path)]
    (work / "notes.txt").write_text("not a folder\n")
    argvs["spec_under_a_file"] = ["run", str(work / "notes.txt" / "x.yaml")]
    (work / "a_folder.yaml").mkdir()
    argvs["spec_is_a_folder"] = ["validate", str(work / "a_folder.yaml")]
    argvs["validate_alias_bomb"] = ["validate", str(work / "alias_bomb.yaml")]
    return argvs


# name: (overrides to job.yaml, text the one error line must start with after "error: ")
OVERRIDES: dict[str, tuple[list[str], str]] = {
    "resources_nan": (["scaling.resources_per_worker={CPU: .nan}"], "scaling.resources_per"),
    "resources_inf": (["scaling.resources_per_worker={CPU: .inf}"], "scaling.resources_per"),
    "resources_bool": (["scaling.resources_per_worker={CPU: true}"], "scaling.resources_per"),
    "clip_nan": (["trainer.gradient_clip_val=.nan"], "trainer.gradient_clip_val"),
    "resize_inf": (["scaling.resize_check_s=.inf"], "scaling.resize_check_s"),
    "storage_nul": (['checkpoint.storage="/tmp/a\\0b"'], "checkpoint.storage"),
    "train_uri_nul": (['data.train.uri="s3://bucket/\\0"'], "data.train.uri"),
    "tag_nul": (['tracking.mlflow.tags={team: "a\\0"}'], "tracking.mlflow.tags"),
    "seed_2_64": (["trainer.seed=18446744073709551616"], "trainer.seed"),
    "seed_negative": (["trainer.seed=-1"], "trainer.seed"),
    "columns_empty": (["data.columns=[]"], "data.columns"),
    "workers_true": (["scaling.num_workers=true"], "scaling.num_workers"),
    "workers_range_bool": (["scaling.num_workers=[true, 2]"], "scaling.num_workers"),
    "batch_size_bool": (["data.batch_size=true"], "data.batch_size"),
    "max_epochs_false": (["trainer.max_epochs=false"], "trainer.max_epochs"),
    "storage_file_host": (["checkpoint.storage=file://runs"], "checkpoint.storage"),
    "train_uri_file_host": (["data.train.uri=file://tmp/x"], "data.train.uri"),
    "experiment_parent": (["tracking.mlflow.experiment=../../escape"], "tracking.mlflow.exp"),
    "experiment_slash": (["tracking.mlflow.experiment=a/b"], "tracking.mlflow.experiment"),
    "name_traversal": (["name=../evil"], "name"),
    "name_dots": (["name=a..b"], "name"),
    "override_alias_bomb": ([f"model.init_args={{x: {_bomb(flow=True)}}}"], "model.init_args"),
    "override_duplicate_key": (["model.init_args={lr: 1, lr: 2}"], "model.init_args"),
    "override_deep_value": (["model.init_args={x: " + "[" * 200 + "]" * 200 + "}"], "model."),
    "override_3000_parts": (["model.init_args." + ".".join(["a"] * 3000) + "=1"], "override"),
    "override_no_equals": (["trainer.max_epochs"], "override 'trainer.max_epochs'"),
}

# issue 33 (names, numbers): names that become metric keys, file names or labels, and sizes
# past their bounds; each also through `raytrain validate` (validate_<name>)
_MIX = "data.train=[{uri: /d/a, weight: 1}, {uri: /d/b, weight: 1}]"
NAMES_AND_SIZES: dict[str, tuple[list[str], str]] = {
    "mix_source_named_dots": (
        ["data.train=[{uri: /d/a, weight: 1, name: ..}]"],
        "data.train.0.name",
    ),
    "mix_source_named_dot": (["data.train=[{uri: /d/a, weight: 1, name: .}]"], "data.train.0.name"),
    "mix_uri_ending_dots": (["data.train=[{uri: /d/a/.., weight: 1}]"], "data.train.0.uri"),
    "mix_weights_overflow": (
        ["data.train=[{uri: /d/a, weight: 1.0e+308}, {uri: /d/b, weight: 1.0e+308}]"],
        "data.train.1.weight",
    ),
    "mix_epoch_rows_petabyte": ([_MIX, "data.epoch_rows=1000000000000000"], "data.epoch_rows"),
    "elastic_billion_keep_batch": (
        ["scaling.num_workers=[1, 1000000000]", "scaling.keep_global_batch=true"],
        "scaling.num_workers",
    ),
    "elastic_accumulates_past_limit": (
        ["scaling.num_workers=[1, 5000]", "scaling.keep_global_batch=true"],
        "scaling.num_workers: [1, 5000] with",
    ),
    "accumulate_million": (
        ["trainer.accumulate_grad_batches=1000000"],
        "trainer.accumulate_grad_batches",
    ),
    "tag_key_traversal": (["tracking.mlflow.tags={../x: y}"], "tracking.mlflow.tags"),
    "register_as_slash": (["tracking.mlflow.register_as=a/b"], "tracking.mlflow.register_as"),
}
OVERRIDES |= NAMES_AND_SIZES


# --- issue 33, sweeps (`raytrain tune`): its settings against Ray Tune's rules, the keys a
# sweep may not sample, and the folders a run and a sweep of one name would share ---
# name: (overrides to sweep.yaml, text the one error line must start with after "error: ")
TUNE_OVERRIDES: dict[str, tuple[list[str], str]] = {
    "tune_grace_above_max_t": (
        ["tune.scheduler={name: asha, grace_period: 5, max_t: 3}"],
        "tune.scheduler: grace_period (5) is above max_t",
    ),
    "tune_grace_above_max_epochs": (
        ["tune.scheduler={name: asha, grace_period: 5}"],
        "tune.scheduler.grace_period: 5 is above max_t (2, ",
    ),
    "tune_max_t_above_max_epochs": (
        ["tune.scheduler={name: asha, max_t: 10}"],
        "tune.scheduler.max_t: 10 is above trainer.max_epochs",
    ),
    "tune_reduction_factor_tiny": (
        ["tune.scheduler={name: asha, reduction_factor: 1.0000001}"],
        "tune.scheduler.reduction_factor: 1.0000001 is below 1.5",
    ),
    "tune_rungs_many": (
        [
            "trainer.max_steps=1000000000",
            "tune.scheduler={name: asha, "
            "time_attr: step, reduction_factor: 1.5, max_t: 1000000000}",
        ],
        "tune.scheduler.reduction_factor: 1.5 makes 52 rungs",
    ),
    "tune_uniform_overflow": (
        ["tune.search_space={model.init_args.lr: {uniform: [-1e308, 1e308]}}"],
        "tune.search_space.model.init_args.lr: uniform: [-1e+308, 1e+308] is wider than a float",
    ),
    "tune_choice_nan": (
        ["tune.search_space={model.init_args.lr: {choice: [.nan, .inf]}}"],
        "tune.search_space.model.init_args.lr: choice: nan is not",
    ),
    "tune_grid_inside_inf": (
        ["tune.search_space={model.init_args: {grid: [{lr: .inf}]}}"],
        "tune.search_space.model.init_args: grid: {'lr': inf}",
    ),
    "tune_randint_past_int64": (
        ["tune.search_space={trainer.seed: {randint: [0, 100000000000000000000]}}"],
        "tune.search_space.trainer.seed: randint: ",
    ),
    "tune_grids_past_the_cap": (
        [
            "tune.num_samples=10000",
            "tune.search_space={a: {grid: "
            f"{list(range(100))}}}, b: {{grid: {list(range(100))}}}, "
            f"c: {{grid: {list(range(100))}}}}}",
        ],
        "tune: num_samples: 10000 x the grids' 100 x 100 "
        "x 100 combinations is 10,000,000,000 trials",
    ),
    "tune_sample_checkpoint": (
        ["tune.search_space={checkpoint.storage: {choice: [/etc]}}"],
        "tune.search_space: 'checkpoint.storage': a sweep may not sample it",
    ),
    "tune_sample_checkpoint_section": (
        ["tune.search_space={checkpoint: {choice: [{keep: 1}]}}"],
        "tune.search_space: 'checkpoint': a sweep",
    ),
    "tune_sample_tracking_uri": (
        ["tune.search_space={tracking.mlflow.tracking_uri: {choice: [sqlite:///x.db]}}"],
        "tune.search_space: 'tracking.mlflow.tracking_uri': a sweep may not sample it",
    ),
    "tune_sample_experiment": (
        ["tune.search_space={tracking.mlflow.experiment: {choice: [a]}}"],
        "tune.search_space: 'tracking.mlflow.experiment'",
    ),
    "tune_sample_tags": (
        ["tune.search_space={tracking.mlflow.tags: {choice: [{a: b}]}}"],
        "tune.search_space: 'tracking.mlflow.tags'",
    ),
    "tune_sample_mlflow_section": (
        ["tune.search_space={tracking.mlflow: {choice: [{}]}}"],
        "tune.search_space: 'tracking.mlflow': a sweep "
        "may not sample it (it holds tracking.mlflow.tracking_uri)",
    ),
    "tune_sample_bare_tune": (
        ["tune.search_space={tune: {choice: [1]}}"],
        "tune.search_space: 'tune': a sweep may not sample",
    ),
    "tune_sample_name": (
        ["tune.search_space={name: {choice: [a]}}"],
        "tune.search_space: 'name': a sweep may not sample it",
    ),
    "tune_101_fields": (
        [
            "tune.search_space={"
            + ", ".join(f"model.init_args.a{i}: {{choice: [1]}}" for i in range(101))
            + "}"
        ],
        "tune.search_space: Dictionary should have at most 100 items",
    ),
}
TUNE_EXPECTED: dict[str, str] = {
    "tune_grid_90000": "tune.search_space.data.batch_size: grid: 90,000 values, "
    "more than the limit of 10,000",
    "tune_choice_10000_last_bad": "tune.search_space.data.train.uri: 'file://host/9999' is not "
    "a value the spec takes: data.train.uri: a file:// URI with a host part",
    "tune_fresh_on_a_runs_folder": "holds a run (raytrain-run.json), not a sweep",
    "tune_on_a_runs_folder": "holds a run (raytrain-run.json), not a sweep",
    "run_on_a_sweeps_folder": "holds a sweep (raytrain-sweep.json), not a run",
    "run_fresh_on_a_sweeps_folder": "holds a sweep (raytrain-sweep.json), not a run",
    "tune_a_live_sweeps_folder": "is in use by another sweep: pid ",
    "tune_fresh_a_live_sweeps_folder": "is in use by another sweep: pid ",
    "tune_folder_is_a_file": "the sweep's folder is a file, not a folder",
}


def _tune_files(work: Path, digits_dir: Path) -> dict[str, list[str]]:
    """The sweep cases: a valid sweep (its space over no class's arguments: checking those
    imports the model, and so Lightning) and the folders and files the cases need."""
    from raytrain.records import lease, runstate
    from raytrain.spec import load_spec
    from raytrain.sweep.runner import write_record

    section = {
        "search_space": {"data.batch_size": {"choice": [16, 32]}},
        "metric": "val_acc",
        "mode": "max",
    }
    tree = digits_spec(digits_dir, work, tune=section)
    spec = str(write_spec(work / "sweep.yaml", tree))
    argvs = {name: ["tune", spec, *v[0]] for name, v in TUNE_OVERRIDES.items()}

    def space_file(name: str, space: dict[str, Any]) -> str:
        """A sweep over ``space``, its lists in YAML's flow style (within the size limit)."""
        path = work / f"{name}.yaml"
        path.write_text(
            yaml.safe_dump(
                {**tree, "tune": {**section, "search_space": space}},
                default_flow_style=None,
                width=2**20,
            )
        )
        return str(path)

    grid = space_file("grid_90000", {"data.batch_size": {"grid": list(range(1, 90_001))}})
    argvs["tune_grid_90000"] = ["tune", grid]
    uris = [f"/data/train-{i}" for i in range(9_999)] + ["file://host/9999"]  # the last bad
    argvs["tune_choice_10000_last_bad"] = [
        "tune",
        space_file("choice_10000", {"data.train.uri": {"choice": uris}}),
    ]

    # a run's folder, its record written as a run writes it; a sweep's, as a sweep does
    run_store, sweep_store = work / "a_runs_store", work / "a_sweeps_store"
    job = load_spec(tree, [f"checkpoint.storage={run_store}"]).model_copy(update={"tune": None})
    runstate.save(job, runstate.new_state(job))
    swept = load_spec(tree, [f"checkpoint.storage={sweep_store}"])
    write_record(str(sweep_store / swept.name), swept, "0123456789abcdef")
    argvs["tune_fresh_on_a_runs_folder"] = [
        "tune",
        spec,
        f"checkpoint.storage={run_store}",
        "--fresh",
    ]
    argvs["tune_on_a_runs_folder"] = ["tune", spec, f"checkpoint.storage={run_store}"]
    job_yaml = str(work / "job.yaml")
    argvs["run_on_a_sweeps_folder"] = ["run", job_yaml, f"checkpoint.storage={sweep_store}"]
    argvs["run_fresh_on_a_sweeps_folder"] = [
        "run",
        job_yaml,
        f"checkpoint.storage={sweep_store}",
        "--fresh",
    ]

    # a live sweep's lease (its heartbeat an hour ahead: live however long the cases take)
    live = work / "a_live_store" / "digits-test"
    live.mkdir(parents=True)
    now = time.time()
    holder = lease.Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=now,
        heartbeat_at=now + 3600,
        token="live",
    )
    (live / lease.LEASE_FILE).write_text(json.dumps(holder.__dict__))
    for name, flags in (
        ("tune_a_live_sweeps_folder", []),
        ("tune_fresh_a_live_sweeps_folder", ["--fresh"]),
    ):
        argvs[name] = ["tune", spec, f"checkpoint.storage={live.parent}", *flags]
    (work / "a_file_store").mkdir()
    (work / "a_file_store" / "digits-test").write_text("a file where the sweep's folder goes\n")
    argvs["tune_folder_is_a_file"] = ["tune", spec, f"checkpoint.storage={work / 'a_file_store'}"]
    return argvs


# --- end of issue 33's sweep cases ---


@pytest.fixture(scope="module")
def sweep(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch

    work = tmp_path_factory.mktemp("sweep")
    argvs = _files(work, digits_dir)
    job = str(work / "job.yaml")
    argvs |= {f"override_{k}": ["run", job, *v[0]] for k, v in OVERRIDES.items()}
    argvs["validate_3000_parts"] = ["validate", job, "model.init_args." + "a." * 3000 + "a=1"]
    argvs["validate_nan"] = ["validate", job, "scaling.resources_per_worker={CPU: .nan}"]
    argvs |= {f"validate_{k}": ["validate", job, *v[0]] for k, v in NAMES_AND_SIZES.items()}

    # data whose columns cannot become tensors
    strings = work / "strings"
    strings.mkdir()
    pq.write_table(
        pa.table({"pixels": [[0.0] * 64] * 8, "label": ["cat"] * 8}), strings / "p.parquet"
    )
    times = work / "times"
    times.mkdir()
    pq.write_table(
        pa.table({"x": [1.0] * 8, "when": pa.array([0] * 8, pa.timestamp("s"))}),
        times / "p.parquet",
    )
    argvs["data_string_label"] = ["run", job, f"data.train.uri={strings}", "data.val=null"]
    argvs["data_timestamp_column"] = [
        "run",
        job,
        f"data.train.uri={times}",
        "data.val=null",
        "data.columns=null",
    ]

    # run-state and checkpoint records that cannot be read
    states = {
        "state_truncated": b'{"name": "digits-test", "spec_digest": "ab',
        "state_unknown_key": json.dumps(
            {"name": "digits-test", "spec_digest": "x", "spec": {}, "owner": "me"}
        ).encode(),
        "state_a_list": b"[1, 2]",
        "state_wrong_type": json.dumps(
            {"name": "digits-test", "spec_digest": "x", "spec": {}, "attempts": "many"}
        ).encode(),
        "state_not_utf8": b'{"name": "\xff\xfe"}',
        "state_deep": b"[" * 100_000 + b"]" * 100_000,
    }
    for name, data in states.items():
        folder = work / name / "digits-test"
        folder.mkdir(parents=True)
        (folder / "raytrain-run.json").write_bytes(data)
        argvs[name] = ["run", job, f"checkpoint.storage={work / name}"]
    snap = work / "snapshot_truncated" / "digits-test"
    snap.mkdir(parents=True)
    (snap / "checkpoint_manager_snapshot.json").write_text('{"checkpoint_results": [')
    argvs["snapshot_truncated"] = ["run", job, f"checkpoint.storage={work / 'snapshot_truncated'}"]

    # raytrain status of a run with no status record, or one it cannot read
    argvs["status_spec_no_record"] = ["status", job]
    argvs["status_name_no_record"] = ["status", "digits-test", "--storage", str(work / "none")]
    (work / "status_bad" / "digits-test").mkdir(parents=True)
    (work / "status_bad" / "digits-test" / "raytrain-status.json").write_text('{"name": 1}')
    argvs["status_bad_record"] = ["status", "digits-test", "--storage", str(work / "status_bad")]
    argvs["doctor_no_record"] = ["doctor", job]

    argvs |= _issue33_b_cases(work, job)  # status, doctor, report, job commands (issue 33)

    # raytrain report of runs in a store that does not exist: not created by reading it
    argvs["report_default_store"] = ["report", "0123456789abcdef", "--out", str(work / "r.png")]
    argvs["report_missing_sqlite"] = [
        "report",
        "abc",
        "--tracking-uri",
        f"sqlite:///{work / 'nowhere.db'}",
    ]

    argvs |= _tune_files(work, digits_dir)  # issue 33's sweep cases (above)

    # raytrain export of things that are not checkpoints
    (work / "ckpt_no_state_dict").mkdir()
    torch.save({"epoch": 1}, work / "ckpt_no_state_dict" / "checkpoint.ckpt")
    argvs["export_not_a_checkpoint"] = ["export", str(work / "notes.txt"), str(work / "o.pt")]
    argvs["export_no_state_dict"] = [
        "export",
        str(work / "ckpt_no_state_dict"),
        str(work / "o.pt"),
    ]
    (work / "out_folder").mkdir()
    good = work / "ckpt_good"
    good.mkdir()
    torch.save({"state_dict": {"w": torch.zeros(2)}}, good / "checkpoint.ckpt")
    argvs["export_out_is_a_folder"] = ["export", str(good), str(work / "out_folder")]

    # issue 33: a sharded (DCP) checkpoint whose shard paths lead out of its folder
    import dataclasses
    import pickle

    import torch.distributed.checkpoint as dcp

    for case, where in (("dcp_shard_outside", "../../outside.bin"), ("dcp_shard_absolute", "")):
        shards = work / case / "checkpoint.ckpt"
        dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(shards), no_dist=True)
        (shard,) = shards.glob("*.distcp")
        (work / "outside.bin").write_bytes(shard.read_bytes())
        metadata = pickle.loads((shards / ".metadata").read_bytes())
        path = where or str(work / "outside.bin")
        metadata.storage_data = {
            k: dataclasses.replace(v, relative_path=path) for k, v in metadata.storage_data.items()
        }
        (shards / ".metadata").write_bytes(pickle.dumps(metadata))
        argvs[f"export_{case}"] = ["export", str(work / case), str(work / f"{case}.pt")]

    before = _tree(work), _tree(digits_dir)
    result = run_fresh(_DRIVER, argvs, work, pythonpath=os.getcwd(), timeout=600)
    return {
        "results": result,
        "argvs": argvs,
        "before": before,
        "after": (_tree(work), _tree(digits_dir)),
    }


# --- issue 33 (status, doctor, report, job ids, submit flags): records read through the one
# reader, run names confined to --storage. ---
def _issue33_b_cases(work: Path, job: str) -> dict[str, list[str]]:
    """Records that are not files, or not text; names that lead out of ``--storage``."""
    argvs: dict[str, list[str]] = {}
    records = work / "records33"
    for name in ("fifo", "dev_zero", "folder", "not_utf8"):
        (records / name).mkdir(parents=True)
    os.mkfifo(records / "fifo" / "raytrain-status.json")
    (records / "dev_zero" / "raytrain-status.json").symlink_to("/dev/zero")
    (records / "folder" / "raytrain-status.json").mkdir()
    (records / "not_utf8" / "raytrain-status.json").write_bytes(b'{"name": "\xff"}')
    for name in ("fifo", "dev_zero", "folder", "not_utf8"):
        argvs[f"status_record_{name}"] = ["status", name, "--storage", str(records)]
    argvs["doctor_record_fifo"] = ["doctor", "fifo", "--storage", str(records)]
    argvs["status_name_parent"] = ["status", "../status_bad/digits-test", "--storage", str(records)]
    argvs["status_name_absolute"] = [
        "status",
        str(work / "status_bad" / "digits-test"),
        "--storage",
        str(records),
    ]
    argvs["doctor_name_parent"] = ["doctor", "../x", "--storage", str(records)]
    state = work / "state_fifo" / "digits-test"
    state.mkdir(parents=True)
    os.mkfifo(state / "raytrain-run.json")
    argvs["state_fifo"] = ["run", job, f"checkpoint.storage={work / 'state_fifo'}"]
    # job ids that are not one: refused before any address, token or request
    argvs["logs_job_id_traversal"] = ["logs", "../../api/version"]
    argvs["stop_job_id_empty"] = ["stop", ""]
    argvs["status_job_id_query"] = ["status", "a?b=1#c"]
    argvs["logs_job_id_20k"] = ["logs", "x" * 20_000]
    argvs["submit_job_id_traversal"] = ["submit", job, "--job-id", "../x"]
    # a supervised job's settings: refused without --supervise, and out of their range
    argvs["submit_max_resubmits_alone"] = ["submit", job, "--max-resubmits", "5"]
    argvs["submit_head_wait_alone"] = ["submit", job, "--head-wait", "-1"]
    argvs["submit_supervise_resubmits_negative"] = [
        "submit",
        job,
        "--supervise",
        "--max-resubmits",
        "-1",
    ]
    argvs["submit_supervise_head_wait_nan"] = ["submit", job, "--supervise", "--head-wait", "nan"]
    # report's output files, checked before a store is read (this one does not exist)
    (work / "report_folder33").mkdir()
    report = ["report", "abc", "--tracking-uri", f"sqlite:///{work / 'nowhere33.db'}"]
    argvs["report_out_is_a_folder"] = [*report, "--out", str(work / "report_folder33")]
    argvs["report_out_under_a_file"] = [*report, "--out", str(work / "notes.txt" / "r.png")]
    argvs["report_html_is_a_folder"] = [
        *report,
        "--out",
        str(work / "r33.png"),
        "--html",
        str(work / "report_folder33"),
    ]
    argvs["report_html_is_the_out"] = [
        *report,
        "--out",
        str(work / "r33.png"),
        "--html",
        str(work / "r33.png"),
    ]
    return argvs


EXPECTED_ISSUE33_B: dict[str, str] = {
    "status_record_fifo": "fifo/raytrain-status.json: is a FIFO, not a regular file",
    "status_record_dev_zero": "dev_zero/raytrain-status.json: is a device, not a regular file",
    "status_record_folder": "folder/raytrain-status.json: is a folder, not a regular file",
    "status_record_not_utf8": "not_utf8/raytrain-status.json: not UTF-8 text",
    "doctor_record_fifo": "fifo/raytrain-status.json: is a FIFO",
    "state_fifo": "raytrain-run.json: is a FIFO",
}
FIELD_CASES_ISSUE33_B: dict[str, str] = {
    "status_name_parent": "NAME '../status_bad/digits-test' cannot name files",
    "status_name_absolute": "NAME '/",
    "doctor_name_parent": "NAME '../x' cannot name files",
    "logs_job_id_traversal": "JOB_ID '../../api/version': not a job id",
    "stop_job_id_empty": "JOB_ID '': not a job id",
    "status_job_id_query": "JOB_ID 'a?b=1#c': not a job id",
    "logs_job_id_20k": "JOB_ID 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'...: not a job id",
    "submit_job_id_traversal": "--job-id '../x': not a job id",
    "submit_max_resubmits_alone": "--max-resubmits: only with --supervise",
    "submit_head_wait_alone": "--head-wait: only with --supervise",
    "submit_supervise_resubmits_negative": "--max-resubmits -1: must be 0 or more",
    "submit_supervise_head_wait_nan": "--head-wait nan: must be more than 0 seconds",
    "report_out_is_a_folder": "--out ",
    "report_out_under_a_file": "--out ",
    "report_html_is_a_folder": "--html ",
    "report_html_is_the_out": "--html ",
}
# --- end of issue 33 (status, doctor, report, job ids, submit flags) ---


# Each case: text its one error line must hold: a file's name, or (FIELD_CASES) the field
# the line starts with.
EXPECTED: dict[str, str] = {
    "spec_alias_bomb": "alias_bomb.yaml: expands into more than the limit of",
    "spec_oversized": "oversized.yaml: the spec file is larger than the limit",
    "spec_nested_5000": "nested_5000.yaml: nested deeper than the limit",
    "spec_brackets_5000": "brackets_5000.yaml: ",
    "spec_duplicate_key": "duplicate_key.yaml: malformed YAML at line 28, column 1: duplicate "
    "key 'name' (first at line 17)",
    "spec_latin1": "latin1.yaml: the spec file is not UTF-8",
    "spec_utf16": "utf16.yaml: the spec file is not UTF-8",
    "spec_binary": "binary.yaml: the spec file is not UTF-8",
    "spec_recursive_alias": "recursive_alias.yaml: a recursive alias",
    "spec_two_documents": "two_documents.yaml: malformed YAML",
    "spec_a_list": "a_list.yaml: expected a mapping",
    "spec_empty": "empty.yaml: the spec file is empty",
    "spec_control_char": "control_char.yaml: malformed YAML",
    "spec_tab_indent": "tab_indent.yaml: malformed YAML",
    "spec_under_a_file": "notes.txt/x.yaml: spec file not found",
    "spec_is_a_folder": "a_folder.yaml: is a directory",
    "validate_alias_bomb": "alias_bomb.yaml: expands into more than",
    "state_truncated": "raytrain-run.json: the run's state file cannot be read",
    "state_unknown_key": "raytrain-run.json: the run's state file cannot be read",
    "state_a_list": "raytrain-run.json: the run's state file cannot be read",
    "state_wrong_type": "raytrain-run.json: the run's state file cannot be read",
    "state_not_utf8": "raytrain-run.json: the run's state file cannot be read",
    "state_deep": "raytrain-run.json: the run's state file cannot be read",
    "snapshot_truncated": "checkpoint_manager_snapshot.json",
    "status_spec_no_record": "raytrain-status.json: no status record",
    "status_name_no_record": "none/digits-test/raytrain-status.json: no status record",
    "status_bad_record": "raytrain-status.json: the run's status record cannot be read",
    "doctor_no_record": "raytrain-status.json: no status record",
    "report_missing_sqlite": "nowhere.db",
    "export_not_a_checkpoint": "notes.txt",
    "export_no_state_dict": "ckpt_no_state_dict",
    "export_out_is_a_folder": "out_folder",
    # issue 33: DCP shard paths confined to the checkpoint
    "export_dcp_shard_outside": "dcp_shard_outside/checkpoint.ckpt (entry model.w): its "
    "shard path '../../outside.bin' leads out of the checkpoint folder",
    "export_dcp_shard_absolute": "dcp_shard_absolute/checkpoint.ckpt (entry model.w): its "
    "shard path '/",
    **TUNE_EXPECTED,
}
FIELD_CASES: dict[str, str] = {
    "validate_3000_parts": "override model.init_args.a.a.",
    "validate_nan": "scaling.resources_per_worker.CPU",
    "data_string_label": "data.columns: column 'label'",
    "data_timestamp_column": "data.train.uri: column 'when'",
    "report_default_store": "--tracking-uri: no MLflow store",
    **{f"override_{k}": v[1] for k, v in OVERRIDES.items()},
    **{f"validate_{k}": v[1] for k, v in NAMES_AND_SIZES.items()},
    **{k: v[1] for k, v in TUNE_OVERRIDES.items()},
}
EXPECTED |= EXPECTED_ISSUE33_B
FIELD_CASES |= FIELD_CASES_ISSUE33_B
CASES = sorted({*EXPECTED, *FIELD_CASES})


def test_the_sweep_is_large() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES)
def test_exits_2_with_one_line_naming_the_field_or_file(sweep: dict, case: str) -> None:
    got = sweep["results"][case]
    assert got["rc"] == 2, got
    assert "Traceback" not in got["stderr"] + got["stdout"], got
    lines = got["stderr"].splitlines()
    assert len(lines) == 1, got["stderr"]
    assert lines[0].startswith("error: "), lines
    if case in FIELD_CASES:
        assert lines[0].startswith(f"error: {FIELD_CASES[case]}"), lines[0]
    else:
        assert EXPECTED[case] in lines[0], lines[0]


def test_every_case_was_run(sweep: dict) -> None:
    assert set(sweep["argvs"]) == set(CASES)


def test_nothing_was_written_and_ray_never_imported(sweep: dict) -> None:
    """No case imported Ray (none started it), and none but ``export`` (run last: its
    checkpoint reader allow-lists Lightning's types) imported Lightning."""
    results = {k: v for k, v in sweep["results"].items() if k in CASES}
    exports = [k for k in results if k.startswith("export_")]
    assert list(results)[-len(exports) :] == exports  # so a module each loaded stays seen
    for case, got in results.items():
        allowed = {"lightning", "pytorch_lightning"} if case.startswith("export_") else set()
        assert set(got["modules"]) <= allowed, (case, got["modules"])
    assert sweep["after"] == sweep["before"]
