"""Image, CSV and JSON ingest: raytrain's per-rank paths beside what a user would write.

In one run, on generated files (nothing downloaded):

- images: ``--images`` JPEGs (64x64 RGB, 10 class folders), local and on a real S3 API
  server on loopback (``moto_server``, as the integration tests use). raytrain's path (the
  folder listed as the driver does, ``image_files.list_images``, then one rank's
  ``ImageStream`` over all of it, ``--workers`` decoding processes) against a plain
  ``torch.utils.data.DataLoader`` over the same files with the same number of worker
  processes (an ``ImageFolder``-like dataset: sorted files, Pillow decode, a tensor each,
  the default collate, shuffled), and the Ray Data path (``read_images`` and
  ``iter_torch_batches``) that images took before. Decoded to tensors, no model; an epoch
  after a first one, so every side's processes have started (the first epochs' times are
  kept in the JSON too).
- packed images: the same folders packed once by ``raytrain pack`` (timed apart; 64 MB
  shards), read by one rank's ``PackedImageStream`` with the same decoding processes.
- CSV and JSON Lines: ``--table-mb`` MB of rows (16 float columns and a label) in 8 files.
  raytrain's path (the blocks planned as the driver does, ``text_blocks.plan_text``, timed
  apart, then one rank's ``ParquetStream`` of an epoch as torch batches) against pyarrow's
  own readers (``pyarrow.csv.read_csv`` / ``pyarrow.json.read_json`` of every file, with
  their threads, cut into the same torch batches).

Medians of ``--reps``; the sides take turns within each repetition.

    python -m bench.formats [--reps 3] [--images 3000] [--workers 2] [--table-mb 64]
                            [--local-only] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.s3_server import S3_ENV, moto_server, s3_client  # noqa: E402

BUCKET = "raytrain-bench"
BATCH = 64
TABLE_BATCH = 1024
COLUMNS = 16


def write_images(root: Path, n: int) -> None:
    """``n`` 64x64 RGB JPEGs (smooth noise, so they compress as photos do) in 10 folders."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class-{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((64, 64), Image.Resampling.BILINEAR)
        image.save(folder / f"{i:06d}.jpg", quality=90)


class PlainImages:
    """What a user writes for a DataLoader: a sorted listing, one Pillow decode an item."""

    def __init__(self, fs, files: list[str], labels: list[int]):
        self.fs, self.files, self.labels = fs, files, labels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import io

        import numpy as np
        import torch
        from PIL import Image

        with self.fs.open_input_stream(self.files[i]) as handle:
            data = handle.read()
        pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        return torch.from_numpy(pixels.copy()), self.labels[i]


def dataloader_epochs(fs, images, workers: int) -> list[float]:
    """Seconds of two epochs of a plain shuffled DataLoader (persistent workers)."""
    import torch
    from torch.utils.data import DataLoader

    data = PlainImages(fs, list(images.files), list(images.labels))
    loader = DataLoader(
        data,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
        generator=torch.Generator().manual_seed(0),
    )
    return [_epoch(loader, images.num_rows) for _ in range(2)]


def raytrain_epochs(fs, images, workers: int) -> list[float]:
    """Seconds of two epochs of one rank's ``ImageStream`` over the whole folder."""
    from raytrain.data.image_stream import ImageFiles, ImageStream

    stream = ImageStream(
        ImageFiles(images, fs, None, "RGB"),
        BATCH,
        rank=0,
        world_size=1,
        shuffle_seed=0,
        num_workers=workers,
    )
    out = []
    for epoch in range(2):
        stream.epoch = epoch
        out.append(_epoch(stream, images.num_rows))
    return out


def packed_epochs(fs, uri: str, workers: int, n: int) -> list[float]:
    """Seconds of two epochs of one rank's ``PackedImageStream`` over the packed folder."""
    from raytrain.data.image_stream import ImageFiles, PackedImageStream
    from raytrain.data.sources import image_plan
    from raytrain.spec import SourceSpec

    options = _OPTIONS.get(uri.split("://")[0])
    found = image_plan(SourceSpec(uri=uri, format="images"), options, "error")
    stream = PackedImageStream(
        found,
        fs,
        ImageFiles(None, fs, None, "RGB"),
        BATCH,
        rank=0,
        world_size=1,
        shuffle_seed=0,
        window_rows=4096,
        num_workers=workers,
    )
    out = []
    for epoch in range(2):
        stream.epoch = epoch
        out.append(_epoch(stream, n))
    return out


