"""A task's output side: ``Output`` writes a chain's records to the channels of one
downstream edge (partitioning by key, batching, adaptive buffer sizes, the in-flight
buffers an unaligned checkpoint persists), ``Outputs`` fans out to every edge, and
``END_OF_DATA`` marks the end of bounded input on each channel. ``StreamTask`` drives
them; they know nothing of the task (Flink's ``RecordWriterOutput`` beside
``StreamTask``)."""

from __future__ import annotations

import copy
import reprlib
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from .._native import int_key_group, route_int_keys
from ..errors import ColumnNotFoundError, KeySelectorError, NonRetryableError, UnhashableKeyError
from ..io import CheckpointedInputGate
from ..state.keygroups import assign_to_key_group, key_groups_of_int64
from .base import rows_of
from .debloat import MIN_BATCH_BYTES, MIN_RECORDS, PY_RECORD_BYTES, ChannelDebloater, summarize

__all__ = ["END_OF_DATA", "OnChannel", "Output", "Outputs"]


class _EndOfData:
    """Sent down every channel, in order, once a task has emitted everything it will:
    the end of bounded input. Tasks still run after it (they take the final checkpoint);
    ``EndOfPartition`` ends them. It travels as a data item, so barriers keep their order
    with it, and unaligned channel state leaves it out (a restore sends it again)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "END_OF_DATA"


END_OF_DATA = _EndOfData()


def _combined(pieces: List[Any]) -> Any:
    """What a sink stages: one ``pyarrow.Table`` when every buffer was an Arrow batch
    of one schema, else a list of records."""
    if all(type(p) is pa.RecordBatch for p in pieces):
        schema = pieces[0].schema
        if all(p.schema.equals(schema) for p in pieces):
            return pa.Table.from_batches(pieces)
    out: List[Any] = []
    for p in pieces:
        out.extend(rows_of(p))
    return out


def _capacity_of(gate: Any) -> int:
    """Buffers a channel holds: the gate's (or remote channel's) ``capacity``."""
    capacity = getattr(gate, "capacity", None)
    if not isinstance(capacity, int) or capacity < 1:
        raise TypeError(f"adaptive buffers need the channel's capacity; {gate!r} has none (buffer_debloat=False)")
    return capacity


class OnChannel:
    """An overtaken buffer of a broadcast exchange, with the channel it was waiting
    for. Every channel of a broadcast gets the same records, each at its own pace, so
    what was in flight differs per channel: it is persisted per channel and replayed
    to that channel alone (through the partitioner it would reach every channel
    again, and the channels that had it already would get it twice)."""

    __slots__ = ("buffer", "channel")

    def __init__(self, channel: int, buffer: Any) -> None:
        self.channel = channel
        self.buffer = buffer


class Output:
    """A task's output to the next vertex: a partitioner over the downstream gates,
    with one buffer per channel, flushed when full, on timeout, or before a barrier."""

    def __init__(
        self,
        gates: Sequence[CheckpointedInputGate],
        channel: int,
        exchange: str,
        key_selector: Optional[Callable[[Any], Any]],
        max_parallelism: int,
        buffer_size: int,
        cancelled: threading.Event,
        gate_channel: Optional[int] = None,
        debloat_target_ms: Optional[int] = None,
        target: str = "",
        grow: bool = False,
    ) -> None:
        self.gates = list(gates)
        self.target = target  # the step this output feeds, for errors ("" when unknown)
        # Adaptive buffers: None keeps buffer_size fixed (StreamEnvironment(buffer_debloat=False)).
        self.debloat_target_ms = debloat_target_ms
        # This subtask's channel index at every downstream gate: its subtask index, offset
        # past the channels of the gate's other inputs when the gate has several (a union,
        # a connect: one gate over all of a task's inputs, as Flink 1.12's).
        self.channel = channel if gate_channel is None else gate_channel
        self.subtask = channel
        self.exchange = exchange
        self.key_selector = key_selector
        # key_by(field)'s field read in C (operator.itemgetter): the routing's own, see emit
        self._route_by = getattr(key_selector, "fast", None)
        self.max_parallelism = max_parallelism
        self.buffer_size = buffer_size
        self.cancelled = cancelled
        self.buffers: List[List[Any]] = [[] for _ in self.gates]
        self.pending: List[Deque[Any]] = [deque() for _ in self.gates]
        self._next = channel % len(self.gates)
        self.last_flush = time.monotonic()
        # One ChannelDebloater per channel (pyengine.runtime.debloat): it measures how fast
        # the consumer takes this channel's data and limits records per buffer and buffers
        # queued to about debloat_target_ms of it. None: the fixed sizes of before, untouched.
        # ``grow`` (the engine chose buffer_size): a channel also grows its buffers past
        # buffer_size while it is not latency-bound (pyengine.runtime.debloat.grow).
        self._debloat: Optional[List[ChannelDebloater]] = None
        if debloat_target_ms is not None:
            self._debloat = [
                ChannelDebloater(
                    debloat_target_ms, buffer_size, _capacity_of(g), min(MIN_RECORDS, buffer_size), can_grow=grow
                )
                for g in self.gates
            ]

    def emit(self, records: Any) -> None:
        if type(records) is pa.RecordBatch:
            self._emit_batch(records)
            return
        n = len(self.gates)
        if self.exchange == "forward" or n == 1:
            self.buffers[self.subtask % n].extend(records)
        elif self.exchange == "hash":
            select, max_p = self.key_selector, self.max_parallelism
            assert select is not None
            buffers = self.buffers
            # key_by(field) over int keys: routed in C, the rest (from the first other
            # key) per record below, where a record without the field is refused.
            fast = self._route_by
            if fast is not None and type(records) is list:
                routed = route_int_keys(records, fast, max_p, buffers)
                if routed:
                    records = records[routed:]
            try:
                for r in records:  # subtask_for_key_group(assign_to_key_group(key)), inlined: per record
                    key = select(r)
                    group = int_key_group(key, max_p)
                    if group < 0:
                        group = assign_to_key_group(key, max_p)
                    buffers[group * n // max_p].append(r)
            except Exception as exc:
                failure = self._key_failure(exc, r)
                if failure is exc:
                    raise
                raise failure from exc
        elif self.exchange == "rebalance":
            for r in records:
                self.buffers[self._next].append(r)
                self._next = (self._next + 1) % n
        elif self.exchange == "broadcast":
            # Every consumer gets records of its own, as in Flink, where each subtask
            # deserializes its copy: in one process the same objects in every channel
            # would let one subtask's in-place change (a record kept in broadcast state
            # and updated later) reach the others, from their threads. Arrow batches are
            # immutable and go as they are.
            first = True
            for b in self.buffers:
                b.extend(records if first else copy.deepcopy(records))
                first = False
        else:
            raise ValueError(f"unknown exchange {self.exchange!r}")
        debloat = self._debloat
        if debloat is None:
            for i, b in enumerate(self.buffers):
                if len(b) >= self.buffer_size:
                    self._send(i)
            return
        for i, b in enumerate(self.buffers):
            c = debloat[i]
            size = c.size
            if c.grown:  # grown: sent once it holds the grown size
                if len(b) >= size:
                    self._send(i)
            elif size >= self.buffer_size:
                if len(b) >= self.buffer_size:
                    self._send(i)
            elif len(b) >= size:  # debloated: cut to the size, the rest waits for more
                self.buffers[i] = []
                for start in range(0, len(b), size):
                    piece = b[start : start + size]
                    if len(piece) < size:
                        self.buffers[i] = piece
                    else:
                        self._put(i, piece)

    def _key_failure(self, exc: Exception, record: Any) -> Exception:
        """What a failure while keying ``record`` for a hash exchange is reported as:
        named after key_by and the step it feeds, with the record. A key of no stable
        hash stays non-retryable (the same record comes again after a restart)."""
        into = f" into {self.target!r}" if self.target else ""
        try:
            shown = reprlib.repr(record)  # bounded: a huge record is not printed whole
        except Exception:
            shown = f"<a {type(record).__name__} whose repr fails>"
        if isinstance(exc, UnhashableKeyError):
            return UnhashableKeyError(f"key_by{into}: {exc}, from the record {shown}")
        if isinstance(exc, NonRetryableError):
            return exc  # a field selector's ColumnNotFoundError names key_by, the field and the record
        return KeySelectorError(
            f"key_by{into}: the key selector raised {type(exc).__name__}: {exc} on the record {shown}"
        )

    def _emit_batch(self, batch: pa.RecordBatch) -> None:
        """An Arrow batch goes on as one buffer (split by key for a hash exchange),
        after whatever rows were buffered for its channel before it."""
        n = len(self.gates)
        if self.exchange == "forward" or n == 1:
            pieces = [(self.subtask % n, batch)]
        elif self.exchange == "hash":
            column = getattr(self.key_selector, "column", None)
            if column is None:  # a key function needs the rows
                self.emit(batch.to_pylist())
                return
            pieces = list(enumerate(_split_by_key(batch, column, n, self.max_parallelism)))
        elif self.exchange == "rebalance":
            pieces = [(self._next, batch)]
            self._next = (self._next + 1) % n
        elif self.exchange == "broadcast":
            pieces = [(i, batch) for i in range(n)]
        else:
            raise ValueError(f"unknown exchange {self.exchange!r}")
        debloat = self._debloat
        for i, piece in pieces:
            if piece.num_rows:
                self._send(i)
                if debloat is not None and debloat[i].shrunk and piece.num_rows > debloat[i].size:
                    # debloated: slices of the size, but never under MIN_BATCH_BYTES
                    row_bytes = max(1, piece.nbytes // piece.num_rows)
                    rows = max(debloat[i].size, -(-MIN_BATCH_BYTES // row_bytes))
                    for start in range(0, piece.num_rows, rows):
                        self._put(i, piece.slice(start, rows))
                    continue
                self._put(i, piece)

    def _send(self, i: int) -> None:
        buffer, self.buffers[i] = self.buffers[i], []
        if buffer:
            self._put(i, buffer)

    def _put(self, i: int, item: Any) -> None:
        # A full channel never blocks the task mid-record: what does not fit waits here,
        # the task stops taking input until it has drained (see ``available``), and
        # meanwhile it still handles its mailbox and overtaking barriers.
        waiting = self.pending[i]
        if self._debloat is None:
            if waiting or not self.gates[i].push(self.channel, item):
                waiting.append(item)
        elif waiting or not self._push_debloated(i, item):
            waiting.append(item)

    def _push_debloated(self, i: int, item: Any) -> bool:
        """``push`` within the channel's adaptive limit of buffers in flight: False
        (backpressure, as a full channel) when that many are queued. The queue is
        looked at before the push: an empty one means the consumer waited for data."""
        c = self._debloat[i]  # type: ignore[index]
        gate, ch = self.gates[i], self.channel
        data = type(item) is list or type(item) is pa.RecordBatch
        limited = data and c.in_flight < c.capacity
        now = time.monotonic()
        if limited or c.due(now):
            queued = gate.queued(ch)
            c.observe(queued, now)
            if limited and queued >= c.in_flight:
                return False
        if not gate.push(ch, item):
            return False
        if data and c.can_grow and type(item) is pa.RecordBatch and item.num_rows and c.row_bytes == PY_RECORD_BYTES:
            c.row_bytes = max(1, item.nbytes // item.num_rows)  # once: an Arrow row's width, for the byte bounds
        c.pushed(len(item) if data else 0)
        return True

    def read_rows(self) -> Optional[int]:
        """Rows (or Python records) a source feeding this output should read at a time
        so that its channels get buffers of their grown size: a hash exchange splits a
        read over every channel, the others send it whole to one. None while no channel
        has grown (the task's own read size then)."""
        debloat = self._debloat
        if debloat is None or not any(c.grown for c in debloat):
            return None
        if self.exchange == "hash":
            return sum(c.size for c in debloat)
        return min(c.size for c in debloat)

    @property
    def available(self) -> bool:
        """Whether nothing is waiting for room downstream (Flink's output availability)."""
        return not any(self.pending)

    def drain(self) -> bool:
        """Pushes what waits, as far as there is room; True when nothing is left."""
        if self._debloat is not None:
            for i, waiting in enumerate(self.pending):
                while waiting and self._push_debloated(i, waiting[0]):
                    waiting.popleft()
            return self.available
        for i, waiting in enumerate(self.pending):
            gate, channel = self.gates[i], self.channel
            while waiting and gate.push(channel, waiting[0]):
                waiting.popleft()
        return self.available

    def wait_for_room(self, timeout_s: float) -> None:
        """Waits (GIL released) up to ``timeout_s`` for room on a backpressured channel."""
        for i, waiting in enumerate(self.pending):
            if waiting:
                if self._debloat is not None:
                    self._wait_debloated(i, waiting, timeout_s)
                elif self.gates[i].put(self.channel, waiting[0], timeout=timeout_s):
                    waiting.popleft()
                return

    def _wait_debloated(self, i: int, waiting: Deque[Any], timeout_s: float) -> None:
        """``wait_for_room`` under an adaptive limit: the gate's own wait knows only its
        capacity, so below it the queue is looked at every millisecond (GIL released
        in between) until the item fits or ``timeout_s`` has passed."""
        c = self._debloat[i]  # type: ignore[index]
        deadline = time.monotonic() + timeout_s
        while True:
            if c.in_flight >= c.capacity:
                if self.gates[i].put(self.channel, waiting[0], timeout=max(0.0, deadline - time.monotonic())):
                    item = waiting.popleft()
                    data = type(item) is list or type(item) is pa.RecordBatch
                    c.pushed(len(item) if data else 0)
                return
            if self._push_debloated(i, waiting[0]):
                waiting.popleft()
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.001, left))

    def debloat_stats(self) -> Optional[Dict[str, Any]]:
        """The adaptive buffers' current limits (None with ``buffer_debloat=False``)."""
        return None if self._debloat is None else summarize(self._debloat)

    def flush(self, timed_out: bool = False) -> None:
        """Sends every part-filled buffer. ``timed_out``: on the buffer timeout, where a
        buffer that has not reached even the configured size tells a channel allowed to
        grow that its producer is short of input (a grown buffer part-filled says
        nothing: the timeout fires on its clock whatever the fill, and it already
        bounds how long a record waits in a buffer of any size)."""
        if timed_out and self._debloat is not None:
            for c, b in zip(self._debloat, self.buffers, strict=True):
                if b and c.can_grow and len(b) < self.buffer_size:
                    c.partial()
        for i in range(len(self.gates)):
            self._send(i)
        self.last_flush = time.monotonic()

    def short_read(self) -> None:
        """The source feeding this output read fewer rows than it asked for: short of
        input, as a buffer timeout is (see ``flush``)."""
        for c in self._debloat or ():
            if c.can_grow:
                c.partial()

    def send_end_of_data(self) -> None:
        self.flush()
        for i in range(len(self.gates)):
            self._put(i, END_OF_DATA)

    def broadcast_event(self, event: Any) -> None:
        """An event in order: after every record emitted before it."""
        self.flush()
        for i in range(len(self.gates)):
            self._put(i, event)

    def broadcast_overtaking(self, barrier: Any) -> List[Any]:
        """An unaligned barrier goes ahead of the output still waiting for room, and
        returns those buffers: they are in flight, so the checkpoint persists them
        (they are still delivered after the barrier, now)."""
        self.flush()
        overtaken: List[Any] = []
        per_channel = self.exchange == "broadcast" and len(self.gates) > 1
        for i, gate in enumerate(self.gates):
            waiting = [item for item in self.pending[i] if isinstance(item, (list, pa.RecordBatch))]
            jump = getattr(gate, "push_overtaking", None)
            jumped: List[Any] = []
            if jump is not None:  # a network channel: the barrier also jumps its send queue
                jumped = list(jump(barrier))
                if self._debloat is not None:
                    self._debloat[i].jumped()
            elif not gate.push(self.channel, barrier):  # events have their own, larger limit
                self.pending[i].appendleft(barrier)
            elif self._debloat is not None:
                self._debloat[i].jumped()
            for item in jumped + waiting:
                overtaken.append(OnChannel(i, item) if per_channel else item)
        return overtaken

    def emit_to_channels(self, channels: Sequence[int], records: Any) -> None:
        """Replayed in-flight output of a broadcast exchange: to these channels only,
        after what is buffered for them."""
        for i in channels:
            self._send(i)
            self._put(i, records)


