"""A checkpoint whose upload was interrupted is never resumed from, and is cleaned up.

For real: the run's S3 traffic goes through a proxy that, once the first checkpoint is
committed, stops answering the upload of the next one (an S3 server that went away
mid-upload); the whole run (driver and its embedded Ray) is then killed. A second run of the
same name, straight to the server, must remove the partial folder and resume from the last
checkpoint Ray Train committed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.integration.cli_runs import ROOT, cli_env, run_cli
from tests.integration.s3_proxy import s3_proxy
from tests.integration.s3_server import s3_filesystem

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "raytrain-test/interrupted/digits-cnn"


def committed_checkpoint(fs: pafs.FileSystem) -> str | None:
    """The folder of the run's latest checkpoint that Ray Train committed, if any."""
    try:
        with fs.open_input_stream(f"{RUN}/checkpoint_manager_snapshot.json") as stream:
            latest = json.loads(stream.read())["latest_checkpoint_result"]
    except FileNotFoundError:
        return None
    return latest["checkpoint_dir_name"] if latest else None


def test_interrupted_upload_is_never_resumed_and_is_removed(
    s3_endpoint: str, s3_digits: str, digits_dir: Path, tmp_path: Path
) -> None:
    fs = s3_filesystem(s3_endpoint)
    args = [f"data.train.uri={digits_dir / 'train'}", f"data.val.uri={digits_dir / 'val'}",
            "checkpoint.storage=s3://raytrain-test/interrupted", "trainer.max_epochs=4",
            "data.prepare=null"]  # fmt: skip
    first_ckpt: list[str] = []

    uploads: dict[str, set[str]] = {}  # checkpoint folder -> files PUT into it

    def second_file_of_second_folder(method: str, path: str) -> bool:
        """A PUT into any checkpoint folder but the first, of a file other than the first
        one PUT there: Ray uploads a folder's files one after the other, so the folder
        is left with one complete file and one that never completes."""
        key = path.split("?")[0].partition(f"/{RUN}/")[2]  # FOLDER/FILE inside the run
        if method != "PUT" or not key.startswith("checkpoint_") or "/" not in key:
            return False
        folder, name = key.split("/", 1)
        if not name:  # the folder's marker object
            return False
        first_ckpt[:] = first_ckpt or [folder]
        files = uploads.setdefault(folder, {name})
        return folder != first_ckpt[0] and name not in files

    with s3_proxy(s3_endpoint) as proxy:
        stalled = proxy.stall_when(second_file_of_second_folder)
        cmd = [sys.executable, "-m", "raytrain", "run", str(ROOT / "jobs" / "digits.yaml"),
               "--json", *args, f"storage.s3.endpoint_url={proxy.endpoint}"]  # fmt: skip
        with open(tmp_path / "first.log", "w") as log:
            proc = subprocess.Popen(cmd, env=cli_env(), cwd=tmp_path, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            # Until the upload stalls; a run that ends first (an error) fails the test.
            while not stalled.wait(timeout=1) and proc.poll() is None:
                pass
            assert stalled.is_set(), (tmp_path / "first.log").read_text()[-3000:]
            # and until Ray Train has committed the first checkpoint (its snapshot names it)
            while committed_checkpoint(fs) != first_ckpt[0] and proc.poll() is None:
                stalled.wait(timeout=0.2)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and its embedded Ray
            proc.wait(timeout=60)
            proxy.release()

    committed = committed_checkpoint(fs)
    assert committed == first_ckpt[0]
    folders = {i.base_name for i in fs.get_file_info(pafs.FileSelector(RUN))
               if i.type == pafs.FileType.Directory}  # fmt: skip
    partial = sorted(folders - {committed})
    assert len(partial) == 1  # the interrupted upload left part of its folder behind
    held = {i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{RUN}/{partial[0]}"))}
    assert len(held) == 1 and held < {"checkpoint.ckpt", "raytrain.json"}

    code, result, out = run_cli(cli_env(AWS_ENDPOINT_URL=s3_endpoint), tmp_path, *args)
    assert code == 0, out[-3000:]
    uri = f"s3://{RUN}"
    assert f"raytrain: removed {uri}/{partial[0]}: its upload never completed" in out
    assert f"resuming digits-cnn from {uri}/{committed} (" in out
    assert result["resumed_from"] == f"{uri}/{committed}"
    assert result["metrics"]["step"] == 4 * 23  # epochs 2-4 trained once each, on top
    assert fs.get_file_info(f"{RUN}/{partial[0]}").type == pafs.FileType.NotFound
