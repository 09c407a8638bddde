"""Channels between the process runner's workers: a Unix socket per channel, buffers pickled.

The process runner (``runners/processes.py``) serves each worker's input gate on a
``multiprocessing.connection`` listener that only the job's processes can open (the
job's secret token is its authkey); a channel between two subtasks of the same worker
hands buffers to the gate directly, never pickled. ``open_channel`` and
``serve_sockets`` are the pair the task body (``spark._run_subtask``) takes, as it
takes ``flight``'s on Spark.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import pickle
import reprlib
import sys
import threading
import uuid
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Deque, Dict, List, Optional, Tuple

import pyarrow as pa

from ..errors import NonRetryableError
from ..runtime.copies import narrow
from .flight import RemoteChannel, decode_event, encode_event

log = logging.getLogger(__name__)


# -- channels between workers: local sockets, buffers pickled -----------------------------------

# Measured on the per-record counter (600,000 Python records, parallelism 1, CPU seconds of
# the whole run): over Flight with msgpack the source worker spent 0.35-0.45 s and the
# counter 1.5-2.0 s, against 1.6 s for the whole job on threads; msgpack alone costs ~1.9
# us per record to write and ~0.5 to read, and every Flight server and client brings gRPC
# threads. A Unix socket per channel, one pickled buffer per message, costs ~0.1 us per
# record. Events (barriers, watermarks, end of data) travel as the channels' JSON
# (``flight.encode_event``), so a sentinel keeps its identity.
_DATA, _EVENT = b"D", b"E"
# A worker's output queue holds this many times ``channel_capacity`` buffers: every buffer
# crosses three threads in two processes (task, sender, receiver), each a wake-up that waits
# for a core when the machine is busy; a deeper queue keeps the pipeline fed meanwhile.
SOCKET_QUEUE_FACTOR = 4


class _Pickled:
    """A buffer of records in a ``SocketChannel``'s queue, pickled already (the message
    it is sent as: ``_DATA`` and the pickle)."""

    __slots__ = ("data",)

    def __init__(self, records: bytes) -> None:
        self.data = _DATA + records


class SocketChannel(RemoteChannel):
    """One output channel to a downstream worker's ``SocketChannelServer``: the Flight
    channel's queue, backpressure and unaligned overtaking (``RemoteChannel``), with each
    item written as one message on a Unix socket instead of a Flight stream.

    Only between the process runner's workers: the server accepts a connection only
    after ``multiprocessing``'s authkey handshake with the job's token (an HMAC
    challenge both ways), and the token reached only the workers this process forked,
    over their pipes; that is ``multiprocessing``'s own trust for what it unpickles. The
    Spark runner, whose channels cross machines, never pickles."""

    _DATA_ITEMS = (list, pa.RecordBatch, _Pickled)

    def __init__(self, location: str, channel: int, token: str, capacity: int = 8, **_: Any) -> None:
        from multiprocessing.connection import Client

        self.location = location
        self.channel = channel
        self.capacity = capacity * SOCKET_QUEUE_FACTOR
        self.split_batch_bytes = 0
        try:
            self._conn = Client(_address(location), family="AF_UNIX", authkey=token.encode())
        except (OSError, multiprocessing.AuthenticationError) as exc:
            raise ConnectionError(f"channel {channel} to {location}: {exc}") from None
        self._conn.send_bytes(str(channel).encode())
        self._queue: Deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._sending = 0
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._send_loop, name=f"socket-out-{channel}", daemon=True)
        self._thread.start()

    # A buffer of Python records is pickled as it is pushed, by the task that made it,
    # not later by the sender thread: its records are still in the core's cache then,
    # and die at once instead of waiting in the queue as objects (on the per-record
    # counter, a full queue of object buffers was ~4 MB of tuples, twice the core's L2
    # cache, and every record was read back from memory when it was finally sent). It
    # also sends what the record was when emitted, as a local channel's consumer sees
    # it. Only the task's thread pushes to a channel, so the room seen before pickling
    # is still there after.

    def push(self, channel: int, item: Any) -> bool:
        if type(item) is not list:
            return super().push(channel, item)
        with self._cond:
            self._check()
            if len(self._queue) >= self.capacity:
                return False
        return self._append(item)

    def put(self, channel: int, item: Any, timeout: Optional[float] = None) -> bool:
        if type(item) is not list:
            return super().put(channel, item, timeout)
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._queue) < self.capacity or self.error is not None, timeout):
                return False
            self._check()
        return self._append(item)

    def _append(self, records: List[Any]) -> bool:
        try:
            data = pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise _unpicklable_records(records, exc) from exc
        pickled = _Pickled(data)
        with self._cond:
            self._check()
            self._queue.append(pickled)
            self._cond.notify_all()
        return True

    def push_overtaking(self, barrier: Any) -> List[Any]:
        # what the barrier overtook goes into the checkpoint as records
        overtaken = super().push_overtaking(barrier)
        return [pickle.loads(memoryview(item.data)[1:]) if type(item) is _Pickled else item for item in overtaken]

    def _send(self, item: Any) -> None:
        if type(item) is _Pickled:
            self._conn.send_bytes(item.data)
        elif type(item) is list or type(item) is pa.RecordBatch:
            self._conn.send_bytes(_DATA + pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            self._conn.send_bytes(_EVENT + encode_event(item))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._conn.close()


class _SlotChannel:
    """A channel to a subtask of the same worker (its slot): the downstream gate
    itself, as the threads runner wires it. ``Output`` pushes buffers and events
    straight into it, no copy, no pickle, no sender thread; with no ``push_overtaking``
    an unaligned barrier takes the gate's own event room, as on threads. ``flush`` and
    ``close`` have nothing to do: nothing waits in between."""

    __slots__ = ("capacity", "channel", "error", "gate", "location", "push", "put", "queued")

    def __init__(self, gate: Any, location: str, channel: int) -> None:
        self.gate = gate
        self.location = location
        self.channel = channel
        self.capacity = gate.capacity
        self.error: Optional[BaseException] = None
        # bound once: Output calls these per buffer
        self.push = gate.push
        self.put = gate.put
        self.queued = gate.queued

    def flush(self, timeout: Optional[float] = None) -> bool:
        return True

    def close(self) -> None:
        pass


# The gates this worker serves, by location: a channel to one of them is a _SlotChannel.
_SLOT_GATES: Dict[str, Any] = {}
_SLOT_LOCK = threading.Lock()


def open_channel(location: str, channel: int, token: str, capacity: int = 8, **options: Any) -> Any:
    """The channel to ``location``: the gate itself when this process serves it (a
    subtask of the same slot), else a ``SocketChannel`` to the worker that does."""
    with _SLOT_LOCK:
        gate = _SLOT_GATES.get(location)
    if gate is not None:
        return _SlotChannel(gate, location, channel)
    return SocketChannel(location, channel, token, capacity, **options)


def _unpicklable_records(records: List[Any], error: BaseException) -> NonRetryableError:
    """Why a buffer cannot go to another worker: its records (which type) do not pickle.
    Not retryable: the same records come again after a restore."""
    where = f"records of type {', '.join(sorted({type(r).__name__ for r in records[:1000]}))}"
    for record in records:
        if not _pickles(record):  # down to what does not pickle: "record -> key 'lock' -> lock object"
            where = narrow(_pickles, record, f"the record {reprlib.repr(record)}")
            break
    return NonRetryableError(
        f"records going to another worker process cannot be pickled ({type(error).__name__}: {error}; {where}): "
        "with executor='processes', what a key_by, rebalance or broadcast sends to another slot is pickled (what "
        "stays in a worker is not). Keep locks, open files and clients out of records, or run the job with "
        "executor='threads'"
    )


def _pickles(value: Any, pickler: Any = None) -> bool:
    """Whether ``value`` pickles: with the job's pickler (cloudpickle's, as the job goes to
    a worker), or by default as a buffer of records goes between workers (plain pickle)."""
    try:
        if pickler is None:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            pickler(io.BytesIO(), []).dump(value)
        return True
    except Exception:
        return False


def _address(location: str) -> str:
    if not location.startswith("unix:"):
        raise ValueError(f"not a worker's socket location: {location!r}")
    return location[len("unix:") :]


class SocketChannelServer:
    """A subtask's input gate, served on a Unix socket: each upstream subtask connects
    once per channel (after the authkey handshake), names its channel, then sends its
    items in order; a thread per connection puts them into the gate, waiting while the
    channel is full (backpressure: the socket fills, then the sender's queue)."""

    def __init__(self, gate: Any, token: str) -> None:
        from multiprocessing.connection import Listener

        self.gate = gate
        self.closed = threading.Event()
        # Linux's abstract namespace: no file to leave behind when a worker is killed.
        address = f"\0pyengine-{os.getpid()}-{uuid.uuid4().hex[:12]}" if sys.platform == "linux" else None
        self._listener = Listener(address, family="AF_UNIX", authkey=token.encode())
        self.location = f"unix:{address if address is not None else self._listener.address}"
        self._conns: List[Connection] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="socket-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError):
                if self.closed.is_set():
                    return
                continue  # a peer without the token: refused by the handshake
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._receive, args=(conn,), name="socket-in", daemon=True).start()

    def _receive(self, conn: Connection) -> None:
        try:
            channel = int(conn.recv_bytes(32))
            if not 0 <= channel < self.gate.num_channels:
                raise ValueError(f"no channel {channel} at this gate")
            while True:
                message = conn.recv_bytes()
                kind, body = message[:1], message[1:]
                item = pickle.loads(body) if kind == _DATA else decode_event(bytes(body))
                while not self.gate.put(channel, item, timeout=0.1):
                    if self.closed.is_set():
                        return
        except (EOFError, OSError):
            return  # the sender closed its channel, or went away (its task fails or ends)
        except Exception:
            log.exception("a worker's channel failed")
        finally:
            try:
                conn.close()
            except OSError:  # closed already by shutdown
                pass

    def shutdown(self) -> None:
        self.closed.set()
        with _SLOT_LOCK:
            _SLOT_GATES.pop(self.location, None)
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass


def serve_sockets(gate: Any, token: str, host: str = "127.0.0.1", **_: Any) -> Tuple[SocketChannelServer, Any]:
    """``flight.serve``'s counterpart for the process runner's workers (this machine only)."""
    server = SocketChannelServer(gate, token)
    with _SLOT_LOCK:
        _SLOT_GATES[server.location] = gate
    return server, server._thread
