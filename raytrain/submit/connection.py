"""Reaching a Ray cluster's job server: its address, its token, and how its refusals read.

The address comes from the argument, ``$RAY_API_SERVER_ADDRESS`` or an http ``$RAY_ADDRESS``.
The token comes from ``token=``, ``$RAY_AUTH_TOKEN``, the file ``$RAY_AUTH_TOKEN_PATH`` or
``~/.ray/auth_token``, in that order, and is never sent over plain http to another machine
unless asked (``insecure``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

from raytrain.errors import EXIT_BAD_INPUT, RaytrainError
from raytrain.util.terminal import printable

# Where a job server is found when no address is given: Ray's own variables for its CLI.
ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path.home() / ".ray" / "auth_token"


# A job id raytrain sends or takes: Ray's own forms (a submission id, ``raysubmit_`` and 16
# letters and digits; a driver job's hex id, ``02000000``) and a user's ``--job-id``. Ray
# takes any string as a submission id, but an id becomes a URL path segment
# (``/api/jobs/{id}``), a log file's name (``job-driver-{id}.log``) and an actor's name, so
# raytrain takes letters, digits and ``_.-``, starting with a letter or digit (never ``.``,
# ``..``, a ``/``, ``?`` or ``#``), and at most ``JOB_ID_MAX_CHARS``.
JOB_ID_MAX_CHARS = 200
_JOB_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{JOB_ID_MAX_CHARS - 1}}}")


class JobsError(RaytrainError):
    """The job server cannot be reached or used: address, token, job id (bad input)."""

    exit_code = EXIT_BAD_INPUT


class ServerUnreachable(JobsError):
    """No job server answers at the address now (the head is down, or not up yet): what a
    supervisor waits out, where a plain command stops."""


class JobUnknown(JobsError):
    """The job server answers but does not know the job id: a typo, or a head that was
    restarted and lost its job table with the old one."""


class TokenRefused(JobsError):
    """The job server refused the token, or wanted one and got none."""


def check_job_id(job_id: str, what: str = "JOB_ID") -> str:
    """``job_id`` when it has a job id's form (see ``_JOB_ID``), else a ``JobsError``
    naming ``what`` (the argument or flag it came from): refused before any request."""
    if isinstance(job_id, str) and _JOB_ID.fullmatch(job_id):
        return job_id
    shown = repr(job_id[:40]) + ("..." if len(job_id) > 40 else "") if job_id else "''"
    raise JobsError(
        f"{what} {shown}: not a job id: Ray's are raysubmit_... or hex; raytrain takes "
        f"letters, digits and _.- (a letter or digit first), at most {JOB_ID_MAX_CHARS}"
    )


def job_segment(job_id: str) -> str:
    """``job_id`` checked and URL-encoded as one path segment, as Ray's client puts it in
    the job server's URLs (``/api/jobs/{id}``, ``.../logs``, ``.../stop``)."""
    from urllib.parse import quote

    return quote(check_job_id(job_id), safe="")


def resolve_address(address: str | None) -> str:
    """The job server's URL: ``address``, else ``$RAY_API_SERVER_ADDRESS`` or
    ``$RAY_ADDRESS`` when it is an http(s) URL; a bare ``host:port`` gets ``http://``."""
    if not address:
        for name in ADDRESS_ENVS:
            value = os.environ.get(name, "")
            if value.startswith(("http://", "https://")):
                address = value
                break
    if not address:
        raise JobsError(
            "no cluster address: pass --address http://HEAD:8265 (the head's dashboard "
            "and job server) or set RAY_API_SERVER_ADDRESS"
        )
    address = address.strip()
    if "://" not in address:
        address = f"http://{address}"
    scheme, _, rest = address.partition("://")
    address = f"{scheme.lower()}://{rest}"  # a scheme is case-insensitive: HTTP:// is http
    if not address.startswith(("http://", "https://")):
        raise JobsError(f"--address {address}: the job server is an http:// or https:// URL")
    try:  # what urllib cannot parse (a bracket not closed, a port past 65535) was a traceback
        parsed = urlsplit(address)
        parsed.port  # noqa: B018  # parsed when read
    except ValueError as exc:
        raise JobsError(f"--address {address}: not a URL ({exc})") from None
    if not parsed.hostname:
        raise JobsError(f"--address {address}: names no host; http://HEAD:8265")
    return address.rstrip("/")


def _find_token(token: str | None = None) -> tuple[str | None, str | None]:
    """(the cluster's token, where it came from), see ``resolve_token``; (None, None)."""
    if token:
        return token.strip(), "the token argument"
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    path = os.environ.get(TOKEN_PATH_ENV)
    if path:
        try:
            return Path(path).read_text().strip(), f"{path} (${TOKEN_PATH_ENV})"
        except OSError as exc:
            raise JobsError(
                f"{TOKEN_PATH_ENV}={path}: cannot read the token file ({exc.strerror})"
            ) from None
    if DEFAULT_TOKEN_FILE.is_file():
        return DEFAULT_TOKEN_FILE.read_text().strip(), str(DEFAULT_TOKEN_FILE)
    return None, None


def resolve_token(token: str | None = None) -> str | None:
    """The cluster's token, from ``token``, ``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``; None when there is none (a cluster without authentication)."""
    return _find_token(token)[0]


def _loopback(host: str | None) -> bool:
    """Whether ``host`` (a URL's host name) is this machine: ``localhost``, 127.0.0.0/8, ::1.
    Other names are not looked up: what they resolve to is not known to be this machine."""
    if not host:
        return False
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_transport(address: str, token: str | None, insecure: bool = False) -> None:
    """Refuse to send ``token`` over plain http to a host other than this machine (anyone on
    the path could read it and use the cluster) unless ``insecure``; ``insecure`` warns."""
    from urllib.parse import urlparse

    parsed = urlparse(address)
    if not token or parsed.scheme != "http" or _loopback(parsed.hostname):
        return
    if insecure:
        print(
            printable(
                f"raytrain: warning: --insecure: the cluster's token goes to {address} "
                "in clear over http"
            ),
            file=sys.stderr,
        )
        return
    raise JobsError(
        f"--address {address}: the cluster's token would travel in clear over http to "
        f"{parsed.hostname}; use https:// (a TLS proxy in front of the dashboard), or a tunnel "
        "to the head (`ray dashboard CLUSTER.yaml`, or `ssh -L 8265:localhost:8265 HEAD`) and "
        "--address http://127.0.0.1:8265; --insecure sends it anyway"
    )


def _refused(exc: Exception, address: str, source: str | None = None) -> TokenRefused | None:
    """Our message for the job server's 'no token' (401) and 'wrong token' (403): Ray's own
    names neither the address nor where raytrain looks for the token. ``source``: where the
    token that was sent came from; None when none was sent."""
    from ray.exceptions import AuthenticationError

    text = str(exc)
    if not isinstance(exc, AuthenticationError) and "status code 40" not in text:
        return None
    where = f"{TOKEN_ENV}, the file {TOKEN_PATH_ENV} names, or {DEFAULT_TOKEN_FILE}"
    missing = "Missing" in text or "required" in text
    invalid = "Invalid" in text or "failed" in text or "403" in text
    if missing and source is not None:
        return TokenRefused(
            f"{address}: the token was refused: one was sent (from {source}) and the cluster "
            "answered that it requires one; a proxy in front of the dashboard may drop the "
            "Authorization header"
        )
    if missing:
        return TokenRefused(f"{address}: the cluster requires a token; none was found in {where}")
    if invalid:
        return TokenRefused(f"{address}: the cluster refused the token from {source or where}")
    return None
