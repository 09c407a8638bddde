"""Channels between subtasks over Arrow Flight: how the Spark runner moves data.

Each task serves its input gate on a ``ChannelServer``; each upstream subtask
opens one ``DoPut`` stream per channel (``RemoteChannel``) and writes, in order:

- Arrow record batches as they are (a new stream begins when the schema changes:
  one Flight stream has one schema);
- lists of records, msgpack-encoded by the safe serializer (never pickle) into a
  one-row batch marked ``pyengine: rows``;
- events — barriers, cancellation markers, end of data, end of partition,
  watermarks and watermark status (idle/active) — as metadata-only messages in
  the same stream, so a channel keeps its order: a watermark never overtakes the
  records before it, nor falls behind those after it.

The server pushes every item into the gate with ``put``: a full channel ring
stops the handler reading, Flight's flow control stops the sender — that is the
backpressure across the network, as the bounded rings are within a process.

Who may talk to a server, and how much (shared with the control plane,
``control.py``):

- Every call carries the job's secret token in a call header (``x-pyengine-token``),
  checked by a server middleware (``TokenCheck``) when the call starts, before any
  handler runs: a stream without it is refused before a byte of it is read, and
  the refusal is one plain sentence — no traceback, no path.
- Messages are bounded: a channel refuses a batch over ``MAX_BATCH_BYTES`` and an
  event over ``MAX_EVENT_BYTES`` (senders split larger Arrow batches first), the
  control server a message over ``MAX_CONTROL_MESSAGE_BYTES``, each before decoding it.
- Off loopback, servers speak TLS by default with the job's own certificate
  (``JobTls``, made by the driver for each run): the token never crosses the network
  in clear, and, since both ends present that certificate (mutual TLS), a peer
  without it is turned away during the handshake, before gRPC reads any message.

One limit Flight sets and pyarrow cannot change: gRPC receives a message (a unary
request such as ``DoAction``, or one message of a stream) whole before any handler
or middleware sees it, and Arrow lifts gRPC's receive limit; pyarrow's
``FlightServerBase`` takes no gRPC options to set it again (apache/arrow#40257), so
no bound can be enforced while a message is received. So on plain loopback a local
process can still make a server's gRPC layer hold one large request (about twice
its size: gRPC's buffer and its parsed copy) for the moment it takes to refuse it
(Python never sees it); over TLS such a peer never gets past the handshake. What
this module does about it: after a refusal (no token, or a message over its bound)
the memory that request held is given back to the system (``_MemoryTrim``), so a
refused call leaves the server at its baseline, not hundreds of MB above it.

What must be reachable when the runner leaves one machine: every executor must
reach the driver's control port, and every executor must reach the channel port
of each executor running a downstream task. Both ports are ephemeral (chosen by
the OS, advertised through the control plane), so the network between the driver
and the executors must allow TCP to their ephemeral ports. Servers off loopback
listen on every interface.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, NoReturn, Optional, Tuple, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from ..io import CancelCheckpointMarker, CheckpointBarrier, CheckpointOptions, CheckpointType, EndOfPartition
from ..io.events import Watermark, WatermarkStatus, time_event_from_json, time_event_to_json
from ..state.serializers import SafeSerializer

__all__ = [
    "MAX_BATCH_BYTES",
    "MAX_CONTROL_MESSAGE_BYTES",
    "MAX_EVENT_BYTES",
    "TOKEN_HEADER",
    "ChannelServer",
    "GuardedServer",
    "JobTls",
    "RemoteChannel",
    "TokenCheck",
    "decode_event",
    "encode_event",
]

log = logging.getLogger(__name__)

TOKEN_HEADER = "x-pyengine-token"
# The name both ends put in and check against the job's certificate. Executors'
# addresses are not known when the driver makes it, so clients verify this name
# (``override_hostname``) instead of the address they dial; ``.invalid`` never resolves.
TLS_SERVER_NAME = "pyengine.invalid"
# Control messages are small JSON: an acknowledgement holds state handles (inline
# state up to 20 KiB each, as hex) and batch indexes. 16 MiB is far above any real
# one and far below what would hurt the driver to parse.
MAX_CONTROL_MESSAGE_BYTES = 16 << 20
# A batch a receiver accepts. Senders split Arrow batches above SPLIT_BATCH_BYTES,
# so only a broken or hostile sender meets this.
MAX_BATCH_BYTES = 256 << 20
SPLIT_BATCH_BYTES = 64 << 20
CONNECT_ATTEMPTS = 3  # a RemoteChannel's first call, when the server is "unavailable"
MAX_EVENT_BYTES = 4096  # an event's JSON is under 200 bytes
CLOSE_WAIT_S = 10.0  # how long RemoteChannel.close() lets the sender finish what is queued
# Credit-based flow control (Flink's, since 1.5): a channel's sender has at most CREDITS
# Flight messages written that its receiver has not yet put into the gate; the receiver
# gives credit back CREDIT_BATCH messages at a time (a message per message it put cost
# the channel a quarter of its throughput). Without it gRPC's own buffers (its HTTP/2
# window grows to megabytes) held ~400,000 small records of one slow channel, 160 s of
# its consumer's work: invisible to the producer's adaptive buffers and ahead of every
# barrier, unaligned ones too.
CREDITS = 8
CREDIT_BATCH = CREDITS // 2
_CREDIT = pa.py_buffer(str(CREDIT_BATCH).encode())
REFUSED = "pyengine: refused: this endpoint takes calls only with the job's token"

_ROWS_SCHEMA = pa.schema([("rows", pa.binary())], metadata={b"pyengine": b"rows"})
_SAFE = SafeSerializer()


def encode_event(event: Any) -> bytes:
    """An event as a metadata message (JSON: small, and never code).

    Watermarks and watermark status use ``time_event_to_json``'s shape, the one
    place that says how a time event looks outside a process."""
    from ..runtime.outputs import END_OF_DATA

    body: Dict[str, Any]
    if type(event) is Watermark or type(event) is WatermarkStatus:
        body = time_event_to_json(event)
    elif isinstance(event, CheckpointBarrier):
        body = {
            "e": "barrier",
            "id": event.checkpoint_id,
            "ts": event.timestamp,
            "type": event.options.checkpoint_type.value,
            "unaligned": event.options.unaligned,
        }
    elif isinstance(event, CancelCheckpointMarker):
        body = {"e": "cancel", "id": event.checkpoint_id}
    elif isinstance(event, EndOfPartition):
        body = {"e": "eop"}
    elif event is END_OF_DATA:
        body = {"e": "eod"}
    else:
        raise TypeError(f"not a channel event: {event!r}")
    return json.dumps(body, separators=(",", ":")).encode()


_TIME_EVENTS = ("wm", "idle", "active")
_COUNTED_AS_DATA = (list, pa.RecordBatch, Watermark, WatermarkStatus)


def _int(value: Any) -> int:
    """An integer field as it was sent: ``"12"``, ``12.5`` or ``true`` are corrupt,
    not numbers to be coerced."""
    if type(value) is not int:
        raise TypeError(f"not an int: {value!r}"[:80])
    return value


def decode_event(raw: bytes) -> Any:
    """The event ``encode_event`` made of ``raw``; ``ValueError`` for anything else.

    ``raw`` comes from another process, so it is checked before it is trusted: its
    size before it is parsed, then that it is a JSON object of a known kind whose
    fields have the right types and ranges (a watermark's ``ts`` an int of 64 bits,
    never a float, bool or string) — a corrupt or hostile event is refused, never
    turned into a plausible one."""
    from ..runtime.outputs import END_OF_DATA

    if len(raw) > MAX_EVENT_BYTES:  # refused before parsing: events are tiny
        raise ValueError(f"a channel event of {len(raw)} bytes (at most {MAX_EVENT_BYTES})")
    try:
        body = json.loads(raw)
        if type(body) is not dict:
            raise TypeError("not an object")
        kind = body["e"]
        if kind in _TIME_EVENTS:
            if set(body) != ({"e", "ts"} if kind == "wm" else {"e"}):
                raise KeyError("missing or unknown fields")
            return time_event_from_json(body)
        if kind == "barrier":
            unaligned = body["unaligned"]
            if type(unaligned) is not bool:
                raise TypeError("unaligned is not a bool")
            options = CheckpointOptions(CheckpointType(body["type"]), unaligned=unaligned)
            return CheckpointBarrier(_int(body["id"]), _int(body["ts"]), options)
        if kind == "cancel":
            return CancelCheckpointMarker(_int(body["id"]))
        if kind == "eop":
            return EndOfPartition()
        if kind == "eod":
            return END_OF_DATA
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(f"corrupt channel event {raw[:80]!r}: {type(exc).__name__}") from None
    raise ValueError(f"unknown channel event {str(kind)[:40]!r}")


CONNECT_TIMEOUT_S = 10.0  # how long a new channel waits for its server to accept
SERVE_JOIN_S = 10.0  # how long a server's shutdown waits for its serve() to return


# -- memory a refused call held, given back -------------------------------------------------

TRIM_DELAY_S = 0.25  # after a refusal: gRPC frees the call's request once its status is sent
TRIM_GAP_S = 1.0  # at most one trim a second, however many calls are refused


class _MemoryTrim:
    """Gives the memory a refused call held back to the system, soon after the refusal.

    gRPC receives a unary request (``DoAction``) whole before any middleware or handler
    runs, and pyarrow 26 offers no way to bound it (``FlightServerBase`` takes no gRPC
    options; Arrow sets no receive limit): a 512 MiB call without the token grew a
    server by 1.14 GB. Freed after the refusal, that memory stayed with the process
    (~300 MB of it): glibc keeps freed heap and raises its mmap threshold after a large
    free, so what followed landed in the heap and was never returned. ``malloc_trim(0)``
    returns the free heap (measured: 117 MB left over after a 128 MiB call, 1 MB after a
    trim). It runs on a thread of its own, a moment after a refusal (the request is
    freed once the call's status is sent), at most once per ``TRIM_GAP_S``; a no-op
    where the C library has no ``malloc_trim`` (not glibc)."""

    def __init__(self) -> None:
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.trims = 0  # how many trims ran (for tests)
        try:
            self._trim: Optional[Callable[[int], int]] = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            self._trim = None

    def soon(self) -> None:
        """Asks for a trim a moment from now (never blocks, never raises)."""
        if self._trim is None:
            return
        self._wanted.set()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pyengine-memory-trim", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        trim = self._trim
        assert trim is not None
        while True:
            self._wanted.wait()
            time.sleep(TRIM_DELAY_S)
            self._wanted.clear()
            try:
                trim(0)
                self.trims += 1
            except Exception:  # never expected; the server serves on, with what it holds
                log.debug("malloc_trim failed", exc_info=True)
            time.sleep(TRIM_GAP_S)


MEMORY_TRIM = _MemoryTrim()


# -- who may call: the token, checked before a handler runs ---------------------------------


class _Authenticated(flight.ServerMiddleware):
    """Marks a call whose token ``TokenCheck`` accepted; handlers look for it."""


class TokenCheck(flight.ServerMiddlewareFactory):
    """Refuses any call without the job's token in its ``x-pyengine-token`` header.

    It runs when a call starts, before the handler and before a stream's first
    message is read, so an unauthenticated peer costs a header comparison: nothing
    of its body is copied into Python or parsed (issue 12: one unauthenticated
    128 MiB call used to cost the driver ~900 MB and 5 s of GIL time). The refusal
    is one fixed sentence, so it tells a prober nothing (no traceback, no path)."""

    KEY = "pyengine-auth"

    def __init__(self, token: str, what: str) -> None:
        super().__init__()
        self._token = token.encode()
        self._what = what
        self._lock = threading.Lock()
        self.refused = 0  # how many calls were turned away (for the log, and tests)

    def start_call(self, info: Any, headers: Dict[str, List[Any]]) -> Optional[flight.ServerMiddleware]:
        try:
            values = headers.get(TOKEN_HEADER) or []
            given = values[0] if len(values) == 1 else b""
            if isinstance(given, str):
                given = given.encode("utf-8", "replace")
            if isinstance(given, bytes) and given and hmac.compare_digest(given, self._token):
                return _Authenticated()
        except Exception:  # whatever went wrong, the caller hears only the plain refusal
            pass
        with self._lock:
            self.refused += 1
            n = self.refused
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... refusal: seen, but a flood does not flood the log
            log.warning("%s refused %d call(s) without the job's token", self._what, n)
        MEMORY_TRIM.soon()  # a unary call's body was received whole before this ran: give it back
        raise flight.FlightUnauthenticatedError(REFUSED)


def authenticated(context: Any) -> None:
    """Raises the plain refusal unless ``TokenCheck`` let this call in: a handler's
    own guard, should a server ever be made without the middleware."""
    if context.get_middleware(TokenCheck.KEY) is None:
        raise flight.FlightUnauthenticatedError(REFUSED)


def call_options(token: str) -> flight.FlightCallOptions:
    """What a client sends with every call: the token, in its header."""
    return flight.FlightCallOptions(headers=[(TOKEN_HEADER.encode(), token.encode())])


# -- the network: TLS off loopback ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobTls:
    """A job's own TLS identity: one self-signed certificate and its private key.

    The driver makes one per run (``generate``) and hands it to every task with the
    job's token, in the task's spec; every server presents it, every client trusts
    only it and presents it too (mutual TLS), so only holders of the run's spec can
    connect at all. Clients check the name ``TLS_SERVER_NAME`` rather than the address
    they dial, since executors' addresses are not known when it is made. The key is
    as secret as the token and travels the same way: Spark ships task closures in
    clear unless ``spark.authenticate`` and ``spark.network.crypto.enabled`` are on.
    Plain bytes, so it pickles with the spec."""

    cert_pem: bytes
    key_pem: bytes
    server_name: str = TLS_SERVER_NAME

    def __repr__(self) -> str:  # never the key, in a log or a traceback
        return f"JobTls(server_name={self.server_name!r})"

    @classmethod
    def generate(cls, job: str = "") -> JobTls:
        """A new key (EC P-256) and certificate. Needs ``cryptography`` (on the driver only).

        Valid for ten years: the key lives only as long as the run and is never reused,
        so an expiry would protect nothing and could stop a long streaming job's
        reconnections after a restart."""
        try:
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
        except ImportError:
            raise RuntimeError(
                "the Spark runner off loopback secures its connections with a per-job TLS certificate, "
                "which needs the cryptography package: pip install cryptography (in the spark extra of pyengine)"
            ) from None
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pyengine job {job}"[:64].strip())])
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=True,  # it is its own (and the job's only) trust anchor
            crl_sign=False,
            encipher_only=False,
            decipher_only=False,
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))  # executors' clocks may lag
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_SERVER_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(
            cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )

    def server_options(self) -> Dict[str, Any]:
        """``FlightServerBase`` arguments: present the certificate, demand it of clients."""
        return {
            "tls_certificates": [flight.CertKeyPair(self.cert_pem, self.key_pem)],
            "verify_client": True,
            "root_certificates": self.cert_pem,
        }

    def client_options(self) -> Dict[str, Any]:
        """``FlightClient`` arguments: trust only the job's certificate, and present it."""
        return {
            "tls_root_certs": self.cert_pem,
            "cert_chain": self.cert_pem,
            "private_key": self.key_pem,
            "override_hostname": self.server_name,
        }


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind_address(host: str) -> str:
    return host if is_loopback(host) else "0.0.0.0"


def _free_port(address: str) -> int:
    """A port no socket holds now, for a server asked for port 0.

    gRPC binds with SO_REUSEPORT, and given port 0 Linux may hand it a port that
    another SO_REUSEPORT socket of the same user already holds (grpc issue 10755): a
    new server would then share a port with an old one and take some of its
    connections. A plain socket's port 0 is one no socket holds; the server binds it
    by number. Another process taking it in between is what ``listening_server``
    catches. (The refusals traced since had another cause: see
    ``GuardedServer.shutdown``.)"""
    family, kind, proto, _, where = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.bind(where)
        return int(probe.getsockname()[1])


def server_tls(host: str, tls: Optional[JobTls], plaintext: bool, *, make: bool, what: str) -> Optional[JobTls]:
    """The TLS a server advertising ``host`` uses: ``tls`` if given (on loopback too);
    none on loopback, where nothing crosses a network; off loopback, none only if
    ``plaintext`` says so, else a new certificate when the server may ``make`` one
    (the driver's), else an error: a plain server there would take the token in clear."""
    if tls is not None:
        return tls
    if is_loopback(host) or plaintext:
        return None
    if make:
        return JobTls.generate()
    raise ValueError(
        f"{what} would listen on {host!r} over plain gRPC, sending the job's token in clear: "
        "pass the job's JobTls (the driver's ControlServer.tls), or plaintext=True on a network you trust"
    )


class GuardedServer(flight.FlightServerBase):
    """A Flight server of the job: calls only with its token (``TokenCheck``), TLS off
    loopback (``server_tls``), and one plain sentence for any call it does not serve —
    pyarrow's own answer to those is a Python traceback.

    It listens on ``host`` if that is a loopback address, else on every interface,
    and advertises ``host`` in ``location``."""

    def __init__(
        self, token: str, host: str, port: int, *, tls: Optional[JobTls], plaintext: bool, make_tls: bool, what: str
    ) -> None:
        self.tls = server_tls(host, tls, plaintext, make=make_tls, what=what)
        self.auth = TokenCheck(token, what)
        self.what = what
        scheme = "grpc+tls" if self.tls is not None else "grpc"
        address = _bind_address(host)
        super().__init__(
            f"{scheme}://{address}:{port or _free_port(address)}",
            middleware={TokenCheck.KEY: self.auth},
            **(self.tls.server_options() if self.tls is not None else {}),
        )
        self.host = host
        self._serving: Optional[threading.Thread] = None

    def serve_in_background(self, name: str) -> threading.Thread:
        """Runs ``serve()`` on a daemon thread named ``name``, which ``shutdown()`` joins."""
        thread = threading.Thread(target=self.serve, name=name, daemon=True)
        self._serving = thread  # before it runs: a shutdown that comes first still joins it
        thread.start()
        return thread

    def serve(self) -> None:
        """Blocks until ``shutdown()`` (the server answers calls from its construction on),
        remembering the thread, which ``shutdown()`` joins.

        It waits with pyarrow's ``wait()``, not its ``serve()``: ``serve()`` installs a C
        handler for SIGINT and SIGTERM while it serves and puts back the handler it found
        when it returns, so two servers whose serving overlaps (a job's channel and control
        servers, one run after another in a driver) can leave a shut-down server's handler
        in place, and Ctrl-C in ``execute()`` then does nothing. A job's servers are ended
        by the job, never by a signal."""
        if self._serving is None:
            self._serving = threading.current_thread()
        self.wait()

    def shutdown(self) -> None:
        """Stops the server, then waits for the thread in ``serve()`` to return.

        That wait keeps the process's next server alive. Until ``serve()`` returns, the
        old server's teardown may not be over (pyarrow 26's gRPC), and a server made
        meanwhile could lose its listener to it: a gRPC worker thread shut down and closed
        the new listening socket right after its ``listen`` (the same fd, ~0.2 ms later,
        seen with ``shutdown(2)`` and ``close(2)`` interposed), so its port refused every
        connection from then on. Servers made one after another on loopback: about 1 in
        3,000 never answered; none of 24,000 once each serving thread was joined, none of
        18,000 with no serving thread. It is the likely cause of the refused channel and
        control calls CI runs reported (the last one's, a channel refused for 30 s, fits
        it: the bench made each server right after the last one's shutdown)."""
        super().shutdown()
        serving = self._serving
        if serving is not None and serving is not threading.current_thread():
            serving.join(SERVE_JOIN_S)
            if serving.is_alive():
                log.warning(
                    "%s on port %d: its serving thread did not return within %.0f s", self.what, self.port, SERVE_JOIN_S
                )

    @property
    def location(self) -> str:
        return f"{'grpc+tls' if self.tls is not None else 'grpc'}://{self.host}:{self.port}"

    def listening(self, within_s: float = 1.0) -> bool:
        """Whether a TCP connection to the server's port is accepted (within ``within_s``):
        checked once after starting it, see ``listening_server``."""
        host = self.host if is_loopback(self.host) else "127.0.0.1"
        deadline = time.monotonic() + within_s
        while True:
            try:
                with socket.create_connection((host, self.port), timeout=within_s):
                    return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)

    def _unserved(self, context: Any, method: str) -> Any:
        authenticated(context)
        raise flight.FlightServerError(f"pyengine: {self.what} does not serve {method}")

    def list_flights(self, context: Any, criteria: Any) -> Any:
        return self._unserved(context, "ListFlights")

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        return self._unserved(context, "GetFlightInfo")

    def get_schema(self, context: Any, descriptor: Any) -> Any:
        # An empty schema, not an error: pyarrow sends any exception raised here with its
        # Python traceback (it converts Flight errors for the other methods, not this one).
        authenticated(context)
        return flight.SchemaResult(pa.schema([]))

    def do_get(self, context: Any, ticket: Any) -> Any:
        return self._unserved(context, "DoGet")

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        self._unserved(context, "DoPut")

    def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        self._unserved(context, "DoExchange")

    def list_actions(self, context: Any) -> Any:
        return self._unserved(context, "ListActions")

    def do_action(self, context: Any, action: Any) -> Any:
        return self._unserved(context, "DoAction")


