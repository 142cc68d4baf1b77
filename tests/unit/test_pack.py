"""``raytrain pack``: the shard plan's invariant, a pack run again after an interruption
keeping the shards already whole, packed images read per rank as a folder's (every image
once, exact on a restore at another world size), packed CSV rows equal to the source's,
and bad input named with exit 2."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raytrain.cli.app import main
from raytrain.data.pack import MANIFEST, pack, plan_shards, shard_name
from raytrain.spec import SourceSpec
from tests.image_folders import IMAGES, first_steps, ids_of, write_images


def test_shards_are_consecutive_whole_and_each_just_past_the_size() -> None:
    rng = random.Random(0)
    for _ in range(500):
        sizes = [rng.randint(0, 50) for _ in range(rng.randint(0, 40))]
        limit = rng.randint(1, 120)
        runs = plan_shards(sizes, limit)
        assert [i for run in runs for i in run] == list(range(len(sizes)))
        assert all(len(run) for run in runs)
        for run in runs[:-1]:
            held = sum(sizes[i] for i in run)
            assert held >= limit and held - sizes[run[-1]] < limit


def test_a_pack_run_again_keeps_whole_shards_and_rewrites_the_rest(tmp_path: Path) -> None:
    write_images(tmp_path / "src")
    log = io.StringIO()
    first = pack(str(tmp_path / "src"), str(tmp_path / "dest"), shard_mb=0.002, out=log)
    assert first.files == first.rows == IMAGES and first.shards >= 3 and first.skipped == 0
    manifest = json.loads((tmp_path / "dest" / MANIFEST).read_text())
    assert manifest["classes"] == ["class-0", "class-1", "class-2"]
    assert manifest["shards"] == [shard_name(i) for i in range(first.shards)]
    # an interrupted pack: one shard never written, another cut short
    (tmp_path / "dest" / shard_name(1)).unlink()
    last = tmp_path / "dest" / shard_name(first.shards - 1)
    last.write_bytes(last.read_bytes()[:100])
    again = pack(str(tmp_path / "src"), str(tmp_path / "dest"), shard_mb=0.002, out=log)
    assert again.skipped == first.shards - 2 and again.rows == IMAGES
    rows = pq.read_table(tmp_path / "dest")
    assert sorted(rows.column("path").to_pylist()) == sorted(
        str(p.relative_to(tmp_path / "src")) for p in (tmp_path / "src").rglob("*.png")
    )
    # larger shards: fewer of them, and none of the old ones past them left to be read
    fewer = pack(str(tmp_path / "src"), str(tmp_path / "dest"), shard_mb=1, out=log)
    assert fewer.shards == 1 and pq.read_table(tmp_path / "dest").num_rows == IMAGES


def test_packed_images_are_read_per_rank_every_image_once_and_exact_on_restore(
    tmp_path: Path,
) -> None:
    from raytrain.data.image_stream import ImageFiles, PackedImageStream
    from raytrain.data.sources import image_plan

    write_images(tmp_path / "src")
    pack(str(tmp_path / "src"), str(tmp_path / "dest"), shard_mb=0.002, out=io.StringIO())
    found = image_plan(SourceSpec(uri=str(tmp_path / "dest"), format="images"), None, "error")
    assert found.images and found.num_rows == IMAGES  # type: ignore[union-attr]
    fs = pafs.LocalFileSystem()

    def ranks(world: int) -> list[PackedImageStream]:
        decoder = ImageFiles(None, fs, None, None)
        return [
            PackedImageStream(
                found,
                fs,
                decoder,
                8,
                rank=r,
                world_size=world,  # type: ignore[arg-type]
                shuffle_seed=2,
                window_rows=16,
                num_workers=1 - r,
            )
            for r in range(world)
        ]

    two = ranks(2)
    batches = [b for s in two for b in s]
    assert sorted(i for b in batches for i in ids_of(b)) == list(range(IMAGES))
    assert all(b["label"].tolist() == b["image"][:, 0, 2].tolist() for b in batches)
    trained = first_steps(two, epoch=1, steps=2)
    (one,) = ranks(1)
    one.load_state_dict(two[0].state_dict())
    assert sorted(trained + [i for b in one for i in ids_of(b)]) == list(range(IMAGES))


def test_packed_csv_rows_are_the_sources(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    for f in range(3):
        lines = "".join(f"{i},{i / 4}\n" for i in range(f * 50, f * 50 + 50))
        (tmp_path / "src" / f"part-{f}.csv").write_text("id,x\n" + lines)
    done = pack(
        str(tmp_path / "src"), str(tmp_path / "dest"), "csv", shard_mb=0.0005, out=io.StringIO()
    )
    table = pq.read_table(tmp_path / "dest")
    assert done.files == 3 and done.rows == 150 and done.shards > 1
    assert sorted(table.column("id").to_pylist()) == list(range(150))
    assert table.schema.field("x").type == "float"  # as the per-rank reader parses it


def test_bad_input_to_pack_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_images(tmp_path / "src", n=6)
    (tmp_path / "src" / "class-1" / "zz.png").write_text("not a png")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "part-1.parquet").write_text("someone else's")
    (tmp_path / "a-file").write_text("x")
    cases = {
        "zz.png does not decode": ["pack", str(tmp_path / "src"), str(tmp_path / "out")],
        "inside": ["pack", str(tmp_path / "src"), str(tmp_path / "src" / "packed")],
        "no such file": ["pack", str(tmp_path / "nothing"), str(tmp_path / "out")],
        "more than 0": ["pack", str(tmp_path / "src"), str(tmp_path / "o2"), "--shard-mb", "0"],
        "a number of MB": [
            "pack",
            str(tmp_path / "src"),
            str(tmp_path / "o2"),
            "--shard-mb",
            "inf",
        ],
        f"{tmp_path / 'theirs'}: holds other files (part-1.parquet) and no pack's": [
            "pack",
            str(tmp_path / "src"),
            str(tmp_path / "theirs"),
        ],
        f"{tmp_path / 'a-file'}: a file: name a folder": [
            "pack",
            str(tmp_path / "src"),
            str(tmp_path / "a-file"),
        ],
        "is a file: pack a folder of images": [
            "pack",
            str(tmp_path / "src" / "class-0" / "0000.png"),
            str(tmp_path / "o3"),
        ],
        "DEST: empty": ["pack", str(tmp_path / "src"), " "],
    }
    for says, argv in cases.items():
        assert main(argv) == 2, says
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "Traceback" not in err, err
        if says.startswith(str(tmp_path)):  # the destination's problems name it first
            assert err.startswith(f"error: {says}"), err
    assert (tmp_path / "theirs" / "part-1.parquet").read_text() == "someone else's"


def test_truncated_images_are_found_or_skipped_and_a_changed_source_is_packed_again(
    tmp_path: Path,
) -> None:
    import os

    from raytrain.data.image_files import BadImages, packed_manifest
    from raytrain.data.pack import PackError

    write_images(tmp_path / "src", n=9)
    whole = (tmp_path / "src" / "class-1" / "0004.png").read_bytes()  # the 5th of 9
    (tmp_path / "src" / "class-1" / "0004.png").write_bytes(whole[:50])  # its header is whole
    with pytest.raises(PackError, match=r"0004\.png does not decode"):
        pack(str(tmp_path / "src"), str(tmp_path / "dest"), shard_mb=0.0003, out=io.StringIO())
    with pytest.raises(BadImages, match="an unfinished pack"):  # what it wrote is not read
        packed_manifest(pafs.LocalFileSystem(), str(tmp_path / "dest"))
    done = pack(
        str(tmp_path / "src"),
        str(tmp_path / "dest"),
        shard_mb=0.0003,
        out=io.StringIO(),
        skip_bad=True,
    )
    assert done.bad_files == 1 and done.rows == 8 and done.shards >= 2
    # a file rewritten in place (its path and size the same, its time not): its shard only
    # is written again
    last = sorted((tmp_path / "src").rglob("*.png"))[-1]
    os.utime(last, ns=(1, 1))
    again = pack(
        str(tmp_path / "src"),
        str(tmp_path / "dest"),
        shard_mb=0.0003,
        out=io.StringIO(),
        skip_bad=True,
    )
    assert again.rows == 8 and again.skipped == done.shards - 1
    assert packed_manifest(pafs.LocalFileSystem(), str(tmp_path / "dest"))["complete"]
