"""``WatermarkStrategy``: where a record's event time comes from, and how far
behind the largest one seen the watermark stays.

A strategy is an immutable value built with Flink's names::

    pe.WatermarkStrategy.for_bounded_out_of_orderness(5_000)
        .with_timestamp_assigner("ts")          # a column / field name, or a function
        .with_idleness(60_000)

Timestamps are integers of milliseconds since the epoch (or any other origin the
job agrees on); a column may also be an Arrow ``timestamp`` (converted to ms) or
hold ``datetime`` values. On an Arrow batch a column is read as one array, never
with a Python call per row.

The generator behind a strategy is Flink's: bounded out-of-orderness keeps the
largest timestamp seen, and its watermark is ``max - out_of_orderness - 1`` (a
record exactly ``out_of_orderness`` behind the newest is still on time);
monotonous timestamps is the same with 0. The watermark is put out periodically
(``StreamEnvironment(auto_watermark_interval_ms=200)``, Flink's default), and a
generator that saw no record for the idleness timeout marks its output idle, so
downstream the others stop waiting for it."""

from __future__ import annotations

import datetime as _dt
import reprlib
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import NonRetryableError
from ..io.events import MAX_WATERMARK, MIN_WATERMARK

__all__ = ["TimestampAssigner", "TimestampError", "WatermarkGenerator", "WatermarkStrategy"]

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


class TimestampError(NonRetryableError, ValueError):
    """A record whose event time cannot be read (a missing or null field, a value
    that is not a time, a time outside the int64 milliseconds) or has no window it
    fits in. A restart would read the same record: the job fails at once."""


def _outside(value: Any) -> str:
    return (
        f"the timestamp {value!r} is outside the int64 milliseconds [{MIN_WATERMARK}, {MAX_WATERMARK}] that event "
        "time is kept in (about 292 million years either side of 1970): it is not wrapped or clamped silently; "
        "a time this far out is a sentinel or a unit mistake (nanoseconds?): drop such records before this step, "
        "or convert the time in the assigner"
    )


def _ms(value: Any) -> int:
    """One timestamp as int milliseconds."""
    t = type(value)
    if t is int:
        return value  # type: ignore[no-any-return]
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return (value - _EPOCH) // _dt.timedelta(milliseconds=1)
    if isinstance(value, (float, np.floating)) and value == value and abs(value) != float("inf"):
        if value != int(value):
            raise TimestampError(_fractional(value))
        return _in_range(int(value), value)
    if isinstance(value, np.integer):
        return _in_range(int(value), value)
    if value is None:
        raise TimestampError(
            "the timestamp is None: every record needs an event time; drop those without one before this step, "
            "e.g. .filter(lambda r: r['ts'] is not None), or compute one with a function assigner"
        )
    hint = ""
    if isinstance(value, (str, bytes)):
        hint = (
            ": convert it in the assigner, e.g. with_timestamp_assigner(lambda r: int(r['ts'])) for milliseconds "
            "as text, or a datetime.fromisoformat(...) for an ISO time"
        )
    raise TimestampError(f"a timestamp must be int milliseconds or a datetime, got {t.__name__} {value!r}{hint}")


def _in_range(ms: int, value: Any) -> int:
    """``ms`` if it is an int64 (``value`` is what the record held, for the message)."""
    if MIN_WATERMARK <= ms <= MAX_WATERMARK:
        return ms
    raise TimestampError(_outside(value))


_SHORT = reprlib.Repr()  # Python 3.11's Repr takes no arguments: its limits are attributes
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = 8


def _short(record: Any) -> str:
    """A record as an error shows it: its repr, cut short (a record can be a large row)."""
    return _SHORT.repr(record)


def _fractional(value: Any) -> str:
    return (
        f"a timestamp must be whole milliseconds, got the float {value!r}: a fraction is not truncated silently "
        "(seconds since the epoch, as time.time() gives, would read as milliseconds of January 1970); convert it "
        "in the assigner, e.g. with_timestamp_assigner(lambda r: round(r['ts'] * 1000)) for seconds"
    )


