"""Adaptive buffers (Flink's buffer debloating, FLIP-183, on by default here).

Each output channel keeps about ``target_ms`` of its consumer's time in flight: the
data queued in the channel is what an aligned barrier waits behind and what an
unaligned checkpoint persists, so bounding it in *time* bounds both, whatever the
consumer's speed. The producer measures, per channel, how fast the consumer takes
what it was sent (from ``gate.queued(channel)``: what left the queue since the last
look was consumed; the same for an in-process gate and for the Spark runner's remote
channel, whose send queue drains as the receiver takes data), and every
``PERIOD_S`` re-plans two limits from the records per second over the last
``WINDOW`` periods:

* **buffers in flight** first: ``budget = records/s * target`` records may be queued,
  so ``budget // buffer_size`` buffers, between ``MIN_IN_FLIGHT`` and the channel's
  capacity. Fewer buffers cut in-flight time without changing what each buffer
  costs, which is where Flink went wrong: it shrinks the buffer *size* first, and a
  consumer with a cost per buffer then gets slower with each shrink, measures slower,
  and shrinks further (FLINK-33077: 256-byte buffers, checkpoints taking minutes).
* **records per buffer** only when ``MIN_IN_FLIGHT`` buffers of the configured size
  are still more than the budget, and never above the configured size.

Floors, and why they rule out FLINK-33077's pathology: at least ``MIN_IN_FLIGHT`` (2)
buffers (one being taken while the next is ready), at least ``MIN_RECORDS`` (16)
Python records per buffer, and Arrow slices of at least ``MIN_BATCH_BYTES`` (32 KiB,
Flink's default buffer: its pathology was 256 bytes). Buffers only shrink once two
configured buffers take the consumer longer than the target, that is, for a consumer
that is slow *per record* (with the default 1 s target and 1,024-record buffers, over
half a millisecond a record), against which a buffer's fixed cost (tens of
microseconds in Python) is small even at 16 records. A consumer slow *per buffer*
would otherwise spiral (smaller buffers, fewer records/s measured, smaller buffers):
the floor stops it, and its in-flight time is cut by the number of buffers instead.

Nothing is limited while the consumer is not the bottleneck: a channel that was
found empty during the window (the consumer waited for data) plans the configured
size and capacity, so a job without backpressure runs exactly as with debloating off.

**Growing** (where the engine chose the buffer size, ``StreamEnvironment(buffer_size=None)``;
``grow()``). Flink only shrinks buffers; a vectorised engine must also grow them, since
each buffer costs every operator it passes a fixed amount (a Python call, an Arrow
kernel's setup, a keyed aggregate's per-key merge of what the buffer holds): at the
1,024 records or 256 KiB slices of the fixed defaults, that cost was two thirds of a
keyed aggregate's time (0.33x of ``buffer_size=65536``). So a channel whose limits are
not shrunk doubles its buffers, up to twice a period (``GROW_PERIOD_S`` while it grows,
so a job of seconds gains too), while it is *throughput-bound*: its buffers leave full (the
consumer busy, or the producer producing as fast as it can: either way fewer, larger
buffers cut the per-buffer cost on both sides), as long as

* ``MIN_IN_FLIGHT`` grown buffers still fit the latency target (the consumer's rate times
  ``target_ms``, the budget shrinking keeps to; when the consumer waited, the flow),
  and the buffers queued stay within it, so a grown channel never holds more of its
  consumer's time than a debloated one may: aligned barriers and what unaligned
  checkpoints persist stay bounded in time;
* a buffer stays under ``MAX_BUFFER_BYTES`` and a grown channel's queued buffers under
  ``MAX_IN_FLIGHT_BYTES`` (Arrow rows by their measured width, Python records reckoned at
  ``PY_RECORD_BYTES``), so memory and unaligned checkpoints stay bounded in bytes too.

A channel whose producer is short of input (at least half of a period's buffers left
on the buffer timeout holding less than the configured size, or its source's reads came
back short) halves its size instead, back to the configured one: live input then gains
nothing from waiting for a larger buffer. (A record waits in a buffer of any size at
most the buffer timeout, as before; what grows is bounded by the target and the bytes.)
As soon as the consumer's latency budget no longer fits the configured size, the
shrinking rule above takes over. A source reads what its grown channels take
(``Output.read_rows``), so Parquet rows come in slices of the grown size. An explicit
``buffer_size`` is a ceiling, as in Flink: nothing grows past it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

__all__ = [
    "MAX_BUFFER_BYTES",
    "MAX_IN_FLIGHT_BYTES",
    "MIN_BATCH_BYTES",
    "MIN_IN_FLIGHT",
    "MIN_RECORDS",
    "ChannelDebloater",
    "Plan",
    "grow",
    "plan",
]

log = logging.getLogger(__name__)

PERIOD_S = 0.1  # how often a channel's limits are re-planned (Flink: 200 ms)
WINDOW = 20  # periods the consumer's rate is measured over (Flink: 20 samples)
SAMPLE_S = 0.005  # how often, at most, the channel's queue is looked at
STARVED_SHARE = 0.25  # a period is busy when at most this share of looks found the queue empty
MIN_IN_FLIGHT = 2  # buffers: one being taken by the consumer while the next is ready
MIN_RECORDS = 16  # Python records per buffer, at least (see "Floors" in the module docstring)
MIN_BATCH_BYTES = 32 * 1024  # an Arrow slice, at least (Flink's default buffer; 256 B was FLINK-33077)
# Growing (see "Growing" in the module docstring)
GROW_WINDOW = 3  # periods the flow is measured over for growing: the flow rises as buffers grow
GROW_PERIOD_S = 0.01  # the period while a channel that may grow is still growing: a short job gains too
# doublings a period at most: a channel re-plans when it pushes, and a grown one pushes
# rarely (a source's slice of 100,000 rows every few tens of ms), so one doubling a
# period took a third of a second from 256 KiB slices to the byte bound
GROW_STEPS = 2
MAX_BUFFER_BYTES = 4 << 20  # a grown buffer, at most
MAX_IN_FLIGHT_BYTES = 16 << 20  # a grown channel's queued buffers, at most
PY_RECORD_BYTES = 256  # what one Python record (a small dict or tuple and its values) is reckoned to take


@dataclass(frozen=True)
class Plan:
    """A channel's limits: ``size`` records per buffer and ``in_flight`` buffers queued."""

    size: int
    in_flight: int


