"""Inside a Slurm allocation: a Ray cluster across its nodes, the run on it, and its end.

``python -m raytrain.slurm.job FOLDER/job-STAMP.json`` is what the sbatch script of ``submit
--slurm`` runs (``exec``: this process is the batch step's, and gets Slurm's USR1); a
user's own sbatch script runs ``python -m raytrain.slurm.job SPEC [OVERRIDES...]``
(``cluster/slurm/raytrain.sbatch``), the node's CPUs and GPUs then read from Slurm's
variables. It:

1. picks the job's port block (``slurm.ports``) and writes a new Ray token (0600) into the
   Slurm folder: Ray's token authentication, as raytrain's other clusters have;
2. starts Ray's head on the first node and a worker node on each other one, each a
   ``ray start --block`` under ``srun`` (so Slurm tracks and ends them), with the node's
   CPUs and GPUs from the allocation, and waits until every node listens;
3. runs ``raytrain run SPEC`` with ``RAY_ADDRESS`` naming the head: the run joins the
   cluster as any run joins one (``--fresh`` on the first attempt only: a requeued job
   resumes);
4. on USR1 (``--signal=B:USR1@GRACE``) sends the driver SIGUSR1 until it exits: the run
   saves and commits a checkpoint and stops (exit 4, ``driver.preempt_request``); on
   SIGTERM (``scancel``, the time limit) it passes SIGTERM on;
5. stops the cluster (SIGTERM to the ``srun`` steps; Slurm ends what is left with the job)
   and, when the run stopped for a preemption, requeues the job (``scontrol requeue``): the
   next attempt resumes the same run, as attempt N+1 of the same MLflow run.

A job killed without notice (a node lost) is requeued by Slurm itself (``--requeue``) and
resumes from the last committed checkpoint.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

from raytrain.errors import EXIT_FAILED, EXIT_PREEMPTED
from raytrain.slurm.ports import PortBlock, port_block
from raytrain.slurm.sbatch import TOKEN_FILE, SlurmRun

# How long the nodes get to listen, and the driver between two SIGUSR1s (it ignores one
# that comes before its handler is installed, during its imports).
NODES_WAIT_S = 180.0
RESEND_S = 2.0
STOP_GRACE_S = 10.0


def say(text: str) -> None:
    print(f"raytrain slurm: {text}", file=sys.stderr, flush=True)


def hostnames() -> list[str]:
    """The allocation's nodes, first the one this runs on (Slurm's batch host)."""
    listed = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    here = os.environ.get("SLURMD_NODENAME", listed[0])
    return [here, *[name for name in listed if name != here]]


def _listening(host: str, port: int) -> bool:
    with suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


class SlurmCluster:
    """The job's Ray cluster: one ``srun ray start --block`` step per node."""

    def __init__(self, run: SlurmRun, nodes: list[str], block: PortBlock, env: dict[str, str]):
        self.run, self.nodes, self.block, self.env = run, nodes, block, env
        self.head_ip = socket.gethostbyname(nodes[0])
        self.steps: list[subprocess.Popen[bytes]] = []
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        self.temp_dir = f"/tmp/rtslurm-{os.environ['SLURM_JOB_ID']}-{restart}"

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.block.gcs}"

    def _ray_start(self, head: bool) -> list[str]:
        ray = str(Path(self.run.python).parent / "ray")
        where = ["--head", "--node-ip-address", self.head_ip] if head else []
        joins = [] if head else ["--address", self.address]
        return [
            ray,
            "start",
            "--block",
            *where,
            *joins,
            *("--num-cpus", str(self.run.cpus_per_node)),
            *("--num-gpus", str(self.run.gpus_per_node)),
            *("--temp-dir", self.temp_dir),
            "--disable-usage-stats",
            *(["--include-dashboard", "false"] if head else []),
            *self.block.node_args(head=head),
        ]

    def _srun(self, command: list[str], nodes: list[str]) -> subprocess.Popen[bytes]:
        srun = [
            "srun",
            "--overlap",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            f"--nodelist={','.join(nodes)}",
            "--kill-on-bad-exit=1",
        ]
        step = subprocess.Popen([*srun, *command], env=self.env)
        self.steps.append(step)
        return step

    def start(self) -> None:
        """The head, then the other nodes; returns once each listens."""
        say(f"Ray head on {self.nodes[0]} ({self.address}), {len(self.nodes)} node(s)")
        head = self._srun(self._ray_start(head=True), self.nodes[:1])
        self._wait([(self.head_ip, self.block.gcs)], [head])
        if len(self.nodes) > 1:
            rest = self._srun(self._ray_start(head=False), self.nodes[1:])
            ports = [(socket.gethostbyname(n), self.block.node_manager) for n in self.nodes[1:]]
            self._wait(ports, [rest])

    def _wait(self, ports: list[tuple[str, int]], steps: list[subprocess.Popen[bytes]]) -> None:
        deadline = time.monotonic() + NODES_WAIT_S
        while not all(_listening(host, port) for host, port in ports):
            if any(step.poll() is not None for step in steps):
                raise RuntimeError("a `ray start` step ended before its node was up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray nodes did not listen in {NODES_WAIT_S:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the steps (srun passes it to ``ray start --block``, which stops its
        node's processes); SIGKILL what is left after ``STOP_GRACE_S``."""
        for step in self.steps:
            with suppress(ProcessLookupError):
                step.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for step in self.steps:
            try:
                step.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                step.kill()
                step.wait()


class Notices:
    """Slurm's signals to this process: USR1 (the job's end is near) and TERM (cancelled)."""

    def __init__(self) -> None:
        self.usr1 = threading.Event()
        self.term = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *_: self.usr1.set())
        signal.signal(signal.SIGTERM, lambda *_: self.term.set())


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def driver_argv(run: SlurmRun, restarts: int) -> list[str]:
    """``raytrain run`` of attempt ``restarts + 1``: ``--fresh`` on the first only (a
    requeued job resumes); ``--force`` on every later one too, as the run's lease may
    still name the earlier attempt, which Slurm has ended (killed with its node: its
    heartbeat goes stale only after ``records.lease.STALE_S``)."""
    argv = [run.python, "-m", "raytrain", "run", run.spec, *run.overrides]
    argv += ["--fresh"] if run.fresh and restarts == 0 else []
    argv += ["--resume-anyway"] if run.resume_anyway else []
    argv += ["--force"] if run.force or restarts > 0 else []
    return argv