def _array_ms(array: Any, where: str, record_at: Optional[Callable[[int], Any]] = None) -> np.ndarray:
    """An Arrow array of timestamps as int64 milliseconds, vectorised. A value that
    is no int64 of milliseconds (a ``uint64`` above 2**63 - 1, a float beyond
    ±2**63) is refused, naming ``record_at(row)`` when given, never wrapped."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise TimestampError(
            f"{where}: the timestamp column has {array.null_count} null value(s); every record needs an event "
            "time: fill or drop them in the data, or read the time with a function assigner that gives one"
        )
    t = array.type
    if pa.types.is_timestamp(t):
        if t.unit != "ms":
            array = pc.cast(array, pa.timestamp("ms", t.tz), safe=False)
        return array.view(pa.int64()).to_numpy()  # type: ignore[no-any-return]
    if pa.types.is_integer(t):
        values = array.to_numpy()
        if t == pa.uint64() and len(values) and values.max() > MAX_WATERMARK:  # would wrap to negative
            _refuse_row(values, values > MAX_WATERMARK, where, record_at)
        return values.astype(np.int64, copy=False)  # type: ignore[no-any-return]
    if pa.types.is_floating(t):
        values = array.to_numpy()
        whole = np.floor(values)
        bad = ~np.isfinite(values) | (whole != values)
        if bad.any():
            first = values[np.argmax(bad)].item()
            if first != first or abs(first) == float("inf"):
                raise TimestampError(f"{where}: a timestamp must be whole milliseconds, got {first!r}")
            raise TimestampError(f"{where}: {_fractional(first)}")
        # 2.0**63 is the first float past int64; -2.0**63 is MIN itself (a cast beyond is undefined)
        outside = (values >= 2.0**63) | (values < -(2.0**63))
        if outside.any():
            _refuse_row(values, outside, where, record_at)
        return values.astype(np.int64)  # type: ignore[no-any-return]
    if pa.types.is_date(t):
        return pc.cast(pc.cast(array, pa.timestamp("ms")), pa.int64()).to_numpy()  # type: ignore[no-any-return]
    raise TimestampError(f"{where}: a timestamp column must be integer milliseconds or an Arrow timestamp, got {t}")


def _refuse_row(values: np.ndarray, bad: np.ndarray, where: str, record_at: Optional[Callable[[int], Any]]) -> None:
    """The error for the first row of ``bad``: its record when known, and its value."""
    row = int(np.argmax(bad))
    value = values[row].item()
    which = f"record {_short(record_at(row))}" if record_at is not None else f"row {row}"
    raise TimestampError(f"{which}, timestamp from {where}: {_outside(value)}")


@dataclass(frozen=True)
class TimestampAssigner:
    """A record's event time: ``column`` of the record (a dict key, a tuple index,
    an Arrow column), or ``fn(record)``; plus ``offset`` ms (a window's result row
    is stamped ``window_end - 1``, as Flink stamps window output)."""

    column: Optional[Union[str, int]] = None
    fn: Optional[Callable[[Any], Any]] = None
    offset: int = 0

    def __post_init__(self) -> None:
        if (self.column is None) == (self.fn is None):
            raise ValueError("a timestamp assigner is a column name or a function")

    @classmethod
    def of(cls, assigner: Any) -> TimestampAssigner:
        if isinstance(assigner, TimestampAssigner):
            return assigner
        if isinstance(assigner, (str, int)) and not isinstance(assigner, bool):
            return cls(column=assigner)
        if callable(assigner):
            return cls(fn=assigner)
        raise TypeError(f"with_timestamp_assigner takes a column name or a function, got {assigner!r}")

    def describe(self) -> str:
        what = f"column {self.column!r}" if self.column is not None else getattr(self.fn, "__name__", "function")
        return what if not self.offset else f"{what} {self.offset:+d} ms"

    def of_record(self, record: Any) -> int:
        """The event time of one record (an int64: a time outside is refused)."""
        ms = self._of_record(record)
        if MIN_WATERMARK <= ms <= MAX_WATERMARK:
            return ms
        raise TimestampError(f"record {_short(record)}, timestamp from {self.describe()}: {_outside(ms)}")

    def _of_record(self, record: Any) -> int:
        """``of_record`` without the range check of a Python int (a buffer's are
        checked by the int64 array they go into: no cost per record)."""
        if self.fn is not None:
            try:
                value = self.fn(record)
            except Exception as exc:
                raise TimestampError(
                    f"the timestamp assigner raised {type(exc).__name__}: {exc}, on record {_short(record)}"
                ) from exc
        else:
            try:
                value = record[self.column]
            except (KeyError, IndexError, TypeError):
                raise TimestampError(
                    f"record {_short(record)} has no timestamp field {self.column!r}: name the record's time "
                    "field in with_timestamp_assigner(...), or give a function that reads it"
                ) from None
        try:
            ms = _ms(value)
        except TimestampError as exc:  # which record, and which field or function gave the value
            raise TimestampError(f"record {_short(record)}, timestamp from {self.describe()}: {exc}") from None
        return ms + self.offset if self.offset else ms

    def of_buffer(self, records: Any, where: Optional[str] = None) -> np.ndarray:
        """The event times of a buffer (an Arrow batch: vectorised when by column).
        ``where`` (an operator's name) prefixes the message of a refusal, so that the
        job's failure names the operator that met the bad record."""
        if where is None:
            return self._of_buffer(records)
        try:
            return self._of_buffer(records)
        except NonRetryableError as exc:
            raise type(exc)(f"{where}: {exc}") from None

    def _of_buffer(self, records: Any) -> np.ndarray:
        if type(records) is pa.RecordBatch:
            if self.column is not None:
                if self.column not in records.schema.names:
                    raise TimestampError(
                        f"the records have no timestamp column {self.column!r} (columns: {records.schema.names})"
                    )
                batch = records
                ms = _array_ms(
                    records.column(self.column),
                    f"column {self.column!r}",
                    lambda row: batch.slice(row, 1).to_pylist()[0],
                )
                return ms + self.offset if self.offset else ms
            records = records.to_pylist()
        of = self._of_record
        try:
            return np.fromiter((of(r) for r in records), np.int64, len(records))
        except OverflowError:  # a Python int outside int64 (2**70): which record
            for r in records:
                self.of_record(r)
            raise


class WatermarkGenerator:
    """Flink's bounded out-of-orderness generator with ``WatermarksWithIdleness``
    around it; one per source split or per subtask of an assigning operator."""

    __slots__ = ("emits", "idle", "idleness_ms", "last_activity", "max_ts", "out_of_orderness")

    def __init__(self, out_of_orderness: Optional[int], idleness_ms: Optional[int], now: int) -> None:
        self.emits = out_of_orderness is not None  # no_watermarks(): only the end of input
        self.out_of_orderness = out_of_orderness or 0
        self.max_ts = MIN_WATERMARK + self.out_of_orderness + 1
        self.idleness_ms = idleness_ms
        self.last_activity = now
        self.idle = False

    def on_timestamps(self, ts: np.ndarray, now: int) -> None:
        """Records came with these event times."""
        if len(ts):
            high = int(ts.max())
            if high > self.max_ts:
                self.max_ts = high
            self.last_activity = now

    def on_max(self, high: int, now: int) -> None:
        if high > self.max_ts:
            self.max_ts = high
        self.last_activity = now

    @property
    def current(self) -> int:
        """The watermark now (MIN until a record came, or for no_watermarks())."""
        if not self.emits:
            return MIN_WATERMARK
        return self.max_ts - self.out_of_orderness - 1

    def check_idle(self, now: int) -> bool:
        """Whether the output is idle now: no record for the idleness timeout."""
        self.idle = self.idleness_ms is not None and now - self.last_activity >= self.idleness_ms
        return self.idle


def _non_negative_ms(what: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, _dt.timedelta):
        value = value // _dt.timedelta(milliseconds=1)
    if type(value) is not int or value < minimum:
        raise ValueError(f"{what} must be milliseconds (an int >= {minimum}) or a timedelta, got {value!r}")
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class WatermarkStrategy:
    """How a stream gets event time; see the module docstring. Build one with
    ``for_bounded_out_of_orderness``, ``for_monotonous_timestamps`` or
    ``no_watermarks``, then ``with_timestamp_assigner`` and ``with_idleness``."""

    out_of_orderness_ms: Optional[int] = 0  # None: no watermarks
    timestamps: Optional[TimestampAssigner] = None
    idleness_ms: Optional[int] = None

    @staticmethod
    def for_bounded_out_of_orderness(max_out_of_orderness_ms: Union[int, _dt.timedelta]) -> WatermarkStrategy:
        """Records may arrive up to ``max_out_of_orderness_ms`` behind the newest one
        and still be on time: the watermark trails the largest timestamp by that much."""
        return WatermarkStrategy(_non_negative_ms("max_out_of_orderness_ms", max_out_of_orderness_ms))

    @staticmethod
    def for_monotonous_timestamps() -> WatermarkStrategy:
        """Timestamps never go down (per split): the watermark follows the latest."""
        return WatermarkStrategy(0)

    @staticmethod
    def no_watermarks() -> WatermarkStrategy:
        """Timestamps without watermarks: event time advances only at the end of
        (bounded) input, where every window and timer fires."""
        return WatermarkStrategy(None)

    def with_timestamp_assigner(self, assigner: Union[str, int, Callable[[Any], Any]]) -> WatermarkStrategy:
        """Where a record's event time is: a column / field name, or ``fn(record)``;
        int milliseconds, or a datetime / Arrow timestamp."""
        return replace(self, timestamps=TimestampAssigner.of(assigner))

    def with_idleness(self, idle_timeout_ms: Union[int, _dt.timedelta]) -> WatermarkStrategy:
        """After ``idle_timeout_ms`` of processing time without records, this input
        (split) is idle: downstream watermarks stop waiting for it until it has
        records again. Without it, an input with nothing to say holds every window
        downstream back (Flink's default too)."""
        return replace(self, idleness_ms=_non_negative_ms("idle_timeout_ms", idle_timeout_ms, minimum=1))

    def create_generator(self, now: int) -> WatermarkGenerator:
        return WatermarkGenerator(self.out_of_orderness_ms, self.idleness_ms, now)

    def require_timestamps(self, where: str) -> TimestampAssigner:
        if self.timestamps is None:
            raise ValueError(
                f"{where}: the watermark strategy has no timestamp assigner; records carry no event time of their "
                "own here, so say where it is: .with_timestamp_assigner('column') or (lambda record: ms)"
            )
        return self.timestamps


def combined(watermarks: List[int]) -> int:
    """Several outputs' watermark (Flink's WatermarkOutputMultiplexer): their minimum;
    MAX when there are none (every split ended)."""
    return min(watermarks) if watermarks else MAX_WATERMARK