def plan(
    records_per_s: float,
    target_ms: float,
    *,
    max_size: int,
    capacity: int,
    min_size: int = MIN_RECORDS,
    busy: bool = True,
) -> Plan:
    """The limits that keep about ``target_ms`` of a consumer taking ``records_per_s``
    in flight (see the module's docstring): fewer buffers first, smaller ones only
    once ``MIN_IN_FLIGHT`` full buffers are too many, within the floors and the
    configured ``max_size`` / ``capacity``. ``busy=False`` (the consumer waited for
    data during the window): the configured limits."""
    min_size = max(1, min(min_size, max_size))
    floor_buffers = min(MIN_IN_FLIGHT, capacity)
    if not busy or records_per_s <= 0 or records_per_s != records_per_s:
        return Plan(max_size, capacity)
    budget = records_per_s * target_ms / 1000.0  # records the consumer takes in the target time
    buffers = int(budget // max_size)
    if buffers >= floor_buffers:
        return Plan(max_size, min(buffers, capacity))
    size = int(budget // floor_buffers)
    return Plan(max(min_size, min(size, max_size)), floor_buffers)


def grow(
    flow_per_s: float,
    records_per_s: float,
    target_ms: float,
    *,
    size: int,
    floor: int,
    capacity: int,
    row_bytes: int,
    busy: bool,
    input_bound: bool = False,
) -> Plan:
    """The limits of a channel allowed to grow, for one period (see "Growing" in the
    module docstring): ``size`` is its records per buffer now, ``floor`` the configured
    size it never grows below (shrinking under it is ``plan``'s part),
    ``flow_per_s`` the records/s through the channel over the last periods,
    ``records_per_s`` the consumer's rate over its busy periods (the latency budget when
    ``busy``; when the consumer waited, the queue is empty and the flow is the budget),
    ``row_bytes`` a record's width, ``input_bound`` whether the producer was short of
    input this period (its buffers left on the buffer timeout under the configured size,
    or its source's reads came back short). Throughput-bound: up to ``GROW_STEPS``
    doublings, while ``MIN_IN_FLIGHT`` buffers fit the budget and a buffer
    ``MAX_BUFFER_BYTES``; input-bound: one halving. Sizes are ``floor`` times a power
    of two."""
    floor = max(1, floor)
    row_bytes = max(1, row_bytes)
    # the consumer takes at least what flowed through the channel lately: its busy rate
    # is averaged over a longer window (slow start-up periods included) and would bound
    # a channel that has just grown by the consumer's speed before it
    rate = max(records_per_s, flow_per_s) if busy else flow_per_s
    if rate <= 0 or rate != rate:  # unmeasured: nothing flows (back to the floor), or a busy consumer
        return Plan(max(floor, size) if busy else floor, capacity)  # not yet measured (as it was)
    budget = rate * target_ms / 1000.0  # records in flight that keep to the latency target
    room = min(budget / MIN_IN_FLIGHT, MAX_BUFFER_BYTES / row_bytes)
    size = max(floor, size)
    if input_bound:
        size = max(floor, size // 2)
    else:
        for _ in range(GROW_STEPS):  # doublings a period, while they fit
            if 2 * size > room:
                break
            size *= 2
    while size > floor and size > room:  # the bounds moved (a slower consumer): halve until it fits
        size //= 2
    size = max(floor, size)
    in_flight = capacity
    if size > floor:  # grown: the byte bound, and the budget when the consumer is the bottleneck
        in_flight = min(in_flight, max(MIN_IN_FLIGHT, MAX_IN_FLIGHT_BYTES // (size * row_bytes)))
        if busy:
            in_flight = min(in_flight, max(MIN_IN_FLIGHT, int(budget // size)))
    return Plan(size, max(1, min(in_flight, capacity)))


class ChannelDebloater:
    """One output channel's measurement and limits; called from the producing task's
    thread only (the statistics read ``size``/``in_flight``/``rate`` from others:
    plain attributes, each written whole).

    The rate is taken over the *busy* periods of the window only, those in which the
    queue was seen empty in at most ``STARVED_SHARE`` of the looks: in the others the
    consumer waited for data, so what it took says how fast the producer was, not how
    fast the consumer can go. A period in which it waited also loosens the limits a
    step (one buffer more, or larger buffers), since a limit too tight is one reason a
    consumer waits; planning from its slower rate instead would tighten them further
    (the spiral of FLINK-33077).

    ``can_grow`` (the engine chose the buffer size): once the limits are not shrunk,
    ``grow`` plans once a period (see its docstring), and ``grown`` says
    the size is above the configured one (``Output`` then cuts Python records at it,
    and an Arrow source reads slices of it)."""

    __slots__ = (
        "_busy",
        "_ceiling",
        "_consumed",
        "_consumed_buffers",
        "_empty",
        "_looks",
        "_next_sample",
        "_partial",
        "_period_consumed",
        "_period_pushes",
        "_period_s",
        "_period_start",
        "_periods",
        "_queued_sizes",
        "can_grow",
        "capacity",
        "flow",
        "grown",
        "in_flight",
        "max_size",
        "min_size",
        "rate",
        "row_bytes",
        "shrunk",
        "size",
        "target_ms",
    )

    def __init__(
        self, target_ms: float, max_size: int, capacity: int, min_size: int = MIN_RECORDS, can_grow: bool = False
    ) -> None:
        self.target_ms = target_ms
        self.can_grow = can_grow
        self.grown = False  # size is above the ceiling: grown by ``grow``
        self.flow = 0.0  # records/s through the channel over the window's periods, busy or not
        self.row_bytes = PY_RECORD_BYTES  # a record's width (an Arrow row's, once one was pushed)
        self._ceiling = max_size
        self.max_size = max_size
        self.capacity = capacity
        self.min_size = min_size
        self.size = max_size  # records per buffer now
        self.shrunk = False  # size is below the ceiling: buffers are cut to it
        self.in_flight = capacity  # buffers queued at most now
        self.rate = 0.0  # the consumer's records/s over the window's busy periods
        # sizes (records; 0 for an event) of what was pushed and may still be queued, oldest first
        self._queued_sizes: Deque[int] = deque()
        self._consumed = 0  # records the consumer took so far
        self._consumed_buffers = 0  # data buffers among them
        self._busy: Deque[Tuple[float, int]] = deque(maxlen=WINDOW)  # (seconds, records) per busy period
        self._periods: Deque[Tuple[float, int]] = deque(maxlen=GROW_WINDOW)  # (seconds, records) per period
        now = time.monotonic()
        self._period_start = now
        self._period_s = GROW_PERIOD_S if can_grow else PERIOD_S
        self._period_consumed = 0
        self._period_pushes = 0  # data buffers pushed this period
        self._partial = 0  # signs the producer was short of input (see ``partial``)
        self._looks = 0
        self._empty = 0
        self._next_sample = now

    def pushed(self, records: int) -> None:
        """An item went into the channel (``records`` 0 for an event)."""
        self._queued_sizes.append(records)
        if records:
            self._period_pushes += 1

    def partial(self) -> None:
        """The producer was short of input: a buffer left on the buffer timeout under
        the configured size, or its source's read gave fewer rows than asked (see ``grow``)."""
        self._partial += 1

    def jumped(self) -> None:
        """A barrier went in ahead of the queued data (unaligned): it leaves first."""
        self._queued_sizes.appendleft(0)

    def due(self, now: float) -> bool:
        """Whether to look at the queue now (at most every ``SAMPLE_S``)."""
        if now >= self._next_sample:
            self._next_sample = now + SAMPLE_S
            return True
        return False

    def observe(self, queued: int, now: float) -> None:
        """The channel holds ``queued`` items now (looked at before a push): what left
        was consumed, and an empty queue means the consumer waited for it."""
        sizes = self._queued_sizes
        while len(sizes) > queued:
            n = sizes.popleft()
            if n:
                self._consumed += n
                self._consumed_buffers += 1
        self._looks += 1
        if queued == 0:
            self._empty += 1
        if now - self._period_start >= self._period_s:
            self._replan(now)

    def _replan(self, now: float) -> None:
        seconds = now - self._period_start
        consumed = self._consumed - self._period_consumed
        busy = self._empty <= STARVED_SHARE * self._looks
        pushes, partial = self._period_pushes, self._partial
        self._period_start, self._period_consumed, self._looks, self._empty = now, self._consumed, 0, 0
        self._period_pushes = self._partial = 0
        # the ceiling is the configured size, or what the buffers hold when they come
        # larger (Arrow batches go on as they come: their rows are the size then); a
        # grown channel's buffers hold what it grew to, so its ceiling stays as it was
        ceiling = self._ceiling
        if not self.grown:
            ceiling = self.max_size
            if self._consumed_buffers:
                ceiling = max(ceiling, self._consumed // self._consumed_buffers)
            self._ceiling = ceiling
        grown_size = self.size if self.grown else 0  # what the channel grew to, before re-planning
        self._periods.append((seconds, consumed))
        self.flow = sum(c for _, c in self._periods) / max(1e-9, sum(t for t, _ in self._periods))
        if not busy:
            if self.size < ceiling:
                self.size = min(ceiling, self.size * 2)
            else:
                self.size = self.size if self.grown else ceiling
                self.in_flight = min(self.capacity, self.in_flight + 1)
            self.shrunk = self.size < ceiling
        else:
            self._busy.append((seconds, consumed))
            self.rate = sum(c for _, c in self._busy) / max(1e-9, sum(t for t, _ in self._busy))
            p = plan(self.rate, self.target_ms, max_size=ceiling, capacity=self.capacity, min_size=self.min_size)
            self.size, self.in_flight = p.size, p.in_flight
            self.shrunk = p.size < ceiling
        if self.can_grow and not self.shrunk:
            before = max(grown_size, ceiling)
            if not busy and not pushes and not partial:  # nothing went through: nothing learnt
                self.size, self.grown = before, before > ceiling
                return
            g = grow(
                self.flow,
                self.rate,
                self.target_ms,
                size=before,
                floor=ceiling,
                capacity=self.in_flight,
                row_bytes=self.row_bytes,
                busy=busy,
                input_bound=2 * partial >= max(1, pushes) and partial > 0,
            )
            self.size, self.in_flight = g.size, g.in_flight
            self.grown = g.size > ceiling
            # short periods while it grows: a job of a few seconds reaches its size early
            self._period_s = GROW_PERIOD_S if g.size > before else PERIOD_S
            if g.size != before:
                log.debug(
                    "adaptive buffers: %s a channel's buffers to %d records (%.0f records/s through it, %d in flight)",
                    "grew" if g.size > before else "shrank",
                    g.size,
                    self.flow,
                    g.in_flight,
                )
        else:
            self.grown = False
            self._period_s = PERIOD_S

    def stats(self) -> Dict[str, Any]:
        return {
            "buffer_size": self.size,
            "buffers_in_flight": self.in_flight,
            "consumer_records_per_s": self.rate,
            "records_per_s": self.flow,
            "grown": self.grown,
        }


def summarize(channels: List[ChannelDebloater]) -> Optional[Dict[str, Any]]:
    """An output's channels in one line for the statistics: the smallest buffer size
    and in-flight limit among them (the most debloated channel), and each channel's."""
    if not channels:
        return None
    return {
        "buffer_size": min(c.size for c in channels),
        "buffers_in_flight": min(c.in_flight for c in channels),
        "channels": [c.stats() for c in channels],
    }
