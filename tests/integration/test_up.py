"""``raytrain up``: a cluster that stays up between runs. Two runs join it (each says so),
the second after the user's model file was edited, and sees the edit: a warm process never
holds the user's code, and the runs leave no actor or placement group behind. The second
runs through the Python API and leaves its process's environment as it found it. ``up``
twice says it is up; ``down`` leaves no process of the cluster's; ``down`` again says
nothing is up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from raytrain.checkpoints.layout import META_FILE
from tests.conftest import digits_spec, write_spec
from tests.integration.cli_runs import cli_env

pytestmark = pytest.mark.integration

MODEL = '''
from pathlib import Path

from raytrain.models.digits import DigitsCNN

VERSION = "{version}"


class Marked(DigitsCNN):
    """The digits net, writing this file's VERSION where it is told when training starts."""

    def __init__(self, mark_file: str, lr: float = 0.003):
        super().__init__(lr=lr)
        self.mark_file = mark_file

    def on_fit_start(self) -> None:
        if self.global_rank == 0:
            Path(self.mark_file).write_text(VERSION)
'''


# What a run left on the cluster, asked by a driver of its own: the processes holding an
# actor on the node (its raylet's stats, as the warm pool counts them) and the placement
# groups not removed; and, to show the count sees one, an actor of its own (``probe``).
LEFT = """
import json, ray
from ray.util.placement_group import placement_group_table
from raytrain._compat.ray_core import RayletPool
ray.init(logging_level="ERROR")
node = ray.nodes()[0]
pool = RayletPool(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
groups = [g["state"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
before = pool.workers().actors

@ray.remote(num_cpus=0)
class Probe:
    def ping(self):
        return 1

probe = Probe.remote()
ray.get(probe.ping.remote())
seen = pool.workers().actors - before
ray.kill(probe)
print(json.dumps({"actors": before, "groups": groups, "probe": seen}))
"""


# The second run through the Python API, in a program of its own: what the run changed in
# its process's environment (a notebook's next run would see it), with the run's result.
API_RUN = """
import dataclasses, json, os, sys
import ray, raytrain  # (their imports set variables of their own)
before = dict(os.environ)
result = raytrain.fit(sys.argv[1], progress=False)
after = dict(os.environ)
changed = {k: [before.get(k), after.get(k)] for k in set(before) | set(after)
           if before.get(k) != after.get(k)}
print(json.dumps({**dataclasses.asdict(result), "changed": changed}))
"""


def _left_behind(env: dict[str, str], record: dict[str, Any]) -> dict[str, Any]:
    joined = {**env, **record["embedded_env"], "RAY_ADDRESS": record["address"]}
    done = subprocess.run(
        [sys.executable, "-c", LEFT], env=joined, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _raytrain(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raytrain", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def _group(pgid: int) -> list[int]:
    """Live processes of the process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    found.append(int(entry.name))
            except ProcessLookupError:
                continue
    return found


def test_runs_join_a_cluster_that_stays_up_and_import_the_users_current_code(
    digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    env = cli_env(RAYTRAIN_HOME=str(tmp_path / "home"))
    assert _raytrain(env, tmp_path, "down").stdout.strip() == "raytrain: no cluster is up"
    status = _raytrain(env, tmp_path, "up", "--status")
    assert status.returncode == 1 and "no cluster is up" in status.stdout

    started = _raytrain(env, tmp_path, "up", "--num-cpus", "4")
    assert started.returncode == 0, started.stderr
    assert "cluster up at" in started.stdout and "raytrain down" in started.stdout
    record = json.loads((tmp_path / "home" / "cluster.json").read_text())
    assert (tmp_path / "home" / "cluster.json").stat().st_mode & 0o777 == 0o600
    again = _raytrain(env, tmp_path, "up")
    assert again.returncode == 0 and "already up" in again.stdout, again.stdout
    try:
        seen, firsts = [], []
        for version in ("one", "two"):
            (tmp_path / "marked_model.py").write_text(MODEL.format(version=version))
            mark = tmp_path / f"mark-{version}"
            spec = digits_spec(
                digits_dir,
                tmp_path,
                name=f"up-{version}",
                model={"class_path": "marked_model:Marked", "init_args": {"mark_file": str(mark)}},
                trainer={"max_epochs": 1},
            )
            path = write_spec(tmp_path / f"{version}.yaml", spec)
            if version == "one":
                run = _raytrain(env, tmp_path, "run", str(path), "--json")
            else:  # the Python API joins too, and leaves its environment as it found it
                run = subprocess.run(
                    [sys.executable, "-c", API_RUN, str(path)],
                    **{"capture_output": True, "text": True, "env": env, "cwd": tmp_path},
                    timeout=300,
                )
            assert run.returncode == 0, run.stderr[-3000:]
            assert "joining the cluster `raytrain up` started" in run.stderr
            result = json.loads(run.stdout.strip().splitlines()[-1])
            assert result["checkpoints"] and "first_step" in result["timings"]
            assert result.get("changed", {}) == {}
            firsts.append(result["timings"])
            seen.append(mark.read_text())
        assert seen == ["one", "two"]  # the edit reached the second run's workers
        # the runs left nothing in the cluster: no actor (controller, workers, sink,
        # keeper), no placement group
        assert _left_behind(env, record) == {"actors": 0, "groups": [], "probe": 1}
        print("first step (s) after the command's start, each run:", firsts)
        assert _raytrain(env, tmp_path, "up", "--status").returncode == 0

        # a longer run; the cluster goes away once it has committed a checkpoint
        cmd = [
            sys.executable,
            "-m",
            "raytrain",
            "run",
            str(path),
            "name=up-lost",
            "trainer.max_epochs=30",
            "--json",
        ]
        lost = subprocess.Popen(
            cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        _wait_for_checkpoints(tmp_path / "runs" / "up-lost", 2, lost)
    finally:
        stopped = _raytrain(env, tmp_path, "down")
    assert stopped.returncode == 0 and "stopped the cluster" in stopped.stdout
    assert _group(record["pid"]) == []
    assert not (tmp_path / "home" / "cluster.json").exists()
    assert _raytrain(env, tmp_path, "down").stdout.strip() == "raytrain: no cluster is up"

    _, err = lost.communicate(timeout=300)
    said = [line for line in err.splitlines() if "went away during the run" in line]
    assert lost.returncode == 1 and len(said) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # the same command again, nothing up: an embedded cluster, resumed where it stopped; to
    # two epochs past the last one committed, not the 30 (a resume may change max_epochs),
    # which took most of this test's time
    done = max(
        json.loads((c / META_FILE).read_text())["epoch"]
        for c in (tmp_path / "runs" / "up-lost").glob("checkpoint_*")
        if (c / META_FILE).is_file()
    )
    assert done < 28, done  # the cluster went away mid-run
    again = _raytrain(env, tmp_path, *cmd[3:-2], f"trainer.max_epochs={done + 2}", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["resumed_from"]


def _wait_for_checkpoints(run_dir: Path, count: int, proc: subprocess.Popen) -> None:
    """Until ``run_dir`` holds ``count`` checkpoint folders (the first is then committed);
    fails if the run ends first."""
    while proc.poll() is None:
        if run_dir.is_dir() and len(list(run_dir.glob("checkpoint_*"))) >= count:
            return
        time.sleep(0.2)  # polling a folder: the run gives no other signal
    raise AssertionError(f"the run ended (exit {proc.returncode}) before its checkpoints")
