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
one is refused before it is read), bounds the request line and the number of
connections it serves at once, times out slow clients, sends JSON and static
files only, and never unpickles anything.

What it costs: answers come from ``JobMonitor.body``, built once per version of
what they show, and the static files are read once; the CPU time of every
request's thread and of the accept loop is charged to ``JobMonitor.cpu_seconds``."""

from __future__ import annotations

import hmac
import logging
import mimetypes
import re
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from .config import is_loopback

if TYPE_CHECKING:
    from .monitor import JobMonitor

__all__ = ["MAX_CONNECTIONS", "MAX_PATH", "MonitoringServer"]

log = logging.getLogger(__name__)

MAX_PATH = 2048  # bytes of the request target
MAX_CONNECTIONS = 16  # served at once; more are closed at once
REQUEST_TIMEOUT_S = 10
WRITE_BUFFER = 256 * 1024  # bytes of an answer sent in one piece (a big job's /metrics is ~100 KiB)
TOKEN_COOKIE = "pyengine_token"

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

Route = Callable[..., Tuple[int, Any]]


_STATIC_CACHE: Dict[str, bytes] = {}


def _static(name: str) -> bytes:
    """A file of the dashboard, read from the package once per process."""
    data = _STATIC_CACHE.get(name)
    if data is None:
        data = resources.files("pyengine.monitoring").joinpath("static").joinpath(name).read_bytes()
        _STATIC_CACHE[name] = data
    return data


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False  # a second job must not share a port it cannot own
    request_queue_size = 32

    def __init__(self, address: Tuple[str, int], handler: Any, family: int, charge: Callable[[int], None]) -> None:
        self.address_family = family
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.closing = False
        self.charge = charge
        self._loop_cpu_ns = 0
        super().__init__(address, handler)

    def service_actions(self) -> None:
        """Once per turn of ``serve_forever``'s loop (on its thread): charges the CPU
        time the loop spent since its last turn (polling, accepting, starting threads)."""
        now = time.thread_time_ns()
        if self._loop_cpu_ns:
            self.charge(now - self._loop_cpu_ns)
        self._loop_cpu_ns = now

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.closing or not self.slots.acquire(blocking=False):  # closing, or too many at once
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        started = time.thread_time_ns()
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
            self.charge(time.thread_time_ns() - started)


class MonitoringServer:
    """Serves one job's monitor on ``host:port`` (0: a free port) until ``close()``;
    ``url`` is where. Raises ``OSError`` when it cannot listen."""

    def __init__(self, monitor: JobMonitor, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None):
        self.monitor = monitor
        self.host = host
        self._token = token.encode() if token is not None else None
        self._loopback_only = token is None and is_loopback(host)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        bind = "127.0.0.1" if host == "localhost" else host
        self._httpd = _Server((bind, port), _handler(self), family, monitor.charge)
        self.port = int(self._httpd.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="pyengine-monitor", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stops serving at once: the job's end must not wait for the server's poll
        interval, so a connection of its own wakes the loop to see the request."""
        httpd = self._httpd
        httpd.closing = True
        stopper = threading.Thread(target=httpd.shutdown, daemon=True)
        stopper.start()
        try:
            host = "127.0.0.1" if self.host in ("localhost", "0.0.0.0") else "::1" if self.host == "::" else self.host
            with socket.create_connection((host, self.port), timeout=1):
                pass
        except OSError:
            pass  # the loop still sees the request within its poll interval
        stopper.join(5)
        httpd.server_close()
        self._thread.join(5)

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


def _handler(server: MonitoringServer) -> Any:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S
        # Headers and body leave in one send when they fit (flushed as the request
        # ends): each socket call lets go of the GIL and takes it back from the job's
        # threads, so one send is one hand-over instead of two.
        wbufsize = WRITE_BUFFER
        server_version = "pyengine-monitoring"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("monitoring %s: " + format, self.client_address[0], *args)

        def _send(self, status: int, body: Any, extra: Optional[Dict[str, str]] = None, head: bool = False) -> None:
            _, payload, kind = server.monitor.encode(status, body)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            for name, value in {**_SECURITY_HEADERS, **(extra or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(payload)

        def _refuse(self, status: int, message: str, extra: Optional[Dict[str, str]] = None) -> None:
            self.close_connection = True
            self._send(status, {"errors": [message]}, extra)

        def _serve(self, head: bool) -> None:
            if len(self.path) > MAX_PATH:
                return self._refuse(414, f"request target longer than {MAX_PATH} bytes")
            length = self.headers.get("Content-Length")
            if (length not in (None, "0")) or self.headers.get("Transfer-Encoding"):
                return self._refuse(413, "the monitoring API takes no request body")
            if not server.host_allowed(self.headers.get("Host")):
                return self._refuse(421, "this server answers only to a loopback Host")
            target = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(target.query, max_num_fields=8))
            allowed, from_query = server.authorized(self.headers, query)
            if not allowed:
                return self._refuse(401, "a token is needed", {"WWW-Authenticate": 'Bearer realm="pyengine"'})
            path = urllib.parse.unquote(target.path)
            if len(path) > 1 and path.endswith("/"):
                path = path[:-1]
            try:
                status, payload, kind = server.respond(path)
                body: Any = (payload, kind)
            except Exception as exc:  # the job's own trouble: said plainly, never a traceback
                log.exception("monitoring request %s failed", path)
                status, body = 500, {"errors": [f"{type(exc).__name__}: {str(exc)[:200]}"]}
            extra = {}
            if from_query and server._token is not None:  # the dashboard's first visit: keep the token
                extra["Set-Cookie"] = f"{TOKEN_COOKIE}={query['token']}; HttpOnly; SameSite=Strict; Path=/"
            self._send(status, body, extra, head=head)
            return None

        def do_GET(self) -> None:
            self._serve(head=False)

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def _not_allowed(self) -> None:
            self._refuse(405, "the monitoring API is read-only (GET)", {"Allow": "GET, HEAD"})

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    return Handler
