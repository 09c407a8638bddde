"""The runtime of windows: ``TimeWindow``, the assigners' arithmetic
(``WindowAssigner``: which windows a record belongs to), session merging, and the
general ``WindowOperator`` (Flink's ``runtime/operators/windowing/WindowOperator``),
per record, each key's windows in keyed state and their triggers as keyed timers.

The user builds windows in ``pyengine.windows`` (``tumbling``, ``sliding``,
``session``, ``WindowedStream``), which checks the arguments and puts one of the
operators here, in ``runtime.aligned_windows`` or in ``runtime.session_windows``
into the job graph. All keep their watermark in operator state, so a restore neither
re-opens a window it had closed nor fires one twice.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..agg import Aggregation
from ..errors import NonRetryableError, not_records, refuse_non_records
from ..io.events import MAX_WATERMARK, MIN_WATERMARK
from ..state import ListStateDescriptor, ValueStateDescriptor
from ..time.domain import now_ms
from ..time.strategy import TimestampAssigner, TimestampError, _short
from .aggregate import AggregateInputError, needed_accumulators
from .base import EventTimeOperatorMixin, UserFunctionError, rows_of
from .keyed import KeyedOperator, NaNKeyError

__all__ = [
    "ProcessWindowFunction",
    "TimeWindow",
    "WindowAssigner",
    "WindowOperator",
    "merge_windows",
]


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
                from ..errors import ColumnNotFoundError

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
        from ..state.timers import InternalTimerService

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