def run_driver(run: SlurmRun, env: dict[str, str], notices: Notices) -> int:
    """``raytrain run`` against the cluster, passing Slurm's notices on; its exit code."""
    argv = driver_argv(run, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
    # SIGUSR1 ignored until the driver installs its handler: one sent before is lost, not
    # fatal (its default action ends the process), and is sent again
    driver = subprocess.Popen(argv, env=env, cwd=run.workdir, preexec_fn=_ignore_usr1)
    told = False
    while driver.poll() is None:
        if notices.term.is_set():
            driver.send_signal(signal.SIGTERM)
            break
        if notices.usr1.is_set():
            if not told:
                say("USR1: the job's time ends soon; the run checkpoints and stops")
                told = True
            with suppress(ProcessLookupError):
                driver.send_signal(signal.SIGUSR1)
            with suppress(subprocess.TimeoutExpired):
                driver.wait(timeout=RESEND_S)
            continue
        notices.usr1.wait(timeout=0.5)
    return driver.wait()


def requeue() -> None:
    """Put this job back in the queue: Slurm ends this attempt (SIGTERM) and starts the
    next one when the job is scheduled again."""
    job = os.environ["SLURM_JOB_ID"]
    say(f"requeueing job {job}: the next attempt resumes the run")
    subprocess.run(["scontrol", "requeue", job], check=False)


def described(argv: list[str]) -> SlurmRun:
    """The run: ``job-STAMP.json`` from ``submit --slurm``, or a spec and its overrides
    from a user's own sbatch script, sized by the allocation's variables."""
    if len(argv) == 1 and argv[0].endswith(".json"):
        return SlurmRun.model_validate_json(Path(argv[0]).read_text())
    cpus = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE", "1")
    gpus = os.environ.get("SLURM_GPUS_ON_NODE") or "0"
    return SlurmRun(
        spec=argv[0],
        overrides=tuple(argv[1:]),
        workdir=os.getcwd(),
        folder=os.path.join(os.getcwd(), ".raytrain", "slurm", "sbatch"),
        cpus_per_node=int(cpus),
        gpus_per_node=int(gpus.split(":")[-1]),
        python=sys.executable,
    )


def main(argv: list[str]) -> int:
    if not argv:
        say("usage: python -m raytrain.slurm.job (JOB.json | SPEC [OVERRIDES...])")
        return 2
    run = described(argv)
    Path(run.folder).mkdir(parents=True, exist_ok=True)
    notices = Notices()
    token = Path(run.folder) / TOKEN_FILE.format(job=os.environ["SLURM_JOB_ID"])
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(16))
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    env.pop("RAY_AUTH_TOKEN", None)
    cluster = SlurmCluster(run, hostnames(), port_block(int(env["SLURM_JOB_ID"]), _taken), env)
    code = EXIT_FAILED
    try:
        cluster.start()
        code = run_driver(run, {**env, "RAY_ADDRESS": cluster.address}, notices)
    finally:
        cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    say(f"the run exited {code}")
    if code == EXIT_PREEMPTED:
        requeue()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
