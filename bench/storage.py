"""Object storage throughput: raytrain's data ingest and checkpoint upload beside raw pyarrow.

Against a real S3 API server on loopback (``moto_server``, as the integration tests use),
in one run:

- ingest: a Parquet dataset of ``--ingest-mb`` MB (32 files; a 128-float feature column
  and a label) read through raytrain's streamed path: the footers read as the driver does
  (``parquet_stream.row_groups``), then 2 ranks' ``ParquetStream`` (each its block of the
  epoch's order, with the column projection), each consumed by its own thread as torch
  batches (what 2 training workers do); unshuffled, unshuffled with the footers read
  already (a later epoch: the driver reads them once a run), and shuffled in 4096-row
  windows.
  Beside them a raw ``pyarrow.dataset`` read of the same files into numpy, and the path
  streamed sets took before, Ray Data's reader and ``streaming_split`` into 2 shards
  (still the path of images, CSV, JSON and ``data.preprocess``). Rows/s, MB/s of file
  bytes, ratios.
- checkpoint upload: a folder holding one ``--ckpt-mb`` MB file (a checkpoint), uploaded the
  way raytrain's checkpoints are (Ray Train's copy into the run's storage, with the
  filesystem raytrain builds) beside a plain ``pyarrow.fs.copy_files`` of the same folder to
  the same server. MB/s and ratio.
- training blocked per checkpoint: two real 2-worker runs of a model whose checkpoint is
  ``--ckpt-mb`` MB, checkpoint storage on the server, with ``checkpoint.upload: sync`` and
  ``async``; the seconds each checkpoint held training up (``checkpoint_blocked_s``, which
  raytrain reports), median over the run's checkpoints.

Figures are medians over ``--reps``; the sides take turns within each repetition. The server
runs on the same 2 cores as the client, so these compare the work each path does per byte,
not a network.

    python -m bench.storage [--reps 3] [--ingest-mb 512] [--ckpt-mb 200] [--ray-cpus N]
                            [--ingest-only] [--out FILE.json]

``--ray-cpus`` gives the local Ray that many logical CPUs (default: what a 2-worker run
gets); ``--ingest-only`` skips the checkpoint figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.s3_server import S3_ENV, moto_server, s3_client  # noqa: E402

BUCKET = "raytrain-bench"
FEATURES = 128
FILES = 32
BATCH = 1024


def _filesystem(endpoint: str):
    from raytrain import storage
    from raytrain.spec import StorageSpec

    options = StorageSpec(s3={"endpoint_url": endpoint, "region": "us-east-1"})
    return storage.filesystem(f"s3://{BUCKET}", options)[0], options


def write_ingest_data(fs, mb: int) -> tuple[str, int, int]:
    """``mb`` MB of Parquet in ``FILES`` files under ``s3://BUCKET/ingest``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.dataset as pads
    import pyarrow.fs as pafs

    rows = mb * 2**20 // (FEATURES * 4 + 8) // 2 * 2  # even: 2 equal shards hold every row
    per_file = -(-rows // FILES)
    rng = np.random.default_rng(0)

    def batches():
        for start in range(0, rows, per_file):
            n = min(per_file, rows - start)
            x = rng.standard_normal((n, FEATURES), dtype=np.float32)
            yield pa.record_batch(
                {
                    "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES),
                    "label": pa.array(rng.integers(0, 10, n)),
                }
            )

    schema = next(batches()).schema
    pads.write_dataset(
        pads.dataset(pa.Table.from_batches(list(batches()), schema)),
        f"{BUCKET}/ingest",
        filesystem=fs,
        format="parquet",
        max_rows_per_file=per_file,
        max_rows_per_group=per_file,
        file_options=pads.ParquetFileFormat().make_write_options(use_dictionary=False),
    )
    infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/ingest"))
    return f"{BUCKET}/ingest", rows, sum(i.size for i in infos)


def ingest_raw(fs, path: str) -> int:
    """A plain pyarrow.dataset read of every file into numpy arrays; returns the rows."""
    import pyarrow.dataset as pads

    table = pads.dataset(path, filesystem=fs, format="parquet").to_table(columns=["x", "label"])
    x = table.column("x").combine_chunks().values.to_numpy().reshape(-1, FEATURES)
    label = table.column("label").to_numpy()
    assert len(x) == len(label)
    return len(label)


def stream_plan(options, path: str):
    """The driver's read of the footers: the split's row groups."""
    from raytrain import storage
    from raytrain.data.parquet_stream import row_groups

    fs, where = storage.filesystem(f"s3://{path}", options)
    return row_groups(f"s3://{path}", fs, where)


def ingest_raytrain(options, path: str, seed: int | None = None, found=None) -> int:
    """raytrain's streamed path: the footers read (unless ``found`` is given: a later
    epoch), then 2 ranks' ``ParquetStream`` consumed as torch batches, each by its own
    thread."""
    from raytrain import storage
    from raytrain.data.parquet_stream import ParquetStream

    fs, _ = storage.filesystem(f"s3://{path}", options)
    found = found or stream_plan(options, path)
    ranks = [
        ParquetStream(
            found,
            fs,
            ["x", "label"],
            BATCH,
            rank=r,
            world_size=2,
            shuffle_seed=seed,
            window_rows=4096,
        )
        for r in (0, 1)
    ]
    return _consume(ranks)


def ingest_ray_data(options, path: str) -> int:
    """The Ray Data path: Ray Data reads, 2 shards consumed as torch batches."""
    from raytrain.data.loaders import ShardBatches
    from raytrain.data.sources import read_source
    from raytrain.spec import SourceSpec

    ds = read_source(SourceSpec(uri=f"s3://{path}"), ["x", "label"], options)
    shards = ds.streaming_split(2, equal=True)
    return _consume([ShardBatches(shards[rank], BATCH, rank=rank) for rank in (0, 1)])


def _consume(ranks: list) -> int:
    """Iterate each rank's batches in a thread of its own; the rows they held."""
    counts = [0] * len(ranks)

    def consume(rank: int) -> None:
        for batch in ranks[rank]:
            counts[rank] += len(batch["label"])

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def upload_copy_files(fs, local: str, dest: str) -> None:
    import pyarrow.fs as pafs

    pafs.copy_files(
        local, dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs
    )


def upload_raytrain(fs, local: str, dest: str) -> None:
    """How Ray Train persists a reported checkpoint folder into raytrain's storage."""
    from ray.train.v2._internal.execution.storage import _pyarrow_fs_copy_files

    _pyarrow_fs_copy_files(local, dest, destination_filesystem=fs)


def blocked_per_checkpoint(endpoint: str, work: Path, mode: str, ckpt_mb: int) -> float:
    """A real run with ``checkpoint.upload: mode``: median seconds a checkpoint blocked it."""
    from mlflow.tracking import MlflowClient

    import raytrain

    spec = {
        "name": f"blocked-{mode}",
        "model": {
            "class_path": "bench.models:BigCheckpointCNN",
            "init_args": {"state_mb": ckpt_mb},
        },
        "data": {
            "train": {"uri": str(work / "digits" / "train")},
            "val": {"uri": str(work / "digits" / "val")},
            "columns": ["pixels", "label"],
            "batch_size": 32,
            "prepare": "raytrain.datasets.digits:write_splits",
        },
        "trainer": {"max_epochs": 4, "log_every_n_steps": 5},
        "checkpoint": {"storage": f"s3://{BUCKET}/runs", "keep": 1, "upload": mode},
        "storage": {"s3": {"endpoint_url": endpoint, "region": "us-east-1"}},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}},
    }
    result = raytrain.fit(spec, fresh=True, progress=False)
    history = MlflowClient(result.tracking_uri).get_metric_history(
        result.mlflow_run_id, "checkpoint_blocked_s"
    )
    return statistics.median(m.value for m in history)


