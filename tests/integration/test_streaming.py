"""A train set larger than the whole object store streams (each rank reading its part of
the files) and trains to the end.

The run gets its own Ray (in a subprocess, as a pipeline would: ``start_local`` with a
deliberately small ``object_store_memory``, then ``raytrain.fit``), so the session's cluster
is not resized. That pipeline also shows what ``start_local`` does to its environment: the
cluster's processes get raytrain's variables, and ``shutdown`` leaves the caller's
environment as it found it (compared in a process that never had Ray in it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import write_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
OBJECT_STORE = 80 * 2**20  # just over Ray's minimum (75 MiB)
# 24,000 rows of 4 KiB: 98 MB, over the 84 MB store
FEATURES, ROWS, FILES, BATCH, EPOCHS = 1024, 24_000, 8, 500, 2

_DRIVER = r"""
import json, os, sys
os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "1.5"  # the caller's own choice
import ray  # (its import sets RAY_CLIENT_MODE; start_local's own import would be undone)
import raytrain
from raytrain.driver.ray_runtime import start_local

keys = json.loads(sys.argv[3])
before = dict(os.environ)
handle = start_local(4, object_store_memory=int(sys.argv[2]))

@ray.remote(num_cpus=1)
def seen(keys):
    return {k: os.environ.get(k) for k in keys}

try:
    env = {"worker": ray.get(seen.remote(keys)), "driver": {k: os.environ.get(k) for k in keys}}
    result = raytrain.fit(sys.argv[1], progress=False)
    out = {"metrics": result.metrics, "data_paths": result.data_paths,
           "store": ray.cluster_resources()["object_store_memory"], **env}
finally:
    handle.shutdown()
handle.shutdown()  # a second shutdown changes nothing
after = dict(os.environ)
out["changed"] = {k: [before.get(k), after.get(k)] for k in set(before) | set(after)
                  if before.get(k) != after.get(k)}
print(json.dumps(out))
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


def _write_wide(path: Path) -> int:
    """FILES Parquet files of ROWS rows of FEATURES float32s (incompressible); their bytes."""
    path.mkdir()
    rng = np.random.default_rng(0)
    per_file = ROWS // FILES
    for i in range(FILES):
        x = rng.standard_normal((per_file, FEATURES), dtype=np.float32)
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES),
                "y": pa.array((x[:, 0] > 0).astype(np.int64)),
            }
        )
        pq.write_table(table, path / f"part-{i}.parquet", compression="none")
    return sum(f.stat().st_size for f in path.iterdir())


def test_train_set_larger_than_the_object_store_streams_to_the_end(
    tmp_path: Path, clean_env: None
) -> None:
    nbytes = _write_wide(tmp_path / "wide")
    assert nbytes > OBJECT_STORE
    spec = {
        "name": "wide",
        "model": {
            "class_path": "tests.integration.models:WideLinear",
            "init_args": {"features": FEATURES},
        },
        "data": {
            "train": {"uri": str(tmp_path / "wide")},
            "columns": ["x", "y"],
            "batch_size": BATCH,
        },
        "scaling": {"num_workers": 2},
        "trainer": {"max_epochs": EPOCHS, "log_every_n_steps": 10, "precision": "32-true"},
        "checkpoint": {"storage": str(tmp_path / "runs")},
        "tracking": {
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "log_model": False}
        },
    }
    path = write_spec(tmp_path / "wide.yaml", spec)
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(path), str(OBJECT_STORE), json.dumps(sorted(EMBEDDED))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["store"] < nbytes  # the whole set never fit in the object store at once
    assert out["data_paths"] == {"train": "streamed"}
    # every epoch ran to its end: 2 ranks' parts of ROWS rows in batches of BATCH
    assert out["metrics"]["epoch"] == EPOCHS - 1
    assert out["metrics"]["step"] == EPOCHS * (ROWS // 2 // BATCH)

    expected = {**EMBEDDED, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1.5"}
    # while the cluster runs, its workers and the driver have raytrain's variables (the
    # caller's own value wins) ...
    assert out["worker"] == expected
    assert out["driver"] == expected
    # ... and after shutdown nothing that start_local or ray.init set or changed remains
    assert out["changed"] == {}
