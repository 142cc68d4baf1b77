"""``submit --slurm`` without Slurm running: the port blocks' invariant, the sbatch script
(every value quoted, the notice and requeue asked for), what ``scontrol`` says read back,
and bad flags refused with exit 2, naming the flag, before anything is written. The job
itself runs on real Slurm daemons in ``tests/integration/test_slurm.py``."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from raytrain.cli.app import main
from raytrain.slurm import control
from raytrain.slurm.job import driver_argv
from raytrain.slurm.ports import BLOCK, BLOCKS, FIRST, WORKER_OFFSET, port_block
from raytrain.slurm.sbatch import SbatchOptions, SlurmRun, described, script, time_limit_s

ROOT = Path(__file__).resolve().parents[2]


def test_port_blocks_are_disjoint_in_range_and_skip_a_taken_one() -> None:
    blocks = [port_block(job) for job in range(BLOCKS)]
    assert len({b.base for b in blocks}) == BLOCKS
    for b in blocks:
        ports = [int(a) for a in b.node_args(head=True) if a.isdigit()]
        assert min(ports) >= FIRST and max(ports) < FIRST + BLOCKS * BLOCK
        assert all(b.base <= p < b.base + BLOCK for p in ports)
        assert len(set(ports)) == len(ports)  # no port twice within a node
    # the job's own block is in use on the head: the next one
    taken = port_block(7).base
    assert port_block(7, taken=lambda port: port == taken).base == taken + BLOCK
    assert (
        port_block(BLOCKS - 1, taken=lambda port: port == FIRST + (BLOCKS - 1) * BLOCK).base
        == FIRST
    )
    with pytest.raises(RuntimeError, match="every one of"):
        port_block(3, taken=lambda port: True)
    args = port_block(0).node_args(head=False)
    assert "--port" not in args and args[args.index("--min-worker-port") + 1] == str(
        FIRST + WORKER_OFFSET
    )


def _run(tmp_path: Path, **kw: object) -> SlurmRun:
    values: dict = {
        "spec": "jobs/my job.yaml",
        "overrides": ("trainer.max_epochs=2",),
        "workdir": str(tmp_path / "work dir"),
        "folder": str(tmp_path / "work dir/.raytrain/slurm/x"),
        "cpus_per_node": 4,
        "python": "/opt/venv/bin/python",
    }
    return SlurmRun(**{**values, **kw})


def test_the_script_asks_for_the_notice_and_requeue_and_quotes_every_value(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path)
    path = Path(run.folder) / "job-1.sbatch"
    options = SbatchOptions(
        nodes=3,
        gpus_per_node=8,
        partition="gpu;rm -rf /",
        time="1-00:00",
        grace_s=90,
        sbatch_args=("--qos=long",),
    )
    text = script(run, "x", options, path)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for wanted in (
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=B:USR1@90",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --partition='gpu;rm -rf /'",
        "#SBATCH --time=1-00:00",
        "#SBATCH --qos=long",
    ):
        assert wanted in lines, wanted
    assert not any(line.startswith("#SBATCH --account") for line in lines)
    # the shell's part: the working dir, then the runner with the run's description
    cd, run_line = [line for line in lines if line and not line.startswith("#")]
    assert shlex.split(cd) == ["cd", run.workdir]
    assert shlex.split(run_line) == [
        "exec",
        run.python,
        "-m",
        "raytrain.slurm.job",
        str(described(path)),
    ]
    assert described(path).name == "job-1.json"
    output = next(line for line in lines if line.startswith("#SBATCH --output="))
    assert shlex.split(output.removeprefix("#SBATCH --output="))[0].endswith("/slurm-%j.out")


def test_fresh_on_the_first_attempt_only_and_later_ones_take_the_lease_over(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, fresh=True, resume_anyway=True)
    first, second = driver_argv(run, 0), driver_argv(run, 1)
    assert first[:5] == [run.python, "-m", "raytrain", "run", run.spec]
    assert first[5] == "trainer.max_epochs=2"
    assert "--fresh" in first and "--force" not in first
    assert "--fresh" not in second and "--force" in second
    assert "--resume-anyway" in first and "--resume-anyway" in second
    assert "--force" in driver_argv(_run(tmp_path, force=True), 0)


def test_scontrol_lines_are_read_back_with_spaces_in_paths() -> None:
    said = control.fields(
        "JobId=5 JobName=raytrain-digits JobState=PENDING Reason=BeginTime Restarts=1 "
        "RunTime=00:00:56 NodeList=(null) Command=/work/my runs/job-1.sbatch "
        "WorkDir=/work StdOut=/work/my runs/slurm-5.out Power="
    )
    assert said["Command"] == "/work/my runs/job-1.sbatch"
    assert said["StdOut"] == "/work/my runs/slurm-5.out"
    assert said["Restarts"] == "1" and said["Power"] == ""
    job = control.SlurmJob("5", "PENDING", "BeginTime", 1, "00:00:56", "(null)", "", "")
    assert not job.ended
    assert job.describe() == "slurm:5 PENDING (BeginTime), ran 00:00:56, attempt 2"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--pip", "x"], "--pip"),
        (["--supervise"], "--supervise"),
        (["--nodes", "0"], "--nodes 0"),
        (["--grace", "3"], "--grace"),
        (["--gpus-per-node", "-1"], "--gpus-per-node"),
        (["trainer.max_epochs=0"], "trainer.max_epochs"),
        (["--cpus-per-node", "0"], "--cpus-per-node"),
        (["--partition", "a\nb"], "--partition"),  # sbatch ends a directive at a newline
        (["--account", "a\\b"], "--account"),
        (["--sbatch-arg=--signal=USR2@9"], "--sbatch-arg: --signal"),
        (["--sbatch-arg=-o/tmp/x"], "--sbatch-arg"),
        (["--sbatch-arg=qos"], "--sbatch-arg"),
        (["--time", "1:00", "--grace", "60"], "--grace 60 s: not shorter than --time"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    spec = str(ROOT / "jobs" / "digits.yaml")
    code = main(["submit", spec, "--slurm", "--working-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and named in err.splitlines()[0], err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_working_dir_that_is_no_folder_is_refused_and_nothing_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dry_run: list[str]
) -> None:
    """A file was a traceback (the script's folder could not be made under it); a missing
    folder was made, then sbatch asked, or printed in the script's cd."""
    spec = str(ROOT / "jobs" / "digits.yaml")
    (tmp_path / "file").write_text("x")
    for workdir in (tmp_path / "file", tmp_path / "missing"):
        code = main(["submit", spec, "--slurm", *dry_run, "--working-dir", str(workdir)])
        captured = capsys.readouterr()
        assert code == 2 and "Traceback" not in captured.err, captured
        assert captured.err == f"error: --working-dir {workdir}: not a directory\n"
        assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("flag", [["--dry-run"], ["--nodes", "2"], ["--grace", "60"]])
def test_slurm_flags_without_slurm_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    # --dry-run without --slurm would otherwise submit a real Ray job
    spec = str(ROOT / "jobs" / "digits.yaml")
    assert main(["submit", spec, "--working-dir", str(tmp_path), *flag]) == 2
    assert "add --slurm" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10", 600), ("10:30", 630), ("1:00:00", 3600), ("1-0", 86400), ("1-2:3:4", 93784)],
)
def test_sbatch_time_limits_read_as_sbatch_reads_them(text: str, seconds: int) -> None:
    assert time_limit_s(text) == seconds


def test_a_dry_run_prints_the_script_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = str(ROOT / "jobs" / "digits.yaml")
    code = main(["submit", spec, "--slurm", "--dry-run", "--working-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    # the spec's 2 one-CPU workers on the one node
    assert "#SBATCH --cpus-per-task=2" in out.splitlines()
    assert f"cd {tmp_path}" in out
    assert list(tmp_path.iterdir()) == []


def test_an_elastic_spec_asks_for_its_most_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a range of workers: the allocation is what the run can grow into (this raised a
    # TypeError, the range times a float)
    spec = str(ROOT / "jobs" / "digits.yaml")
    argv = ["submit", spec, "scaling.num_workers=[1, 3]", "--slurm", "--dry-run", "--nodes", "2"]
    code = main([*argv, "--working-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "#SBATCH --cpus-per-task=2" in out.splitlines()  # 3 one-CPU workers on 2 nodes
    assert list(tmp_path.iterdir()) == []


def test_a_job_id_that_is_not_slurms_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "slurm:12;rm"]) == 2
    assert "slurm:NUMBER" in capsys.readouterr().err
