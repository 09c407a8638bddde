"""The joins of Arrow batches (``.project(...)``; ``pyengine.joins`` builds them):
``ArrowIntervalJoinOperator`` and ``ArrowWindowJoinOperator``, with no Python call per
row: rows wait as Arrow batches, probed with one hash join per input batch (interval
join) or per watermark over every window it ends (window join), and the joined rows
go on as Arrow batches. ``runtime.joins`` names them too."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import ColumnNotFoundError, NonRetryableError
from ..io.events import MIN_WATERMARK
from ..state import ListStateDescriptor
from ..state.keygroups import assign_to_key_group, key_groups_of_int64
from ..time.strategy import TimestampAssigner
from .base import OperatorContext, batch_of
from .join_base import LateCounting

__all__ = ["ArrowIntervalJoinOperator", "ArrowWindowJoinOperator", "joined_schema"]

_ARROW_BUFFERS = ListStateDescriptor("join-buffers")  # union: [bucket, side, Arrow IPC stream bytes]
_TS = "__pe_ts"  # a buffered row's event time (int64), kept beside its columns
_WINDOW = "__pe_w"  # a buffered row's window start (the window join)


def joined_schema(
    left: pa.Schema,
    right: pa.Schema,
    keys: Tuple[str, str],
    columns: Tuple[Optional[Sequence[str]], Optional[Sequence[str]]],
    right_suffix: str,
    extra: Sequence[Tuple[str, pa.DataType]] = (),
) -> Tuple[List[str], List[str], pa.Schema]:
    """What ``project`` outputs: the left key column, the chosen left columns and the
    chosen right columns (the right key left out: it equals the left's), a right
    column whose name the left side has taking ``right_suffix``; then ``extra``.
    Returns the left's columns, the right's and the output schema; a name that
    collides even so is refused."""
    left_cols = [c for c in (columns[0] if columns[0] is not None else left.names) if c != keys[0]]
    right_cols = [c for c in (columns[1] if columns[1] is not None else right.names) if c != keys[1]]
    for side, schema, wanted in (("left", left, left_cols), ("right", right, right_cols)):
        missing = [c for c in wanted if c not in schema.names]
        if missing:
            raise ColumnNotFoundError(
                f"join project: the {side} stream has no column {missing[0]!r} (columns: {schema.names})"
            )
    fields = [left.field(keys[0])] + [left.field(c) for c in left_cols]
    taken = {f.name for f in fields}
    for c in right_cols:
        f = right.field(c)
        fields.append(f.with_name(c + right_suffix) if c in taken or c == keys[0] else f)
    fields += [pa.field(n, t) for n, t in extra]
    names = [f.name for f in fields]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ValueError(
            f"join project: output columns {clashes} repeat; choose columns with left=/right= or another right_suffix="
        )
    return left_cols, right_cols, pa.schema(fields)


class _ArrowJoinBase(LateCounting):
    """Rows of both sides wait as Arrow batches in buckets (a window start, or one
    bucket for the interval join), each batch with its rows' event times in ``_TS``.

    A snapshot writes each bucket of each side as one Arrow IPC stream into union
    operator state; a restored subtask reads them all and keeps the rows whose key
    falls in its key groups (the same assignment as the exchange's), so a restore at
    another parallelism splits them exactly as the keyed records are split."""

    def __init__(
        self,
        uid: str,
        name: str,
        keys: Tuple[str, str],
        timestamps: Tuple[TimestampAssigner, TimestampAssigner],
        columns: Tuple[Optional[Sequence[str]], Optional[Sequence[str]]],
        right_suffix: str,
        late_tags: Tuple[Optional[str], Optional[str]] = (None, None),
    ) -> None:
        super().__init__(uid, name, late_tags)
        self.keys = keys
        self.timestamps = timestamps
        self.columns = columns
        self.right_suffix = right_suffix
        self._buckets: Dict[Tuple[int, int], List[pa.RecordBatch]] = {}  # (bucket, side) -> batches
        self._saved: Any = None
        self._schemas: List[Optional[pa.Schema]] = [None, None]  # each side's kept columns
        self._plan: Optional[Tuple[List[str], List[str], pa.Schema]] = None

    def setup(self, ctx: OperatorContext, restored: Any) -> None:
        super().setup(ctx, restored)
        assert self.operator_state is not None
        self._saved = self.operator_state.get_union_list_state(_ARROW_BUFFERS)
        if restored is None:
            return
        r = self.backend.key_group_range
        for bucket, side, data in self._saved.get():
            table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
            if not table.num_rows:
                continue
            batch = table.combine_chunks().to_batches()[0]
            groups = self._key_groups(batch.column(self.keys[side]))
            mine = batch.filter(pa.array((groups >= r.start) & (groups <= r.end)))
            if mine.num_rows:
                mine = self._fit(mine, int(side))  # subtasks that saw other types: one type per column
                if self._schemas[side] is None:
                    self._schemas[side] = mine.schema
                self._buckets.setdefault((int(bucket), int(side)), []).append(mine)

    def _key_groups(self, keys: pa.Array) -> np.ndarray:
        max_parallelism = self.backend.max_parallelism
        if keys.null_count == 0 and pa.types.is_integer(keys.type):
            return key_groups_of_int64(keys.to_numpy().astype(np.int64, copy=False), max_parallelism)
        return np.array([assign_to_key_group(k, max_parallelism) for k in keys.to_pylist()], np.int64)

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        entries = []
        for (bucket, side), batches in sorted(self._buckets.items()):
            if not batches:
                continue
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batches[0].schema) as writer:
                for b in batches:
                    writer.write_batch(b)
            entries.append([bucket, side, sink.getvalue().to_pybytes()])
        self._saved.update(entries)
        return super().snapshot(checkpoint_id, location)

    def _input(self, records: Any, side: int) -> Tuple[pa.RecordBatch, np.ndarray]:
        """A buffer as an Arrow batch of the columns kept, with its event times."""
        try:
            batch = batch_of(records)
        except (TypeError, pa.ArrowException) as exc:
            raise NonRetryableError(f"{self.where()}: join project needs records that form a table: {exc}") from None
        key = self.keys[side]
        wanted = [key] + [c for c in (self.columns[side] or batch.schema.names) if c != key]
        missing = [c for c in wanted if c not in batch.schema.names]
        if missing:
            raise ColumnNotFoundError(
                f"{self.where()}: the {('left', 'right')[side]} records have no column {missing[0]!r} "
                f"(columns: {batch.schema.names})"
            )
        ts = self.timestamps[side].of_buffer(batch, self.where())
        keys = batch.column(key)
        if keys.null_count:
            raise NonRetryableError(f"{self.where()}: the {('left', 'right')[side]} key column {key!r} has nulls")
        kept = batch.select(wanted)
        kept = kept.append_column(_TS, pa.array(ts, pa.int64()))
        return self._fit(kept, side), ts

    def _fit(self, batch: pa.RecordBatch, side: int) -> pa.RecordBatch:
        """``batch`` with the column types of the rows waiting on its side, unified as
        Arrow unifies types (``promote_options="permissive"``: int64 and float64 make
        float64, never narrower): where ``batch`` needs a wider type, the waiting rows
        are widened first (whole numbers, then fractions), so the side's rows make one
        table and the output one type per column. Types Arrow cannot unify fail the
        job, naming the column and both."""
        known = self._schemas[side]
        if known is None:
            return batch
        shared = [f for f in batch.schema if f.name in known.names]
        if all(known.field(f.name).type.equals(f.type) for f in shared):
            return batch  # the usual case
        types: Dict[str, pa.DataType] = {}
        for f in shared:
            k = known.field(f.name)
            if k.type.equals(f.type):
                continue
            try:
                unified = pa.unify_schemas([pa.schema([k]), pa.schema([f])], promote_options="permissive")
            except (pa.ArrowException, TypeError) as exc:
                raise NonRetryableError(
                    f"{self.where()}: the {('left', 'right')[side]} column {f.name!r} was {k.type} and is now "
                    f"{f.type}, and Arrow cannot make them one type ({exc}); give the column one type before the join"
                ) from None
            types[f.name] = unified.field(f.name).type
        wider = {n: t for n, t in types.items() if not t.equals(known.field(n).type)}
        if wider:
            for where, batches in self._buckets.items():
                if where[1] == side:
                    self._buckets[where] = [_cast_columns(b, wider) for b in batches]
            self._schemas[side] = _cast_columns(known.empty_table(), wider).schema
            self._plan = None  # the output's columns widen too
        return _cast_columns(batch, types)

    def _output_plan(self) -> Tuple[List[str], List[str], pa.Schema]:
        if self._plan is None:
            left, right = self._schemas
            assert left is not None and right is not None
            internal = (_TS, _WINDOW)
            strip = [f for f in left if f.name not in internal], [f for f in right if f.name not in internal]
            self._plan = joined_schema(
                pa.schema(strip[0]), pa.schema(strip[1]), self.keys, self.columns, self.right_suffix, self._extra()
            )
        return self._plan

    def _extra(self) -> List[Tuple[str, pa.DataType]]:
        return []

    def _join(self, left: pa.Table, right: pa.Table, also: Sequence[str] = ()) -> pa.Table:
        """The inner equi-join of two tables on the keys (and the columns ``also``,
        which both have), by Arrow's hash join; the event times of both come out as
        ``__pe_ts`` and ``__pe_ts_r``."""
        left_cols, right_cols, _ = self._output_plan()
        lk, rk = self.keys
        lt = left.select([lk, *left_cols, _TS, *also])
        rt = right.select([rk, *right_cols, _TS, *also]).rename_columns(
            ["__pe_rk", *[f"__pe_r_{c}" for c in right_cols], "__pe_ts_r", *[f"__pe_r{c}" for c in also]]
        )
        if lt.schema.field(lk).type != rt.schema.field("__pe_rk").type:
            rt = rt.set_column(0, "__pe_rk", pc.cast(rt.column(0), lt.schema.field(lk).type))
        return lt.join(
            rt,
            keys=[lk, *also],
            right_keys=["__pe_rk", *[f"__pe_r{c}" for c in also]],
            join_type="inner",
            use_threads=False,
        )

    def _finish(self, joined: pa.Table, extra: Dict[str, Any]) -> pa.RecordBatch:
        left_cols, right_cols, schema = self._output_plan()
        arrays = [joined.column(self.keys[0])] + [joined.column(c) for c in left_cols]
        arrays += [joined.column(f"__pe_r_{c}") for c in right_cols]
        arrays += [extra[n] for n in schema.names[len(arrays) :]]
        table = pa.Table.from_arrays(arrays, schema=schema)
        return table.combine_chunks().to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], schema)


def _cast_columns(batch: Any, types: Dict[str, pa.DataType]) -> Any:
    """``batch`` (a record batch or table) with the columns named in ``types`` cast to
    them (widening casts only: safe)."""
    if not types:
        return batch
    fields = [pa.field(f.name, types.get(f.name, f.type), f.nullable, f.metadata) for f in batch.schema]
    columns = [c.cast(t.type, safe=True) if t.name in types else c for c, t in zip(batch.columns, fields, strict=True)]
    return type(batch).from_arrays(columns, schema=pa.schema(fields, metadata=batch.schema.metadata))


def _min_max(column: pa.Array) -> Tuple[int, int]:
    values = column.to_numpy()
    return int(values.min()), int(values.max())


def _one_buffer(batches: List[pa.RecordBatch]) -> Any:
    batches = [b for b in batches if b.num_rows]
    if not batches:
        return []
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


class ArrowWindowJoinOperator(_ArrowJoinBase):
    """The window join of Arrow batches (tumbling and sliding windows, event time).

    Per input batch: each row's windows at once (``assign_array``), the late
    (row, window) pairs dropped, and the rows appended to their side's buffer with
    their window's start (``__pe_w``; a row of several sliding windows once per
    window). When the watermark passes, every window that ended (``end - 1`` at or
    below it) fires in one go: the due rows of both sides are hash-joined on (key,
    window start) by Arrow, one join per watermark however many windows and keys
    end, and leave the buffers. Output: the joined columns, then ``window_start`` and
    ``window_end``."""

    def __init__(self, uid: str, name: str, assigner: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(uid, name, *args, **kwargs)
        self.assigner = assigner

    def _extra(self) -> List[Tuple[str, pa.DataType]]:
        return [("window_start", pa.int64()), ("window_end", pa.int64())]

    def process(self, records: Any) -> Any:
        return self._process(records, 0)

    def process2(self, records: Any) -> Any:
        return self._process(records, 1)

    def _process(self, records: Any, side: int) -> Any:
        if not len(records):
            return []
        batch, ts = self._input(records, side)
        rows, starts = self.assigner.assign_array(ts)
        on_time = starts + (self.assigner.size - 1) > self.current_watermark
        if not on_time.all():
            kept = rows[on_time]
            late = np.setdiff1d(np.arange(batch.num_rows), kept)
            if len(late):
                self._late_record(side, batch.take(pa.array(late)).drop_columns([_TS]), len(late))
            rows, starts = kept, starts[on_time]
        if not len(rows):
            return []
        if len(rows) != batch.num_rows or self.assigner.kind != "tumbling":
            batch = batch.take(pa.array(rows))
        batch = batch.append_column(_WINDOW, pa.array(starts, pa.int64()))
        self._schemas[side] = batch.schema
        self._buckets.setdefault((0, side), []).append(batch)
        return []

    def process_watermark(self, watermark: int) -> Any:
        if watermark <= self.current_watermark:
            return []
        self.current_watermark = watermark
        last_start = watermark - self.assigner.size + 1  # windows starting up to here have ended
        due: List[Optional[pa.Table]] = [None, None]
        for side in (0, 1):
            batches = self._buckets.get((0, side))
            if not batches:
                continue
            table = pa.Table.from_batches(batches)
            ended = pc.less_equal(table.column(_WINDOW), last_start)
            if not pc.any(ended).as_py():
                continue
            due[side] = table.filter(ended)
            rest = table.filter(pc.invert(ended)).combine_chunks()
            self._buckets[(0, side)] = rest.to_batches() if rest.num_rows else []
        left, right = due
        if left is None or right is None:
            return []
        joined = self._join(left, right, (_WINDOW,))
        if not joined.num_rows:
            return []
        starts = joined.column(_WINDOW)
        extra = {"window_start": starts, "window_end": pc.add(starts, self.assigner.size)}
        return self._finish(joined, extra)


class ArrowIntervalJoinOperator(_ArrowJoinBase):
    """The interval join of Arrow batches: each input batch (its late rows dropped)
    is hash-joined on the key with the other side's buffer and the pairs whose right
    time lies in ``[left + lower, left + upper]`` are kept; then the batch joins its
    own side's buffer. When the watermark passes, each side's rows past their
    cleanup time (as ``IntervalJoinOperator``'s) are dropped from its buffer, one
    filter per side. Output: the joined columns, then ``left_ts`` and ``right_ts``
    (named by ``timestamp_columns``)."""

    def __init__(
        self,
        uid: str,
        name: str,
        lower: int,
        upper: int,
        timestamp_columns: Tuple[str, str],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(uid, name, *args, **kwargs)
        self.lower, self.upper = lower, upper
        self.timestamp_columns = timestamp_columns
        self._time_ranges: Dict[int, List[Tuple[int, int]]] = {}

    def _extra(self) -> List[Tuple[str, pa.DataType]]:
        return [(self.timestamp_columns[0], pa.int64()), (self.timestamp_columns[1], pa.int64())]

    def process(self, records: Any) -> Any:
        return self._process(records, 0)

    def process2(self, records: Any) -> Any:
        return self._process(records, 1)

    def _process(self, records: Any, side: int) -> Any:
        if not len(records):
            return []
        batch, ts = self._input(records, side)
        self._schemas[side] = batch.schema
        watermark = self.current_watermark
        if watermark != MIN_WATERMARK:
            on_time = ts >= watermark
            if not on_time.all():
                late = np.nonzero(~on_time)[0]
                self._late_record(side, batch.take(pa.array(late)).drop_columns([_TS]), len(late))
                batch = batch.filter(pa.array(on_time))
                if not batch.num_rows:
                    return []
        out: Any = []
        stamps = batch.column(_TS).to_numpy()
        # the other side's times that can pair with this batch's: [min + low, max + high]
        low, high = (self.lower, self.upper) if side == 0 else (-self.upper, -self.lower)
        first, last = int(stamps.min()) + low, int(stamps.max()) + high
        other = self._buckets.get((0, 1 - side))
        if other:
            # buffered batches whose time range misses that are skipped whole, rows filtered after
            near = [b for b, (lo, hi) in zip(other, self._ranges(1 - side), strict=True) if hi >= first and lo <= last]
            that = pa.Table.from_batches(near, other[0].schema) if near else None
            if that is not None and that.num_rows:
                t = that.column(_TS)
                that = that.filter(pc.and_(pc.greater_equal(t, first), pc.less_equal(t, last)))
            if that is not None and that.num_rows:
                this = pa.Table.from_batches([batch])
                joined = self._join(this, that) if side == 0 else self._join(that, this)
                if joined.num_rows:
                    lt, rt = joined.column(_TS), joined.column("__pe_ts_r")
                    keep = pc.and_(
                        pc.greater_equal(rt, pc.add(lt, self.lower)), pc.less_equal(rt, pc.add(lt, self.upper))
                    )
                    joined = joined.filter(keep)
                    if joined.num_rows:
                        names = self.timestamp_columns
                        out = self._finish(joined, {names[0]: joined.column(_TS), names[1]: joined.column("__pe_ts_r")})
        self._ranges(side).append((int(stamps.min()), int(stamps.max())))
        self._buckets.setdefault((0, side), []).append(batch)
        return out

    def _ranges(self, side: int) -> List[Tuple[int, int]]:
        """The (min, max) event time of each buffered batch of ``side``, in order."""
        batches = self._buckets.get((0, side), [])
        ranges = self._time_ranges.setdefault(side, [])
        if len(ranges) != len(batches):  # restored, or trimmed: measured again
            ranges[:] = [_min_max(b.column(_TS)) for b in batches]
        return ranges

    def process_watermark(self, watermark: int) -> Any:
        if watermark <= self.current_watermark:
            return []
        self.current_watermark = watermark
        for side, reach in ((0, max(self.upper, 0)), (1, max(-self.lower, 0))):
            batches = self._buckets.get((0, side))
            if not batches:
                continue
            # a row stays while its cleanup time (ts + reach) is after the watermark: a batch
            # all of whose rows stay is kept as it is, one all of whose rows go is dropped, and
            # only one with both is filtered (cleanup in proportion to what expired)
            last = watermark - reach
            ranges = self._ranges(side)
            if all(lo > last for lo, _ in ranges):
                continue
            kept, kept_ranges = [], []
            for b, (lo, hi) in zip(batches, ranges, strict=True):
                if hi <= last:
                    continue
                if lo <= last:
                    b = b.filter(pc.greater(b.column(_TS), last))
                    lo = _min_max(b.column(_TS))[0]
                kept.append(b)
                kept_ranges.append((lo, hi))
            if len(kept) > 64:  # many small batches: fewer, so a probe gathers fewer pieces
                kept = [pa.concat_batches(kept)]
                kept_ranges = [(min(lo for lo, _ in kept_ranges), max(hi for _, hi in kept_ranges))]
            self._buckets[(0, side)] = kept
            self._time_ranges[side] = kept_ranges
        return []
