"""A real Ray cluster started as users start one: ``ray start --head`` with its dashboard and
job server on loopback, token authentication on, and worker nodes joined with ``ray start
--address``. Every process it starts is stopped at the end, and only those: ``ray stop``
would kill every Ray on the machine, the tests' embedded one too."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from raytrain.driver.ray_runtime import EMBEDDED_ENV
from tests.integration.servers import _die_with_parent, free_port, http_answers

# Ray's CLI from the environment running the tests, whatever PATH says.
RAY_CLI = str(Path(sys.executable).parent / "ray")


@dataclass
class RayHead:
    """A running head: where its job server answers, and the token it wants."""

    dashboard_url: str
    gcs_address: str
    token: str
    temp_dir: Path
    env: dict[str, str]
    metrics_port: int  # the head node's Prometheus endpoint: http://127.0.0.1:{port}/metrics
    nodes: list[subprocess.Popen] = field(default_factory=list)
    proc: subprocess.Popen | None = None  # the head's `ray start --block`

    def kill(self) -> None:
        """SIGKILL the head's whole process tree at once, as a crash of its machine would:
        its GCS, dashboard and job server, raylet, workers and jobs' drivers; then whatever
        of this cluster escaped the tree (by its temp dir, pid by pid)."""
        assert self.proc is not None
        kill_tree(self.proc.pid)
        for pid in _processes_under(str(self.temp_dir)):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def request(self, path: str, *, token: str | None = None) -> dict:
        """GET a dashboard API path as JSON, with ``token`` (the head's by default)."""
        req = urllib.request.Request(
            self.dashboard_url + path,
            headers={"Authorization": f"Bearer {self.token if token is None else token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def metrics_targets(self) -> list[str]:
        """Every node's metrics endpoint, from the service discovery file the head keeps
        for Prometheus (the README's way); the head's own port until the file is there."""
        found = self.temp_dir / "prom_metrics_service_discovery.json"
        try:
            groups = json.loads(found.read_text())
            targets = [t for group in groups for t in group["targets"]]
        except (OSError, ValueError, KeyError, TypeError):
            targets = []
        return targets or [f"127.0.0.1:{self.metrics_port}"]

    def scrape(self, **match: str) -> dict[str, list[dict[str, str]]]:
        """The cluster's metrics endpoints as Prometheus reads them: each series' name with
        the labels of its samples, of those whose labels include ``match`` (an endpoint not
        listening yet is skipped, as Prometheus does)."""
        out: dict[str, list[dict[str, str]]] = {}
        for text in self._read_targets().values():
            if isinstance(text, Exception):
                continue
            for line in text.splitlines():
                found = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} ", line)
                if found:
                    labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', found.group(2)))
                    if all(labels.get(k) == v for k, v in match.items()):
                        out.setdefault(found.group(1), []).append(labels)
        return out

    def _read_targets(self) -> dict[str, str | Exception]:
        texts: dict[str, str | Exception] = {}
        for target in self.metrics_targets():
            try:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as resp:
                    texts[target] = resp.read().decode()
            except OSError as e:
                texts[target] = e
        return texts

    def metrics_diagnosis(self) -> str:
        """What a failed metrics check needs to be understood afterwards: each endpoint's
        answer (how many series, how many of them raytrain's) or its error, and the last
        lines of the head's logs that mention metrics."""
        lines = []
        for target, text in self._read_targets().items():
            if isinstance(text, Exception):
                lines.append(f"{target}: {text!r}")
            else:
                names = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
                ours = sum("raytrain_" in ln for ln in names)
                lines.append(f"{target}: {len(names)} samples, {ours} raytrain's")
        logs = sorted((self.temp_dir / "session_latest" / "logs").glob("*"))
        for log in logs:
            with suppress(OSError):
                said = [
                    ln
                    for ln in log.read_text(errors="replace").splitlines()
                    if "metric" in ln.lower() or "prometheus" in ln.lower()
                ]
                lines += [f"{log.name}: {ln[:300]}" for ln in said[-5:]]
        return "\n".join(lines)

    def alive_nodes(self) -> int:
        summary = self.request("/nodes?view=summary")["data"]["summary"]
        return sum(1 for node in summary if node["raylet"]["state"] == "ALIVE")


def _node_ports(metrics_port: int | None = None) -> list[str]:
    """Ports a node on this machine must not share with another node here."""
    return [
        "--dashboard-agent-listen-port",
        str(free_port()),
        "--metrics-export-port",
        str(metrics_port or free_port()),
        "--runtime-env-agent-port",
        str(free_port()),
    ]


def _wait(what: str, ready, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + 90
    while not ready():
        died = [p for p in procs if p.poll() is not None]
        if died or time.monotonic() > deadline:
            text = "\n".join(log.read_text()[-3000:] for log in logs if log.exists())
            raise RuntimeError(f"{what} did not start:\n{text}")
        time.sleep(0.5)


def _process_table() -> dict[int, tuple[int, str]]:
    """Every process now: pid -> (parent pid, command line)."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with suppress(OSError):
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            table[int(entry)] = (ppid, cmd)
    return table


def _with_descendants(found: set[int], table: dict[int, tuple[int, str]]) -> set[int]:
    grew = True
    while grew:
        children = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        found |= children
        grew = bool(children)
    return found


def processes_below(pid: int) -> dict[int, str]:
    """The processes descended from ``pid`` now, with their command lines: a local Ray that
    a test process started (its raylet, and the raylet's workers) and nothing of another Ray
    on the same machine."""
    table = _process_table()
    return {p: table[p][1] for p in _with_descendants({pid}, table) - {pid} if p in table}


def _processes_under(marker: str) -> set[int]:
    """Pids whose command line names ``marker`` (the cluster's temp dir), and all their
    descendants (Ray's agents rename themselves and lose it)."""
    table = _process_table()
    return _with_descendants({pid for pid, (_, cmd) in table.items() if marker in cmd}, table)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it at once, as a machine's crash ends them.

    The tree is first frozen with SIGSTOP, scanned again until no new process shows (a
    stopped process cannot fork), and only then killed: killing the parent first would hand
    its children to init, out of reach of a later scan, and a driver's embedded Ray's
    workers would train on for a moment after it died."""
    tree: set[int] = set()
    while True:
        found = {p for p in _with_descendants({pid}, _process_table()) if _running(p)}
        if found <= tree:
            break
        for stop in found - tree:
            with suppress(ProcessLookupError):
                os.kill(stop, signal.SIGSTOP)
        tree |= found
    for kill in tree:
        with suppress(ProcessLookupError):
            os.kill(kill, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs. An exited process stays in ``/proc`` as a zombie until its
    parent reaps it, and the init of this project's machines never reaps the orphans it
    inherits (a Ray worker whose raylet died): waiting for those to vanish waited out the
    whole grace period, 20 s per cluster stopped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# How long the ``ray start`` processes get to stop their nodes themselves, and then the
# cluster's processes get to exit on SIGTERM. An idle head and node stop in about 1 s each.
# A head that had run Ray Train jobs did not exit on SIGTERM within 20 s, and 5 of its
# processes outlived another SIGTERM by 10 s: waiting longer only delays their SIGKILL.
# Nothing of a test cluster needs flushing: its temp dir is deleted right after.
GRACE_S = 3


def stop_cluster(temp_dir: Path, procs: list[subprocess.Popen]) -> None:
    """SIGTERM the ``ray start`` processes; after ``GRACE_S``, SIGTERM everything of this
    cluster still running, then SIGKILL whatever is left ``GRACE_S`` later."""
    for proc in procs:
        with suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = {pid for pid in _processes_under(str(temp_dir)) if _running(pid)}
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + GRACE_S
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if _running(pid)}
            time.sleep(0.2)
    for proc in procs:  # reap them: this process is their parent
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def start_node(head: RayHead, log: Path, *, num_cpus: int) -> subprocess.Popen:
    """Join a worker node with ``num_cpus`` CPUs to ``head`` and wait until it is alive."""
    before = head.alive_nodes()
    # a temp dir of its own (named after the head's, for stop_cluster): nodes sharing one
    # would share runtime_resources, and one node's agent deletes what another's job runs in
    temp_dir = f"{head.temp_dir}-n{len(head.nodes) + 1}"
    cmd = [
        RAY_CLI,
        "start",
        "--block",
        "--address",
        head.gcs_address,
        "--num-cpus",
        str(num_cpus),
        "--temp-dir",
        temp_dir,
        *_node_ports(),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=head.env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    head.nodes.append(proc)
    _wait("a Ray worker node", lambda: head.alive_nodes() > before, [proc], [log])
    return proc


@contextmanager
def ray_head(
    work: Path,
    *,
    num_cpus: int = 2,
    gcs_port: int | None = None,
    dashboard_port: int | None = None,
    token: str | None = None,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> Iterator[RayHead]:
    """Start ``ray start --head`` (plus ``args``) with token authentication on (``token``,
    default: a new one), the GCS on ``gcs_port`` (default: a free one), the dashboard and
    its job server on ``dashboard_port`` on loopback (default: a free one), its metrics
    endpoint on a free port, and its state under a short temp dir of its own. The same
    ports and token again: a head that came back where clients knew it."""
    token = token or secrets.token_hex(16)
    token_file = work / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    # unix socket paths must stay under 108 bytes: the temp dir is short
    temp_dir = Path(f"/tmp/rth-{os.getpid()}-{secrets.token_hex(3)}")
    # Not what an embedded Ray of this process (the session's cluster) put in os.environ
    # for its own processes: a `ray start` has none of it. RAY_enable_metrics_collection=0
    # turned this head's metrics endpoint off in CI, where that cluster runs first.
    inherited = {k: v for k, v in os.environ.items() if k not in EMBEDDED_ENV}
    head_env = {
        **inherited,
        **(env or {}),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_file),
    }
    head_env.pop("RAY_ADDRESS", None)
    head_env.pop("RAY_AUTH_TOKEN", None)
    gcs_port, metrics_port = gcs_port or free_port(), free_port()
    dash_port = dashboard_port or free_port()
    cmd = [
        RAY_CLI,
        "start",
        "--head",
        "--block",
        "--port",
        str(gcs_port),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dash_port),
        "--include-dashboard",
        "true",
        "--num-cpus",
        str(num_cpus),
        "--temp-dir",
        str(temp_dir),
        "--disable-usage-stats",
        "--ray-client-server-port",
        str(free_port()),
        *_node_ports(metrics_port),
        *args,
    ]
    log = work / "ray-head.log"
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=head_env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    head = RayHead(
        dashboard_url=f"http://127.0.0.1:{dash_port}",
        gcs_address=f"127.0.0.1:{gcs_port}",
        token=token,
        temp_dir=temp_dir,
        env=head_env,
        metrics_port=metrics_port,
        proc=proc,
    )
    try:
        version_url = head.dashboard_url + "/api/version"
        _wait("the Ray head", lambda: http_answers(version_url), [proc], [log])
        _wait("the Ray head's node", lambda: head.alive_nodes() >= 1, [proc], [log])
        yield head
    finally:
        stop_cluster(temp_dir, [*head.nodes, proc])
        for path in Path("/tmp").glob(f"{temp_dir.name}*"):
            shutil.rmtree(path, ignore_errors=True)
