"""A real Slurm cluster of one node on loopback: Debian's ``munged``, ``slurmctld`` and
``slurmd`` (packages ``munge`` and ``slurm-wlm``; ``tests/run`` installs them), each
started by the test with a configuration of its own under a short temp dir, on free ports,
and stopped by its own process id. Nothing of the machine's own Slurm (if any) is read:
every command gets ``SLURM_CONF``, and munge its own socket and key."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from raytrain.driver.ray_runtime import EMBEDDED_ENV
from tests.integration.servers import _die_with_parent, free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
INSTALL = "apt-get install -y slurm-wlm munge (as root; tests/run does it)"


def missing() -> str | None:
    """Why Slurm's daemons cannot run here, or None."""
    absent = [d for d in (*DAEMONS, "sbatch") if shutil.which(d) is None]
    if absent:
        return f"{', '.join(absent)} not installed: {INSTALL}"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users: the test's cluster needs root"
    return None


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]  # for sbatch, scontrol, ...: SLURM_CONF, no inherited Ray

    def command(self, *argv: str) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{argv}: {done.stderr}"
        return done.stdout

    def jobs(self) -> list[str]:
        return self.command("squeue", "-h", "-o", "%i").split()


# KillWait=5: a step that does not end on SIGTERM (Ray's `ray start --block` takes more
# than 10 s after a Ray Train run) gets SIGKILL 5 s later, not after Slurm's default 30 s:
# the test's Ray clusters hold nothing to flush.
def _config(root: Path, cpus: int) -> str:
    return f"""ClusterName=rt{secrets.token_hex(2)}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=5
InactiveLimit=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        with suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd up, the node idle; at the end every job of this
    cluster cancelled and ended, then the daemons stopped by their pids."""
    why = missing()
    if why:
        pytest.skip(f"Slurm's daemons cannot run here: {why}")
    # munge's socket path must stay under 108 bytes: a short dir
    root = Path(f"/tmp/rts-{os.getpid()}-{secrets.token_hex(3)}")
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True)
    root.chmod(0o755)  # munged wants its socket's folder reachable by all
    key = root / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    (root / "slurm.conf").write_text(_config(root, os.cpu_count() or 2))
    inherited = {k: v for k, v in os.environ.items() if k not in EMBEDDED_ENV}
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
        inherited.pop(var, None)
    env = {**inherited, "SLURM_CONF": str(root / "slurm.conf")}
    cluster = SlurmCluster(root, env)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        munged = ["munged", "-F", "-f", f"--socket={root}/munge.sock", f"--key-file={key}"]
        munged += [f"--{f}-file={root}/munged.{f}" for f in ("pid", "seed", "log")]
        procs.append(_start(munged, root / "munged.out", env))
        _wait(lambda: (root / "munge.sock").exists(), procs, root / "munged.out")
        procs.append(_start(["slurmctld", "-D", "-i"], root / "slurmctld.out", env))
        procs.append(_start(["slurmd", "-D", "-N", "localhost"], root / "slurmd.out", env))
        _wait(lambda: _idle(cluster), procs, root / "slurmd.log")
        yield cluster
    finally:
        with suppress(Exception):
            _end_jobs(cluster)
        _stop(procs)
        shutil.rmtree(root, ignore_errors=True)


def _idle(cluster: SlurmCluster) -> bool:
    done = subprocess.run(
        ["sinfo", "-h", "-o", "%T"], env=cluster.env, capture_output=True, text=True, timeout=30
    )
    return done.returncode == 0 and done.stdout.strip() == "idle"


def _end_jobs(cluster: SlurmCluster) -> None:
    for job in cluster.jobs():
        cluster.command("scancel", job)
    _wait(lambda: not cluster.jobs(), [], cluster.root / "slurmctld.log")


def _wait(ready, procs: list[subprocess.Popen[bytes]], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        died = [p.args for p in procs if p.poll() is not None]
        if died or time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
            raise RuntimeError(f"Slurm did not start ({died or 'timeout'}):\n{text}")
        time.sleep(0.2)
