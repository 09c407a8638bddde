"""Channels between subtasks over Arrow Flight: how the Spark runner moves data.

Each task serves its input gate on a ``ChannelServer``; each upstream subtask
opens one ``DoPut`` stream per channel (``RemoteChannel``) and writes, in order:

- Arrow record batches as they are (a new stream begins when the schema changes:
  one Flight stream has one schema);
- lists of records, msgpack-encoded by the safe serializer (never pickle) into a
  one-row batch marked ``pyengine: rows``;
- events — barriers, cancellation markers, end of data, end of partition — as
  metadata-only messages in the same stream, so a channel keeps its order.

The server pushes every item into the gate with ``put``: a full channel ring
stops the handler reading, Flight's flow control stops the sender — that is the
backpressure across the network, as the bounded rings are within a process.
Every stream carries the job's secret token; one without it is refused before
anything reaches the gate.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import pyarrow as pa
import pyarrow.flight as flight

from ..io import CancelCheckpointMarker, CheckpointBarrier, CheckpointOptions, CheckpointType, EndOfPartition
from ..state.serializers import SafeSerializer

__all__ = ["ChannelServer", "RemoteChannel", "decode_event", "encode_event"]

_ROWS_SCHEMA = pa.schema([("rows", pa.binary())], metadata={b"pyengine": b"rows"})
_SAFE = SafeSerializer()


def encode_event(event: Any) -> bytes:
    """An event as a metadata message (JSON: small, and never code)."""
    from ..runtime.task import END_OF_DATA

    if isinstance(event, CheckpointBarrier):
        body: Dict[str, Any] = {
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


def decode_event(raw: bytes) -> Any:
    from ..runtime.task import END_OF_DATA

    try:
        body = json.loads(raw)
        kind = body["e"]
        if kind == "barrier":
            options = CheckpointOptions(CheckpointType(body["type"]), unaligned=bool(body["unaligned"]))
            return CheckpointBarrier(int(body["id"]), int(body["ts"]), options)
        if kind == "cancel":
            return CancelCheckpointMarker(int(body["id"]))
        if kind == "eop":
            return EndOfPartition()
        if kind == "eod":
            return END_OF_DATA
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"corrupt channel event {raw[:80]!r}: {exc}") from None
    raise ValueError(f"unknown channel event {kind!r}")


CONNECT_TIMEOUT_S = 10.0  # how long a new channel waits for its server to accept


def _descriptor(token: str, channel: int) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(json.dumps({"token": token, "channel": channel}).encode())


class ChannelServer(flight.FlightServerBase):
    """A task's input gate, served: upstream subtasks ``DoPut`` their channels here."""

    def __init__(self, gate: Any, token: str, host: str = "127.0.0.1", port: int = 0) -> None:
        # Listens on every interface unless the address it advertises is the loopback one.
        super().__init__(f"grpc://{_bind_address(host)}:{port}")
        self.gate = gate
        self._token = token.encode()
        self.host = host
        self.closed = threading.Event()
        self.error: Optional[BaseException] = None

    @property
    def location(self) -> str:
        return f"grpc://{self.host}:{self.port}"

    def _authorize(self, descriptor: flight.FlightDescriptor) -> int:
        try:
            request = json.loads(descriptor.command)
            token, channel = str(request["token"]).encode(), int(request["channel"])
        except (ValueError, KeyError, TypeError):
            raise flight.FlightUnauthenticatedError("pyengine: a channel stream needs a token and a channel") from None
        if not hmac.compare_digest(token, self._token):
            raise flight.FlightUnauthenticatedError("pyengine: wrong job token for this channel")
        if not 0 <= channel < self.gate.num_channels:
            raise flight.FlightServerError(f"pyengine: no channel {channel} at this gate")
        return channel

    def do_action(self, context: Any, action: flight.Action) -> Any:
        """``hello``: a sender checks its token before it sends anything."""
        if action.type != "hello":
            raise flight.FlightServerError(f"pyengine: unknown action {action.type!r}")
        if not hmac.compare_digest(action.body.to_pybytes(), self._token):
            raise flight.FlightUnauthenticatedError("pyengine: wrong job token for this channel")
        return []

    def _put(self, channel: int, item: Any) -> None:
        # A full ring: stop reading this stream until there is room (backpressure).
        while not self.gate.put(channel, item, timeout=0.1):
            if self.closed.is_set():
                raise flight.FlightCancelledError("pyengine: the receiving task is gone")

    def do_put(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any, writer: Any) -> None:
        channel = self._authorize(descriptor)
        rows = reader.schema.metadata is not None and reader.schema.metadata.get(b"pyengine") == b"rows"
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return
            if chunk.data is not None and chunk.data.num_rows:
                if rows:
                    for payload in chunk.data.column(0).to_pylist():
                        self._put(channel, _SAFE.loads(payload))
                else:
                    self._put(channel, chunk.data)
            if chunk.app_metadata is not None:
                self._put(channel, decode_event(chunk.app_metadata.to_pybytes()))

    def shutdown(self) -> None:
        self.closed.set()
        super().shutdown()