class Outputs:
    """A task's outputs when it has several: each edge of the job graph that leaves
    it (fan-out to several consumers, side outputs) is an ``Output`` of its own. The
    main output goes to every edge without a tag; ``emit_side`` to those with its tag.
    Events (barriers, watermarks, the end of data) go to every edge."""

    def __init__(self, edges: Sequence[Tuple[Optional[str], Output]]) -> None:
        self.edges = list(edges)
        self.outputs = [o for _, o in self.edges]
        self.main = [o for tag, o in self.edges if tag is None]
        self.sides: Dict[str, List[Output]] = {}
        for tag, o in self.edges:
            if tag is not None:
                self.sides.setdefault(tag, []).append(o)
        self.last_flush = time.monotonic()

    @property
    def cancelled(self) -> threading.Event:
        return self.outputs[0].cancelled

    @cancelled.setter
    def cancelled(self, event: threading.Event) -> None:
        for o in self.outputs:
            o.cancelled = event

    def emit(self, records: Any) -> None:
        for o in self.main:
            o.emit(records)

    def emit_side(self, tag: str, records: Any) -> None:
        for o in self.sides.get(tag, ()):
            o.emit(records)

    def emit_to(self, edge: int, records: Any) -> None:
        self.outputs[edge].emit(records)

    def emit_to_channels(self, edge: int, channels: Sequence[int], records: Any) -> None:
        self.outputs[edge].emit_to_channels(channels, records)

    @property
    def available(self) -> bool:
        return all(o.available for o in self.outputs)

    def drain(self) -> bool:
        done = True
        for o in self.outputs:
            done = o.drain() and done
        return done

    def wait_for_room(self, timeout_s: float) -> None:
        for o in self.outputs:
            if not o.available:
                o.wait_for_room(timeout_s)
                return

    def flush(self, timed_out: bool = False) -> None:
        for o in self.outputs:
            o.flush(timed_out)
        self.last_flush = time.monotonic()

    def short_read(self) -> None:
        for o in self.outputs:
            o.short_read()

    def send_end_of_data(self) -> None:
        for o in self.outputs:
            o.send_end_of_data()

    def broadcast_event(self, event: Any) -> None:
        for o in self.outputs:
            o.broadcast_event(event)

    def broadcast_overtaking(self, barrier: Any) -> List[Any]:
        return [b for _, b in self.overtaking_by_edge(barrier)]

    def read_rows(self) -> Optional[int]:
        """``Output.read_rows`` over every edge: the smallest, and None unless every edge grew."""
        rows = [o.read_rows() for o in self.outputs]
        if not rows or any(r is None for r in rows):
            return None
        return min(r for r in rows if r is not None)

    def debloat_stats(self) -> Optional[Dict[str, Any]]:
        """The adaptive buffers' limits over every edge (None when off)."""
        stats = [s for s in (o.debloat_stats() for o in self.outputs) if s is not None]
        if not stats:
            return None
        return {
            "buffer_size": min(s["buffer_size"] for s in stats),
            "buffers_in_flight": min(s["buffers_in_flight"] for s in stats),
            "channels": [c for s in stats for c in s["channels"]],
        }

    def overtaking_by_edge(self, barrier: Any) -> List[Tuple[int, Any]]:
        """``broadcast_overtaking`` on every edge: the overtaken buffers with their edge."""
        return [(j, b) for j, o in enumerate(self.outputs) for b in o.broadcast_overtaking(barrier)]


