"""The checkpointed input gate in plain Python.

This is the executable specification of the gate: the native gate
(``pyengine._native``) must produce exactly the same outputs, listener calls,
in-flight data and errors for any sequence of calls, and the differential tests
hold it to that. It is also the baseline the benchmarks compare against. It
favours clarity over speed, but is not deliberately slow.

Behaviour, per mode (Flink 1.11/1.12 names in brackets):

* ``at_least_once`` [CheckpointBarrierTracker]: never blocks; counts barriers
  per checkpoint in an ordered table of at most 50 pending checkpoints; a
  checkpoint triggers when every open channel delivered it, dropping older
  pending ones; cancellation markers abort once and are still counted.
* ``exactly_once`` aligned [CheckpointBarrierAligner]: a channel that delivered
  the barrier is blocked until all open channels have; closed channels count
  as aligned; newer barriers subsume, cancellation markers and end of
  partition abort.
* ``exactly_once`` with ``unaligned=True`` [CheckpointBarrierUnaligner,
  AlternatingCheckpointBarrierHandler]: checkpoints trigger on the first
  barrier; barriers overtake queued buffers, which become in-flight data
  together with buffers read from channels whose barrier is still outstanding;
  savepoints stay aligned; with ``aligned_timeout_ms`` a checkpoint starts
  aligned and turns unaligned when alignment takes longer.

Callbacks always run after the gate's state is updated, on the consumer's
thread, in the order the events imply.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

from ._config import Callbacks, GateConfig, check_channel, item_nbytes
from .errors import ChannelClosedError, CorruptStreamError
from .events import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointFailureReason,
    CheckpointMetrics,
    CheckpointType,
    EndOfPartition,
)

__all__ = ["ReferenceCheckpointedInputGate"]

_DATA, _BARRIER, _CANCEL, _EOP = 0, 1, 2, 3
_ALIGNED, _UNALIGNED = 0, 1
_MAX_PENDING = 50

_R = CheckpointFailureReason


def _kind(item: Any) -> int:
    t = type(item)
    if t is CheckpointBarrier:
        return _BARRIER
    if t is CancelCheckpointMarker:
        return _CANCEL
    if t is EndOfPartition:
        return _EOP
    return _DATA


class _Pending:
    """One row of the at-least-once tracker's pending-checkpoint table."""

    __slots__ = ("aborted", "checkpoint_id", "seen", "start_delay_ns")

    def __init__(self, checkpoint_id: int, start_delay_ns: int) -> None:
        self.checkpoint_id = checkpoint_id
        self.seen: set[int] = set()
        self.aborted = False
        self.start_delay_ns = start_delay_ns


