"""pyarrow's native S3 filesystem beside s3fs (fsspec): dataset read, folder upload, listing.

raytrain reads its Parquet data and writes its checkpoints through ``pyarrow.fs``; on S3
that can be pyarrow's own ``S3FileSystem`` (C++, AWS SDK) or s3fs wrapped as
``PyFileSystem(FSSpecHandler(s3fs.S3FileSystem(...)))``. This measures what the choice costs,
both filesystems on the same real S3 API server (``moto_server`` on loopback, the one the
integration tests use) in the same run:

- read: a Parquet dataset (``--mb`` MB in 20 files of 16 random float32 columns) through
  ``pyarrow.dataset.dataset(...).to_table()``, all columns and a 2-column projection;
  MB/s of the file bytes (of the column chunks read, for the projection) and rows/s.
- write: a local folder holding one ``--mb`` MB file (like a checkpoint) uploaded with
  ``pyarrow.fs.copy_files``, and for s3fs also with its own ``put(recursive=True)``; MB/s.
  The write is also run with upload checksums off (``request_checksum_calculation`` =
  ``when_required``): by default pyarrow's AWS SDK streams each part as an aws-chunked body
  with a CRC64 trailer, which moto_server decodes in Python, so its default write measures
  the server more than the client.
- list: ``get_file_info(FileSelector(prefix, recursive=True))`` over 1000 small objects; ms.

Each figure is a median over ``--reps`` repetitions; within a repetition the filesystems take
turns on each operation, in an order that alternates from one repetition to the next. Both
are given the endpoint and credentials explicitly; whether each would find the endpoint in
``AWS_ENDPOINT_URL`` by itself is checked and reported separately. The server runs on the
same machine as the client, so the figures are an upper bound on client overhead, not
network throughput: what they compare is the work each client does per byte and per request.
The machine is shared by client and server, so each operation's CPU seconds are reported too:
the client's (this process, all threads) and the server's.

    python -m bench.s3_filesystems [--reps 3] [--mb 200] [--out FILE.json]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.dataset as ds  # noqa: E402
import pyarrow.fs as pafs  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import s3fs  # noqa: E402

from tests.integration.s3_server import S3_ENV, moto_server  # noqa: E402

BUCKET = "bench"
DATA = f"{BUCKET}/data"  # the Parquet dataset, uploaded once
MANY = f"{BUCKET}/many"  # the small objects listed, uploaded once
FILES, COLUMNS, PROJECTION = 20, 16, ["c00", "c01"]
LIST_DIRS, LIST_PER_DIR = 10, 100
MB = 1_000_000
# The AWS SDKs' default since 2025 is a checksum on every upload; pyarrow's SDK streams it as
# an aws-chunked body with a trailer, s3fs's botocore as a header. "when_required" is the old
# behaviour: pyarrow takes it only from the environment, s3fs from its botocore config.
NO_CHECKSUM = "when_required"

# table rows: (label, unit, operation, its pyarrow side, its s3fs side, what the unit counts)
ROWS = [
    ("read 16 columns", "MB/s", "read", "pyarrow", "s3fs", "bytes"),
    ("read 16 columns", "Mrows/s", "read", "pyarrow", "s3fs", "rows"),
    (
        "read 2 columns (column chunks)",
        "MB/s",
        "read_projection",
        "pyarrow",
        "s3fs",
        "projected_bytes",
    ),
    ("read 2 columns", "Mrows/s", "read_projection", "pyarrow", "s3fs", "rows"),
    ("write, copy_files", "MB/s", "write", "pyarrow", "s3fs", "file_bytes"),
    ("write, s3fs put (pyarrow copy_files)", "MB/s", "write", "pyarrow", "s3fs put", "file_bytes"),
    (
        "write, copy_files, no checksum",
        "MB/s",
        "write_no_checksum",
        "pyarrow",
        "s3fs",
        "file_bytes",
    ),
    (
        "write, s3fs put, no checksum",
        "MB/s",
        "write_no_checksum",
        "pyarrow",
        "s3fs put",
        "file_bytes",
    ),
    (f"list {LIST_DIRS * LIST_PER_DIR} objects", "ms", "list", "pyarrow", "s3fs", "ms"),
]


def make_filesystems(endpoint: str, checksum: str | None = None) -> dict[str, tuple]:
    """Each side's ``pyarrow.fs`` filesystem and native object, defaults kept but checksum."""
    key, secret = S3_ENV["AWS_ACCESS_KEY_ID"], S3_ENV["AWS_SECRET_ACCESS_KEY"]
    region = S3_ENV["AWS_DEFAULT_REGION"]
    if checksum:  # the SDK reads it when the client is made
        os.environ["AWS_REQUEST_CHECKSUM_CALCULATION"] = checksum
    try:
        native = pafs.S3FileSystem(
            access_key=key,
            secret_key=secret,
            region=region,
            endpoint_override=endpoint,
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )
    finally:
        os.environ.pop("AWS_REQUEST_CHECKSUM_CALCULATION", None)
    config = {"request_checksum_calculation": checksum} if checksum else {}
    s3 = s3fs.S3FileSystem(
        key=key,
        secret=secret,
        endpoint_url=endpoint,
        config_kwargs=config,
        client_kwargs={"region_name": region},
        skip_instance_cache=True,
    )
    return {"pyarrow": (native, native), "s3fs": (pafs.PyFileSystem(pafs.FSSpecHandler(s3)), s3)}


