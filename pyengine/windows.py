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

Three operators run windows, all in the runtime (``pyengine.runtime.aligned_windows``,
``pyengine.runtime.session_windows``, ``pyengine.runtime.windows``); this module builds
them and checks the arguments:

- tumbling and sliding windows with ``.aggregate`` over a stream keyed by a column
  (``AlignedWindowAggregateOperator``): vectorised like ``KeyedStream.aggregate``.
  Every key shares the windows' bounds, so a window fires for all its keys at once
  from columnar state, with no timer per key (see the class);
- event-time session windows with ``.aggregate`` over a stream keyed by a column
  (``SessionWindowAggregateOperator``): per batch, runs cut at gaps in NumPy and merged
  with each key's open sessions once; its rows are the per-record operator's;
- everything else (``.process``, keys by function, processing-time sessions):
  ``WindowOperator``, per record, each key's windows in keyed state and their
  triggers as keyed timers, as Flink's ``WindowOperator``.

All three keep their watermark in operator state, so a restore neither re-opens a window
it had closed nor fires one twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from .agg import Aggregation
from .connectors.base import check_columns
from .runtime.aligned_windows import AlignedWindowAggregateOperator
from .runtime.base import OutputTag
from .runtime.copies import per_subtask
from .runtime.session_windows import SessionWindowAggregateOperator
from .runtime.windows import ProcessWindowFunction, TimeWindow, WindowAssigner, WindowOperator
from .time.strategy import TimestampAssigner

if TYPE_CHECKING:
    from .api import DataStream, KeyedStream

__all__ = [
    "AlignedWindowAggregateOperator",
    "ProcessWindowFunction",
    "SessionWindowAggregateOperator",
    "TimeWindow",
    "WindowAssigner",
    "WindowOperator",
    "WindowedStream",
    "session",
    "sliding",
    "tumbling",
]

TIMES = ("event", "processing")


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
            check_columns(stream._schema, [a.column for a in aggregations if a.column is not None], "aggregate")
        aggs, assigner, lateness, timestamps = list(aggregations), self._assigner, self._lateness, stream._timestamps
        late = self._late_tag.name if self._late_tag is not None else None
        if assigner.aligned and column is not None:
            key_column = column
            factory: Callable[..., Any] = lambda uid, n, _c: AlignedWindowAggregateOperator(  # noqa: E731
                uid, n, key_column, assigner, lateness, timestamps, aggs, late_tag=late
            )
        elif assigner.merging and assigner.is_event_time and column is not None:
            key_column = column
            factory = lambda uid, n, _c: SessionWindowAggregateOperator(  # noqa: E731
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