class ReferenceCheckpointedInputGate:
    """Pure-Python twin of the native gate; see the module docstring."""

    def __init__(self, config: GateConfig, callbacks: Callbacks) -> None:
        n = config.num_channels
        self._config = config
        self._cb = callbacks
        self._n = n
        self._capacity = config.capacity
        self._mono: Callable[[], int] = config.clock or time.monotonic_ns
        self._wall: Callable[[], int] = config.clock or time.time_ns

        self._lock = threading.RLock()
        self._data_cv = threading.Condition(self._lock)
        self._space_cv = threading.Condition(self._lock)

        self._rings: List[Deque[Any]] = [deque() for _ in range(n)]
        self._available: Deque[int] = deque()
        self._queued = [False] * n
        self._blocked = [False] * n
        self._num_blocked = 0
        self._eop_pushed = [False] * n
        self._closed = [False] * n
        self._num_closed = 0
        self._priority: Deque[Tuple[int, int]] = deque()
        self._in_poll = False
        self._stashed: Optional[BaseException] = None
        self._failure: Optional[CorruptStreamError] = None
        self._last_barrier_pushed = [-1] * n

        # exactly-once state: the one checkpoint in progress
        self._current = -1
        self._pending = False
        self._phase = _ALIGNED
        self._received = [False] * n
        self._num_received = 0
        self._current_barrier: Optional[CheckpointBarrier] = None
        self._alignment_start = 0
        self._timeout_eligible = False
        # at-least-once state: ordered table of pending checkpoints
        self._table: Deque[_Pending] = deque()
        self._latest_pending = -1

        self._last_alignment_ns = 0
        self._last_start_delay_ns = 0
        self._bytes_during_alignment = 0

    # ------------------------------------------------------------------ producer

    def push(self, channel: int, item: Any) -> bool:
        ch = check_channel(channel, self._n)
        with self._lock:
            return self._push_locked(ch, item)

    def push_many(self, channel: int, items: Any) -> int:
        ch = check_channel(channel, self._n)
        pushed = 0
        with self._lock:
            for item in items:
                if not self._push_locked(ch, item):
                    break
                pushed += 1
        return pushed

    def put(self, channel: int, item: Any, timeout: Optional[float] = None) -> bool:
        ch = check_channel(channel, self._n)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._push_locked(ch, item):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._space_cv.wait(remaining)
            return True

    def _push_locked(self, ch: int, item: Any) -> bool:
        kind = _kind(item)
        if self._eop_pushed[ch]:
            raise ChannelClosedError(f"channel {ch} already delivered EndOfPartition; cannot push {item!r} after it")
        ring = self._rings[ch]
        limit = self._capacity if kind == _DATA else self._config.event_limit
        if len(ring) >= limit:
            return False
        ring.append(item)
        if kind == _EOP:
            self._eop_pushed[ch] = True
        elif kind == _BARRIER:
            if item.checkpoint_id == self._last_barrier_pushed[ch] and self._failure is None:
                # A producer never sends one checkpoint's barrier twice. The consumer
                # fails, not the producer: that is the task the corrupt input belongs to.
                self._failure = CorruptStreamError(
                    f"stream corrupt: repeated barrier for checkpoint {item.checkpoint_id} on channel {ch}"
                )
            self._last_barrier_pushed[ch] = item.checkpoint_id
            if self._overtakes_on_push(item):
                self._priority.append((ch, item.checkpoint_id))
        if not self._blocked[ch]:
            self._make_available(ch)
        self._data_cv.notify_all()
        return True

    def _overtakes_on_push(self, barrier: CheckpointBarrier) -> bool:
        if not self._config.unaligned or barrier.options.checkpoint_type is not CheckpointType.CHECKPOINT:
            return False
        if self._config.aligned_timeout_ns == 0:
            return True
        # Aligned-first checkpoints: only once this checkpoint has timed out of alignment.
        return self._pending and self._phase == _UNALIGNED and barrier.checkpoint_id == self._current

    def _make_available(self, ch: int) -> None:
        if not self._queued[ch]:
            self._queued[ch] = True
            self._available.append(ch)

    # ------------------------------------------------------------------ consumer

    def poll_next(self) -> Optional[Tuple[int, Any]]:
        with self._lock:
            self._enter()
            try:
                self._raise_pending_error()
                return self._poll_one()
            finally:
                self._in_poll = False

    def poll_priority(self) -> Optional[Tuple[int, Any]]:
        with self._lock:
            self._enter()
            try:
                self._raise_pending_error()
                return self._take_urgent()
            finally:
                self._in_poll = False

    def poll_batch(self, max_items: int) -> List[Tuple[int, Any]]:
        if type(max_items) is bool or not isinstance(max_items, int) or max_items < 1:
            raise ValueError(f"max_items must be a positive int, got {max_items!r}")
        out: List[Tuple[int, Any]] = []
        with self._lock:
            self._enter()
            try:
                self._raise_pending_error()
                while len(out) < max_items:
                    # A batch is data only, or one event alone: every listener call
                    # except add_input_data happens before the caller sees later data.
                    if out and self._next_needs_own_batch():
                        break
                    try:
                        r = self._poll_one()
                    except Exception as exc:
                        if not out:
                            raise
                        self._stashed = exc
                        break
                    if r is None:
                        break
                    out.append(r)
                    if _kind(r[1]) != _DATA:
                        break
            finally:
                self._in_poll = False
        return out

    def next(self, timeout: Optional[float] = None) -> Optional[Tuple[int, Any]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                r = self.poll_next()
                if r is not None or self._num_closed == self._n:
                    return r
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                align_left = self._alignment_deadline_left_s()
                if align_left is not None:
                    remaining = align_left if remaining is None else min(remaining, align_left)
                self._data_cv.wait(remaining)

    def _enter(self) -> None:
        if self._in_poll:
            raise RuntimeError(
                "the gate is already being polled, from one of its listener callbacks or another thread: "
                "a gate has a single consumer"
            )
        self._in_poll = True

    def _raise_pending_error(self) -> None:
        if self._failure is not None:
            raise self._failure
        exc = self._stashed
        if exc is not None:
            self._stashed = None
            raise exc

    def _alignment_deadline_left_s(self) -> Optional[float]:
        if self._config.clock is not None or not self._timeout_pending():
            return None
        left = self._alignment_start + self._config.aligned_timeout_ns - self._mono()
        return max(left, 0) / 1e9

    def _next_channel(self) -> Optional[int]:
        """Front of the available queue, dropping channels that are empty or blocked."""
        while self._available:
            ch = self._available[0]
            if self._rings[ch] and not self._blocked[ch]:
                return ch
            self._available.popleft()
            self._queued[ch] = False
        return None

    def _next_needs_own_batch(self) -> bool:
        if self._priority or self._timeout_due():
            return True
        ch = self._next_channel()
        return ch is not None and _kind(self._rings[ch][0]) != _DATA

    def _take_urgent(self) -> Optional[Tuple[int, Any]]:
        """A priority item, or None once there is none and no aligned timeout is
        due (a due timeout switches to unaligned first, which may queue some)."""
        while True:
            taken = self._take_priority()
            if taken is not None:
                return taken
            if self._timeout_due():
                self._switch_to_unaligned()
                continue
            return None

    def _poll_one(self) -> Optional[Tuple[int, Any]]:
        while True:
            taken = self._take_urgent()
            if taken is not None:
                return taken
            ch = self._next_channel()
            if ch is None:
                return None
            ring = self._rings[ch]
            item = ring[0]
            kind = _kind(item)
            if kind == _DATA and self._pending and self._phase == _UNALIGNED and not self._received[ch]:
                # Hand in-flight data over before taking it, so a failing writer loses nothing.
                if self._cb.add_input_data is not None:
                    self._cb.add_input_data(self._current, ch, item)
            ring.popleft()
            self._available.popleft()
            self._queued[ch] = False
            self._space_cv.notify_all()
            if kind == _DATA:
                if self._pending and self._phase == _ALIGNED:
                    self._bytes_during_alignment += item_nbytes(item)
                if ring:
                    self._make_available(ch)
                return ch, item
            notes: List[Callable[[], Any]] = []
            try:
                if kind == _BARRIER:
                    self._on_barrier(item, ch, None, notes)
                elif kind == _CANCEL:
                    self._on_cancel(item, ch, notes)
                else:
                    self._on_end_of_partition(ch, notes)
            finally:
                if ring and not self._blocked[ch]:
                    self._make_available(ch)
            self._dispatch(notes)
            if kind != _CANCEL:
                return ch, item

    @staticmethod
    def _barrier_position(ring: Deque[Any], checkpoint_id: int) -> Optional[int]:
        for k, item in enumerate(ring):
            if type(item) is CheckpointBarrier and item.checkpoint_id == checkpoint_id:
                return k
        return None

    def _take_priority(self) -> Optional[Tuple[int, Any]]:
        while self._priority:
            ch, checkpoint_id = self._priority.popleft()
            ring = self._rings[ch]
            k = self._barrier_position(ring, checkpoint_id)
            if k is None:
                continue
            item = ring[k]
            overtaken = [x for i, x in enumerate(ring) if i < k and _kind(x) == _DATA]
            del ring[k]
            self._space_cv.notify_all()
            notes: List[Callable[[], Any]] = []
            self._on_barrier(item, ch, overtaken, notes)
            self._dispatch(notes)
            return ch, item
        return None

    @staticmethod
    def _dispatch(notes: List[Callable[[], Any]]) -> None:
        for note in notes:
            note()

    def _corrupt(self, message: str) -> CorruptStreamError:
        """The gate stays failed: everything after a corrupt event is suspect."""
        self._failure = CorruptStreamError(message)
        return self._failure

    # ------------------------------------------------------------------ handlers

    def _on_barrier(
        self, barrier: CheckpointBarrier, ch: int, overtaken: Optional[List[Any]], notes: List[Callable[[], Any]]
    ) -> None:
        if self._config.exactly_once:
            self._eo_barrier(barrier, ch, overtaken, notes)
        else:
            self._tracker_barrier(barrier, ch, notes)

    def _on_cancel(self, marker: CancelCheckpointMarker, ch: int, notes: List[Callable[[], Any]]) -> None:
        if self._config.exactly_once:
            self._eo_cancel(marker.checkpoint_id, notes)
        else:
            self._tracker_cancel(marker.checkpoint_id, ch, notes)

    def _on_end_of_partition(self, ch: int, notes: List[Callable[[], Any]]) -> None:
        self._closed[ch] = True
        self._num_closed += 1
        if self._config.exactly_once:
            if self._pending:
                self._abort_pending(_R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM, notes)
        else:
            for entry in self._table:
                if not entry.aborted:
                    entry.aborted = True
                    notes.append(self._abort_note(entry.checkpoint_id, _R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM))
            self._table.clear()

    # exactly-once --------------------------------------------------------------

    def _eo_barrier(
        self, barrier: CheckpointBarrier, ch: int, overtaken: Optional[List[Any]], notes: List[Callable[[], Any]]
    ) -> None:
        checkpoint_id = barrier.checkpoint_id
        if self._pending:
            if checkpoint_id == self._current:
                if self._received[ch]:
                    raise self._corrupt(
                        f"stream corrupt: repeated barrier for checkpoint {checkpoint_id} on channel {ch}"
                    )
                self._mark_received(ch)
                if self._phase == _ALIGNED:
                    self._block(ch)
                else:
                    self._hand_overtaken(ch, overtaken, notes)
            elif checkpoint_id > self._current:
                self._abort_pending(_R.CHECKPOINT_DECLINED_SUBSUMED, notes)
                self._begin(barrier, ch, overtaken, notes)
            else:
                return
        elif checkpoint_id > self._current:
            self._begin(barrier, ch, overtaken, notes)
        else:
            return
        if self._pending and self._num_received + self._num_closed >= self._n:
            self._complete(barrier, notes)

    def _begin(
        self, barrier: CheckpointBarrier, ch: int, overtaken: Optional[List[Any]], notes: List[Callable[[], Any]]
    ) -> None:
        self._current = barrier.checkpoint_id
        self._pending = True
        self._received = [False] * self._n
        self._num_received = 0
        self._current_barrier = barrier
        self._alignment_start = self._mono()
        self._last_start_delay_ns = max(0, self._wall() // 1_000_000 - barrier.timestamp) * 1_000_000
        self._bytes_during_alignment = 0
        self._mark_received(ch)
        unaligned_kind = self._config.unaligned and barrier.options.checkpoint_type is CheckpointType.CHECKPOINT
        if unaligned_kind and self._config.aligned_timeout_ns == 0:
            self._phase = _UNALIGNED
            self._timeout_eligible = False
            self._last_alignment_ns = 0
            metrics = CheckpointMetrics(0, self._last_start_delay_ns, 0, True)
            taken = barrier.with_alignment(True)
            notes.append(lambda: self._cb.trigger(taken, metrics))
            self._hand_overtaken(ch, overtaken, notes)
        else:
            self._phase = _ALIGNED
            self._timeout_eligible = unaligned_kind
            self._block(ch)

    def _end_alignment(self) -> int:
        """Ends the aligned phase: releases the blocked channels, records how long it took."""
        duration = self._mono() - self._alignment_start
        self._release_blocks()
        self._last_alignment_ns = duration
        return duration

    def _complete(self, barrier: CheckpointBarrier, notes: List[Callable[[], Any]]) -> None:
        self._pending = False
        checkpoint_id = self._current
        if self._phase == _ALIGNED:
            duration = self._end_alignment()
            metrics = CheckpointMetrics(duration, self._last_start_delay_ns, self._bytes_during_alignment, False)
            # An aligned-first checkpoint whose barriers all came in time is an aligned one:
            # no in-flight data and no finish_input follow, so its barrier must not say unaligned.
            taken = barrier.with_alignment(False)
            notes.append(lambda: self._cb.trigger(taken, metrics))
        elif self._cb.finish_input is not None:
            finish = self._cb.finish_input
            notes.append(lambda: finish(checkpoint_id))

    def _abort_pending(self, reason: CheckpointFailureReason, notes: List[Callable[[], Any]]) -> None:
        self._pending = False
        if self._phase == _ALIGNED:
            self._end_alignment()
        notes.append(self._abort_note(self._current, reason))

    def _eo_cancel(self, checkpoint_id: int, notes: List[Callable[[], Any]]) -> None:
        if self._pending:
            if checkpoint_id == self._current:
                self._abort_pending(_R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER, notes)
                return
            if checkpoint_id < self._current:
                return
            if self._phase == _UNALIGNED:
                # Already triggered: the task must hear that it will not complete.
                self._abort_pending(_R.CHECKPOINT_DECLINED_SUBSUMED, notes)
            else:
                # Never triggered at this task; Flink drops the alignment silently.
                self._pending = False
                self._release_blocks()
        elif checkpoint_id <= self._current:
            return
        self._current = checkpoint_id
        self._last_alignment_ns = 0
        notes.append(self._abort_note(checkpoint_id, _R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER))

    def _timeout_pending(self) -> bool:
        return self._pending and self._phase == _ALIGNED and self._timeout_eligible

    def _timeout_due(self) -> bool:
        return self._timeout_pending() and (self._mono() - self._alignment_start >= self._config.aligned_timeout_ns)

    def _switch_to_unaligned(self) -> None:
        """Alignment took longer than aligned_timeout_ms: trigger now, unaligned."""
        duration = self._mono() - self._alignment_start
        self._phase = _UNALIGNED
        self._release_blocks()
        self._last_alignment_ns = duration
        checkpoint_id = self._current
        for ch in range(self._n):
            if self._closed[ch] or self._received[ch]:
                continue
            if self._barrier_position(self._rings[ch], checkpoint_id) is not None:
                self._priority.append((ch, checkpoint_id))
        assert self._current_barrier is not None
        barrier = self._current_barrier.with_alignment(True)
        metrics = CheckpointMetrics(duration, self._last_start_delay_ns, self._bytes_during_alignment, True)
        self._cb.trigger(barrier, metrics)

    def _hand_overtaken(self, ch: int, overtaken: Optional[List[Any]], notes: List[Callable[[], Any]]) -> None:
        add = self._cb.add_input_data
        if overtaken and add is not None:
            checkpoint_id = self._current
            for item in overtaken:
                notes.append(functools.partial(add, checkpoint_id, ch, item))

    def _mark_received(self, ch: int) -> None:
        self._received[ch] = True
        self._num_received += 1

    def _block(self, ch: int) -> None:
        if not self._blocked[ch]:
            self._blocked[ch] = True
            self._num_blocked += 1

    def _release_blocks(self) -> None:
        if self._num_blocked == 0:
            return
        for ch in range(self._n):
            if self._blocked[ch]:
                self._blocked[ch] = False
                if self._rings[ch]:
                    self._make_available(ch)
        self._num_blocked = 0

    # at-least-once -------------------------------------------------------------

    def _tracker_barrier(self, barrier: CheckpointBarrier, ch: int, notes: List[Callable[[], Any]]) -> None:
        checkpoint_id = barrier.checkpoint_id
        open_channels = self._n - self._num_closed
        pos = next((i for i, e in enumerate(self._table) if e.checkpoint_id == checkpoint_id), None)
        if pos is not None:
            entry = self._table[pos]
        else:
            if checkpoint_id <= self._latest_pending:
                return  # an old checkpoint: it cannot complete any more
            delay = max(0, self._wall() // 1_000_000 - barrier.timestamp) * 1_000_000
            self._last_start_delay_ns = delay
            self._latest_pending = checkpoint_id
            entry = _Pending(checkpoint_id, delay)
            if len(self._table) == _MAX_PENDING:
                self._table.popleft()
            self._table.append(entry)
            pos = len(self._table) - 1
        if ch in entry.seen:
            raise self._corrupt(f"stream corrupt: repeated barrier for checkpoint {checkpoint_id} on channel {ch}")
        entry.seen.add(ch)
        if len(entry.seen) >= open_channels:
            for _ in range(pos + 1):
                self._table.popleft()
            if not entry.aborted:
                metrics = CheckpointMetrics(0, entry.start_delay_ns, 0, False)
                notes.append(lambda: self._cb.trigger(barrier, metrics))

    def _tracker_cancel(self, checkpoint_id: int, ch: int, notes: List[Callable[[], Any]]) -> None:
        reason = _R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER
        # Every pending checkpoint older than the cancelled one can no longer complete.
        while self._table and self._table[0].checkpoint_id < checkpoint_id:
            entry = self._table.popleft()
            if not entry.aborted:
                entry.aborted = True
                notes.append(self._abort_note(entry.checkpoint_id, reason))
        if self._table and self._table[0].checkpoint_id == checkpoint_id:
            entry = self._table[0]
            if ch in entry.seen:
                raise self._corrupt(
                    f"stream corrupt: repeated cancellation of checkpoint {checkpoint_id} on channel {ch}"
                )
            if not entry.aborted:
                entry.aborted = True
                notes.append(self._abort_note(checkpoint_id, reason))
        elif checkpoint_id > self._latest_pending:
            # The first we hear of this checkpoint is its cancellation; the table is
            # empty here (everything older was just dropped), so append is Flink's addFirst.
            notes.append(self._abort_note(checkpoint_id, reason))
            self._latest_pending = checkpoint_id
            entry = _Pending(checkpoint_id, 0)
            entry.aborted = True
            self._table.append(entry)
        else:
            return  # trailing cancellation of a checkpoint already dealt with
        # Still counted, so the row goes once every open channel has reported.
        entry.seen.add(ch)
        if len(entry.seen) >= self._n - self._num_closed:
            self._table.popleft()

    def _abort_note(self, checkpoint_id: int, reason: CheckpointFailureReason) -> Callable[[], Any]:
        return lambda: self._cb.abort(checkpoint_id, reason)

    # ------------------------------------------------------------------ inspection

    @property
    def num_channels(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        """Data buffers per channel (what a producer limiting its in-flight buffers needs)."""
        return self._capacity

    @property
    def is_finished(self) -> bool:
        with self._lock:
            return self._num_closed == self._n

    @property
    def latest_checkpoint_id(self) -> int:
        with self._lock:
            return self._current if self._config.exactly_once else self._latest_pending

    @property
    def blocked_channels(self) -> List[int]:
        with self._lock:
            return [ch for ch in range(self._n) if self._blocked[ch]]

    @property
    def last_alignment_duration_ns(self) -> int:
        return self._last_alignment_ns

    @property
    def last_checkpoint_start_delay_ns(self) -> int:
        return self._last_start_delay_ns

    @property
    def bytes_processed_during_alignment(self) -> int:
        return self._bytes_during_alignment

    def queued(self, channel: int) -> int:
        ch = check_channel(channel, self._n)
        with self._lock:
            return len(self._rings[ch])