class RemoteChannel:
    """One output channel to a downstream subtask's ``ChannelServer``.

    It looks like a local gate channel to ``Output``: ``push`` never blocks and says
    whether the item fitted in the bounded send queue, ``put`` waits for room. A
    sender thread writes the queue to the Flight stream, in order. An unaligned
    barrier (``push_overtaking``) jumps the queue, and what it overtook is returned,
    to be persisted with the checkpoint."""

    def __init__(self, location: str, channel: int, token: str, capacity: int = 8) -> None:
        self.location = location
        self.channel = channel
        self.capacity = capacity
        self._token = token
        self._client = flight.FlightClient(location)
        try:  # refused here, before any data moves, if the token is wrong
            self._hello(token)
        except flight.FlightUnauthenticatedError as exc:
            self._client.close()
            raise PermissionError(f"channel {channel} to {location}: {exc}") from None
        except flight.FlightUnavailableError as exc:
            self._client.close()
            raise ConnectionError(f"channel {channel} to {location}: no server there ({exc})") from None
        self._writer: Any = None
        self._schema: Optional[pa.Schema] = None
        self._queue: Deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._sending = 0
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._send_loop, name=f"flight-out-{channel}", daemon=True)
        self._thread.start()

    def _hello(self, token: str) -> None:
        """The first call, retried while the address refuses for up to CONNECT_TIMEOUT_S:
        the server may be a moment from listening, and gRPC shares one connection per
        address across a process's clients, so a server that just closed on a port a
        new one now has can leave a refused connection behind for a while."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        pause = 0.02
        while True:
            try:
                list(self._client.do_action(flight.Action("hello", token.encode())))
                return
            except flight.FlightUnavailableError:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.5)

    # -- the gate-like side ---------------------------------------------------------------

    def _check(self) -> None:
        if self.error is not None:
            raise ConnectionError(f"channel {self.channel} to {self.location} failed: {self.error}") from self.error

    def push(self, channel: int, item: Any) -> bool:
        with self._cond:
            self._check()
            is_event = not isinstance(item, (list, pa.RecordBatch))
            if len(self._queue) >= self.capacity and not is_event:  # events always fit, as at a gate
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
            overtaken = [item for item in self._queue if isinstance(item, (list, pa.RecordBatch))]
            self._queue.appendleft(barrier)
            self._cond.notify_all()
            return overtaken

    def queued(self, channel: int) -> int:
        with self._cond:
            return len(self._queue)

    # -- the Flight side ------------------------------------------------------------------

    def _stream(self, schema: pa.Schema) -> Any:
        if self._writer is not None and self._schema is not None and self._schema.equals(schema, check_metadata=True):
            return self._writer
        self._close_stream()
        writer, _ = self._client.do_put(_descriptor(self._token, self.channel), schema)
        self._writer, self._schema = writer, schema
        return writer

    def _close_stream(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def _send(self, item: Any) -> None:
        """Writes one item (blocks while the receiver holds back: backpressure)."""
        if isinstance(item, pa.RecordBatch):
            self._stream(item.schema).write_batch(item)
        elif isinstance(item, list):
            batch = pa.RecordBatch.from_arrays([pa.array([_SAFE.dumps(item)], pa.binary())], schema=_ROWS_SCHEMA)
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
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._close_stream()
        self._client.close()


def _bind_address(host: str) -> str:
    return host if host in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"


def serve(gate: Any, token: str, host: str = "127.0.0.1") -> Tuple[ChannelServer, threading.Thread]:
    """Starts a ``ChannelServer`` for ``gate`` on a free port, serving on its own thread."""
    server = ChannelServer(gate, token, host)
    thread = threading.Thread(target=server.serve, name=f"flight-{server.port}", daemon=True)
    thread.start()
    return server, thread
