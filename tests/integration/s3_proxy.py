"""A fault-injecting HTTP reverse proxy on loopback, in front of an S3 endpoint, for the tests.

Stdlib only: a ``ThreadingHTTPServer`` in a daemon thread forwards each request (any method,
path and query, headers, body) to the upstream endpoint with ``http.client`` and streams the
answer back, so a client pointed at the proxy talks to the real server::

    with moto_server(log) as upstream, s3_proxy(upstream) as proxy:
        fs = pyarrow.fs.S3FileSystem(endpoint_override=proxy.endpoint, ...)
        proxy.fail_next(2)  # the next two requests get 503 SlowDown, unforwarded
        stalled = proxy.stall_when(lambda method, path: method == "PUT")
        ...
        assert stalled.wait(30)  # a matching request arrived and hangs, unanswered
        proxy.release()  # its connection is closed, still unanswered

The ``Host`` header goes upstream as the client sent it (the proxy's address), since AWS
SigV4 signs it. Request bodies framed by ``Content-Length`` are forwarded byte for byte, and
``Transfer-Encoding: chunked`` ones with their chunk framing (and trailers) as received. The
proxy answers ``Expect: 100-continue`` itself and does not pass that header on. Each request
opens its own upstream connection; the client's connection to the proxy is kept alive.
"""

from __future__ import annotations

import http.client
import select
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

_CHUNK = 64 * 1024
# Hop-by-hop headers (RFC 9110 7.6.1): never forwarded as they are. A chunked request body
# goes upstream with its framing unchanged, so its Transfer-Encoding header goes along.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}
_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "AccessDenied": "Access Denied",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
}

Predicate = Callable[[str, str], bool]


class _ClientGone(Exception):
    """The client sent a malformed or truncated request body, or hung up."""


@dataclass(frozen=True)
class _Verdict:
    kind: str  # "forward", "fail" or "stall"
    status: int = 0
    code: str = ""
    release: threading.Event | None = None
    drain: bool = True


