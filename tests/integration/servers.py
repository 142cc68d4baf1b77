"""What the test servers on loopback share: a free port, a process that dies with the tests,
waiting until it answers, and stopping its process group."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url``; an error status (401: it wants
    credentials) is an answer too."""
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the test process dies, even by a crash (Linux only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextmanager
def server_process(
    cmd: list[str], log: Path, is_up: Callable[[], bool], what: str, **popen: object
) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` (output to ``log``) in its own process group until the block ends, once
    ``is_up()`` is true (it may raise OSError while the server is starting)."""
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **popen,
        )  # type: ignore[call-overload]
    try:
        deadline = time.monotonic() + 60
        while True:
            with suppress(OSError):
                if is_up():
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start: {log.read_text()}")
            time.sleep(0.2)
        yield proc
    finally:
        with suppress(ProcessLookupError):  # it already exited (a failed start)
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