_OPTIONS: dict[str, object] = {}  # the S3 options, by scheme, once the server is up


def ray_data_epochs(uri: str, options, n: int) -> list[float]:
    """Seconds of two epochs of the Ray Data path (``read_images``, torch batches)."""
    from raytrain.data.sources import read_source
    from raytrain.spec import SourceSpec

    ds = read_source(SourceSpec(uri=uri, format="images", image_mode="RGB"), None, options)
    out = []
    for _ in range(2):
        began = time.perf_counter()
        got = sum(len(b["image"]) for b in ds.iter_torch_batches(batch_size=BATCH))
        assert got == n, got
        out.append(time.perf_counter() - began)
    return out


def _epoch(batches, n: int) -> float:
    began = time.perf_counter()
    got = 0
    for batch in batches:
        got += len(batch["image"] if isinstance(batch, dict) else batch[0])
    assert got == n, (got, n)
    return time.perf_counter() - began


def write_tables(root: Path, mb: int) -> tuple[Path, Path, int]:
    """``mb`` MB of CSV (and the same rows as JSON Lines) in 8 files each."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv

    rows = mb * 2**20 // (COLUMNS * 11 + 3)
    rng = np.random.default_rng(0)
    csv, jsonl = root / "csv", root / "json"
    csv.mkdir()
    jsonl.mkdir()
    per = -(-rows // 8)
    for f in range(8):
        n = min(per, rows - f * per)
        table = pa.table(
            {
                **{f"f{c}": rng.random(n).astype(np.float32) for c in range(COLUMNS)},
                "label": rng.integers(0, 10, n),
            }
        )
        pacsv.write_csv(table, csv / f"part-{f}.csv")
        with open(jsonl / f"part-{f}.json", "w") as handle:
            for row in table.to_pylist():
                handle.write(json.dumps(row) + "\n")
    return csv, jsonl, rows


def pyarrow_epoch(folder: Path, fmt: str, rows: int) -> float:
    """pyarrow's own reader over every file, cut into torch batches."""
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    from ray.data.util.torch_utils import arrow_batch_to_tensors

    began = time.perf_counter()
    got = 0
    for path in sorted(folder.iterdir()):
        table = pacsv.read_csv(path) if fmt == "csv" else pajson.read_json(path)
        for start in range(0, table.num_rows, TABLE_BATCH):
            batch = arrow_batch_to_tensors(table.slice(start, TABLE_BATCH), combine_chunks=True)
            got += len(batch["label"])
    assert got == rows, (got, rows)
    return time.perf_counter() - began