def _timed(fn, *args) -> tuple[float, object]:
    began = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - began, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ingest-mb", type=int, default=512)
    parser.add_argument("--ckpt-mb", type=int, default=200)
    parser.add_argument("--ray-cpus", type=int, default=None)
    parser.add_argument("--ingest-only", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "storage.json"))
    args = parser.parse_args()

    os.environ.update(S3_ENV)  # before Ray starts: its workers inherit the credentials
    with tempfile.TemporaryDirectory() as tmp, moto_server(Path(tmp) / "moto.log") as endpoint:
        work = Path(tmp)
        s3_client(endpoint).create_bucket(Bucket=BUCKET)
        fs, options = _filesystem(endpoint)
        from raytrain.driver.ray_runtime import DATA_CPUS, start_local

        # sized as raytrain sizes a 2-worker run, unless told
        ray_handle = start_local(args.ray_cpus or 2 + DATA_CPUS)
        path, rows, nbytes = write_ingest_data(fs, args.ingest_mb)
        ckpt = work / "ckpt"
        ckpt.mkdir()
        (ckpt / "checkpoint.ckpt").write_bytes(os.urandom(args.ckpt_mb * 2**20))
        ckpt_bytes = args.ckpt_mb * 2**20
        plan = stream_plan(options, path)
        ingest = {
            "raw": lambda: ingest_raw(fs, path),
            "raytrain": lambda: ingest_raytrain(options, path),
            "raytrain_epoch": lambda: ingest_raytrain(options, path, found=plan),
            "raytrain_shuffled": lambda: ingest_raytrain(options, path, seed=0),
            "ray_data": lambda: ingest_ray_data(options, path),
        }
        uploads = () if args.ingest_only else ("copy_files", "upload")
        runs: dict[str, list[float]] = {k: [] for k in (*ingest, *uploads)}
        for rep in range(args.reps):
            sides = list(ingest)
            for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:  # take turns
                seconds, got = _timed(ingest[side])
                assert got == rows, (side, got, rows)
                runs[side].append(seconds)
            for side in uploads if rep % 2 == 0 else uploads[::-1]:
                dest = f"{BUCKET}/ckpt-{side}-{rep}"
                fn = upload_copy_files if side == "copy_files" else upload_raytrain
                seconds, _ = _timed(fn, fs, str(ckpt), dest)
                assert fs.get_file_info(f"{dest}/checkpoint.ckpt").size == ckpt_bytes
                fs.delete_dir(dest)
                runs[side].append(seconds)
            print(
                f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()),
                file=sys.stderr,
                flush=True,
            )
        ray_handle.shutdown()
        blocked = (
            {}
            if args.ingest_only
            else {
                mode: blocked_per_checkpoint(endpoint, work, mode, args.ckpt_mb)
                for mode in ("sync", "async")
            }
        )

    med = {k: statistics.median(v) for k, v in runs.items()}
    mb = nbytes / 1e6
    table = {
        "ingest rows/s": (rows / med["raytrain"], rows / med["raw"]),
        "ingest MB/s": (mb / med["raytrain"], mb / med["raw"]),
        "ingest rows/s, footers read already": (rows / med["raytrain_epoch"], rows / med["raw"]),
        "ingest rows/s, shuffled": (rows / med["raytrain_shuffled"], rows / med["raw"]),
        "ingest rows/s, Ray Data path": (rows / med["ray_data"], rows / med["raw"]),
    }
    if not args.ingest_only:
        table["checkpoint upload MB/s"] = (
            ckpt_bytes / 1e6 / med["upload"],
            ckpt_bytes / 1e6 / med["copy_files"],
        )
    title = f"figure (median of {args.reps})"
    header = f"{title:<34} {'raytrain':>12} {'baseline':>12} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for name, (ours, base) in table.items():
        print(f"{name:<34} {ours:>12,.1f} {base:>12,.1f} {ours / base:>7.2f}")
    for mode, seconds in blocked.items():
        print(f"{'training blocked per ckpt, ' + mode + ' (s)':<34} {seconds:>12.2f}")
    print(
        f"ingest: {rows:,} rows, {mb:,.0f} MB in {FILES} files; baseline: pyarrow.dataset "
        f"to numpy. checkpoint: {ckpt_bytes / 1e6:,.0f} MB; baseline: pyarrow.fs.copy_files"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "reps": args.reps,
                "ray_cpus": args.ray_cpus or 2 + DATA_CPUS,
                "rows": rows,
                "ingest_bytes": nbytes,
                "checkpoint_bytes": ckpt_bytes,
                "seconds": runs,
                "table": {
                    k: {"raytrain": a, "baseline": b, "ratio": a / b} for k, (a, b) in table.items()
                },
                "blocked_per_checkpoint_s": blocked,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
