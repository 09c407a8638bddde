"""Windows: ``key_by(k).window(pe.windows.tumbling(60_000)).aggregate(pe.agg.count())``.

Window assigners (Flink's): ``tumbling(size_ms, offset_ms=0)``, ``sliding(size_ms,
slide_ms, offset_ms=0)`` and ``session(gap_ms)``, in event time by default or
``time="processing"``. A window is ``[start, end)`` in milliseconds; an event-time
window fires once the watermark reaches ``end - 1`` (every record of it is in, as far
as the watermark knows), emitting one row per key and window::

    {key column, "window_start", "window_end", one column per aggregation}

``.allowed_lateness(ms)`` keeps a fired window's state that much longer: a late
record inside it updates the window and emits an updated row at once (the totals so
far, as Flink's ``EventTimeTrigger`` fires on a late element). A record later than
that (its window's ``end - 1 + allowed_lateness`` is at or below the watermark) is
dropped and counted in the job's statistics (``numLateRecordsDropped``). Session
windows merge as Flink's ``MergingWindowSet``: a record opens ``[ts, ts + gap)`` and
every window that intersects it (touching counts) merges into one.

Two operators run windows:

- tumbling and sliding windows with ``.aggregate`` over a stream keyed by a column
  (``AlignedWindowAggregateOperator``): vectorised like ``KeyedStream.aggregate``.
  Every key shares the windows' bounds, so a window fires for all its keys at once
  from columnar state, with no timer per key (see the class);
- everything else (session windows, ``.process``, keys by function):
  ``WindowOperator``, per record, each key's windows in keyed state and their
  triggers as keyed timers, as Flink's ``WindowOperator``.

Both keep their watermark in operator state, so a restore neither re-opens a window
it had closed nor fires one twice.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import pyarrow as pa

from .agg import Aggregation
from .errors import NonRetryableError, not_records, refuse_non_records
from .io.events import MAX_WATERMARK, MIN_WATERMARK
from .runtime.aggregate import (
    AggregateInputError,
    accumulator_type,
    check_key_type,
    needed_accumulators,
    not_a_table,
    null_keys,
    unified_schema,
    value_state,
)
from .runtime.copies import per_subtask
from .runtime.operators import (
    EventTimeOperatorMixin,
    KeyedOperator,
    NaNKeyError,
    OutputTag,
    UserFunctionError,
    batch_of,
    rows_of,
)
from .state import ListStateDescriptor, ValueStateDescriptor
from .state.keygroups import key_groups_of_int64
from .time.domain import now_ms
from .time.strategy import TimestampAssigner, TimestampError, _short

if TYPE_CHECKING:
    from .api import DataStream, KeyedStream

__all__ = [
    "AlignedWindowAggregateOperator",
    "ProcessWindowFunction",
    "TimeWindow",
    "WindowAssigner",
    "WindowOperator",
    "WindowedStream",
    "session",
    "sliding",
    "tumbling",
]

TIMES = ("event", "processing")


@dataclass(frozen=True, order=True)
class TimeWindow:
    """``[start, end)`` in milliseconds (Flink's ``TimeWindow``)."""

    start: int
    end: int

    @property
    def max_timestamp(self) -> int:
        """The last millisecond in the window: an event-time window fires when the watermark reaches it."""
        return self.end - 1

    def intersects(self, other: TimeWindow) -> bool:
        """Overlapping or touching (Flink merges sessions that touch)."""
        return self.start <= other.end and self.end >= other.start

    def cover(self, other: TimeWindow) -> TimeWindow:
        return TimeWindow(min(self.start, other.start), max(self.end, other.end))


_END = operator.itemgetter(1)


class _Sessions:
    """A key's merging windows (sessions) in order, beside the state's dict of their
    contents. They are disjoint and never touch (every addition merges what it meets),
    so they are in order of start and of end alike, and both merging a new window and
    firing one are a binary search: Flink's ``mergeWindows`` sorts all of a key's
    windows per record, and a job with hundreds of open sessions per key (a busy
    pipeline before its next watermark) spent seconds per thousand records there.
    ``merge_windows`` below is that sort, kept as the reference (tests)."""

    __slots__ = ("merged", "order")

    def __init__(self, contents: Iterable[Tuple[int, int]]) -> None:
        self.order: List[Tuple[int, int]] = sorted(contents)
        self.merged: List[Tuple[int, int]] = []  # the windows the last merge replaced by their cover

    def merge(self, contents: Dict[Tuple[int, int], Any], new: TimeWindow, accumulators: Any) -> TimeWindow:
        """Flink's ``MergingWindowSet.addWindow``: the windows the new one meets (or
        touches) and it become their cover, their contents merged in order of start
        into ``contents`` under it. The window returned is in ``order``; in
        ``contents`` only when something merged (the caller stores the new one's)."""
        order = self.order
        start, end = new.start, new.end
        i = j = bisect.bisect_left(order, start, key=_END)  # the first to end at or after the new one's start
        n = len(order)
        while j < n and order[j][0] <= end:
            j += 1
        if i == j:
            order.insert(i, (start, end))
            self.merged = []
            return new
        hits = self.merged = order[i:j]
        cover = (min(start, hits[0][0]), max(end, hits[-1][1]))
        combined: Any = None
        for bounds in hits:
            part = contents.pop(bounds)
            if combined is None:
                combined = part
            elif accumulators is not None:
                combined = accumulators.merge(combined, part)
            else:
                combined = combined + part
        contents[cover] = combined
        order[i:j] = [cover]
        return TimeWindow(*cover)

    def discard(self, bounds: Tuple[int, int]) -> None:
        order = self.order
        i = bisect.bisect_left(order, bounds)
        if i < len(order) and order[i] == bounds:
            del order[i]

    def fired(self, ts: int, lateness: int) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
        """A timer at ``ts``: the window it fires (ending at ``ts + 1``; at most one)
        and the windows whose state goes (cleanup at or before ``ts``: the first ones,
        cleanup following the end), taken out of ``order``."""
        order = self.order
        i = bisect.bisect_left(order, ts + 1, key=_END)
        due = [order[i]] if i < len(order) and order[i][1] == ts + 1 else []
        k = 0
        while k < len(order) and min(order[k][1] - 1 + lateness, MAX_WATERMARK) <= ts:
            k += 1
        gone = order[:k]
        del order[:k]
        return due, gone


def merge_windows(windows: List[TimeWindow], new: TimeWindow) -> Tuple[TimeWindow, List[TimeWindow]]:
    """Flink's ``TimeWindow.mergeWindows`` for one new window: all windows sorted, each
    run of overlapping (or touching) ones merged; the run with ``new`` in it, as its
    cover and the existing windows in it (sorted). The reference for
    ``_Sessions.merge`` (tests)."""
    merged: List[Tuple[TimeWindow, List[TimeWindow]]] = []
    for w in sorted([*windows, new]):
        if merged and merged[-1][0].intersects(w):
            cover, members = merged[-1]
            merged[-1] = (cover.cover(w), [*members, w])
        else:
            merged.append((w, [w]))
    for cover, members in merged:
        if any(m is new for m in members):
            return cover, [m for m in members if m is not new]
    raise AssertionError("the new window is in one run")


def _window_start(ts: int, offset: int, size: int) -> int:
    return ts - (ts - offset) % size  # Python's % floors: right for negative timestamps too


@dataclass(frozen=True)
class WindowAssigner:
    """Which windows a record belongs to; build one with ``tumbling``, ``sliding`` or ``session``."""

    kind: str
    size: int = 0
    slide: int = 0
    offset: int = 0
    gap: int = 0
    time: str = "event"

    @property
    def is_event_time(self) -> bool:
        return self.time == "event"

    @property
    def merging(self) -> bool:
        return self.kind == "session"

    @property
    def aligned(self) -> bool:
        """Every key's windows share their bounds (tumbling and sliding)."""
        return self.kind in ("tumbling", "sliding")

    def assign(self, ts: int) -> List[TimeWindow]:
        """The windows of a record at ``ts`` (Flink's ``assignWindows``). A record
        with a window that starts before -2**63 or ends after 2**63 - 1 is refused
        (``TimestampError``): its bounds are no int64, and Flink's would wrap."""
        if self.kind == "tumbling":  # the per-record path's usual case, without a further call
            start = ts - (ts - self.offset) % self.size
            end = start + self.size
            if start < MIN_WATERMARK or end > MAX_WATERMARK:
                raise TimestampError(self.range_error(ts))
            return [TimeWindow(start, end)]
        windows = self._windows(ts)
        if windows and (windows[-1].start < MIN_WATERMARK or windows[0].end > MAX_WATERMARK):
            raise TimestampError(self.range_error(ts))
        return windows

    def _windows(self, ts: int) -> List[TimeWindow]:
        """``assign`` in Python ints, unchecked: the latest window first."""
        if self.kind == "session":
            return [TimeWindow(ts, ts + self.gap)]
        if self.kind == "tumbling":
            start = _window_start(ts, self.offset, self.size)
            return [TimeWindow(start, start + self.size)]
        out = []
        start = _window_start(ts, self.offset, self.slide)
        while start > ts - self.size:
            out.append(TimeWindow(start, start + self.size))
            start -= self.slide
        return out

    def range_error(self, ts: int) -> str:
        """Why a record at ``ts`` is refused: the window of it outside the int64 range."""
        windows = self._windows(ts)
        if windows[0].end > MAX_WATERMARK:
            w, side = windows[0], f"ends after the largest timestamp {MAX_WATERMARK} (2**63 - 1)"
        else:
            w, side = windows[-1], f"starts before the smallest timestamp {MIN_WATERMARK} (-2**63)"
        return (
            f"its timestamp {ts} is in the window [{w.start}, {w.end}) of {self.describe()}, which {side}: window "
            "bounds are int64 milliseconds and are neither wrapped nor clamped, so a record within a window of either "
            "end has no window; a time this far out is a sentinel or a unit mistake: drop such records before the "
            "window (.filter(...)), or correct the time in the timestamp assigner"
        )

    def _margin(self) -> int:
        """How far from either end of int64 a timestamp must be for every window of
        it, and every intermediate of ``assign_array``, to be an int64."""
        return self.size + self.slide + self.gap + abs(self.offset)

    def near_ends(self, ts: np.ndarray) -> bool:
        """Whether a timestamp of ``ts`` is within ``_margin`` of either end of int64
        (none of a real stream's is): a min and a max of the array."""
        m = self._margin()
        return bool(len(ts)) and (ts.min() < MIN_WATERMARK + m or ts.max() > MAX_WATERMARK - m)

    def out_of_range(self, ts: np.ndarray, near: Optional[bool] = None) -> Optional[int]:
        """The first row of ``ts`` that ``assign`` refuses, or None; ``near`` is
        ``near_ends(ts)`` when the caller has it already."""
        if not (self.near_ends(ts) if near is None else near):
            return None
        m = self._margin()
        low, high = MIN_WATERMARK + m, MAX_WATERMARK - m
        for row in np.nonzero((ts < low) | (ts > high))[0].tolist():
            windows = self._windows(int(ts[row]))
            if windows and (windows[-1].start < MIN_WATERMARK or windows[0].end > MAX_WATERMARK):
                return int(row)
        return None

    def assign_array(self, ts: np.ndarray, near: Optional[bool] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Vectorised ``assign`` for aligned windows: (row index, window start) pairs.
        Timestamps near either end of int64 (``near_ends``, or ``near`` when the
        caller has it; windows that ``out_of_range`` found in range) are assigned in
        Python ints: int64 arithmetic would wrap there."""
        if self.near_ends(ts) if near is None else near:
            pairs = [(row, w.start) for row, t in enumerate(ts.tolist()) for w in self.assign(t)]
            return np.array([r for r, _ in pairs], np.int64), np.array([s for _, s in pairs], np.int64)
        rows = np.arange(len(ts), dtype=np.int64)
        if self.kind == "tumbling":
            return rows, ts - (ts - self.offset) % self.size
        last = ts - (ts - self.offset) % self.slide
        per_row = -(-self.size // self.slide)  # ceil: at most this many windows per record
        all_rows, all_starts = [], []
        for k in range(per_row):
            starts = last - k * self.slide
            keep = starts > ts - self.size
            all_rows.append(rows[keep])
            all_starts.append(starts[keep])
        return np.concatenate(all_rows), np.concatenate(all_starts)

    def describe(self) -> str:
        t = "" if self.is_event_time else ", time='processing'"
        if self.kind == "tumbling":
            return f"tumbling({self.size}{f', offset_ms={self.offset}' if self.offset else ''}{t})"
        if self.kind == "sliding":
            return f"sliding({self.size}, {self.slide}{f', offset_ms={self.offset}' if self.offset else ''}{t})"
        return f"session({self.gap}{t})"


def _ms(what: str, value: Any, minimum: int = 1) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{what} must be an int of milliseconds >= {minimum}, got {value!r}")
    return value  # type: ignore[no-any-return]


def _time(value: Any) -> str:
    if value not in TIMES:
        raise ValueError(f"time must be 'event' or 'processing', got {value!r}")
    return value  # type: ignore[no-any-return]


def tumbling(size_ms: int, offset_ms: int = 0, *, time: str = "event") -> WindowAssigner:
    """Fixed windows of ``size_ms``, back to back: ``[offset + k*size, offset + (k+1)*size)``."""
    size = _ms("tumbling size_ms", size_ms)
    if type(offset_ms) is not int or abs(offset_ms) >= size:
        raise ValueError(f"tumbling offset_ms must be an int with |offset_ms| < size_ms, got {offset_ms!r}")
    return WindowAssigner("tumbling", size=size, offset=offset_ms, time=_time(time))


def sliding(size_ms: int, slide_ms: int, offset_ms: int = 0, *, time: str = "event") -> WindowAssigner:
    """Windows of ``size_ms`` starting every ``slide_ms``: a record is in ``size/slide`` of them."""
    size = _ms("sliding size_ms", size_ms)
    slide = _ms("sliding slide_ms", slide_ms)
    if type(offset_ms) is not int or abs(offset_ms) >= slide:
        raise ValueError(f"sliding offset_ms must be an int with |offset_ms| < slide_ms, got {offset_ms!r}")
    return WindowAssigner("sliding", size=size, slide=slide, offset=offset_ms, time=_time(time))


def session(gap_ms: int, *, time: str = "event") -> WindowAssigner:
    """Per key, records closer than ``gap_ms`` to one another form one window; it ends
    ``gap_ms`` after its last record."""
    return WindowAssigner("session", gap=_ms("session gap_ms", gap_ms), time=_time(time))


class ProcessWindowFunction:
    """``WindowedStream.process(fn)``: ``process(key, context, elements)`` yields the
    outputs for one key and window, with every element of it; ``context.window()``
    is the ``TimeWindow`` (PyFlink's ``ProcessWindowFunction``). A plain function
    ``fn(key, window, elements)`` works too."""

    def open(self, ctx: Any) -> None:
        pass

    def process(self, key: Any, context: Any, elements: List[Any]) -> Iterable[Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _WindowContext:
    __slots__ = ("_op", "_window")

    def __init__(self, op: Any) -> None:
        self._op = op
        self._window: Optional[TimeWindow] = None

    def window(self) -> TimeWindow:
        assert self._window is not None
        return self._window

    def current_watermark(self) -> int:
        return int(self._op.current_watermark)

    def current_processing_time(self) -> int:
        return now_ms()


def _cleanup_time(assigner: WindowAssigner, window_max: int, lateness: int) -> int:
    """When a window's state goes: ``max_timestamp + allowed_lateness`` in event time."""
    if not assigner.is_event_time:
        return window_max
    return min(window_max + lateness, MAX_WATERMARK)


# -- accumulators of pe.agg in Python (WindowOperator) and in columns (the aligned one) ------------


def _acc_name(kind: str, column: Optional[str]) -> str:
    return "count(*)" if column is None else f"{kind}({column})"


def _results(aggregations: Sequence[Aggregation], acc: Dict[str, Any]) -> Dict[str, Any]:
    """Output columns from one window's accumulators (name -> value)."""
    out: Dict[str, Any] = {}
    for a in aggregations:
        if a.kind == "count":
            out[a.output] = int(acc[_acc_name("rows" if a.column is None else "n", a.column)])
        elif a.kind == "mean":
            n = acc[f"n({a.column})"]
            out[a.output] = float(acc[f"sum({a.column})"]) / n if n else None
        else:
            value = acc[f"{a.kind}({a.column})"]
            out[a.output] = None if acc[f"n({a.column})"] == 0 else value
    return out


class _PyAccumulators:
    """``pe.agg`` accumulators as a list of Python numbers per window (``WindowOperator``)."""

    def __init__(self, aggregations: Sequence[Aggregation], where: Callable[[], str]) -> None:
        self.aggregations = list(aggregations)
        self.needed = needed_accumulators(aggregations)
        self.names = [_acc_name(k, c) for k, c in self.needed]
        self.where = where

    def create(self) -> List[Any]:
        return [None if kind in ("min", "max") else 0 for kind, _ in self.needed]

    def add(self, acc: List[Any], record: Any) -> None:
        for i, (kind, column) in enumerate(self.needed):
            if kind == "rows":
                acc[i] += 1
                continue
            try:
                v = record[column]
            except (KeyError, IndexError, TypeError):
                from .errors import ColumnNotFoundError

                raise ColumnNotFoundError(f"{self.where()}: record {record!r} has no field {column!r}") from None
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise AggregateInputError(
                    f"{self.where()}: pe.agg.{kind}({column!r}) needs numbers, got {type(v).__name__} {v!r}"
                )
            if kind == "n":
                acc[i] += 1
            elif kind == "sum":
                acc[i] += v
            elif kind == "min":
                acc[i] = v if acc[i] is None or v < acc[i] else acc[i]
            else:
                acc[i] = v if acc[i] is None or v > acc[i] else acc[i]

    def merge(self, a: List[Any], b: List[Any]) -> List[Any]:
        out = []
        for i, (kind, _) in enumerate(self.needed):
            x, y = a[i], b[i]
            if kind in ("rows", "n", "sum"):
                out.append(x + y)
            elif x is None or y is None:
                out.append(y if x is None else x)
            else:
                out.append(min(x, y) if kind == "min" else max(x, y))
        return out

    def result(self, acc: List[Any]) -> Dict[str, Any]:
        return _results(self.aggregations, dict(zip(self.names, acc, strict=True)))


# -- the general window operator ----------------------------------------------------------------------

_CONTENTS = ValueStateDescriptor("window-contents")
_LATE = ListStateDescriptor("window-late-records")


class WindowOperator(EventTimeOperatorMixin, KeyedOperator):
    """Flink's ``WindowOperator`` with its default triggers, per record.

    Each key's open windows and their contents are one keyed value: ``{(start,
    end): contents}``, the contents being the accumulators of ``.aggregate`` or the
    elements of ``.process``. A window's trigger is a keyed timer at its
    ``max_timestamp`` (and one at its cleanup time when there is allowed
    lateness): when one fires, every window of the key due then fires or goes. A
    timer left behind by a window that merged away finds nothing to do. In
    processing time, what is open at the end of bounded input fires then (Flink
    drops it)."""

    def __init__(
        self,
        uid: str,
        name: str,
        key_selector: Callable[[Any], Any],
        key_name: str,
        assigner: WindowAssigner,
        lateness: int,
        timestamps: Optional[TimestampAssigner],
        aggregations: Optional[Sequence[Aggregation]] = None,
        function: Any = None,
        late_tag: Optional[str] = None,
    ) -> None:
        super().__init__(uid, name)
        self.late_tag = late_tag  # side_output_late_data: late records go there, not dropped
        self.key_selector = key_selector
        self.key_name = key_name
        self.assigner = assigner
        self.lateness = lateness
        self.timestamps = timestamps
        self.accumulators = _PyAccumulators(aggregations, self.where) if aggregations else None
        self.function = function
        self._timers: Any = None
        self._contents: Any = None
        # merging windows: each key's in order, beside the state (see _Sessions); not state
        self._sessions: Dict[Any, _Sessions] = {}
        self._late: Any = None
        self._wctx = _WindowContext(self)

    def setup(self, ctx: Any, restored: Any) -> None:
        super().setup(ctx, restored)
        self._restore_watermark(restored)
        from .state.timers import InternalTimerService

        self._contents = self.backend.get_state(_CONTENTS)
        self._timers = InternalTimerService(self.backend, self.current_watermark)
        assert self.operator_state is not None
        self._late = self.operator_state.get_list_state(_LATE)
        self.late_records_dropped = sum(int(v) for v in self._late.get()) if restored is not None else 0

    def open(self) -> None:
        opener = getattr(self.function, "open", None)
        if opener is not None:
            self._call(opener, self._wctx)

    def close(self) -> None:
        closer = getattr(self.function, "close", None)
        if closer is not None:
            self._call(closer)

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        self._save_watermark()
        self._late.update([self.late_records_dropped])
        return super().snapshot(checkpoint_id, location)

    # -- records -----------------------------------------------------------------------------

    def _is_late(self, window: TimeWindow) -> bool:
        return self.assigner.is_event_time and (
            _cleanup_time(self.assigner, window.max_timestamp, self.lateness) <= self.current_watermark
        )

    def process(self, records: Any) -> List[Any]:
        out: List[Any] = []
        rows = rows_of(records)
        if not rows:
            return out
        backend, select, assigner = self.backend, self.key_selector, self.assigner
        if assigner.is_event_time:
            if self.timestamps is None:
                raise NonRetryableError(f"{self.where()}: event-time windows need timestamps")
            stamps = self.timestamps.of_buffer(rows).tolist()
        else:
            stamps = [now_ms()] * len(rows)
        try:
            for record, ts in zip(rows, stamps, strict=True):
                key = select(record)
                if key.__class__ is float and key != key:
                    raise NaNKeyError(f"{self.where()}: the key of record {record!r} is NaN")
                backend.set_current_key(key)
                self._add(key, record, ts, out)
        except TimestampError as exc:  # a window out of range (assign): which record, which field
            where = self.timestamps.describe() if self.timestamps is not None else "processing time"
            raise TimestampError(f"{self.where()}: record {_short(record)}, timestamp from {where}: {exc}") from None
        except NonRetryableError:
            raise
        except UserFunctionError:
            raise
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc
        return out

    def _sessions_of(self, key: Any, contents: Dict[Tuple[int, int], Any]) -> _Sessions:
        """The key's merging windows in order, beside its state (built from it when
        not known here: after a restore, or should the two ever differ)."""
        sessions = self._sessions.get(key)
        if sessions is None or len(sessions.order) != len(contents):
            sessions = self._sessions[key] = _Sessions(contents)
        return sessions

    def _add(self, key: Any, record: Any, ts: int, out: List[Any]) -> None:
        contents: Dict[Tuple[int, int], Any] = self._contents.value() or {}
        accepted = assigned = False
        changed: List[TimeWindow] = []
        sessions = self._sessions_of(key, contents) if self.assigner.merging else None
        for window in self.assigner.assign(ts):
            assigned = True
            if sessions is not None:
                window = sessions.merge(contents, window, self.accumulators)
                if sessions.merged and not self.lateness:
                    self._forget_timers(sessions.merged, window)
            if self._is_late(window):
                if sessions is not None:
                    contents.pop((window.start, window.end), None)
                    sessions.discard((window.start, window.end))
                continue
            accepted = True
            bounds = (window.start, window.end)
            current = contents.get(bounds)
            if self.accumulators is not None:
                if current is None:
                    current = self.accumulators.create()
                self.accumulators.add(current, record)
            else:
                current = [] if current is None else current
                current.append(record)
            contents[bounds] = current
            changed.append(window)
        if not assigned:  # in no window (between a sliding window's slides): not late, in nothing
            return
        if not accepted:
            if sessions is not None and not sessions.order:
                self._sessions.pop(key, None)  # a key whose every record was late keeps nothing here
            if self.late_tag is None:
                self.late_records_dropped += 1
            elif self.side_output is not None:  # as Flink: to the side output, not counted as dropped
                self.side_output(self.late_tag, [record])
            return
        self._contents.update(contents)
        for window in changed:
            if self.assigner.is_event_time:
                if window.max_timestamp <= self.current_watermark:
                    self._emit(key, window, contents[(window.start, window.end)], out)  # late but allowed: fire now
                else:
                    self._timers.event.register(window.max_timestamp)
                cleanup = _cleanup_time(self.assigner, window.max_timestamp, self.lateness)
                if cleanup != window.max_timestamp:
                    self._timers.event.register(cleanup)
            else:
                self._timers.processing.register(window.max_timestamp)

    def _forget_timers(self, merged: List[Tuple[int, int]], cover: TimeWindow) -> None:
        """Deletes the timers of sessions merged into ``cover`` (Flink deletes them on
        merge too): a session that grows with every record of its key would otherwise
        leave a timer per record, each fired for nothing. Only without allowed
        lateness, where a window's one timer is at its end - 1 and no two windows of a
        key share an end; the cover's own timer is registered after this."""
        timers = self._timers.event if self.assigner.is_event_time else self._timers.processing
        for bounds in merged:
            if bounds[1] != cover.end:
                timers.delete(bounds[1] - 1)

    # -- firing ------------------------------------------------------------------------------

    def _emit(self, key: Any, window: TimeWindow, contents: Any, out: List[Any]) -> None:
        if self.accumulators is not None:
            row = {self.key_name: key, "window_start": window.start, "window_end": window.end}
            row.update(self.accumulators.result(contents))
            out.append(row)
            return
        fn = self.function
        self._wctx._window = window
        try:
            if isinstance(fn, ProcessWindowFunction):
                produced = fn.process(key, self._wctx, list(contents))
            else:
                produced = fn(key, window, list(contents))
            if produced is not None:
                if produced.__class__ is dict or produced.__class__ is str:
                    raise not_records(produced, self.where(), "the window function")
                try:
                    out.extend(produced)
                except TypeError:
                    refuse_non_records(produced, self.where(), "the window function")
                    raise
        except NonRetryableError:
            raise
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: window function: {type(exc).__name__}: {exc}") from exc

    def _on_timer(self, key: Any, ts: int, out: List[Any]) -> None:
        contents: Dict[Tuple[int, int], Any] = self._contents.value()
        if not contents:
            return
        # Objects only for what fires: a timer per window, and hundreds of windows per
        # key before a watermark (merging sessions), made a sort of them all per timer
        # most of a job's time.
        lateness = self.lateness if self.assigner.is_event_time else 0
        if self.assigner.merging:
            due, gone = self._sessions_of(key, contents).fired(ts, lateness)
        else:
            due = sorted(b for b in contents if b[1] - 1 == ts)
            gone = [b for b in contents if min(b[1] - 1 + lateness, MAX_WATERMARK) <= ts]
        for bounds in due:
            self._emit(key, TimeWindow(*bounds), contents[bounds], out)
        for bounds in gone:
            del contents[bounds]
        if gone:
            self._contents.update(contents or None)
            if not contents:
                self._sessions.pop(key, None)

    def process_watermark(self, watermark: int) -> List[Any]:
        if watermark <= self.current_watermark:
            return []
        self.current_watermark = watermark
        out: List[Any] = []
        for key, ts in self._timers.advance_watermark(watermark):
            self._on_timer(key, ts, out)
        return out

    def next_processing_time(self) -> Optional[int]:
        return self._timers.next_processing_time() if self._timers is not None else None

    def on_processing_time(self, now: int) -> List[Any]:
        out: List[Any] = []
        for key, ts in self._timers.fire_processing(now):
            self._on_timer(key, ts, out)
        return out

    def end_input(self) -> List[Any]:
        """Processing-time windows still open fire at the end of bounded input."""
        if self.assigner.is_event_time:
            return []
        out: List[Any] = []
        for key, _ in self._timers.fire_processing(MAX_WATERMARK):
            self.backend.set_current_key(key)
            contents = self._contents.value()
            for bounds in sorted(contents or {}):
                self._emit(key, TimeWindow(*bounds), contents[bounds], out)
            self._contents.clear()
            self._sessions.pop(key, None)
        return out


# -- the vectorised operator for tumbling and sliding windows ----------------------------------------

_ARROW_FN = {"n": "count", "sum": "sum", "min": "min", "max": "max"}
_ADDED = ("rows", "n", "sum")
_SLOTS = ListStateDescriptor("window-slots")  # [key group, slot, window start]
_SCHEMA = ListStateDescriptor("window-schema")  # [the input schema the accumulators were made for (IPC bytes)]
_OVERFLOW = ValueStateDescriptor("window/overflow")  # key -> {window start: [accumulators]}
# A keyed state file holds at most 127 states: the slots' states stay well below.
_MAX_SLOT_STATES = 96


class AlignedWindowAggregateOperator(EventTimeOperatorMixin, KeyedOperator):
    """Tumbling / sliding windows with ``pe.agg`` aggregations, vectorised.

    Per input batch: window starts for all rows at once (``WindowAssigner.assign_array``),
    late (row, window) pairs dropped, Arrow's hash aggregation per window and key,
    and the partial results merged into typed columnar keyed state, as
    ``KeyedStream.aggregate`` does.

    Where a window's accumulators live: every key of a window shares its bounds, so
    instead of a state per window (an unbounded number of states over a stream) the
    operator has a few *slots*: per accumulator, value states ``window/<acc>@<slot>``
    keyed by the record key. In each key group, a window holds one slot while it is
    open, and the slot is free again once the window is purged (its key group's
    columns cleared at once, no per-key deletes). Which window holds which slot of
    which key group is operator state (``window-slots``), so it moves with its key
    group when the job is rescaled.

    When a key group has more windows open than there are slots (the watermark far
    behind the data), the further windows of that key group go to
    ``window/overflow``, one dict per key (``{window start: accumulators}``):
    correct, one Python step per key. Non-integer keys always take that path.

    Firing needs no timer per key: the open windows are known, and when the
    watermark passes ``end - 1`` a window emits every key of every key group it
    has, straight from the columns."""

    def __init__(
        self,
        uid: str,
        name: str,
        key_column: str,
        assigner: WindowAssigner,
        lateness: int,
        timestamps: Optional[TimestampAssigner],
        aggregations: Sequence[Aggregation],
        late_tag: Optional[str] = None,
    ) -> None:
        super().__init__(uid, name)
        self.late_tag = late_tag  # side_output_late_data: late rows go there, not dropped
        self.key_column = key_column
        self.assigner = assigner
        self.lateness = lateness
        self.timestamps = timestamps
        self.aggregations = list(aggregations)
        self.needed = needed_accumulators(aggregations)
        self.names = [_acc_name(k, c) for k, c in self.needed]
        self._py = _PyAccumulators(aggregations, self.where)
        self._types: Dict[str, pa.DataType] = {}  # accumulator -> int64 / float64, from the input schema
        self._schema: Optional[pa.Schema] = None
        self._key_type: Optional[pa.DataType] = None
        self._max_slots = 1
        self._tables: List[Dict[str, Any]] = []  # per slot: accumulator -> value state
        self._slots: List[Dict[int, int]] = []  # per key group index: window start -> slot
        self._windows: Dict[int, Set[int]] = {}  # window start -> key group indexes with it in a slot
        self._overflowed: Dict[int, Set[int]] = {}  # window start -> key group indexes with it in overflow
        self._fired: Set[int] = set()  # windows that fired and wait for their cleanup
        self._overflow: Any = None
        self._schema_state: Any = None
        self._slot_state: Any = None
        self._late: Any = None

    # -- state -----------------------------------------------------------------------------

    def setup(self, ctx: Any, restored: Any) -> None:
        super().setup(ctx, restored)
        self._restore_watermark(restored)
        assert self.operator_state is not None
        r = self.backend.key_group_range
        self._slots = [{} for _ in range(len(r))]
        self._schema_state = self.operator_state.get_union_list_state(_SCHEMA)
        self._slot_state = self.operator_state.get_union_list_state(_SLOTS)
        self._late = self.operator_state.get_list_state(_LATE)  # split on rescaling: the sum stays
        self._overflow = self.backend.get_state(_OVERFLOW)
        if restored is None:
            return
        self.late_records_dropped = sum(int(v) for v in self._late.get())
        schemas = [pa.ipc.read_schema(pa.py_buffer(e[0])) for e in self._schema_state.get() if e[0]]
        if schemas:
            # every subtask's columns as one: one that saw fractions widens the others' states
            schema = schemas[0]
            for other in schemas[1:]:
                schema = unified_schema(self.where(), schema, other, self._typed_columns())
            self._make_accumulators(schema)
        for group, slot, window in self._slot_state.get():
            if r.start <= group <= r.end:
                index = int(group) - r.start
                self._slots[index][int(window)] = int(slot)
                self._windows.setdefault(int(window), set()).add(index)
                self._ensure_slot(int(slot))
        table = self.backend._tables.get(_OVERFLOW.name)
        for index, group in enumerate(table.groups if table is not None else []):
            for windows in group.values():
                for window in windows:
                    self._overflowed.setdefault(int(window), set()).add(index)
        self._fired = {w for w in self._open() if w + self.assigner.size - 1 <= self.current_watermark}

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        self._save_watermark()
        r = self.backend.key_group_range
        schema = self._schema.serialize().to_pybytes() if self._schema is not None else b""
        self._schema_state.update([[schema]])
        self._late.update([self.late_records_dropped])
        self._slot_state.update(
            [[r.start + i, slot, window] for i, slots in enumerate(self._slots) for window, slot in slots.items()]
        )
        return super().snapshot(checkpoint_id, location)

    def _open(self) -> List[int]:
        return sorted(set(self._windows) | set(self._overflowed))

    def _make_accumulators(self, schema: pa.Schema) -> None:
        """The accumulators' types for the columns' types in ``schema``; called again when
        a column widens (whole numbers, then fractions): the slots' int64 states of its
        accumulators become float64 in place (``retype_value_state``)."""
        changed = []
        for kind, column in self.needed:
            name = _acc_name(kind, column)
            t = schema.field(column).type if column is not None else pa.int64()
            arrow_type = accumulator_type(self.where(), kind, column, t)
            if name not in self._types or not self._types[name].equals(arrow_type):
                changed.append(name)
            self._types[name] = arrow_type
        for index, table in enumerate(self._tables):
            for name in changed:
                descriptor = ValueStateDescriptor(f"window/{name}@{index}", 0, self._types[name])
                table[name] = value_state(self.backend, descriptor)
        columns = [self.key_column] + [c for _, c in self.needed if c is not None]
        self._schema = pa.schema([schema.field(c) for c in dict.fromkeys(columns)])
        self._key_type = schema.field(self.key_column).type
        self._max_slots = max(1, _MAX_SLOT_STATES // len(self._types))

    def _typed_columns(self) -> List[str]:
        return [c for k, c in self.needed if c is not None and k != "n"]

    def _ensure_slot(self, slot: int) -> None:
        while len(self._tables) <= slot:
            index = len(self._tables)
            self._tables.append(
                {
                    name: value_state(self.backend, ValueStateDescriptor(f"window/{name}@{index}", 0, arrow_type))
                    for name, arrow_type in self._types.items()
                }
            )

    def _slot_for(self, index: int, window: int) -> int:
        """The slot of ``window`` in key group ``index`` (taking a free one), or -1:
        the window is in overflow there (it already was, or every slot is taken)."""
        slots = self._slots[index]
        slot = slots.get(window)
        if slot is not None:
            return slot
        spilled = self._overflowed.get(window)
        if spilled is not None and index in spilled:
            return -1
        if len(slots) >= self._max_slots:
            self._overflowed.setdefault(window, set()).add(index)
            return -1
        used = set(slots.values())
        slot = 0
        while slot in used:
            slot += 1
        slots[window] = slot
        self._windows.setdefault(window, set()).add(index)
        self._ensure_slot(slot)
        return slot

    # -- records -----------------------------------------------------------------------------

    def process(self, records: Any) -> Any:
        if not len(records):
            return []
        try:
            batch = batch_of(records)
        except (TypeError, pa.ArrowException) as exc:
            raise not_a_table(self.where(), records, self.key_column, exc) from exc
        names = batch.schema.names
        wanted = [self.key_column] + [c for _, c in self.needed if c is not None]
        missing = [c for c in wanted if c not in names]
        if missing:
            from .errors import ColumnNotFoundError

            raise ColumnNotFoundError(
                f"{self.where()}: the records have no column {missing[0]!r} (columns: {', '.join(names)})"
            )
        if not self._types:
            self._make_accumulators(batch.schema)
        else:
            check_key_type(self.where(), self.key_column, self._key_type, batch)
            schema = self._schema
            assert schema is not None
            if not all(batch.schema.field(f.name).type.equals(f.type) for f in schema):  # else: the fast path
                widened = unified_schema(self.where(), schema, batch.schema, self._typed_columns())
                if not widened.equals(schema):
                    self._make_accumulators(widened)
        if self.assigner.is_event_time:
            assert self.timestamps is not None
            try:
                ts = self.timestamps.of_buffer(batch)
            except NonRetryableError as exc:
                raise type(exc)(f"{self.where()}: {exc}") from None
            near = self.assigner.near_ends(ts)
            bad = self.assigner.out_of_range(ts, near) if near else None
            if bad is not None:  # as WindowOperator refuses it: the record, the field, the window
                raise TimestampError(
                    f"{self.where()}: record {_short(batch.slice(bad, 1).to_pylist()[0])}, timestamp from "
                    f"{self.timestamps.describe()}: {self.assigner.range_error(int(ts[bad]))}"
                )
        else:
            ts = np.full(batch.num_rows, now_ms(), np.int64)
            near = False  # the clock: nowhere near either end
        rows, starts = self.assigner.assign_array(ts, near)
        if self.assigner.is_event_time:
            # late: the window's cleanup time (end - 1 + allowed lateness) is at or below the watermark
            on_time = starts + (self.assigner.size - 1) > self.current_watermark - self.lateness
            if not on_time.all():
                kept_rows = rows[on_time]
                # late: in some window, but in none still open (a record in no window at
                # all, between a sliding window's slides, is not late: it is in no window)
                if self.late_tag is None:
                    gaps = self.assigner.kind == "sliding" and self.assigner.slide > self.assigner.size
                    in_windows = len(np.unique(rows)) if gaps else batch.num_rows  # else every record is in one
                    self.late_records_dropped += in_windows - len(np.unique(kept_rows))
                elif self.side_output is not None:
                    late = np.setdiff1d(rows, kept_rows)
                    if len(late):
                        self.side_output(self.late_tag, batch.take(pa.array(late)))
                rows, starts = kept_rows, starts[on_time]
                if not len(rows):
                    return []
        if not len(rows):  # no record in any window (a sliding window's slide longer than its size)
            return []
        out: List[pa.RecordBatch] = []
        first, last = int(starts.min()), int(starts.max())
        if first == last and len(rows) == batch.num_rows:  # the usual case: one window for the whole batch
            self._merge_window(batch, first, out)
        else:
            taken = len(rows) != batch.num_rows or self.assigner.kind != "tumbling"
            table = batch.take(pa.array(rows)) if taken else batch
            for window in np.unique(starts).tolist():
                self._merge_window(table.filter(pa.array(starts == window)), window, out)
        return _one_buffer(out)

    def _merge_window(self, batch: pa.RecordBatch, window: int, out: List[pa.RecordBatch]) -> None:
        spec: List[Tuple[Any, str]] = [([], "count_all")]
        for kind, column in self.needed:
            if column is not None:
                spec.append((column, _ARROW_FN[kind]))
        grouped = pa.Table.from_batches([batch]).group_by(self.key_column, use_threads=False).aggregate(spec)
        keys = grouped.column(self.key_column)
        if keys.null_count:
            raise null_keys(self.where(), self.key_column)
        partial = {}
        for kind, column in self.needed:
            source = "count_all" if kind == "rows" else f"{column}_{_ARROW_FN[kind]}"
            partial[_acc_name(kind, column)] = grouped.column(source)
        if pa.types.is_integer(keys.type):
            totals = self._merge_columnar(keys.to_numpy().astype(np.int64, copy=False), window, partial)
        else:
            indexes = [self._group_index(k) for k in keys.to_pylist()]
            totals = self._merge_overflow(keys.to_pylist(), indexes, window, partial, np.arange(len(keys)))
        if window in self._fired:  # a late record inside the allowed lateness: the updated rows now
            out.append(self._output(keys, window, totals))

    def _group_index(self, key: Any) -> int:
        from .state.keygroups import assign_to_key_group

        return assign_to_key_group(key, self.backend.max_parallelism) - self.backend.key_group_range.start

    def _merge_columnar(self, keys: np.ndarray, window: int, partial: Dict[str, Any]) -> Dict[str, np.ndarray]:
        from . import _native

        r = self.backend.key_group_range
        groups_of = key_groups_of_int64(keys, self.backend.max_parallelism) - r.start
        if len(groups_of) and (groups_of.min() < 0 or groups_of.max() >= len(r)):
            raise ValueError(f"{self.where()}: some keys are outside this subtask's key groups")
        order = np.argsort(groups_of, kind="stable")
        bounds = np.searchsorted(groups_of[order], np.arange(len(r) + 1))
        sorted_keys = keys[order]
        active = np.nonzero(np.diff(bounds))[0].tolist()
        slot_of = {index: self._slot_for(index, window) for index in active}
        in_slots = [index for index in active if slot_of[index] >= 0]
        totals: Dict[str, np.ndarray] = {}
        for kind, column in self.needed:
            name = _acc_name(kind, column)
            dtype = np.int64 if self._types[name] == pa.int64() else np.float64
            p = partial[name]
            values = np.asarray(p.fill_null(0).to_numpy(zero_copy_only=False) if p.null_count else p.to_numpy(), dtype)
            sorted_values = values[order]
            merged = np.zeros(len(sorted_keys), dtype)
            if in_slots:
                # merge_groups reads the dtype of the first group and touches only the
                # active ones: slot 0's groups fill the rest
                groups: List[Any] = list(self._tables[0][name]._table.groups)
                for index in in_slots:
                    groups[index] = self._tables[slot_of[index]][name]._table.groups[index]
                if kind in _ADDED or not p.null_count:
                    how = "add" if kind in _ADDED else kind
                    merged = _native.merge_groups(groups, sorted_keys, sorted_values, bounds, in_slots, how)
                else:  # keys with only nulls here keep what they have (n(column) tells if anything)
                    has = ~np.asarray(p.is_null())[order]
                    for index in in_slots:
                        a, b = bounds[index], bounds[index + 1]
                        group = groups[index]
                        _, old = group.get_many(sorted_keys[a:b])
                        sel = has[a:b]
                        if sel.any():
                            old[sel] = group.merge_many(sorted_keys[a:b][sel], sorted_values[a:b][sel], kind)
                        merged[a:b] = old
            totals[name] = merged
        spilled = [index for index in active if slot_of[index] < 0]
        if spilled:
            positions = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in spilled])
            rows = order[positions]  # rows of `keys` (and of the partials) in overflow
            indexes = groups_of[rows].tolist()
            extra = self._merge_overflow(keys[rows].tolist(), indexes, window, partial, rows)
            for name in totals:
                totals[name][positions] = extra[name]
        result = {}
        for name, merged in totals.items():
            unsorted = np.empty_like(merged)
            unsorted[order] = merged
            result[name] = unsorted
        return result

    def _merge_overflow(
        self, keys: List[Any], indexes: List[int], window: int, partial: Dict[str, Any], rows: np.ndarray
    ) -> Dict[str, np.ndarray]:
        """The overflow path, one key at a time (see the class docstring)."""
        backend, state, py = self.backend, self._overflow, self._py
        columns = {name: partial[name].take(pa.array(rows)).to_pylist() for name in self.names}
        out: Dict[str, List[Any]] = {name: [] for name in self.names}
        for i, key in enumerate(keys):
            backend.set_current_key(key)
            windows = state.value() or {}
            part = [columns[name][i] for name in self.names]
            part = [0 if v is None and kind in _ADDED else v for v, (kind, _) in zip(part, self.needed, strict=True)]
            acc = windows.get(window)
            acc = part if acc is None else py.merge(acc, part)
            windows[window] = acc
            state.update(windows)
            self._overflowed.setdefault(window, set()).add(indexes[i])
            for name, v in zip(self.names, acc, strict=True):
                out[name].append(0 if v is None else v)
        return {name: np.array(values, self._dtype(name)) for name, values in out.items()}

    def _dtype(self, name: str) -> Any:
        return np.int64 if self._types[name] == pa.int64() else np.float64

    # -- firing ------------------------------------------------------------------------------

    def _output(self, keys: Any, window: int, totals: Dict[str, Any]) -> pa.RecordBatch:
        if isinstance(keys, pa.ChunkedArray):
            keys = keys.combine_chunks()
        n = len(keys)
        columns: Dict[str, Any] = {
            self.key_column: keys,
            "window_start": pa.array(np.full(n, window, np.int64)),
            "window_end": pa.array(np.full(n, window + self.assigner.size, np.int64)),
        }
        for a in self.aggregations:
            if a.kind == "count":
                name = _acc_name("rows" if a.column is None else "n", a.column)
                columns[a.output] = pa.array(np.asarray(totals[name], np.int64))
            elif a.kind == "mean":
                count = np.asarray(totals[f"n({a.column})"], np.int64)
                total = np.asarray(totals[f"sum({a.column})"], np.float64)
                with np.errstate(invalid="ignore", divide="ignore"):
                    columns[a.output] = pa.array(total / count, pa.float64(), mask=count == 0)
            else:
                count = np.asarray(totals[f"n({a.column})"], np.int64)
                values = np.asarray(totals[f"{a.kind}({a.column})"])
                columns[a.output] = pa.array(values, self._types[_acc_name(a.kind, a.column)], mask=count == 0)
        return pa.RecordBatch.from_pydict(columns)

    def _read_window(self, window: int) -> Optional[pa.RecordBatch]:
        """Every key's totals of ``window``: its slots' columns, then its overflow."""
        first = self.names[0]
        key_parts: List[Any] = []
        value_parts: Dict[str, List[Any]] = {name: [] for name in self.names}
        for index in sorted(self._windows.get(window, ())):
            tables = self._tables[self._slots[index][window]]
            keys, values = tables[first]._table.groups[index].arrays()
            keys = keys.copy()
            key_parts.append(keys)
            value_parts[first].append(values.copy())
            for name in self.names[1:]:
                _, other = tables[name]._table.groups[index].get_many(keys)
                value_parts[name].append(other)
        spilled_keys: List[Any] = []
        spilled: Dict[str, List[Any]] = {name: [] for name in self.names}
        table = self.backend._tables.get(_OVERFLOW.name)
        for index in sorted(self._overflowed.get(window, ())):
            for key, windows in table.groups[index].items():
                acc = windows.get(window)
                if acc is not None:
                    spilled_keys.append(key)
                    for name, v in zip(self.names, acc, strict=True):
                        spilled[name].append(0 if v is None else v)
        if spilled_keys:
            key_parts.append(spilled_keys)
            for name in self.names:
                value_parts[name].append(np.array(spilled[name], self._dtype(name)))
        if not key_parts or not sum(len(k) for k in key_parts):
            return None
        if all(isinstance(k, np.ndarray) for k in key_parts):
            keys_array: Any = pa.array(np.concatenate(key_parts), self._key_type)
        else:
            keys_array = pa.array([k for part in key_parts for k in list(part)], self._key_type)
        totals = {name: np.concatenate(parts) for name, parts in value_parts.items()}
        return self._output(keys_array, window, totals)

    def _purge(self, window: int) -> None:
        from . import _native

        for index in self._windows.pop(window, ()):
            slot = self._slots[index].pop(window)
            for state in self._tables[slot].values():
                table = state._table
                if table.tracking:  # incremental: the removals go into the next delta
                    table.groups[index].clear()
                else:  # a new, empty group: a snapshot still writing the old one keeps it
                    table.groups[index] = _native.ColumnarGroup(table.dtype)
        spilled = self._overflowed.pop(window, ())
        if spilled:
            table = self.backend._tables.get(_OVERFLOW.name)
            backend, state = self.backend, self._overflow
            for index in spilled:
                for key in [k for k, windows in table.groups[index].items() if window in windows]:
                    backend.set_current_key(key)
                    windows = state.value()
                    del windows[window]
                    state.update(windows or None)
        self._fired.discard(window)

    def _advance(self, time: int) -> Any:
        """Fires the windows whose ``end - 1`` is at or below ``time`` (watermark or
        clock), in order of their end, and purges those past their cleanup time."""
        out: List[pa.RecordBatch] = []
        size, lateness = self.assigner.size, self.lateness if self.assigner.is_event_time else 0
        for window in self._open():
            if window + size - 1 > time:
                break
            if window not in self._fired:
                batch = self._read_window(window)
                if batch is not None:
                    out.append(batch)
                self._fired.add(window)
            if window + size - 1 + lateness <= time or time == MAX_WATERMARK:
                self._purge(window)
        return _one_buffer(out)

    def process_watermark(self, watermark: int) -> List[Any]:
        if watermark <= self.current_watermark:
            return []
        self.current_watermark = watermark
        if not self.assigner.is_event_time:
            return []
        return self._advance(watermark)  # type: ignore[no-any-return]

    def next_processing_time(self) -> Optional[int]:
        if self.assigner.is_event_time:
            return None
        open_windows = self._open()
        return open_windows[0] + self.assigner.size - 1 if open_windows else None

    def on_processing_time(self, now: int) -> Any:
        return self._advance(now)

    def end_input(self) -> Any:
        """Processing-time windows still open fire at the end of bounded input."""
        return [] if self.assigner.is_event_time else self._advance(MAX_WATERMARK)


def _one_buffer(batches: List[pa.RecordBatch]) -> Any:
    """What an operator returns is one buffer: the batches as one, or ``[]``."""
    if not batches:
        return []
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


# -- the builder ----------------------------------------------------------------------------------


class WindowedStream:
    """``keyed.window(assigner)``: end it with ``.aggregate(...)`` or ``.process(fn)``."""

    def __init__(self, keyed: KeyedStream, assigner: WindowAssigner) -> None:
        if not isinstance(assigner, WindowAssigner):
            raise TypeError(f"window takes pe.windows.tumbling(...), sliding(...) or session(...), got {assigner!r}")
        self._keyed = keyed
        self._assigner = assigner
        self._lateness = 0
        self._late_tag: Optional[OutputTag] = None
        stream = keyed._stream
        if assigner.is_event_time and stream._timestamps is None:
            raise ValueError(
                f"window({assigner.describe()}) is in event time and the stream has no timestamps: give the source a "
                "watermark_strategy=pe.WatermarkStrategy...with_timestamp_assigner(...), or call "
                "assign_timestamps_and_watermarks(...) before key_by; or use time='processing'"
            )

    def allowed_lateness(self, lateness_ms: int) -> WindowedStream:
        """How long after a window fired a late record still updates it (emitting an
        updated row); later records are dropped and counted. Event time only."""
        if type(lateness_ms) is not int or lateness_ms < 0:
            raise ValueError(f"allowed_lateness must be an int of milliseconds >= 0, got {lateness_ms!r}")
        if lateness_ms and not self._assigner.is_event_time:
            raise ValueError("allowed_lateness applies to event-time windows only")
        self._lateness = lateness_ms
        return self

    def side_output_late_data(self, tag: OutputTag) -> WindowedStream:
        """Records too late for every window they belong to (past ``allowed_lateness``)
        go to the side output ``tag`` instead of being dropped (PyFlink's name): read
        them with ``get_side_output(tag)`` on the windowed result. They are not counted
        in ``numLateRecordsDropped`` then, as in Flink. Event time only."""
        if not isinstance(tag, OutputTag):
            raise TypeError(f"side_output_late_data takes a pe.OutputTag, got {tag!r}")
        if not self._assigner.is_event_time:
            raise ValueError("side_output_late_data applies to event-time windows only (no record is late otherwise)")
        self._late_tag = tag
        return self

    def _key_name(self) -> Tuple[Optional[str], str]:
        column = getattr(self._keyed._select, "column", None)
        return (column, column) if isinstance(column, str) else (None, "key")

    def aggregate(self, *aggregations: Aggregation) -> DataStream:
        """One row per key and window when it fires: the key, ``window_start``,
        ``window_end`` (int ms) and each aggregation's column (``pe.agg``)."""
        if not aggregations:
            raise ValueError("aggregate needs at least one aggregation, e.g. pe.agg.count()")
        for a in aggregations:
            if not isinstance(a, Aggregation):
                raise TypeError(f"aggregate takes pe.agg aggregations, got {a!r}")
        column, key_name = self._key_name()
        if key_name in ("window_start", "window_end"):
            raise ValueError(
                f"the key column {key_name!r} has the name of a window bound in the output rows; "
                f"key by a column of another name (rename it with .map(...) before key_by)"
            )
        outputs = [a.output for a in aggregations]
        reserved = {key_name, "window_start", "window_end"}
        clashes = sorted({o for o in outputs if outputs.count(o) > 1 or o in reserved})
        if clashes:
            raise ValueError(
                f"window aggregate output columns must be unique and differ from the key and window bounds; "
                f"repeated: {clashes}"
            )
        stream = self._keyed._stream
        if stream._schema is not None:
            from .connectors.base import check_columns

            check_columns(stream._schema, [a.column for a in aggregations if a.column is not None], "aggregate")
        aggs, assigner, lateness, timestamps = list(aggregations), self._assigner, self._lateness, stream._timestamps
        late = self._late_tag.name if self._late_tag is not None else None
        if assigner.aligned and column is not None:
            key_column = column
            factory: Callable[..., Any] = lambda uid, n, _c: AlignedWindowAggregateOperator(  # noqa: E731
                uid, n, key_column, assigner, lateness, timestamps, aggs, late_tag=late
            )
        else:
            select = self._keyed._select
            factory = lambda uid, n, _c: WindowOperator(  # noqa: E731
                uid, n, select, key_name, assigner, lateness, timestamps, aggregations=aggs, late_tag=late
            )
        out = stream._op("window", factory)
        out._steps[-1].event_time = True
        out._timestamps = TimestampAssigner(column="window_end", offset=-1)  # Flink stamps window.maxTimestamp()
        return out

    def process(self, fn: Any) -> DataStream:
        """``fn``: a ``ProcessWindowFunction`` (``process(key, context, elements)``) or
        ``fn(key, window, elements)``; called once per key and window when it fires,
        with all its elements; what it yields goes downstream. The elements are kept
        in keyed state until then (plain data: the safe serializer's types)."""
        if isinstance(fn, type) and issubclass(fn, ProcessWindowFunction):
            raise TypeError(
                f"process takes an instance of a ProcessWindowFunction: pass {fn.__name__}(), not the class"
            )
        if not isinstance(fn, ProcessWindowFunction) and not callable(fn):
            raise TypeError(f"process takes a pe.windows.ProcessWindowFunction or a function, got {fn!r}")

        _, key_name = self._key_name()
        stream = self._keyed._stream
        select, assigner, lateness, timestamps = self._keyed._select, self._assigner, self._lateness, stream._timestamps
        late = self._late_tag.name if self._late_tag is not None else None
        out = stream._op(
            "window",
            lambda uid, n, _c: WindowOperator(
                uid, n, select, key_name, assigner, lateness, timestamps, function=per_subtask(fn, n), late_tag=late
            ),
        )
        out._steps[-1].event_time = True
        out._timestamps = None
        return out
