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

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from raytrain.driver.ray_runtime import EMBEDDED_ENV
from raytrain.errors import EXIT_FAILED, EXIT_PREEMPTED
from raytrain.slurm.ports import WORKER_OFFSET, PortBlock, port_block
from raytrain.slurm.sbatch import TOKEN_FILE, SlurmRun

# How long the head gets to listen, and the cluster's steps to stop on SIGTERM.
NODES_WAIT_S = 180.0
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


def node_ip_address() -> str:
    """This node's address as Ray picks it (``ray.util``)."""
    from ray.util import get_node_ip_address

    return str(get_node_ip_address())


def _listening(host: str, port: int) -> bool:
    with suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _taken(port: int) -> bool:
    """Whether any of a block's node ports, from ``port`` on, is in use on this node."""
    for each in range(port, port + WORKER_OFFSET):
        with socket.socket() as s:
            try:
                s.bind(("", each))
            except OSError:
                return True
    return False


class SlurmCluster:
    """The job's Ray cluster: one ``srun ray start --block`` step per node."""

    def __init__(self, run: SlurmRun, nodes: list[str], block: PortBlock, env: dict[str, str]):
        self.run, self.nodes, self.block, self.env = run, nodes, block, env
        # Ray's own choice of this node's address (the route out of it), not the hostname's:
        # Debian maps a host's own name to 127.0.1.1, which other nodes cannot reach
        self.head_ip = node_ip_address()
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

    def srun(self, nodes: list[str]) -> list[str]:
        """``srun`` of one task on each of ``nodes``, with the node's CPUs and GPUs (since
        Slurm 22.05 a step no longer inherits ``--cpus-per-task``: it would get one CPU)."""
        gpus = [f"--gpus-per-node={self.run.gpus_per_node}"] if self.run.gpus_per_node else []
        return [
            "srun",
            "--overlap",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            f"--nodelist={','.join(nodes)}",
            f"--cpus-per-task={self.run.cpus_per_node}",
            *gpus,
            "--kill-on-bad-exit=1",
        ]

    def _step(self, command: list[str], nodes: list[str]) -> subprocess.Popen[bytes]:
        step = subprocess.Popen([*self.srun(nodes), *command], env=self.env)
        self.steps.append(step)
        return step

    def start(self) -> None:
        """The head, then the other nodes; returns once every node is in the cluster."""
        say(f"Ray head on {self.nodes[0]} ({self.address}), {len(self.nodes)} node(s)")
        self._step(self._ray_start(head=True), self.nodes[:1])
        self._wait(lambda: _listening(self.head_ip, self.block.gcs))
        if len(self.nodes) > 1:
            self._step(self._ray_start(head=False), self.nodes[1:])
            self._wait(self._all_joined)

    def _all_joined(self) -> bool:
        """Whether every node of the allocation is alive in the cluster (Ray's node table)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False)
        joined = sum(1 for node in ray.nodes() if node.get("Alive"))
        if joined >= len(self.nodes):
            ray.shutdown()
            return True
        return False

    def _wait(self, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + NODES_WAIT_S
        while not ready():
            if any(step.poll() is not None for step in self.steps):
                raise RuntimeError("a `ray start` step ended before its node was up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray nodes were not up in {NODES_WAIT_S:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the steps (srun passes it to ``ray start --block``, which stops its
        node's processes); SIGKILL what is left after ``STOP_GRACE_S``; then remove Ray's
        temp dir on every node."""
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
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if len(self.nodes) > 1:
            with suppress(subprocess.SubprocessError, OSError):
                subprocess.run(
                    [*self.srun(self.nodes[1:]), "rm", "-rf", self.temp_dir],
                    env=self.env,
                    timeout=60,
                    check=False,
                )


class Notices:
    """Slurm's signals to this process: USR1 (the job's end is near) and TERM (cancelled)."""

    def __init__(self) -> None:
        self.usr1 = threading.Event()
        self.term = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *_: self.usr1.set())
        signal.signal(signal.SIGTERM, lambda *_: self.term.set())


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def catches_usr1(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGUSR1 (``SigCgt`` in its status): the
    driver installs one at its start; before, a SIGUSR1 is ignored and must come again."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)


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
    told = delivered = False
    while driver.poll() is None:
        asked = notices.usr1.is_set() or notices.term.is_set()
        if asked and not told:
            why = "SIGTERM: the job is ending" if notices.term.is_set() else "USR1: time is short"
            say(f"{why}; the run saves a checkpoint and stops")
            told = True
        if asked and not delivered:
            # sent until the driver's handler is there, then no more: a signal interrupts
            # the driver's blocking calls, Ray's too
            delivered = catches_usr1(driver.pid)
            with suppress(ProcessLookupError):
                driver.send_signal(signal.SIGUSR1)
        with suppress(subprocess.TimeoutExpired):
            driver.wait(timeout=0.5)
    return driver.wait()


def committed_step(run: SlurmRun) -> int | None:
    """The step of the run's latest committed checkpoint (-1: none yet); None when it
    cannot be read. A job requeues only if its attempt moved it forward: one whose every
    attempt is stopped before its first checkpoint would requeue forever."""
    try:
        from raytrain.checkpoints.layout import latest_committed, run_dir
        from raytrain.spec import load_spec

        spec = load_spec(Path(run.workdir) / run.spec, run.overrides)
        found = latest_committed(run_dir(spec), spec.storage)
    except Exception:
        return None
    return -1 if found is None else int(found[1].get("step", -1))


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
    # this process's too: it asks the cluster whether every node joined
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    # raytrain owns this cluster as it owns an embedded one, and tunes it alike (workers
    # at nice 0, no metrics export nothing scrapes: ``driver.ray_runtime``); the user's
    # own settings win. Without it the digits job trained at a third of its speed here.
    env = {**EMBEDDED_ENV, **os.environ}
    cluster = SlurmCluster(run, hostnames(), port_block(int(env["SLURM_JOB_ID"]), _taken), env)
    before = committed_step(run)
    code = EXIT_FAILED
    try:
        cluster.start()
        code = run_driver(run, {**env, "RAY_ADDRESS": cluster.address}, notices)
    finally:
        cluster.stop()
    say(f"the run exited {code}")
    if code == EXIT_PREEMPTED and not notices.term.is_set():
        after = committed_step(run)
        if after is not None and before is not None and after <= before:
            say(
                f"not requeued: no checkpoint newer than step {before} was committed in this "
                "attempt (its time, less --grace, is too short for a step?)"
            )
        else:
            requeue()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