class S3Proxy:
    """A running proxy: its ``endpoint``, the requests it saw, and the fault controls."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream must be http(s)://host[:port], got {upstream!r}")
        self.upstream = upstream
        self._upstream_https = parts.scheme == "https"
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port
        self.upstream_timeout = 300.0
        self.requests: list[tuple[str, str]] = []  # (method, path with query), as seen
        self._lock = threading.Lock()
        self._fail_left = 0
        self._fail_status = 503
        self._fail_code = "SlowDown"
        self._failed = 0
        self._stall: Predicate | None = None
        self._stall_drain = True
        self._stall_event = threading.Event()
        self._stall_release = threading.Event()
        self._stalled = 0
        self._stopped = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self.port: int = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"s3-proxy-{self.port}", daemon=True
        )

    # -- fault controls ---------------------------------------------------------------------

    def fail_next(self, n: int, status: int = 503, code: str = "SlowDown") -> None:
        """Answer the next ``n`` requests with ``status`` and an S3 error ``code``, unforwarded.

        Replaces any failures still pending; ``fail_next(0)`` cancels them.
        """
        with self._lock:
            self._fail_left = n
            self._fail_status = status
            self._fail_code = code

    @property
    def failed(self) -> int:
        """How many requests ``fail_next`` has failed so far."""
        with self._lock:
            return self._failed

    def stall_when(self, predicate: Predicate, *, drain: bool = True) -> threading.Event:
        """From now on, hang every request whose ``(method, path)`` matches ``predicate``.

        A matching request is neither forwarded nor answered: its handler reads the request
        body and discards it (or, with ``drain=False``, stops reading, so the client's send
        blocks), then waits until :meth:`release` or the proxy stops, and closes the
        connection without answering (with ``drain``, it also stops waiting when the client
        hangs up first). The returned event is set when the first matching request arrives.
        A new call replaces the predicate and returns a new event.
        """
        with self._lock:
            self._stall = predicate
            self._stall_drain = drain
            self._stall_event = threading.Event()
            self._stall_release = threading.Event()
            return self._stall_event

    def release(self) -> None:
        """Stop stalling: drop the predicate; the hanging handlers close their connections."""
        with self._lock:
            self._stall = None
            self._stall_release.set()

    @property
    def stalled(self) -> int:
        """How many requests have been stalled so far."""
        with self._lock:
            return self._stalled

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Serve in a daemon thread (``s3_proxy`` calls this, and :meth:`stop`)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving: release the stalled handlers and close every client connection."""
        self._stopped.set()
        with self._lock:
            self._stall_release.set()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:  # wakes the handlers idle on a kept-alive connection
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)

    # -- used by the handler ----------------------------------------------------------------

    def _admit(self, method: str, path: str) -> _Verdict:
        """Record a request and decide whether it is failed, stalled or forwarded."""
        with self._lock:
            self.requests.append((method, path))
            if self._fail_left > 0:
                self._fail_left -= 1
                self._failed += 1
                return _Verdict("fail", status=self._fail_status, code=self._fail_code)
            if self._stall is not None and self._stall(method, path):
                self._stalled += 1
                self._stall_event.set()
                return _Verdict("stall", release=self._stall_release, drain=self._stall_drain)
            return _Verdict("forward")

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._upstream_https else http.client.HTTPConnection
        return cls(self._upstream_host, self._upstream_port, timeout=self.upstream_timeout)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], proxy: S3Proxy
    ) -> None:
        self.proxy = proxy
        super().__init__(address, handler)

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that hangs up (or a stop that shuts its socket) is no error here.
        if not isinstance(sys.exc_info()[1], OSError | _ClientGone):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.proxy._lock:
            self.server.proxy._sockets.add(self.connection)

    def finish(self) -> None:
        with self.server.proxy._lock:
            self.server.proxy._sockets.discard(self.connection)
        with suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _handle(self) -> None:
        proxy = self.server.proxy
        if proxy._stopped.is_set():
            self.close_connection = True
            return
        verdict = proxy._admit(self.command, self.path)
        if verdict.kind == "fail":
            self._drain_body()
            self._send_error(verdict.status, verdict.code)
        elif verdict.kind == "stall":
            assert verdict.release is not None
            if verdict.drain:
                self._drain_body()
            while not verdict.release.wait(0.2) and not proxy._stopped.is_set():
                if verdict.drain and self._client_hung_up():
                    break  # the client gave up (its timeout): nothing left to hold
            self.close_connection = True  # hang up, unanswered
            with suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
        else:
            self._forward()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = _handle

    def _client_hung_up(self) -> bool:
        """Whether the client closed its end (only meaningful once its request is all read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    # -- request body -----------------------------------------------------------------------

    def _body_chunks(self) -> Iterator[bytes]:
        """The request body as it came on the wire (chunked framing kept), piece by piece."""
        rfile: IO[bytes] = self.rfile
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = rfile.readline(65537)
                if not line.endswith(b"\n"):
                    raise _ClientGone("bad chunk size line")
                yield line
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise _ClientGone(f"bad chunk size line {line!r}") from None
                if size == 0:
                    while True:  # trailer section, up to its empty line
                        line = rfile.readline(65537)
                        if not line.endswith(b"\n"):
                            raise _ClientGone("truncated chunked trailer")
                        yield line
                        if line in (b"\r\n", b"\n"):
                            return
                left = size + 2  # the data and its CRLF
                while left:
                    data = rfile.read(min(left, _CHUNK))
                    if not data:
                        raise _ClientGone("truncated chunk")
                    left -= len(data)
                    yield data
        length = int(self.headers.get("Content-Length") or 0)
        while length > 0:
            data = rfile.read(min(length, _CHUNK))
            if not data:
                raise _ClientGone("truncated request body")
            length -= len(data)
            yield data

    def _drain_body(self) -> None:
        for _ in self._body_chunks():
            pass

    # -- answers ----------------------------------------------------------------------------

    def _send_error(self, status: int, code: str) -> None:
        message = _MESSAGES.get(code, "Injected by the test proxy.")
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
            f"<Resource>{escape(self.path)}</Resource><RequestId>s3proxy</RequestId></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        if status == 503:
            self.send_header("Retry-After", "0")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self) -> None:
        connection_tokens = {
            t.strip().lower() for t in self.headers.get("Connection", "").split(",") if t.strip()
        }
        skip = _HOP_BY_HOP | connection_tokens | {"expect"}
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            skip.add("content-length")  # RFC 9112 6.3: chunked framing wins
        upstream = self.server.proxy._connect()
        try:
            try:
                upstream.putrequest(
                    self.command, self.path, skip_host=True, skip_accept_encoding=True
                )
                for name, value in self.headers.items():
                    if name.lower() not in skip:
                        upstream.putheader(name, value)
                upstream.endheaders()
            except (OSError, ValueError, http.client.HTTPException):
                self.close_connection = True  # the request body is still unread
                self._send_error(502, "BadGateway")
                return
            for data in self._body_chunks():  # a client gone mid-body raises out of here
                try:
                    upstream.send(data)
                except OSError:
                    # The upstream stopped reading: it may have answered early (an error);
                    # the client's body is partly unread, so its connection closes after.
                    self.close_connection = True
                    break
            try:
                response = upstream.getresponse()
            except (OSError, http.client.HTTPException):
                self.close_connection = True
                self._send_error(502, "BadGateway")
                return
            self._relay(response)
        finally:
            upstream.close()

    def _relay(self, response: http.client.HTTPResponse) -> None:
        no_body = (
            self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        )
        chunked = not no_body and response.chunked
        close_delimited = not no_body and not chunked and response.length is None
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "transfer-encoding":
                self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if close_delimited:
            self.close_connection = True
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if no_body:
            return
        while True:
            try:
                data = response.read(_CHUNK)
            except (OSError, http.client.HTTPException):
                data = None
            # b"" short of its Content-Length: the upstream broke off mid-body, as with an error.
            if data is None or (not data and response.length):
                self.close_connection = True  # hang up on the client too: a short read there
                with suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            if not data:
                break
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            else:
                self.wfile.write(data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")


@contextmanager
def s3_proxy(upstream: str) -> Iterator[S3Proxy]:
    """Start an :class:`S3Proxy` in front of ``upstream`` on a free loopback port; stop it after."""
    proxy = S3Proxy(upstream)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
