"""The digits job streamed from a many-file prefix on a real S3 API server, in a fresh CLI
process as a user's would run; and the driver's read of a checkpoint on S3.

The run with its data and checkpoints on S3 that is killed and resumed there is in
``test_driver_failure``."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.integration.cli_runs import checkpoint_dirs, cli_env, digits_on_s3, run_cli
from tests.integration.conftest import S3_DIGITS_FILES
from tests.integration.s3_server import s3_filesystem

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_many_file_prefix_streams_with_projection(
    s3_endpoint: str, s3_digits: str, tmp_path: Path
) -> None:
    """``data.cache: never``: each worker streams its part of the many-file prefix."""
    fs = s3_filesystem(s3_endpoint)
    assert len(fs.get_file_info(pafs.FileSelector("raytrain-test/digits/train"))) == S3_DIGITS_FILES
    code, result, out = run_cli(
        cli_env(),
        tmp_path,
        *digits_on_s3(s3_digits, "streamed"),
        "data.cache=never",
        f"storage.s3.endpoint_url={s3_endpoint}",
        "trainer.max_epochs=2",
    )
    assert code == 0, out[-3000:]
    assert result["data_paths"] == {"train": "streamed", "val": "streamed"}
    assert result["metrics"]["val_acc"] >= 0.8
    # 1438 rows over 2 workers, 32 a batch: 23 steps an epoch (every row: step_slices).
    assert result["metrics"]["step"] == 2 * 23
    assert len(checkpoint_dirs(fs, result["run_dir"])) == 2


def test_a_checkpoint_on_s3_loads_for_model_logging_and_export(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No Ray: the driver's read of a checkpoint folder on S3 (what the model logged to
    MLflow and ``raytrain export`` load). pyarrow's ``copy_files`` of a folder does not
    create the destination folder, which every read of an S3 checkpoint tripped on."""
    import torch

    from raytrain.checkpoints.export import checkpoint_weights, trained_model
    from raytrain.models.digits import DigitsCNN
    from raytrain.spec import JobSpec, StorageSpec
    from tests.integration.s3_server import S3_ENV, s3_client

    for key, value in S3_ENV.items():  # the standard chain, as a driver's would be
        monkeypatch.setenv(key, value)
    s3_client(s3_endpoint).create_bucket(Bucket="raytrain-ckpt")
    model = DigitsCNN()
    local = tmp_path / "checkpoint_000003"
    local.mkdir()
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, local / "checkpoint.ckpt")
    (local / "raytrain.json").write_text("{}")
    pafs.copy_files(
        str(local),
        "raytrain-ckpt/runs/x/checkpoint_000003",
        destination_filesystem=s3_filesystem(s3_endpoint),
    )
    uri = "s3://raytrain-ckpt/runs/x/checkpoint_000003"
    options = StorageSpec(s3={"endpoint_url": s3_endpoint, "region": "us-east-1"})
    weights = checkpoint_weights(uri, options)
    assert weights.keys() == model.state_dict().keys()
    job = JobSpec.model_validate(
        {
            "name": "x",
            "model": {"class_path": "raytrain.models.digits:DigitsCNN"},
            "data": {"train": {"uri": str(tmp_path)}},
            "storage": {"s3": {"endpoint_url": s3_endpoint, "region": "us-east-1"}},
        }
    )
    pixels = torch.rand(2, 64) * 16
    with torch.no_grad():
        assert torch.equal(trained_model(job, uri)(pixels), model.eval()(pixels))


def test_an_image_folder_on_s3_is_listed_checked_and_read_per_rank(
    s3_endpoint: str, tmp_path: Path
) -> None:
    """An image folder under a prefix on the S3 server: listed with its classes and every
    header read there (a bad object named), then two ranks' ``ImageStream``s (a decoding
    process each, reads in threads) give every image once, decoded as from local disk."""
    from raytrain.data.image_files import BadImages, list_images
    from raytrain.data.image_stream import ImageFiles, ImageStream
    from tests.image_folders import IMAGES, ids_of, write_images

    write_images(tmp_path / "images")
    from tests.integration.s3_server import s3_client

    s3_client(s3_endpoint).create_bucket(Bucket="raytrain-images")
    fs = s3_filesystem(s3_endpoint)
    pafs.copy_files(
        str(tmp_path / "images"),
        "raytrain-images/images",
        source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=fs,
    )
    images = list_images("s3://raytrain-images/images", fs, "raytrain-images/images")
    assert images.num_rows == IMAGES and images.classes == ("class-0", "class-1", "class-2")
    ranks = [
        ImageStream(
            ImageFiles(images, fs, None, None),
            8,
            rank=r,
            world_size=2,
            shuffle_seed=1,
            num_workers=1,
        )
        for r in range(2)
    ]
    batches = [b for s in ranks for b in s]
    assert sorted(i for b in batches for i in ids_of(b)) == list(range(IMAGES))
    assert all(b["label"].tolist() == b["image"][:, 0, 2].tolist() for b in batches)
    with fs.open_output_stream("raytrain-images/images/class-1/zz-broken.png") as handle:
        handle.write(b"not a png")
    with pytest.raises(BadImages, match=r"class-1/zz-broken\.png does not decode"):
        list_images("s3://raytrain-images/images", fs, "raytrain-images/images")