def raytrain_table_epoch(found, fmt: str, rows: int) -> float:
    """One rank's ``ParquetStream`` over the planned blocks, an epoch of torch batches."""
    import pyarrow.fs as pafs

    from raytrain.data.parquet_stream import ParquetStream

    stream = ParquetStream(found, pafs.LocalFileSystem(), None, TABLE_BATCH, rank=0, world_size=1)
    began = time.perf_counter()
    got = sum(len(b["label"]) for b in stream)
    assert got == rows, (got, rows)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--table-mb", type=int, default=64)
    parser.add_argument(
        "--local-only",
        action="store_true",
        help="images on local disk only (longer local epochs, no S3 sides)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "formats.json"))
    args = parser.parse_args()

    import pyarrow.fs as pafs

    from raytrain import storage
    from raytrain.data import text_blocks
    from raytrain.data.image_files import list_images
    from raytrain.driver.ray_runtime import DATA_CPUS, start_local
    from raytrain.spec import StorageSpec

    os.environ.update(S3_ENV)
    runs: dict[str, list[float]] = {}
    firsts: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, moto_server(Path(tmp) / "moto.log") as endpoint:
        work = Path(tmp)
        write_images(work / "images", args.images)
        s3_client(endpoint).create_bucket(Bucket=BUCKET)
        options = StorageSpec(s3={"endpoint_url": endpoint, "region": "us-east-1"})
        s3, _ = storage.filesystem(f"s3://{BUCKET}", options)
        local = pafs.LocalFileSystem()
        sets = {"local": (local, str(work / "images"), str(work / "images"))}
        if not args.local_only:
            pafs.copy_files(
                str(work / "images"),
                f"{BUCKET}/images",
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=s3,
            )
            sets["s3"] = (s3, f"s3://{BUCKET}/images", f"{BUCKET}/images")
        listed = {k: list_images(uri, fs, path, check=False) for k, (fs, uri, path) in sets.items()}
        _OPTIONS["s3"] = options
        from raytrain.data.pack import pack

        packed = {"local": str(work / "packed"), "s3": f"s3://{BUCKET}/packed"}
        for where, (_, uri, _) in sets.items():
            began = time.perf_counter()
            pack(uri, packed[where], "images", 64, options, out=open(os.devnull, "w"))  # noqa: SIM115
            runs[f"images {where}: pack (once)"] = [time.perf_counter() - began]
        ray_handle = start_local(2 + DATA_CPUS)
        sides: dict[str, Callable[[], list[float]]] = {}
        for where, (fs, uri, _) in sets.items():
            images, w = listed[where], args.workers
            s3_options = options if uri.startswith("s3") else None
            sides |= {
                f"images {where}: raytrain": partial(raytrain_epochs, fs, images, w),
                f"images {where}: DataLoader": partial(dataloader_epochs, fs, images, w),
                f"images {where}: packed": partial(
                    packed_epochs, fs, packed[where], w, images.num_rows
                ),
                f"images {where}: Ray Data": partial(
                    ray_data_epochs, uri, s3_options, images.num_rows
                ),
            }
        csv, jsonl, rows = write_tables(work, args.table_mb)
        plans = {}
        for fmt, folder in (("csv", csv), ("json", jsonl)):
            began = time.perf_counter()
            plans[fmt] = text_blocks.plan_text(str(folder), local, str(folder), fmt)
            runs[f"{fmt}: raytrain plan (driver, once a run)"] = [time.perf_counter() - began]
            sides[f"{fmt}: raytrain"] = lambda f=fmt: [raytrain_table_epoch(plans[f], f, rows)]
            sides[f"{fmt}: pyarrow"] = lambda f=fmt, d=folder: [pyarrow_epoch(d, f, rows)]
        names = list(sides)
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                times = sides[name]()
                runs.setdefault(name, []).append(times[-1])
                firsts.setdefault(name, []).append(times[0])
            print(
                f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()),
                file=sys.stderr,
                flush=True,
            )
        ray_handle.shutdown()

    med = {k: statistics.median(v) for k, v in runs.items()}
    counts = {"images": args.images, "csv": rows, "json": rows}
    rows_out = []
    for name in names:
        if name.endswith(("DataLoader", "pyarrow")):
            continue
        what = name.split(":")[0]
        base = f"{what}: DataLoader" if what.startswith("images") else f"{what}: pyarrow"
        n = counts[what.split()[0]]
        rows_out.append((name, n / med[name], n / med[base]))
    header = f"{'per second (median of ' + str(args.reps) + ')':<30} {'raytrain':>12} {'baseline':>12} {'ratio':>7}"  # noqa: E501
    print(header)
    print("-" * len(header))
    for name, ours, base in rows_out:
        print(f"{name:<30} {ours:>12,.0f} {base:>12,.0f} {ours / base:>7.2f}")
    for where in [w for w in ("local", "s3") if f"images {w}: pack (once)" in med]:
        print(
            f"images {where}: `raytrain pack` of the folder (once): "
            f"{med[f'images {where}: pack (once)']:.2f} s"
        )
    for fmt in ("csv", "json"):
        print(
            f"{fmt}: the driver's plan (a parse of every block, once a run): "
            f"{med[f'{fmt}: raytrain plan (driver, once a run)']:.2f} s"
        )
    print(
        f"images: {args.images} JPEGs 64x64, {args.workers} decoding processes a side; "
        f"csv/json: {rows:,} rows x {COLUMNS + 1} columns, {args.table_mb} MB of CSV"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "reps": args.reps,
                "workers": args.workers,
                "seconds": runs,
                "first_epoch_seconds": firsts,
                "table": {
                    n: {"raytrain": a, "baseline": b, "ratio": a / b} for n, a, b in rows_out
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