def endpoint_from_env(endpoint: str) -> dict[str, str]:
    """Whether each client, given no endpoint, finds the server through AWS_ENDPOINT_URL."""
    probe = f"{DATA}/part-000.parquet"
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    checks: dict[str, Callable[[], pafs.FileInfo | dict]] = {
        "pyarrow.fs.S3FileSystem()": lambda: pafs.S3FileSystem(
            connect_timeout=2, request_timeout=2
        ).get_file_info(probe),
        "pyarrow.fs.FileSystem.from_uri('s3://...')": lambda: pafs.FileSystem.from_uri(
            f"s3://{probe}"
        )[0].get_file_info(probe),
        "s3fs.S3FileSystem()": lambda: s3fs.S3FileSystem(skip_instance_cache=True).info(probe),
    }
    found = {}
    try:
        for name, check in checks.items():
            try:
                info = check()
                ok = info.type == pafs.FileType.File if isinstance(info, pafs.FileInfo) else True
                found[name] = "finds the server" if ok else f"does not: {info}"
            except Exception as exc:  # any failure to reach it is the finding
                found[name] = f"does not: {str(exc).split('AWS Error ')[-1][:90]}"
    finally:
        del os.environ["AWS_ENDPOINT_URL"]
    return found


def write_dataset(local: Path, mb: int) -> dict[str, int]:
    """``FILES`` Parquet files of ``COLUMNS`` random float32 columns, ``mb`` MB in all."""
    rng = np.random.default_rng(0)
    rows = mb * MB // (FILES * COLUMNS * 4)
    local.mkdir(parents=True)
    projected = 0
    for i in range(FILES):
        cols = {f"c{c:02d}": rng.random(rows, dtype=np.float32) for c in range(COLUMNS)}
        path = local / f"part-{i:03d}.parquet"
        # dictionary encoding would only grow random floats (by half, before it falls back)
        pq.write_table(pa.table(cols), path, use_dictionary=False)
        meta = pq.ParquetFile(path).metadata
        names = [meta.schema.column(c).name for c in range(meta.num_columns)]
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            projected += sum(group.column(names.index(n)).total_compressed_size for n in PROJECTION)
    files = sorted(local.iterdir())
    return {
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "rows": rows * FILES,
        "projected_bytes": projected,
    }


def server_cpu(endpoint: str) -> Callable[[], float]:
    """CPU seconds used so far by the server process behind ``endpoint`` (0 if not found)."""
    arg = f"-p\0{endpoint.rsplit(':', 1)[1]}\0".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"moto_server" in (cmd := Path(f"/proc/{pid}/cmdline").read_bytes()) and arg in cmd:
                break
        except OSError:
            continue
    else:
        return lambda: 0.0
    tick = os.sysconf("SC_CLK_TCK")

    def used() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    return used