def _runs(items: List[Tuple[int, List[int], List[Any]]]) -> List[Tuple[int, List[int], List[Any]]]:
    """Consecutive replayed records for the same edge and channels, as one buffer each."""
    out: List[Tuple[int, List[int], List[Any]]] = []
    for edge, channels, records in items:
        if out and out[-1][0] == edge and out[-1][1] == channels:
            out[-1][2].extend(records)
        else:
            out.append((edge, channels, list(records)))
    return out


def _split_by_key(batch: pa.RecordBatch, column: str, n: int, max_parallelism: int) -> List[pa.RecordBatch]:
    """The rows of ``batch`` for each of ``n`` subtasks, by the key group of ``column``
    (the same assignment as for single records, vectorised for integer keys)."""
    if column not in batch.schema.names:
        raise ColumnNotFoundError(
            f"key_by({column!r}): the batch has no column {column!r} (columns: {batch.schema.names})"
        )
    keys = batch.column(column)
    if keys.null_count == 0 and pa.types.is_integer(keys.type):
        groups = key_groups_of_int64(keys.to_numpy().astype(np.int64, copy=False), max_parallelism)
    else:
        groups = np.array([assign_to_key_group(k, max_parallelism) for k in keys.to_pylist()], np.int64)
    targets = groups * n // max_parallelism  # subtask_for_key_group, for all rows at once
    return [batch.filter(pa.array(targets == i)) for i in range(n)]
