"""``raytrain pack`` of an image folder on a real S3 API server into Parquet on the same
server, killed mid-pack and run again in fresh CLI processes, as a user would: the rerun
keeps the shards already whole and writes the rest; then the packed set (on S3) and the
folder it came from (on local disk) train the same model to the same accuracy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import raytrain
from tests.conftest import digits_spec
from tests.image_folders import write_digit_images
from tests.integration.cli_runs import cli_env
from tests.integration.s3_server import s3_client, s3_filesystem

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUCKET, TRAIN, VAL = "raytrain-pack", 1400, 397


def test_pack_on_s3_killed_and_rerun_then_trains_as_the_folder_does(
    ray_cluster: None, s3_endpoint: str, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    write_digit_images(tmp_path / "images" / "train", 0, TRAIN)
    write_digit_images(tmp_path / "images" / "val", TRAIN, VAL)
    s3_client(s3_endpoint).create_bucket(Bucket=BUCKET)
    fs = s3_filesystem(s3_endpoint)
    pafs.copy_files(
        str(tmp_path / "images" / "train"),
        f"{BUCKET}/images/train",
        source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=fs,
    )
    env = cli_env(AWS_ENDPOINT_URL=s3_endpoint)

    def pack(split: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "raytrain",
            "pack",
            f"s3://{BUCKET}/images/{split}",
            f"s3://{BUCKET}/packed/{split}",
            "--shard-mb",
            "0.02",
        ]

    # killed once it has written 2 shards, while it gathers or uploads the third
    proc = subprocess.Popen(
        pack("train"), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stderr is not None
    written = 0
    for line in proc.stderr:
        written += line.startswith("raytrain pack: shard ")
        if written == 2:
            proc.kill()
            break
    proc.wait(timeout=60)
    assert written == 2 and proc.returncode != 0
    again = subprocess.run(pack("train"), capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    kept = again.stderr.count("already packed")
    shards = again.stderr.count("raytrain pack: shard ")
    assert 2 <= kept <= 3 and shards > 5, again.stderr
    assert (
        f"packed {TRAIN:,} files" in again.stdout
        and f"{kept} of them already there" in again.stdout
    )
    rows = pq.read_table(f"{BUCKET}/packed/train", filesystem=fs)
    assert rows.num_rows == TRAIN and len(set(rows.column("path").to_pylist())) == TRAIN

    def train(where: str) -> dict:
        image = {"format": "images", "image_mode": "L"}
        spec = digits_spec(
            digits_dir,
            tmp_path,
            name=f"from-{where.rsplit('/', 1)[-1]}",
            model={"class_path": "raytrain.models.digits:DigitsCNN", "init_args": {"lr": 0.01}},
            data={
                "train": {"uri": f"{where}/train", **image},
                "val": {"uri": str(tmp_path / "images" / "val"), **image},  # one val set
                "columns": None,
                "num_workers": 1,
                "preprocess": "tests.integration.models:digit_pixels",
            },
            scaling={"num_workers": 1},
            trainer={"max_epochs": 3, "seed": 0},
            storage={"s3": {"endpoint_url": s3_endpoint}},
        )
        return raytrain.fit(spec, progress=False).metrics

    # the folder from local disk (a GET per image is what packing is for), the shards on S3;
    # both validated on the same folder
    folder, packed = train(str(tmp_path / "images")), train(f"s3://{BUCKET}/packed")
    assert folder["step"] == packed["step"]  # the same rows, cut alike
    assert min(folder["val_acc"], packed["val_acc"]) >= 0.85
    assert abs(folder["val_acc"] - packed["val_acc"]) <= 0.05, (folder, packed)