def bench_rep(
    rep: int, fss: dict, dataset: dict, ckpt_dir: Path, server: Callable[[], float]
) -> dict[str, dict[str, dict[str, float]]]:
    """One repetition of every operation: wall, client CPU and server CPU seconds per side."""
    local = pafs.LocalFileSystem()
    native = fss["default"]["pyarrow"][0]

    def fresh(side: str, checksum: str = "default") -> tuple[pafs.FileSystem, object]:
        fs, obj = fss[checksum][side]
        if isinstance(obj, s3fs.S3FileSystem):
            obj.invalidate_cache()  # s3fs keeps listings; each operation starts without them
        return fs, obj

    def read(side: str, columns: list[str] | None) -> Callable[[], Callable[[], object]]:
        def op() -> pa.Table:
            fs = fresh(side)[0]
            return ds.dataset(DATA, filesystem=fs, format="parquet").to_table(columns=columns)

        def check(table: pa.Table) -> None:
            assert table.num_rows == dataset["rows"], (side, table.num_rows)
            assert table.num_columns == len(columns or range(COLUMNS)), (side, table.schema)

        return op, check

    def write(side: str, checksum: str) -> tuple[Callable, Callable]:
        dest = f"{BUCKET}/ckpt-{side.replace(' ', '-')}"
        fs, obj = fresh(side.split()[0], checksum)

        def op() -> None:
            if side == "s3fs put":
                obj.put(str(ckpt_dir), dest, recursive=True)
            else:
                pafs.copy_files(str(ckpt_dir), dest, local, fs)

        def check(_: None) -> None:
            info = native.get_file_info(f"{dest}/checkpoint.ckpt")
            assert info.size == dataset["file_bytes"], (side, info)
            native.delete_dir(dest)  # moto keeps every object in memory

        return op, check

    def listing(side: str) -> tuple[Callable, Callable]:
        fs = fresh(side)[0]

        def check(infos: list[pafs.FileInfo]) -> None:
            files = sum(i.type == pafs.FileType.File for i in infos)
            assert files == LIST_DIRS * LIST_PER_DIR, (side, files)

        return lambda: fs.get_file_info(pafs.FileSelector(MANY, recursive=True)), check

    writers = ("pyarrow", "s3fs", "s3fs put")
    cases: dict[str, dict[str, Callable[[], tuple[Callable, Callable]]]] = {
        "read": {s: (lambda s=s: read(s, None)) for s in ("pyarrow", "s3fs")},
        "read_projection": {s: (lambda s=s: read(s, PROJECTION)) for s in ("pyarrow", "s3fs")},
        "write": {s: (lambda s=s: write(s, "default")) for s in writers},
        "write_no_checksum": {s: (lambda s=s: write(s, NO_CHECKSUM)) for s in writers},
        "list": {s: (lambda s=s: listing(s)) for s in ("pyarrow", "s3fs")},
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    for case, sides in cases.items():
        out[case] = {}
        # alternate the order so neither side always runs first (on a cooler server)
        for side in list(sides) if rep % 2 == 0 else list(sides)[::-1]:
            op, check = sides[side]()
            cpu, srv, wall = time.process_time(), server(), time.perf_counter()
            result = op()
            wall, cpu, srv = time.perf_counter() - wall, time.process_time() - cpu, server() - srv
            check(result)
            del result
            out[case][side] = {"wall_s": wall, "client_cpu_s": cpu, "server_cpu_s": srv}
        shown = {side: round(t["wall_s"], 3) for side, t in out[case].items()}
        print(f"  rep {rep + 1} {case}: {shown} s", file=sys.stderr, flush=True)
    return out


def summarize(runs: list[dict], dataset: dict) -> tuple[dict[str, dict], dict[str, dict]]:
    """The table rows (each side's figure, pyarrow/s3fs throughput ratio) and median seconds."""
    med = {
        case: {
            side: {k: statistics.median(r[case][side][k] for r in runs) for k in times}
            for side, times in sides.items()
        }
        for case, sides in runs[0].items()
    }
    rows = {}
    for label, unit, case, pa_side, s3_side, basis in ROWS:
        secs = {"pyarrow": med[case][pa_side]["wall_s"], "s3fs": med[case][s3_side]["wall_s"]}
        if basis == "ms":
            fig = {s: t * 1000 for s, t in secs.items()}
            ratio = fig["s3fs"] / fig["pyarrow"]  # as throughput: listings per second
        else:
            fig = {s: dataset[basis] / 1e6 / t for s, t in secs.items()}  # MB or Mrows
            ratio = fig["pyarrow"] / fig["s3fs"]
        rows[f"{label} ({unit})"] = {**fig, "ratio": ratio, "sides": [pa_side, s3_side]}
    return rows, med


def _print_tables(rows: dict[str, dict], med: dict[str, dict], reps: int) -> None:
    print(f"\nmedian of {reps}; ratio = pyarrow / s3fs throughput (> 1: pyarrow faster)")
    header = f"{'operation':<46} {'pyarrow':>9} {'s3fs':>9} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        print(f"{name:<46} {row['pyarrow']:>9.1f} {row['s3fs']:>9.1f} {row['ratio']:>7.2f}")
    print(f"\nseconds, median of {reps} (client = this process, all its threads)")
    header = f"{'operation':<20} {'side':<10} {'wall':>7} {'client CPU':>11} {'server CPU':>11}"
    print(header)
    print("-" * len(header))
    for case, sides in med.items():
        for side, t in sides.items():
            print(
                f"{case:<20} {side:<10} {t['wall_s']:>7.2f} {t['client_cpu_s']:>11.2f} "
                f"{t['server_cpu_s']:>11.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mb", type=int, default=200, help="dataset and file size, MB")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "s3_filesystems.json"))
    args = parser.parse_args()

    for name in (
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_PROFILE",
        "AWS_REQUEST_CHECKSUM_CALCULATION",
    ):
        os.environ.pop(name, None)
    os.environ.update(S3_ENV)
    runs = []
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-s3-") as tmp:
        work = Path(tmp)
        dataset = write_dataset(work / "data", args.mb)
        ckpt_dir = work / "ckpt"
        ckpt_dir.mkdir()
        ckpt = ckpt_dir / "checkpoint.ckpt"
        ckpt.write_bytes(np.random.default_rng(1).bytes(args.mb * MB))
        dataset["file_bytes"] = ckpt.stat().st_size
        with moto_server(work / "moto.log") as endpoint:
            fss = {
                "default": make_filesystems(endpoint),
                NO_CHECKSUM: make_filesystems(endpoint, NO_CHECKSUM),
            }
            native = fss["default"]["pyarrow"][0]
            native.create_dir(BUCKET)
            pafs.copy_files(str(work / "data"), DATA, pafs.LocalFileSystem(), native)
            small = {
                f"{MANY}/d{d:02d}/obj-{i:04d}": b"x" * 100
                for d in range(LIST_DIRS)
                for i in range(LIST_PER_DIR)
            }
            fss["default"]["s3fs"][1].pipe(small)
            env_check = endpoint_from_env(endpoint)
            server = server_cpu(endpoint)
            for rep in range(args.reps):
                runs.append(bench_rep(rep, fss, dataset, ckpt_dir, server))
            s3 = fss["default"]["s3fs"][1]
            settings = {
                "s3fs max_pool_connections": s3.s3._client_config.max_pool_connections,
                "s3fs default_block_size": s3.default_block_size,
                "s3fs max_concurrency": s3.max_concurrency,
                "pyarrow io_thread_count": pa.io_thread_count(),
                "pyarrow cpu_count": pa.cpu_count(),
            }
    rows, med = summarize(runs, dataset)

    _print_tables(rows, med, args.reps)
    print("\nendpoint from AWS_ENDPOINT_URL alone (no endpoint argument):")
    for name, found in env_check.items():
        print(f"  {name:<44} {found}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = {m.__name__: m.__version__ for m in (pa, s3fs)}
    out.write_text(
        json.dumps(
            {
                "reps": args.reps,
                "mb": args.mb,
                "dataset": dataset,
                "versions": versions,
                "settings": settings,
                "endpoint_from_env": env_check,
                "results": rows,
                "seconds": med,
                "runs": runs,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
