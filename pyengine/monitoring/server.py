"""The monitoring server: a small read-only HTTP server on the standard library.

Routes (all GET; HEAD too):

=============================================================  ==============================================
``/``                                                          the dashboard (static files shipped with pyengine)
``/jobs``                                                      Flink's job list
``/jobs/:jobid``                                               Flink's ``JobDetailsInfo``
``/jobs/:jobid/checkpoints``                                   Flink's ``CheckpointingStatistics``
``/jobs/:jobid/checkpoints/config``                            Flink's ``CheckpointConfigInfo``
``/jobs/:jobid/checkpoints/details/:checkpointid``             Flink's ``CheckpointStatistics``
``/jobs/:jobid/checkpoints/details/:checkpointid/subtasks/:v`` Flink's ``TaskCheckpointStatisticsWithSubtaskDetails``
``/jobs/:jobid/vertices/:vertexid/backpressure``               Flink's ``JobVertexBackPressureInfo``
``/jobs/:jobid/progress``                                      Spark's ``StreamingQueryProgress`` (``lastProgress``)
``/jobs/:jobid/recent-progress``                               the progress history (Spark's ``recentProgress``)
``/metrics``                                                   Prometheus
=============================================================  ==============================================

Flink's ``/v1/`` prefix is accepted too. Errors are Flink's ``{"errors": [...]}``.

What guards it: it listens on loopback unless told otherwise, and then only with
a token, compared in constant time (``hmac.compare_digest``); on loopback without
a token it answers only requests whose ``Host`` is a loopback name, so a web page
cannot reach it through DNS rebinding. It reads no request body (a request with
one is refused before it is read), bounds the request line, the request's head and
the query, sends JSON and static files only, and never unpickles anything.

What a slow or greedy client can do to it (issue 37): nothing beyond its own
requests. Connections are served on one event loop (asyncio), so a connection that
trickles its request costs a socket, not a thread or a slot others wait for. Each
request has a deadline for the whole exchange (``request_timeout_s``, reading the
request and sending the answer; a per-read timeout let a byte every few seconds
hold a connection for ever). Connections are bounded per client address
(``MAX_CONNECTIONS_PER_CLIENT``) and in total (``MAX_CONNECTIONS``); at a bound, the
oldest connection still sending its request is closed to make room (the one
furthest from its deadline's end is the likeliest to be a slow client), so a
request that arrives whole is answered even while slow clients fill the bounds.
The token (and the ``Host``) is checked as soon as the request's head is in,
before any route runs.

What it costs: answers come from ``JobMonitor.body``, built once per version of
what they show, and the static files are read once; the CPU time of the server's
event loop thread (accepting, reading, building and sending answers) is charged to
``JobMonitor.cpu_seconds``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import http.client
import io
import logging
import mimetypes
import re
import socket
import threading
import time
import urllib.parse
from email.utils import formatdate
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from .config import is_loopback

if TYPE_CHECKING:
    from .monitor import JobMonitor

__all__ = ["MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_CLIENT", "MAX_PATH", "MonitoringServer"]

log = logging.getLogger(__name__)

MAX_PATH = 2048  # bytes of the request target
MAX_CONNECTIONS = 64  # open at once, in total
MAX_CONNECTIONS_PER_CLIENT = 16  # open at once from one client address
MAX_QUERY_FIELDS = 8  # parameters in a query string (the API takes one: ``token``)
MAX_HEAD = 64 * 1024  # bytes of a request line or header line, as http.server
MAX_HEADERS = 100  # header lines of a request, as http.server
REQUEST_TIMEOUT_S = 10.0  # the default deadline of a whole request (see ``Monitoring``)
LISTEN_BACKLOG = 32
TOKEN_COOKIE = "pyengine_token"
SERVER_NAME = "pyengine-monitoring"

_STATIC = {
    "/": "index.html",
    "/index.html": "index.html",
    "/dashboard.js": "dashboard.js",
    "/dashboard.css": "dashboard.css",
}
_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; frame-ancestors 'none'",
}
_READ_ONLY = frozenset({"POST", "PUT", "DELETE", "PATCH", "OPTIONS"})

Route = Callable[..., Tuple[int, Any]]


_STATIC_CACHE: Dict[str, bytes] = {}


def _static(name: str) -> bytes:
    """A file of the dashboard, read from the package once per process."""
    data = _STATIC_CACHE.get(name)
    if data is None:
        data = resources.files("pyengine.monitoring").joinpath("static").joinpath(name).read_bytes()
        _STATIC_CACHE[name] = data
    return data


class _Refusal(Exception):
    """A request answered with an error and the connection closed."""

    def __init__(self, status: int, message: str, extra: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra or {}


class _Connection:
    """One open connection: who, since when, and whether it is still sending its request."""

    __slots__ = ("client", "opened", "reading", "transport")

    def __init__(self, client: str, transport: asyncio.WriteTransport) -> None:
        self.client = client
        self.opened = time.monotonic()
        self.reading = True  # sending its request: the kind a new connection may push out
        self.transport = transport


class MonitoringServer:
    """Serves one job's monitor on ``host:port`` (0: a free port) until ``close()``;
    ``url`` is where. Raises ``OSError`` when it cannot listen.

    ``request_timeout_s``: the deadline of one request, from its connection's accept
    to the last byte of its answer; a connection past it is closed (with a 408 when
    it had not sent its request yet). ``max_connections`` and ``max_per_client``: the
    bounds on open connections, in total and per client address."""

    def __init__(
        self,
        monitor: JobMonitor,
        host: str = "127.0.0.1",
        port: int = 0,
        token: Optional[str] = None,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
    ) -> None:
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
        if not 1 <= max_per_client <= max_connections:
            raise ValueError(
                f"the connection bounds must satisfy 1 <= max_per_client ({max_per_client}) "
                f"<= max_connections ({max_connections})"
            )
        self.monitor = monitor
        self.host = host
        self.request_timeout_s = float(request_timeout_s)
        self.max_connections = int(max_connections)
        self.max_per_client = int(max_per_client)
        self._token = token.encode() if token is not None else None
        self._loopback_only = token is None and is_loopback(host)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        bind = "127.0.0.1" if host == "localhost" else host
        # Bound here, on the caller's thread, so a port in use raises OSError from the
        # constructor. No SO_REUSEADDR: a second job must not share a port it cannot own.
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.bind((bind, port))
            self._socket.listen(LISTEN_BACKLOG)
            self._socket.setblocking(False)
        except BaseException:
            self._socket.close()
            raise
        self.port = int(self._socket.getsockname()[1])
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/"
        self._open: List[_Connection] = []  # in the order they were accepted (only the loop's thread)
        self._closing = False
        self.evicted = 0  # connections closed to make room for a new one (for the log, and tests)
        self.expired = 0  # connections closed at their deadline
        self._cpu_mark = 0
        self._loop = asyncio.new_event_loop()
        # answers are made here, off the loop (at most 4 at once: the server is for a few people)
        self._workers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="pyengine-monitor-answer")
        self._stopped: Optional[asyncio.Future[None]] = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="pyengine-monitor", daemon=True)
        self._thread.start()
        started.wait(5)

    def close(self) -> None:
        """Stops serving at once: no new connection is taken, open ones are closed,
        and the loop's thread is joined."""
        self._closing = True
        loop = self._loop
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stop)
            except RuntimeError:  # the loop already ended
                pass
        self._thread.join(5)
        if self._thread.is_alive():
            log.warning("the monitoring server on port %d did not stop within 5 s", self.port)
        self._workers.shutdown(wait=False, cancel_futures=True)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self, started: threading.Event) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        self._cpu_mark = time.thread_time_ns()
        try:
            loop.run_until_complete(self._serve(started))
        except Exception:  # never expected: said, and the job runs on without its server
            log.exception("the monitoring server on port %d stopped", self.port)
        finally:
            started.set()
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self._socket.close()
                self._charge()

    async def _serve(self, started: threading.Event) -> None:
        self._stopped = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(self._client, sock=self._socket, limit=MAX_HEAD)
        started.set()
        try:
            if not self._closing:
                await self._stopped
        finally:
            server.close()
            for conn in list(self._open):
                conn.transport.abort()
            # the connections' own tasks end here, not destroyed pending with the loop
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await server.wait_closed()

    def _stop(self) -> None:
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    def _charge(self) -> None:
        """Charges the loop thread's CPU time since the last charge (on the loop's thread)."""
        now = time.thread_time_ns()
        self.monitor.charge(now - self._cpu_mark)
        self._cpu_mark = now

    def _admit(self, transport: asyncio.WriteTransport) -> Optional[_Connection]:
        """A new connection's place, made at a bound by closing the oldest connection still
        sending its request (of this client at its own bound; of the client with the most
        connections at the total bound); None when there is no such connection to close."""
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        mine = [c for c in self._open if c.client == client]
        if len(mine) >= self.max_per_client:
            if not self._evict(mine):
                return None
        if len(self._open) >= self.max_connections:
            counts: Dict[str, int] = {}
            for c in self._open:
                counts[c.client] = counts.get(c.client, 0) + 1
            greediest = max(counts, key=lambda k: counts[k])
            if not self._evict([c for c in self._open if c.client == greediest]) and not self._evict(self._open):
                return None
        conn = _Connection(client, transport)
        self._open.append(conn)
        return conn

    def _evict(self, candidates: List[_Connection]) -> bool:
        for conn in candidates:  # oldest first
            if conn.reading:
                self._open.remove(conn)
                conn.transport.abort()
                self.evicted += 1
                n = self.evicted
                if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: seen, without flooding the log
                    log.warning(
                        "the monitoring server closed %d connection(s) that had not sent their request "
                        "to make room for new ones (slow or idle clients; bounds: %d per client, %d in all)",
                        n,
                        self.max_per_client,
                        self.max_connections,
                    )
                return True
        return False

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        conn = None if self._closing else self._admit(transport)
        if conn is None:
            transport.abort()
            return
        # Written straight to the socket, and drained to empty: closing then waits for nothing.
        transport.set_write_buffer_limits(high=0)
        try:
            await asyncio.wait_for(self._exchange(conn, reader, writer), self.request_timeout_s)
        except asyncio.TimeoutError:
            self.expired += 1
            if conn.reading and not transport.is_closing():  # a slow client: said, never waited for
                transport.write(self._answer(408, {"errors": ["the request took too long to arrive"]}, {}))
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass  # the client went away (or was pushed out): nothing to answer
        except asyncio.CancelledError:
            pass  # the server is closing: the connection goes with it
        except Exception:  # a bug of the server's own: logged, the client gets no traceback
            log.exception("the monitoring server failed on a request")
        finally:
            if conn in self._open:
                self._open.remove(conn)
            transport.abort()
            self._charge()

    async def _exchange(self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, target, headers = await self._read_head(reader)
            conn.reading = False
        except _Refusal as refused:
            conn.reading = False
            status, body, extra = refused.status, {"errors": [refused.message]}, refused.extra
            writer.write(self._answer(status, body, extra))
        else:
            # the route and its encoding on a worker thread: a slow route (a long checkpoint
            # history, a busy job holding the GIL) must not stall every other connection's
            # reading and deadlines on the loop
            status, answer = await asyncio.get_running_loop().run_in_executor(
                self._workers, self._respond, method, target, headers
            )
            writer.write(answer)
        await writer.drain()
        log.debug("monitoring %s: %d", conn.client, status)

    async def _read_head(self, reader: asyncio.StreamReader) -> Tuple[str, str, http.client.HTTPMessage]:
        """The request line and headers, each line bounded (``MAX_HEAD``), at most
        ``MAX_HEADERS`` of them; the target's length is checked as soon as it is read."""
        line = await self._line(reader)
        while line in (b"\r\n", b"\n"):  # blank lines before a request are allowed (RFC 9112)
            line = await self._line(reader)
        words = line.decode("iso-8859-1").rstrip("\r\n").split()
        if len(words) != 3 or not words[2].startswith("HTTP/"):
            raise _Refusal(400, "a request line is METHOD TARGET HTTP/1.x")
        method, target, _ = words
        if len(target) > MAX_PATH:
            raise _Refusal(414, f"request target longer than {MAX_PATH} bytes")
        lines = []
        while True:
            line = await self._line(reader)
            if line in (b"\r\n", b"\n"):
                break
            lines.append(line)
            if len(lines) > MAX_HEADERS:
                raise _Refusal(431, f"more than {MAX_HEADERS} header lines")
        try:
            headers = http.client.parse_headers(io.BytesIO(b"".join(lines) + b"\r\n"))
        except http.client.HTTPException:
            raise _Refusal(400, "malformed headers") from None
        return method, target, headers

    @staticmethod
    async def _line(reader: asyncio.StreamReader) -> bytes:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            raise _Refusal(431, f"a request line or header longer than {MAX_HEAD} bytes") from None
        return line

    def _respond(self, method: str, target: str, headers: Any) -> Tuple[int, bytes]:
        """A request's status and whole answer (on a worker thread, whose CPU time is
        charged to the monitor as the loop's is)."""
        start = time.thread_time_ns()
        try:
            try:
                status, body, extra, head = self._handle(method, target, headers)
            except _Refusal as refused:
                status, body, extra, head = refused.status, {"errors": [refused.message]}, refused.extra, False
            return status, self._answer(status, body, extra, head=head)
        finally:
            self.monitor.charge(time.thread_time_ns() - start)

    def _handle(self, method: str, target: str, headers: Any) -> Tuple[int, Any, Dict[str, str], bool]:
        """(status, body, extra headers, HEAD) for a request whose head is in: the checks
        that need no route first (method, body, ``Host``, query, token), then the route."""
        if method in _READ_ONLY:
            raise _Refusal(405, "the monitoring API is read-only (GET)", {"Allow": "GET, HEAD"})
        if method not in ("GET", "HEAD"):
            raise _Refusal(501, f"unsupported method {method[:20]!r}", {"Allow": "GET, HEAD"})
        length = headers.get("Content-Length")
        if (length not in (None, "0")) or headers.get("Transfer-Encoding"):
            raise _Refusal(413, "the monitoring API takes no request body")
        if not self.host_allowed(headers.get("Host")):
            raise _Refusal(421, "this server answers only to a loopback Host")
        parts = urllib.parse.urlsplit(target)
        try:
            query = dict(urllib.parse.parse_qsl(parts.query, max_num_fields=MAX_QUERY_FIELDS))
        except ValueError:  # more fields than that: a bad request, not the server's failure
            raise _Refusal(400, f"a query of more than {MAX_QUERY_FIELDS} parameters") from None
        allowed, from_query = self.authorized(headers, query)
        if not allowed:
            raise _Refusal(401, "a token is needed", {"WWW-Authenticate": 'Bearer realm="pyengine"'})
        path = urllib.parse.unquote(parts.path)
        if len(path) > 1 and path.endswith("/"):
            path = path[:-1]
        try:
            status, payload, kind = self.respond(path)
            body: Any = (payload, kind)
        except Exception as exc:  # the job's own trouble: said plainly, never a traceback
            log.exception("monitoring request %s failed", path)
            status, body = 500, {"errors": [f"{type(exc).__name__}: {str(exc)[:200]}"]}
        extra = {}
        if from_query and self._token is not None:  # the dashboard's first visit: keep the token
            extra["Set-Cookie"] = f"{TOKEN_COOKIE}={query['token']}; HttpOnly; SameSite=Strict; Path=/"
        return status, body, extra, method == "HEAD"

    def _answer(self, status: int, body: Any, extra: Dict[str, str], head: bool = False) -> bytes:
        """The whole answer, status line to body, as one piece (one send)."""
        _, payload, kind = self.monitor.encode(status, body)
        reason = http.client.responses.get(status, "")
        lines = [
            f"HTTP/1.0 {status} {reason}",
            f"Server: {SERVER_NAME}",
            f"Date: {formatdate(usegmt=True)}",
            f"Content-Type: {kind}",
            f"Content-Length: {len(payload)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in {**_SECURITY_HEADERS, **extra}.items()),
        ]
        head_bytes = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")
        return head_bytes if head else head_bytes + payload

    # -- checks --------------------------------------------------------------------------

    def authorized(self, headers: Any, query: Dict[str, str]) -> Tuple[bool, bool]:
        """(allowed, came with ``?token=``): the bearer token, the token cookie the
        dashboard got on its first visit, or ``?token=``, compared in constant time."""
        if self._token is None:
            return True, False
        candidates = []
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            candidates.append((auth[7:].strip(), False))
        for part in headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == TOKEN_COOKIE:
                candidates.append((value, False))
        if "token" in query:
            candidates.append((query["token"], True))
        for value, from_query in candidates:
            if hmac.compare_digest(value.encode("utf-8", "replace"), self._token):
                return True, from_query
        return False, False

    def host_allowed(self, host_header: Optional[str]) -> bool:
        """On loopback without a token, only a loopback ``Host`` (DNS-rebinding guard)."""
        if not self._loopback_only:
            return True
        if not host_header:
            return False
        host = host_header.strip()
        if host.startswith("["):
            name = host[1 : host.find("]")] if "]" in host else host
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return is_loopback(name)

    # -- routes ------------------------------------------------------------------------------

    def respond(self, path: str) -> Tuple[int, bytes, str]:
        """(status, payload, content type) for a path: the static files as they are,
        everything else built once per version of the job's statistics (see
        ``JobMonitor.body``)."""
        m = self.monitor
        if path in _STATIC or (path.startswith("/v1/") and path[3:] in _STATIC):
            return m.encode(*self.route(path))
        return m.body(path, lambda: m.encode(*self.route(path)))

    def route(self, path: str) -> Tuple[int, Any]:
        """(status, body) for a path; the body is JSON-able, or bytes with a content type."""
        m = self.monitor
        if path.startswith("/v1/"):
            path = path[3:]
        if path in _STATIC:
            name = _STATIC[path]
            kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
            return 200, (
                _static(name),
                kind + ("; charset=utf-8" if kind.startswith("text/") or "javascript" in kind else ""),
            )
        if path == "/metrics":
            try:
                return 200, m.metrics_text()
            except ImportError:
                return 503, {"errors": ["/metrics needs prometheus_client: pip install prometheus_client"]}
        if path in ("/jobs", "/jobs/overview"):
            return 200, m.jobs_overview()
        match = re.fullmatch(r"/jobs/([^/]+)(/.*)?", path)
        if match is None:
            return 404, {"errors": ["Not found: " + path[:200]]}
        if match.group(1) != m.job_id:
            return 404, {"errors": [f"Job {match.group(1)[:64]} not found"]}
        rest = match.group(2) or ""
        if rest == "":
            return 200, m.job_details()
        if rest == "/checkpoints":
            return 200, m.checkpoints()
        if rest == "/checkpoints/config":
            info = m.config_info()
            if info is None:
                return 404, {"errors": ["Checkpointing is not enabled for this job."]}
            return 200, info
        if rest == "/progress":
            return 200, m.progress()
        if rest == "/recent-progress":
            return 200, m.recent_progress()
        found = re.fullmatch(r"/checkpoints/details/(\d{1,18})(?:/subtasks/([^/]+))?", rest)
        if found is not None:
            checkpoint_id = int(found.group(1))
            if found.group(2) is None:
                body = m.checkpoint_details(checkpoint_id)
            else:
                body = m.subtask_details(checkpoint_id, found.group(2))
            if body is None:
                return 404, {"errors": [f"Could not find checkpointing statistics for checkpoint {checkpoint_id}."]}
            return 200, body
        found = re.fullmatch(r"/vertices/([^/]+)/backpressure", rest)
        if found is not None:
            body = m.backpressure(found.group(1))
            if body is None:
                return 404, {"errors": [f"Vertex {found.group(1)[:64]} not found"]}
            return 200, body
        return 404, {"errors": ["Not found: " + path[:200]]}