S = TypeVar("S", bound=GuardedServer)


def listening_server(make: Callable[[], S], attempts: int = 3) -> S:
    """A server from ``make()`` that accepts connections at its port, made again (on a
    new port) when one does not: a server that does not answer its own port is replaced
    before anyone is told of it. CI runs saw just-started loopback servers refuse every
    connection; the cause traced since, a server made while another's teardown was still
    running, has not been seen once ``GuardedServer.shutdown`` joined the serving thread
    (none of 24,000). This check stays for what that does not cover; a listener lost after
    this check passed is not caught here."""
    for attempt in range(1, attempts + 1):
        server = make()
        if server.listening():
            return server
        log.warning(
            "%s on port %d refused connections when started (attempt %d of %d): starting it again",
            server.what,
            server.port,
            attempt,
            attempts,
        )
        server.shutdown()
    raise ConnectionError(f"{server.what} refused connections at every port it started on ({attempts} tries)")


def _row_payloads(rows: List[Any], limit: int) -> Iterator[bytes]:
    """A list of Python records as serialized pieces of at most ``limit`` bytes where
    the records allow (halving the list), so large records in a full buffer stay
    under the receiver's batch cap as Arrow batches do; the pieces arrive in order as
    consecutive buffers."""
    payload = _SAFE.dumps(rows)
    if len(payload) <= limit or len(rows) < 2:
        yield payload
        return
    middle = len(rows) // 2
    yield from _row_payloads(rows[:middle], limit)
    yield from _row_payloads(rows[middle:], limit)


