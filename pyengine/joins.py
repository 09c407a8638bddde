"""Joins of two streams: the interval join and the window join (Flink's, with PyFlink's names).

Interval join: ``a.key_by(k).interval_join(b.key_by(k)).between(lower_ms, upper_ms)``
pairs each record of ``a`` at ``t`` with the records of ``b`` of the same key at
``t + lower_ms <= t' <= t + upper_ms`` (``.lower_bound_exclusive()`` /
``.upper_bound_exclusive()`` open either end), then ``.process(pe.ProcessJoinFunction)``
calls ``process_element(left, right, ctx)`` per pair.

Window join: ``a.join(b).where(k1).equal_to(k2).window(pe.windows.tumbling(...))
.apply(fn)`` calls ``fn(left, right)`` for every pair of records with equal keys in
the same window (an inner join), when the window ends.

Both are in event time: both streams need timestamps and watermarks (a source's
``watermark_strategy=`` or ``assign_timestamps_and_watermarks``). A record behind the
watermark when it arrives is late: dropped and counted in ``numLateRecordsDropped``.

On Arrow batches, ``.project(left=..., right=...)`` in place of ``process`` /
``apply`` joins with no Python call per row: the output is Arrow batches of the key,
the chosen columns of each side and the pair's times (``pyengine.runtime.joins``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple

from .runtime.base import Operator, OutputTag
from .runtime.copies import per_subtask
from .runtime.joins import (
    ArrowIntervalJoinOperator,
    ArrowWindowJoinOperator,
    IntervalJoinOperator,
    JoinContext,
    ProcessJoinFunction,
    WindowJoinOperator,
    joined_schema,
)
from .runtime.windows import WindowAssigner
from .time.strategy import TimestampAssigner

if TYPE_CHECKING:
    from .api import DataStream, KeyedStream

__all__ = [
    "IntervalJoin",
    "IntervalJoined",
    "JoinContext",
    "JoinFunction",
    "JoinedStreams",
    "ProcessJoinFunction",
    "WindowJoinOperator",
    "WithWindow",
]


class JoinFunction:
    """A window join's function (Flink's ``JoinFunction``): ``join(left, right)``
    returns the output of one pair. ``apply`` also takes a plain ``fn(left, right)``."""

    def join(self, left: Any, right: Any) -> Any:
        raise NotImplementedError

    def __call__(self, left: Any, right: Any) -> Any:
        return self.join(left, right)


def _needs_timestamps(stream: DataStream, side: str, what: str) -> TimestampAssigner:
    stamps = stream._timestamps
    if stamps is None:
        raise ValueError(
            f"{what} is in event time and the {side} stream has no timestamps: give its source a "
            "watermark_strategy=pe.WatermarkStrategy...with_timestamp_assigner(...), or call "
            "assign_timestamps_and_watermarks(...) on it before key_by"
        )
    return stamps


def _columns(value: Optional[Sequence[str]], what: str) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(c, str) for c in value):
        raise TypeError(f"{what} takes a list of column names (or None for all), got {value!r}")
    return tuple(value)


def _key_column(select: Callable[[Any], Any], side: str, what: str) -> str:
    column = getattr(select, "column", None)
    if not isinstance(column, str):
        raise TypeError(
            f"{what} joins Arrow batches by column: key the {side} stream by a column name "
            "(key_by('k') / where('k') / equal_to('k')), not a function; or use a Python function to join"
        )
    return column


def _two_input(
    left: DataStream, right: DataStream, name: str, factory: Callable[[str, str, bool], Operator]
) -> DataStream:
    """A two-input operator node reading both streams (already keyed: their exchanges):
    an operator after ``left``, with ``right`` as its second input (as ``connect`` builds
    one; this module does not import the job API, which imports it)."""
    out = left._op(name, factory)
    node = out._node
    node.inputs.append(right._node)
    node.event_time = True
    return out


def _check_pair(left: DataStream, right: DataStream, what: str) -> None:
    if left._env is not right._env:
        raise ValueError(f"{what}: the streams belong to different StreamEnvironments; build a job in one")
    left._check_open(what)
    right._check_open(what)


# -- the interval join -----------------------------------------------------------------------------


class IntervalJoin:
    """``a.key_by(k).interval_join(b.key_by(k))``: say the interval with ``.between(lower_ms, upper_ms)``."""

    def __init__(self, left: KeyedStream, right: KeyedStream) -> None:
        # left is a KeyedStream (KeyedStream.interval_join made this): its type is the API's
        if not isinstance(right, type(left)):
            hint = " (key it: other.key_by(k))" if isinstance(right, type(left._stream)) else ""
            raise TypeError(f"interval_join takes a keyed stream{hint}, got {right!r}")
        _check_pair(left._stream, right._stream, "interval_join()")
        self._left = left
        self._right = right
        self._stamps = (
            _needs_timestamps(left._stream, "left", "interval_join"),
            _needs_timestamps(right._stream, "right", "interval_join"),
        )

    def between(self, lower_ms: int, upper_ms: int) -> IntervalJoined:
        """A left record at ``t`` pairs with the right records at ``t + lower_ms`` to
        ``t + upper_ms``, both included (negative bounds reach into the past)."""
        for what, value in (("lower_ms", lower_ms), ("upper_ms", upper_ms)):
            if type(value) is not int:
                raise TypeError(f"interval_join between: {what} must be an int of milliseconds, got {value!r}")
        if lower_ms > upper_ms:
            raise ValueError(f"interval_join between: lower_ms ({lower_ms}) must be <= upper_ms ({upper_ms})")
        return IntervalJoined(self._left, self._right, self._stamps, lower_ms, upper_ms)


class IntervalJoined:
    """An interval join with its bounds: end it with ``.process(fn)`` or ``.project(...)``."""

    def __init__(
        self,
        left: KeyedStream,
        right: KeyedStream,
        stamps: Tuple[TimestampAssigner, TimestampAssigner],
        lower: int,
        upper: int,
    ) -> None:
        self._left, self._right, self._stamps = left, right, stamps
        self._lower, self._upper = lower, upper
        self._lower_exclusive = self._upper_exclusive = False
        self._late: Tuple[Optional[OutputTag], Optional[OutputTag]] = (None, None)

    def lower_bound_exclusive(self) -> IntervalJoined:
        """Leaves out right records at exactly ``t + lower_ms``."""
        self._lower_exclusive = True
        return self

    def upper_bound_exclusive(self) -> IntervalJoined:
        """Leaves out right records at exactly ``t + upper_ms``."""
        self._upper_exclusive = True
        return self

    def side_output_left_late_data(self, tag: OutputTag) -> IntervalJoined:
        """Left records behind the watermark go to the side output ``tag`` instead of
        being dropped (read it with ``get_side_output(tag)`` on the join's result)."""
        self._late = (_tag(tag, "side_output_left_late_data"), self._late[1])
        return self

    def side_output_right_late_data(self, tag: OutputTag) -> IntervalJoined:
        """As ``side_output_left_late_data``, for the right stream's late records."""
        self._late = (self._late[0], _tag(tag, "side_output_right_late_data"))
        return self

    def _bounds(self) -> Tuple[int, int]:
        lower = self._lower + 1 if self._lower_exclusive else self._lower
        upper = self._upper - 1 if self._upper_exclusive else self._upper
        if lower > upper:
            raise ValueError(
                f"interval_join: between({self._lower}, {self._upper}) with its exclusive bounds leaves no "
                "interval: widen it or drop lower_bound_exclusive()/upper_bound_exclusive()"
            )
        return lower, upper

    def _late_names(self) -> Tuple[Optional[str], Optional[str]]:
        return (
            self._late[0].name if self._late[0] is not None else None,
            self._late[1].name if self._late[1] is not None else None,
        )

    def process(self, fn: ProcessJoinFunction) -> DataStream:
        """Calls ``fn.process_element(left, right, ctx)`` for each joined pair; what it
        yields goes downstream."""
        if not isinstance(fn, ProcessJoinFunction):
            raise TypeError(
                f"interval_join process takes a pe.ProcessJoinFunction (process_element(left, right, ctx)), got {fn!r}"
            )
        lower, upper = self._bounds()
        selectors = (self._left._select, self._right._select)
        stamps, late = self._stamps, self._late_names()
        a, b = self._left._stream, self._right._stream

        def factory(uid: str, n: str, _c: bool) -> Operator:
            return IntervalJoinOperator(uid, n, selectors, stamps, lower, upper, per_subtask(fn, n), late)

        out = _two_input(a, b, "interval_join", factory)
        out._timestamps = None  # outputs are the function's: assign timestamps again to go on in event time
        return out

    def project(
        self,
        left: Optional[Sequence[str]] = None,
        right: Optional[Sequence[str]] = None,
        *,
        right_suffix: str = "_right",
        timestamp_columns: Tuple[str, str] = ("left_ts", "right_ts"),
    ) -> DataStream:
        """The joined pairs as Arrow batches, with no Python call per row: the key
        column (the left's name), the ``left`` columns of the left record and the
        ``right`` columns of the right one (all when None; a right column whose name
        the output has already gets ``right_suffix``), then the two records' event
        times (int64 ms, named by ``timestamp_columns``). Both streams keyed by a column."""
        lower, upper = self._bounds()
        a, b = self._left._stream, self._right._stream
        keys = (
            _key_column(self._left._select, "left", "interval_join project"),
            _key_column(self._right._select, "right", "interval_join project"),
        )
        columns = (_columns(left, "project left="), _columns(right, "project right="))
        if (
            not isinstance(timestamp_columns, tuple)
            or len(timestamp_columns) != 2
            or not all(isinstance(c, str) and c for c in timestamp_columns)
        ):
            raise TypeError(f"project timestamp_columns takes two column names, got {timestamp_columns!r}")
        stamps, late = self._stamps, self._late_names()
        extra = [(timestamp_columns[0], "int64"), (timestamp_columns[1], "int64")]
        schema = _check_schema(a, b, keys, columns, right_suffix, extra)

        def factory(uid: str, n: str, _c: bool) -> Operator:
            return ArrowIntervalJoinOperator(
                uid, n, lower, upper, timestamp_columns, keys, stamps, columns, right_suffix, late
            )

        out = _two_input(a, b, "interval_join", factory)
        out._node.side_outputs = any(t is not None for t in late)  # only late rows: else get_side_output is refused
        out._timestamps = None
        out._schema = schema
        return out


def _tag(tag: Any, what: str) -> OutputTag:
    if not isinstance(tag, OutputTag):
        raise TypeError(f"{what} takes a pe.OutputTag, got {tag!r}: make one with pe.OutputTag('name')")
    return tag


def _check_schema(
    a: DataStream,
    b: DataStream,
    keys: Tuple[str, str],
    columns: Tuple[Optional[Sequence[str]], Optional[Sequence[str]]],
    right_suffix: str,
    extra: Sequence[Tuple[str, str]],
) -> Any:
    """The output schema when both inputs' are known (columns checked now), else None."""
    import pyarrow as pa

    if not isinstance(right_suffix, str) or not right_suffix:
        raise ValueError(f"project right_suffix must be a non-empty string, got {right_suffix!r}")
    if a._schema is None or b._schema is None:
        return None
    extra_types = [(n, pa.type_for_alias(t)) for n, t in extra]
    return joined_schema(a._schema, b._schema, keys, columns, right_suffix, extra_types)[2]


# -- the window join -------------------------------------------------------------------------------


class JoinedStreams:
    """``a.join(b)``: then ``.where(k1).equal_to(k2).window(assigner).apply(fn)``."""

    def __init__(self, left: DataStream, right: DataStream) -> None:
        # left is a DataStream (DataStream.join made this); a KeyedStream has a selector
        if hasattr(right, "_select"):
            raise TypeError(
                "join takes streams that are not keyed: the keys are where(k1).equal_to(k2) "
                "(a.join(b).where(k1).equal_to(k2)...); for keyed streams see interval_join"
            )
        if not isinstance(right, type(left)):
            raise TypeError(f"join takes a DataStream, got {right!r}")
        _check_pair(left, right, "join()")
        self._left, self._right = left, right

    def where(self, key: Any) -> _Where:
        """The left stream's key: a column / field name or a function."""
        return _Where(self._left, self._right, key)


class _Where:
    def __init__(self, left: DataStream, right: DataStream, key: Any) -> None:
        self._left, self._right, self._key = left, right, key

    def equal_to(self, key: Any) -> _EqualTo:
        """The right stream's key: records pair when it equals the left's."""
        return _EqualTo(self._left, self._right, self._key, key)


class _EqualTo:
    def __init__(self, left: DataStream, right: DataStream, key1: Any, key2: Any) -> None:
        self._left, self._right, self._keys = left, right, (key1, key2)

    def window(self, assigner: WindowAssigner) -> WithWindow:
        """``pe.windows.tumbling(size_ms)``, ``sliding(size_ms, slide_ms)`` or
        ``session(gap_ms)``, in event time."""
        return WithWindow(self._left, self._right, self._keys, assigner)


class WithWindow:
    """A window join with its keys and windows: end it with ``.apply(fn)`` or ``.project(...)``."""

    def __init__(self, left: DataStream, right: DataStream, keys: Tuple[Any, Any], assigner: WindowAssigner) -> None:
        if not isinstance(assigner, WindowAssigner):
            raise TypeError(
                f"join window takes pe.windows.tumbling(...), sliding(...) or session(...), got {assigner!r}"
            )
        if not assigner.is_event_time:
            raise ValueError(
                f"join window({assigner.describe()}): the window join is in event time only; drop time='processing' "
                "and give both streams timestamps"
            )
        self._stamps = (
            _needs_timestamps(left, "left", f"join window({assigner.describe()})"),
            _needs_timestamps(right, "right", f"join window({assigner.describe()})"),
        )
        self._left = left.key_by(keys[0])
        self._right = right.key_by(keys[1])
        self._assigner = assigner

    def apply(self, fn: Any) -> DataStream:
        """``fn(left, right)`` (or a ``pe.JoinFunction``'s ``join``) returns the output
        of each pair of a window, called when the window ends."""
        if not callable(fn):
            raise TypeError(f"join apply takes a function fn(left, right) or a pe.JoinFunction, got {fn!r}")
        selectors = (self._left._select, self._right._select)
        stamps, assigner = self._stamps, self._assigner

        def factory(uid: str, n: str, _c: bool) -> Operator:
            return WindowJoinOperator(uid, n, selectors, stamps, assigner, per_subtask(fn, n))

        out = _two_input(self._left._stream, self._right._stream, "window_join", factory)
        out._node.side_outputs = False  # a window join sends nothing aside: get_side_output is refused
        out._timestamps = None
        return out

    def project(
        self,
        left: Optional[Sequence[str]] = None,
        right: Optional[Sequence[str]] = None,
        *,
        right_suffix: str = "_right",
    ) -> DataStream:
        """The joined pairs as Arrow batches, with no Python call per row: the key
        column (the left's name), the ``left`` columns of the left record, the
        ``right`` columns of the right one (all when None; a right column whose name
        the output has already gets ``right_suffix``), then ``window_start`` and
        ``window_end``. Tumbling and sliding windows; both keys column names."""
        if self._assigner.merging:
            raise ValueError(
                "join project: session windows merge per key, which the Arrow join does not do; "
                "use apply(fn) for session windows"
            )
        keys = (
            _key_column(self._left._select, "left", "join project"),
            _key_column(self._right._select, "right", "join project"),
        )
        columns = (_columns(left, "project left="), _columns(right, "project right="))
        a, b = self._left._stream, self._right._stream
        schema = _check_schema(a, b, keys, columns, right_suffix, [("window_start", "int64"), ("window_end", "int64")])
        stamps, assigner = self._stamps, self._assigner

        def factory(uid: str, n: str, _c: bool) -> Operator:
            return ArrowWindowJoinOperator(uid, n, assigner, keys, stamps, columns, right_suffix)

        out = _two_input(a, b, "window_join", factory)
        out._node.side_outputs = False
        out._timestamps = TimestampAssigner(column="window_end", offset=-1)  # as windows stamp their output
        out._schema = schema
        return out
