"""``AlignedWindowAggregateOperator``: tumbling and sliding windows with
``.aggregate`` over a stream keyed by a column, vectorised like
``KeyedStream.aggregate``. Every key shares the windows' bounds, so a window fires for
all its keys at once from columnar state, with no timer per key (see the class);
``pyengine.windows.WindowedStream.aggregate`` chooses it, and ``runtime.windows``'s
``WindowOperator`` for everything else.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import pyarrow as pa

from .._native import ColumnarGroup, merge_groups
from ..agg import Aggregation
from ..errors import NonRetryableError
from ..io.events import MAX_WATERMARK
from ..state import ListStateDescriptor, ValueStateDescriptor
from ..state.keygroups import key_groups_of_int64
from ..time.domain import now_ms
from ..time.strategy import TimestampAssigner, TimestampError, _short
from .aggregate import (
    accumulator_type,
    check_key_type,
    needed_accumulators,
    not_a_table,
    null_keys,
    unified_schema,
    value_state,
)
from .base import EventTimeOperatorMixin, batch_of
from .keyed import KeyedOperator
from .windows import _LATE, WindowAssigner, _acc_name, _PyAccumulators

__all__ = ["AlignedWindowAggregateOperator"]

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
            from ..errors import ColumnNotFoundError

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
        from ..state.keygroups import assign_to_key_group

        return assign_to_key_group(key, self.backend.max_parallelism) - self.backend.key_group_range.start

    def _merge_columnar(self, keys: np.ndarray, window: int, partial: Dict[str, Any]) -> Dict[str, np.ndarray]:
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
                    merged = merge_groups(groups, sorted_keys, sorted_values, bounds, in_slots, how)
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
        for index in self._windows.pop(window, ()):
            slot = self._slots[index].pop(window)
            for state in self._tables[slot].values():
                table = state._table
                if table.tracking:  # incremental: the removals go into the next delta
                    table.groups[index].clear()
                else:  # a new, empty group: a snapshot still writing the old one keeps it
                    table.groups[index] = ColumnarGroup(table.dtype)
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