def first_call(call: Callable[[], Any]) -> Any:
    """A client's first call, retried while the address refuses, for up to
    CONNECT_TIMEOUT_S: the server may be a moment from listening, and gRPC shares one
    connection per address across a process's clients, so a server that just closed
    on a port a new one now has can leave a refused connection behind for a while.
    A refused call delivered nothing, so calling again is safe."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    pause = 0.02
    while True:
        try:
            return call()
        except flight.FlightUnavailableError:
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 0.5)


# Each client its own gRPC subchannels: by default a process's clients share one per
# address, so a connection refused by a server that closed (its port since taken by a
# new one) stays in reconnect backoff for every later client of that address, past
# first_call's retries (seen in CI: a control call refused for 9.6 s).
_OWN_SUBCHANNELS = [("grpc.use_local_subchannel_pool", 1)]


def connect(location: str, tls: Optional[JobTls]) -> flight.FlightClient:
    """A Flight client for ``location``: over TLS with the job's certificate when the
    location says ``grpc+tls``, which it refuses to reach without one."""
    if location.startswith("grpc+tls://"):
        if tls is None:
            raise ValueError(f"{location} speaks TLS: pass the job's JobTls to reach it")
        return flight.FlightClient(location, generic_options=_OWN_SUBCHANNELS, **tls.client_options())
    return flight.FlightClient(location, generic_options=_OWN_SUBCHANNELS)


def _channel_descriptor(channel: int) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(json.dumps({"channel": channel}).encode())


class ChannelServer(GuardedServer):
    """A task's input gate, served: upstream subtasks ``DoPut`` their channels here.

    On loopback it speaks plain gRPC unless ``tls`` is given; advertising any other
    ``host`` it listens on every interface and needs the job's ``tls`` (or an explicit
    ``plaintext=True``). It refuses a batch over ``max_batch_bytes`` before decoding
    it, and a call without the token before reading it (``TokenCheck``)."""

    def __init__(
        self,
        gate: Any,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls: Optional[JobTls] = None,
        plaintext: bool = False,
        max_batch_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        super().__init__(token, host, port, tls=tls, plaintext=plaintext, make_tls=False, what="a channel server")
        self.gate = gate
        self.max_batch_bytes = max_batch_bytes
        self.closed = threading.Event()
        self.error: Optional[BaseException] = None

    def _channel(self, descriptor: flight.FlightDescriptor) -> int:
        try:
            command = descriptor.command
            if command is None or len(command) > 256:
                raise ValueError("no channel")
            channel = json.loads(command)["channel"]
            if type(channel) is not int:
                raise TypeError("not a number")
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            raise flight.FlightServerError("pyengine: a channel stream must name its channel") from None
        if not 0 <= channel < self.gate.num_channels:
            raise flight.FlightServerError(f"pyengine: no channel {channel} at this gate")
        return channel

    def do_action(self, context: Any, action: flight.Action) -> Any:
        """``hello``: a sender's first call, to learn its token is good before it sends anything."""
        authenticated(context)
        if action.type != "hello":
            raise flight.FlightServerError(f"pyengine: {self.what} has no action {action.type[:40]!r}")
        return []

    def _put(self, channel: int, item: Any) -> None:
        # A full ring: stop reading this stream until there is room (backpressure).
        while not self.gate.put(channel, item, timeout=0.1):
            if self.closed.is_set():
                raise flight.FlightCancelledError("pyengine: the receiving task is gone")

    def do_put(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any, writer: Any) -> None:
        authenticated(context)
        channel = self._channel(descriptor)
        try:
            self._receive(channel, reader, writer)
        except flight.FlightError:
            raise
        except Exception as exc:  # a token holder's bad data: named, without a traceback
            raise flight.FlightServerError(
                f"pyengine: bad data on channel {channel}: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None

    def _receive(self, channel: int, reader: Any, credits: Any) -> None:
        """Puts each message's items into the gate (waiting while it is full) and gives
        the sender credit for them, ``CREDIT_BATCH`` messages at a time (``CREDITS``)."""
        metadata = reader.schema.metadata
        put = 0  # messages put into the gate since the last credit
        rows = metadata is not None and metadata.get(b"pyengine") == b"rows"
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return
            data, app_metadata = chunk.data, chunk.app_metadata
            if data is not None and data.num_rows:
                if data.nbytes > self.max_batch_bytes:  # refused before it is decoded or queued
                    MEMORY_TRIM.soon()  # gRPC received it whole: give that memory back once it is freed
                    raise flight.FlightServerError(
                        f"pyengine: a batch of {data.nbytes} bytes on channel {channel} "
                        f"(this gate takes at most {self.max_batch_bytes})"
                    )
                if rows:
                    for payload in data.column(0).to_pylist():
                        self._put(channel, _SAFE.loads(payload))
                else:
                    self._put(channel, data)
            if app_metadata is not None:
                if app_metadata.size > MAX_EVENT_BYTES:
                    raise flight.FlightServerError(f"pyengine: an event of {app_metadata.size} bytes")
                self._put(channel, decode_event(app_metadata.to_pybytes()))
            put += 1
            if put == CREDIT_BATCH:  # the sender may be waiting for these
                credits.write(_CREDIT)
                put = 0

    def shutdown(self) -> None:
        self.closed.set()
        super().shutdown()


def _split(batch: pa.RecordBatch, limit: int) -> Iterator[pa.RecordBatch]:
    """``batch`` in row slices of at most ``limit`` bytes each (zero-copy), in order,
    so a large batch from a source never meets the receiver's bound."""
    if batch.nbytes <= limit or batch.num_rows <= 1:
        yield batch
        return
    half = batch.num_rows // 2
    yield from _split(batch.slice(0, half), limit)
    yield from _split(batch.slice(half), limit)


class RemoteChannel:
    """One output channel to a downstream subtask's ``ChannelServer``.

    It looks like a local gate channel to ``Output``: ``push`` never blocks and says
    whether the item fitted in the bounded send queue, ``put`` waits for room. A
    sender thread writes the queue to the Flight stream, in order. An unaligned
    barrier (``push_overtaking``) jumps the queue, and what it overtook is returned,
    to be persisted with the checkpoint.

    The token goes in each call's header; ``tls`` (the job's ``JobTls``) is needed to
    reach a ``grpc+tls://`` location. Arrow batches over ``split_batch_bytes`` are sent
    as row slices, so they stay under the receiver's bound."""

    _DATA_ITEMS: Tuple[type, ...] = (list, pa.RecordBatch)  # queued items that are data (overtaken, persisted)

    def __init__(
        self,
        location: str,
        channel: int,
        token: str,
        capacity: int = 8,
        *,
        tls: Optional[JobTls] = None,
        split_batch_bytes: int = SPLIT_BATCH_BYTES,
    ) -> None:
        self.location = location
        self.channel = channel
        self.capacity = capacity
        self.split_batch_bytes = split_batch_bytes
        self._options = call_options(token)
        self._client = connect(location, tls)
        # Refused here, before any data moves, if the token is wrong. "Unavailable" is
        # tried CONNECT_ATTEMPTS times, 0.2 s apart, each with first_call's retries: a
        # server may be a moment from listening; a server that is not there, or refuses
        # our certificate, is still reported, that much later.
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                self._hello()
                break
            except flight.FlightUnauthenticatedError as exc:
                self._client.close()
                raise PermissionError(f"channel {channel} to {location}: {exc}") from None
            except flight.FlightUnavailableError as exc:
                if attempt + 1 < CONNECT_ATTEMPTS:
                    time.sleep(0.2)
                    continue
                self._client.close()
                raise ConnectionError(
                    f"channel {channel} to {location}: no server there, or it refused our TLS certificate ({exc})"
                ) from None
        self._writer: Any = None
        self._credits_in: Any = None  # the stream's credits from the receiver
        self._uncredited = 0  # messages written on this stream that no credit has come back for
        self._schema: Optional[pa.Schema] = None
        self._queue: Deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._sending = 0
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._send_loop, name=f"flight-out-{channel}", daemon=True)
        self._thread.start()

    def _hello(self) -> None:
        first_call(lambda: list(self._client.do_action(flight.Action("hello", b""), options=self._options)))

    # -- the gate-like side ---------------------------------------------------------------

    def _check(self) -> None:
        if self.error is not None:
            raise ConnectionError(f"channel {self.channel} to {self.location} failed: {self.error}") from self.error

    def push(self, channel: int, item: Any) -> bool:
        with self._cond:
            self._check()
            # Events always fit, as at a gate; watermarks and their status count as data
            # there (the gate does not recognise them), so they do here too.
            is_event = type(item) not in _COUNTED_AS_DATA
            if len(self._queue) >= self.capacity and not is_event:
                return False
            self._queue.append(item)
            self._cond.notify_all()
            return True

    def put(self, channel: int, item: Any, timeout: Optional[float] = None) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._queue) < self.capacity or self.error is not None, timeout):
                return False
            self._check()
            self._queue.append(item)
            self._cond.notify_all()
            return True

    def push_overtaking(self, barrier: Any) -> List[Any]:
        """Puts ``barrier`` ahead of the queued data; returns the data it overtook."""
        with self._cond:
            self._check()
            overtaken = [item for item in self._queue if isinstance(item, self._DATA_ITEMS)]
            self._queue.appendleft(barrier)
            self._cond.notify_all()
            return overtaken

    def queued(self, channel: int) -> int:
        with self._cond:
            return len(self._queue)

    # -- the Flight side ------------------------------------------------------------------

    def _stream(self, schema: pa.Schema) -> Any:
        """The open stream for ``schema`` (a new one when the schema changes), with a
        credit for one more message: waits, on this sender thread, for the receiver to
        send one back when ``CREDITS`` messages are uncredited (backpressure)."""
        if self._writer is None or self._schema is None or not self._schema.equals(schema, check_metadata=True):
            self._close_stream()
            writer, credits_in = self._client.do_put(_channel_descriptor(self.channel), schema, options=self._options)
            self._writer, self._credits_in, self._schema = writer, credits_in, schema
        while self._uncredited >= CREDITS:
            credit = self._credits_in.read()
            if credit is None:
                self._receiver_ended()
            self._uncredited -= int(credit.to_pybytes())
        self._uncredited += 1
        return self._writer

    def _receiver_ended(self) -> NoReturn:
        """The receiver ended the stream while we waited for credit (its task failed, or
        its server refused a message): closing the writer here, on the sender thread with
        no read pending, gives the server's reason, which the error carries."""
        writer, self._writer, self._credits_in = self._writer, None, None
        self._uncredited = 0
        reason = "the receiver ended the stream"
        try:
            writer.close()
        except Exception as exc:  # the server's status: why it ended
            reason = f"{reason}: {exc}"
        raise ConnectionError(f"channel {self.channel} to {self.location}: {reason}")

    def _close_stream(self) -> None:
        """Ends the stream: ``close`` returns once the receiver has put all of it into
        its gate, so the next stream starts with every credit."""
        if self._writer is not None:
            writer, self._writer, self._credits_in = self._writer, None, None
            self._uncredited = 0
            writer.close()

    def _send(self, item: Any) -> None:
        """Writes one item, a credit per message (blocks while the receiver holds back:
        backpressure)."""
        if isinstance(item, pa.RecordBatch):
            for piece in _split(item, self.split_batch_bytes):
                self._stream(item.schema).write_batch(piece)
        elif isinstance(item, list):
            for payload in _row_payloads(item, self.split_batch_bytes):
                batch = pa.RecordBatch.from_arrays([pa.array([payload], pa.binary())], schema=_ROWS_SCHEMA)
                self._stream(_ROWS_SCHEMA).write_batch(batch)
        else:
            writer = self._stream(self._schema if self._schema is not None else _ROWS_SCHEMA)
            writer.write_metadata(pa.py_buffer(encode_event(item)))
            if isinstance(item, EndOfPartition):
                self._close_stream()

    def _send_loop(self) -> None:
        # The producer is woken once the queue is down to half, not after every item:
        # on two cores a wake-up per batch cost more than writing a 64-row batch.
        # Items are still taken one at a time, so an overtaking barrier waits behind
        # at most the one being written.
        low = self.capacity // 2
        try:
            with self._cond:
                while True:
                    if not self._queue:
                        self._cond.notify_all()  # everything written: for flush
                        self._cond.wait_for(lambda: self._queue or self._closed)
                        if not self._queue:
                            return
                    # taken off first: a barrier that overtakes from now on goes after it
                    item = self._queue.popleft()
                    if len(self._queue) <= low:
                        self._cond.notify_all()
                    self._sending = 1
                    self._cond.release()
                    try:
                        self._send(item)
                    finally:
                        self._cond.acquire()
                        self._sending = 0
        except BaseException as exc:  # surfaces at the task's next push or put
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until everything queued was written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: (not self._queue and not self._sending) or self.error is not None, timeout
            )

    def close(self) -> None:
        """Sends what is queued (for up to ``CLOSE_WAIT_S``), ends the stream and the connection;
        never raises: a channel is closed on the way out of a task, failed or not, and
        what comes after it (the task's own server, its other channels) must still close.

        A sender still busy then waits for credit (or for room in gRPC's window)
        from a receiver that takes nothing: the stream is left to it, not closed from
        here. Arrow's ``close`` drains the stream's reads under the lock a pending
        ``read`` holds, so closing it now would wait as long as the sender does; the
        receiver's server ending the stream (its task's end) releases both."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning(
                "channel %s to %s: the receiver took nothing for %.0f s; closed without waiting for it",
                self.channel,
                self.location,
                CLOSE_WAIT_S,
            )
            return
        try:
            self._close_stream()
        except Exception as exc:  # the receiver had ended the stream (failed, or shut down)
            log.debug("channel %s to %s: closing the stream: %s", self.channel, self.location, exc)
        finally:
            self._client.close()


def serve(
    gate: Any, token: str, host: str = "127.0.0.1", *, tls: Optional[JobTls] = None, plaintext: bool = False
) -> Tuple[ChannelServer, threading.Thread]:
    """Starts a ``ChannelServer`` for ``gate`` on a free port, serving on its own thread
    (see ``ChannelServer`` for ``tls`` and ``plaintext``)."""
    server = listening_server(lambda: ChannelServer(gate, token, host, tls=tls, plaintext=plaintext))
    return server, server.serve_in_background(f"flight-{server.port}")
