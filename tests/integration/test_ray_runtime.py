"""An embedded Ray started by ``start_local`` gives its processes raytrain's variables, and
``shutdown`` leaves the caller's environment as it found it.

The cluster is started in a subprocess (as a pipeline would), so the session's cluster is not
touched and the environment compared is that of a process that never had Ray in it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

_PIPELINE = r"""
import json, os
os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "1.5"  # the caller's own choice
import ray  # (its import sets RAY_CLIENT_MODE; start_local's own import would be undone)
from raytrain.driver.ray_runtime import start_local

before = dict(os.environ)
handle = start_local(1)
keys = %r

@ray.remote(num_cpus=1)
def seen(keys):
    return {k: os.environ.get(k) for k in keys}

worker = ray.get(seen.remote(keys))
driver = {k: os.environ.get(k) for k in keys}
handle.shutdown()
handle.shutdown()  # a second shutdown changes nothing
after = dict(os.environ)
changed = {k: [before.get(k), after.get(k)] for k in set(before) | set(after)
           if before.get(k) != after.get(k)}
print("RESULT" + json.dumps({"worker": worker, "driver": driver, "changed": changed}))
"""

# What raytrain gives an embedded cluster's processes (ray_runtime.EMBEDDED_ENV), written out
# so that a change to it is a decision this test sees.
EMBEDDED = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_worker_niceness": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
}


def test_start_local_leaves_the_environment_as_it_found_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PIPELINE % sorted(EMBEDDED)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    result = json.loads(line.removeprefix("RESULT"))
    expected = {**EMBEDDED, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1.5"}
    # while the cluster runs, its workers and the driver have raytrain's variables (the
    # caller's own value wins) ...
    assert result["worker"] == expected
    assert result["driver"] == expected
    # ... and after shutdown nothing that start_local or ray.init set or changed remains
    assert result["changed"] == {}
