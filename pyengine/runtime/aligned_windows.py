"""``AlignedWindowAggregateOperator``: tumbling and sliding windows with
``.aggregate`` over a stream keyed by a column, vectorised like
``KeyedStream.aggregate``. Every key shares the windows' bounds, so the operator
keeps its window contents as columnar *panes* (``runtime.window_panes``), fires a
window for all its keys at once, and needs no timer per key (see the class);
``pyengine.windows.WindowedStream.aggregate`` chooses it, and ``runtime.windows``'s
``WindowOperator`` for everything else.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .._native import ColumnarGroup
from ..agg import Aggregation
from ..errors import NonRetryableError
from ..io.events import MAX_WATERMARK, MIN_WATERMARK
from ..state import ListStateDescriptor, ValueStateDescriptor
from ..state.keygroups import assign_to_key_group, key_groups_of_int64
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
from .window_panes import Pane, cast_to, combine, decode, group_packed, partial_names, partial_spec, split_by
from .windows import _LATE, WindowAssigner, _acc_name

__all__ = ["AlignedWindowAggregateOperator"]

_PANES = ListStateDescriptor("window-panes")  # [0, pane start, IPC bytes] / [1, window start, IPC bytes]
_SCHEMA = ListStateDescriptor("window-schema")  # [the input schema the accumulators were made for (IPC bytes)]
# The layout before panes (release 0.x): per accumulator, value states
# ``window/<acc>@<slot>`` keyed by the record key, which window holds which slot of
# which key group in ``window-slots`` ([key group, slot, window start]), and windows
# beyond the slots in ``window/overflow`` (key -> {window start: [accumulators]}).
# Restored into whole-window *bases*, then left empty.
_SLOTS = ListStateDescriptor("window-slots")
_OVERFLOW = ValueStateDescriptor("window/overflow")
_PANE, _BASE = 0, 1


class AlignedWindowAggregateOperator(EventTimeOperatorMixin, KeyedOperator):
    """Tumbling / sliding windows with ``pe.agg`` aggregations, vectorised.

    Event time is cut into *panes* ``gcd(size, slide)`` long (a tumbling window is
    one pane). Per input batch: each row's pane at once, rows too late for every
    window of their pane dropped (or sent to the late-data side output), one Arrow
    ``group_by`` over (pane, key), and each touched pane gets that batch's partial
    aggregates as one more table (``window_panes.Pane``). A record goes into one
    pane however many sliding windows it is in.

    When the watermark passes ``end - 1`` of windows, all of them fire together: their
    panes' tables, tagged with the window, are concatenated and combined in one
    ``group_by`` over (window, key) (none when each window is one pane already
    combined, as a tumbling window is), and leave as one Arrow batch. A pane is
    dropped (a dict entry) once the last window it is in has passed its cleanup time
    (``end - 1 + allowed lateness``). No Python runs per key or per (key, window).

    State: the panes, each as one Arrow IPC blob with its start (``window-panes``,
    union operator state: every subtask reads all and keeps the rows whose key is in
    its key groups, so rescaling by key groups works as for keyed state). Only panes
    that changed since the previous snapshot are encoded again. A checkpoint of the
    layout before panes (keyed slot states) restores into whole-window *bases*, which
    a window combines with the panes that come after."""

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
        self._kinds = [k for k, _ in self.needed]
        self._index = {name: i for i, name in enumerate(self.names)}
        self._inputs = {c: f"c{i}" for i, c in enumerate(dict.fromkeys(c for _, c in self.needed if c is not None))}
        self._spec = partial_spec(self.needed, self._inputs)
        self._spec_names = partial_names(self.needed, self._inputs)
        self._size = assigner.size
        self._slide = assigner.slide if assigner.kind == "sliding" else assigner.size
        self._pane = math.gcd(self._size, self._slide)  # every window is whole panes, and so is every gap
        self._offset = assigner.offset
        self._types: Dict[str, pa.DataType] = {}  # accumulator -> int64 / float64, from the input schema
        self._schema: Optional[pa.Schema] = None
        self._key_type: Optional[pa.DataType] = None
        self._stored: Optional[pa.Schema] = None  # the panes' tables: k, a0, a1, ...
        self._panes: Dict[int, Pane] = {}  # pane start -> its partial aggregates
        self._bases: Dict[int, Pane] = {}  # window start -> totals restored from the layout before panes
        self._pending: Set[int] = set()  # windows with contents that have not fired
        self._fired: Set[int] = set()  # windows that fired and wait for their cleanup
        self._schema_state: Any = None
        self._pane_state: Any = None
        self._slot_state: Any = None
        self._late: Any = None
        self._late_rows = np.empty(0, np.int64)  # of the batch being processed

    # -- state -----------------------------------------------------------------------------

    def setup(self, ctx: Any, restored: Any) -> None:
        super().setup(ctx, restored)
        self._restore_watermark(restored)
        assert self.operator_state is not None
        self._schema_state = self.operator_state.get_union_list_state(_SCHEMA)
        self._pane_state = self.operator_state.get_union_list_state(_PANES)
        self._slot_state = self.operator_state.get_union_list_state(_SLOTS)
        self._late = self.operator_state.get_list_state(_LATE)  # split on rescaling: the sum stays
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
        for kind, start, data in self._pane_state.get():
            table = self._mine(decode(data))
            if table.num_rows:
                into = self._panes if kind == _PANE else self._bases
                into.setdefault(int(start), Pane()).tables.append(table)
        self._restore_slots()
        for pane in list(self._panes.values()) + list(self._bases.values()):
            pane.added_rows = sum(t.num_rows for t in pane.tables)  # combined when first used
        windows = {w for p in self._panes for w in self._windows_of(p)} | set(self._bases)
        for w in windows:
            if self._cleanup(w) > self.current_watermark:  # else: purged before the snapshot
                due = self.assigner.is_event_time and w + self._size - 1 <= self.current_watermark
                (self._fired if due else self._pending).add(w)

    def _mine(self, table: pa.Table) -> pa.Table:
        """The rows of a restored pane whose key is in this subtask's key groups."""
        assert self._stored is not None
        table = cast_to(table, self._stored)
        r = self.backend.key_group_range
        keys = table.column("k")
        if pa.types.is_integer(keys.type):
            groups = key_groups_of_int64(keys.to_numpy(), self.backend.max_parallelism)
        else:
            groups = np.array([assign_to_key_group(k, self.backend.max_parallelism) for k in keys.to_pylist()])
        keep = (groups >= r.start) & (groups <= r.end)
        return table if keep.all() else table.filter(pa.array(keep))

    def _restore_slots(self) -> None:
        """Windows of a checkpoint in the layout before panes, read into bases; their
        keyed states are then emptied (they are not written again)."""
        if self._stored is None:  # no record seen before the checkpoint: no window either
            return
        r = self.backend.key_group_range
        entries = [(int(g) - r.start, int(s), int(w)) for g, s, w in self._slot_state.get() if r.start <= g <= r.end]
        columns: Dict[int, List[List[Any]]] = {}  # window -> [keys, a0, a1, ...] parts
        for index, slot, window in entries:
            states = [
                value_state(self.backend, ValueStateDescriptor(f"window/{n}@{slot}", 0, self._types[n]))
                for n in self.names
            ]
            groups = [s._table.groups[index] for s in states]
            keys, first = groups[0].arrays()
            parts = columns.setdefault(window, [[] for _ in range(len(self.names) + 1)])
            parts[0].append(keys.copy())
            parts[1].append(first.copy())
            for i, group in enumerate(groups[1:], start=2):
                parts[i].append(group.get_many(keys)[1])
            for s in states:
                s._table.groups[index] = ColumnarGroup(s._table.dtype)
        overflow = self.backend._tables.get(_OVERFLOW.name)
        spilled: Dict[int, List[List[Any]]] = {}
        if overflow is not None:
            state = self.backend.get_state(_OVERFLOW)
            for group in overflow.groups:
                for key, windows in list(group.items()):
                    for window, acc in windows.items():
                        rows = spilled.setdefault(int(window), [[] for _ in range(len(self.names) + 1)])
                        rows[0].append(key)
                        for i, v in enumerate(acc, start=1):
                            rows[i].append(v)
                    self.backend.set_current_key(key)
                    state.clear()
        for window in set(columns) | set(spilled):
            arrays: List[List[Any]] = [[np.concatenate(p) for p in columns[window]]] if window in columns else []
            if window in spilled:
                arrays.append(spilled[window])
            for values in arrays:
                table = pa.table(
                    [pa.array(v, f.type) for v, f in zip(values, self._stored, strict=True)], schema=self._stored
                )
                self._bases.setdefault(window, Pane()).tables.append(_nulls_where_nothing(table, self.needed))

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        self._save_watermark()
        schema = self._schema.serialize().to_pybytes() if self._schema is not None else b""
        self._schema_state.update([[schema]])
        self._late.update([self.late_records_dropped])
        self._slot_state.update([])
        kinds = self._kinds
        entries = [[_PANE, p, pane.encode(kinds)] for p, pane in self._panes.items()]
        entries += [[_BASE, w, base.encode(kinds)] for w, base in self._bases.items()]
        self._pane_state.update(entries)
        return super().snapshot(checkpoint_id, location)

    def _make_accumulators(self, schema: pa.Schema) -> None:
        """The accumulators' types for the columns' types in ``schema``; called again when
        a column widens (whole numbers, then fractions): the panes' int64 accumulators
        of it become float64."""
        for kind, column in self.needed:
            name = _acc_name(kind, column)
            t = schema.field(column).type if column is not None else pa.int64()
            self._types[name] = accumulator_type(self.where(), kind, column, t)
        columns = [self.key_column] + [c for _, c in self.needed if c is not None]
        self._schema = pa.schema([schema.field(c) for c in dict.fromkeys(columns)])
        self._key_type = schema.field(self.key_column).type
        stored_key = pa.int64() if pa.types.is_integer(self._key_type) else self._key_type
        stored = pa.schema([("k", stored_key)] + [(f"a{i}", self._types[n]) for i, n in enumerate(self.names)])
        if self._stored is not None and not stored.equals(self._stored):
            for pane in list(self._panes.values()) + list(self._bases.values()):
                pane.tables = [cast_to(t, stored) for t in pane.tables]
                pane.encoded = None
        self._stored = stored

    def _typed_columns(self) -> List[str]:
        return [c for k, c in self.needed if c is not None and k != "n"]

    # -- panes and windows (Python ints: the bounds near either end of int64 do not wrap) ----

    def _windows_of(self, pane: int) -> Iterable[int]:
        """The starts of the windows pane ``pane`` is in, latest first."""
        w = pane - (pane - self._offset) % self._slide
        while w > pane - self._size:
            yield w
            w -= self._slide

    def _last_window(self, pane: int) -> int:
        return pane - (pane - self._offset) % self._slide

    def _cleanup(self, window: int) -> int:
        lateness = self.lateness if self.assigner.is_event_time else 0
        return window + self._size - 1 + lateness

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
            check_key_type(self.where(), self.key_column, None, batch)
            self._make_accumulators(batch.schema)
        else:
            check_key_type(self.where(), self.key_column, self._key_type, batch)
            schema = self._schema
            assert schema is not None
            if not all(batch.schema.field(f.name).type.equals(f.type) for f in schema):  # else: the fast path
                widened = unified_schema(self.where(), schema, batch.schema, self._typed_columns())
                if not widened.equals(schema):
                    self._make_accumulators(widened)
        if batch.column(self.key_column).null_count:
            raise null_keys(self.where(), self.key_column)
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
        panes, keep = self._panes_of(ts, near)
        if keep is not None:
            late = self._late_rows
            if self.late_tag is None:
                self.late_records_dropped += len(late)
            elif self.side_output is not None and len(late):  # as Flink: not counted as dropped
                self.side_output(self.late_tag, batch.take(pa.array(late)))
            if not keep.any():
                return []
            batch = batch.filter(pa.array(keep))
            if not isinstance(panes, int):
                panes = panes[keep]
        return self._add(batch, panes)

    def _panes_of(self, ts: np.ndarray, near: bool) -> Any:
        """(each row's pane start, or the one pane of every row; the rows to keep, or
        None for all); the rows too late for every window of their pane go to
        ``_late_rows``. A row between two sliding windows (a slide longer than the
        size) is in none: not kept, and not late."""
        g, slide, size, offset = self._pane, self._slide, self._size, self._offset
        threshold = self.current_watermark - self.lateness  # late: the last window's end - 1 at or below it
        check_late = self.assigner.is_event_time and threshold >= MIN_WATERMARK
        self._late_rows = np.empty(0, np.int64)
        if not near:
            low = int(ts.min())
            first = low - (low - offset) % g
            if int(ts.max()) < first + g:  # the usual case: the whole batch in one pane
                if (first - offset) % slide >= size:  # between two windows: in none
                    return first, np.zeros(len(ts), bool)
                if check_late and self._last_window(first) + size - 1 <= threshold:
                    self._late_rows = np.arange(len(ts), dtype=np.int64)
                    return first, np.zeros(len(ts), bool)
                return first, None
        in_window: Optional[np.ndarray]
        if near:  # in Python ints: int64 would wrap here (every window of a row fits: out_of_range said so)
            values = ts.tolist()
            panes = np.array([t - (t - offset) % g for t in values], np.int64)
            in_window = np.array([(t - offset) % slide < size for t in values], bool)
            last_end: Optional[List[int]] = [t - (t - offset) % slide + size - 1 for t in values]
        else:
            into = (ts - offset) % slide
            panes = ts - into if g == slide else ts - (ts - offset) % g
            in_window = into < size if slide > size else None
            last_end = None
        late: Optional[np.ndarray] = None
        if check_late:
            if last_end is not None:
                late = np.array([e <= threshold for e in last_end], bool)
            elif int(ts.min()) - g - slide + size - 1 <= threshold:  # else none is late, the usual case
                late = ts - into + (size - 1) <= threshold
        if in_window is not None and late is not None:
            late &= in_window
        if late is None or not late.any():
            return panes, (in_window if in_window is not None and not in_window.all() else None)
        self._late_rows = np.flatnonzero(late)
        keep = ~late if in_window is None else in_window & ~late
        return panes, keep

    def _add(self, batch: pa.RecordBatch, panes: Any) -> Any:
        """Adds a batch's (pane, key) partial aggregates to the panes; returns the
        updated rows of windows that had fired already (late records within the
        allowed lateness)."""
        assert self._stored is not None
        keys = batch.column(self.key_column)
        if keys.type != self._stored.field("k").type:
            keys = keys.cast(self._stored.field("k").type)
        columns = [keys] + [batch.column(c) for c in self._inputs]
        names = ["k", *list(self._inputs.values())]
        first, last = (panes, panes) if isinstance(panes, int) else (int(panes.min()), int(panes.max()))
        if first == last:  # the usual case: one pane for the whole batch
            grouped = pa.table(columns, names=names).group_by("k", use_threads=False).aggregate(self._spec)
            parts = {first: self._stored_table(grouped)}
        elif (last - first) // self._pane < 8 and bool((panes[1:] >= panes[:-1]).all()):
            # in order, a few panes (a sliding window's short panes): a slice and a group_by each
            table = pa.table(columns, names=names)
            starts = list(range(first, last + 1, self._pane))
            bounds = np.searchsorted(panes, [*starts, last + 1]).tolist()
            parts = {
                p: self._stored_table(table.slice(a, b - a).group_by("k", use_threads=False).aggregate(self._spec))
                for p, a, b in zip(starts, bounds[:-1], bounds[1:], strict=True)
                if b > a
            }
        else:
            table = pa.table([*columns, pa.array(panes)], names=[*names, "p"])
            grouped = group_packed(table, ("p", "k"), self._pane, self._spec)
            order, starts, bounds = split_by(grouped.column("p").to_numpy())
            grouped = self._stored_table(grouped.take(pa.array(order)))
            parts = {p: grouped.slice(a, b - a) for p, a, b in zip(starts, bounds[:-1], bounds[1:], strict=False)}
        updated: Dict[int, List[pa.Table]] = {}
        wm, event_time = self.current_watermark, self.assigner.is_event_time
        for p, part in parts.items():
            pane = self._panes.get(p)
            if pane is None:
                pane = self._panes[p] = Pane()
            pane.add(part, self._kinds)
            for w in self._windows_of(p):
                if w in self._fired or (event_time and w + self._size - 1 <= wm):
                    if self._cleanup(w) > wm:  # else purged: this pane's other windows take the rows
                        updated.setdefault(w, []).append(part)
                else:
                    self._pending.add(w)
        if not updated:
            return []
        windows = sorted(updated)
        self._fired.update(windows)
        self._pending.difference_update(windows)
        out = self._fire(windows)
        assert out is not None
        touched = pa.concat_tables(
            [
                pa.table({"w": pa.array(np.full(t.num_rows, w, np.int64)), "k": t.column("k")})
                for w in windows
                for t in updated[w]
            ]
        )
        # the updated rows only: the (window, key) pairs this batch touched
        return _one_buffer([out.filter(_pairs_in(out, touched, self.key_column))])

    def _stored_table(self, grouped: pa.Table) -> pa.Table:
        assert self._stored is not None
        columns = [grouped.column("k")] + [grouped.column(n) for n in self._spec_names]
        return cast_to(pa.table(columns, names=self._stored.names), self._stored)

    # -- firing ------------------------------------------------------------------------------

    def _fire(self, windows: List[int]) -> Optional[pa.RecordBatch]:
        """Every key's results of ``windows`` (in order) as one batch, from their panes:
        the panes combined in bulk (``_combine_panes``), each pane's rows taken once per
        window it is in, tagged with the window by NumPy, and one ``group_by`` over
        (window, key), none when each window is one pane (tumbling)."""
        size, g = self._size, self._pane
        pair_w: List[int] = []  # (window, pane) pairs, in window order
        pair_p: List[int] = []
        for w in windows:
            for p in range(w, w + size, g):
                if p in self._panes:
                    pair_w.append(w)
                    pair_p.append(p)
        bases = [(w, self._bases[w]) for w in windows if w in self._bases]
        if not pair_p and not bases:
            return None
        panes = sorted(set(pair_p))
        tables = self._combine_panes(panes)
        lengths = np.array([t.num_rows for t in tables], np.int64)
        table = pa.concat_tables(tables) if tables else None
        if len(pair_p) == len(panes) and pair_p == panes:  # each pane in one window, in order: no copy
            starts = np.repeat(np.array(pair_w, np.int64), lengths)
        else:
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            index = {p: i for i, p in enumerate(panes)}
            which = np.array([index[p] for p in pair_p], np.int64)
            counts = lengths[which]
            # row i of pair j: offsets[pane of j] + i
            rows = np.repeat(offsets[which] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
            rows += np.arange(len(rows), dtype=np.int64)
            starts = np.repeat(np.array(pair_w, np.int64), counts)
            assert table is not None
            table = table.take(pa.array(rows))
        parts = [] if table is None else [table.append_column("w", pa.array(starts))]
        for w, base in bases:
            t = base.compact(self._kinds)
            parts.append(t.append_column("w", pa.array(np.full(t.num_rows, w, np.int64))))
        if len(panes) == len(windows) == len(pair_p) and not bases:  # one pane a window
            return self._output(pa.concat_tables(parts))
        result = combine(parts, self._kinds, by=("w", "k"), step=self._slide)
        if bases:  # windows only in bases came last
            result = result.take(pc.sort_indices(result.column("w")))
        return self._output(result)

    def _combine_panes(self, panes: List[int]) -> List[pa.Table]:
        """Each of ``panes`` as one table of one row per key; those with more (tables
        added since they were last combined) combined in one ``group_by`` over
        (pane, key), and kept so."""
        kinds = self._kinds
        stale = [p for p in panes if not self._panes[p].combined]
        if len(stale) == 1:
            self._panes[stale[0]].compact(kinds)
        elif stale:
            tables = [t for p in stale for t in self._panes[p].tables]
            lengths = [sum(t.num_rows for t in self._panes[p].tables) for p in stale]
            tag = np.repeat(np.array(stale, np.int64), lengths)
            table = pa.concat_tables(tables).append_column("p", pa.array(tag))
            combined = combine([table], kinds, by=("p", "k"), step=self._pane)
            order, starts, bounds = split_by(combined.column("p").to_numpy())
            combined = combined.drop_columns(["p"]).take(pa.array(order))
            for p, a, b in zip(starts, bounds[:-1], bounds[1:], strict=False):
                self._panes[p].set_combined(combined.slice(a, b - a))
        return [self._panes[p].tables[0] for p in panes]

    def _output(self, table: pa.Table) -> pa.RecordBatch:
        starts = table.column("w").combine_chunks()
        keys = table.column("k").combine_chunks()
        if self._key_type is not None and keys.type != self._key_type:
            keys = keys.cast(self._key_type)
        columns: Dict[str, Any] = {
            self.key_column: keys,
            "window_start": starts,
            "window_end": pc.add(starts, pa.scalar(self._size, pa.int64())),
        }

        def acc(kind: str, column: Optional[str]) -> Any:
            return table.column(f"a{self._index[_acc_name(kind, column)]}").combine_chunks()

        for a in self.aggregations:
            if a.kind == "count":
                columns[a.output] = acc("rows" if a.column is None else "n", a.column).fill_null(0)
            elif a.kind == "mean":
                total = acc("sum", a.column).cast(pa.float64())
                columns[a.output] = pc.divide(total, acc("n", a.column).cast(pa.float64()))
            else:
                columns[a.output] = acc(a.kind, a.column).cast(self._types[_acc_name(a.kind, a.column)])
        return pa.RecordBatch.from_pydict(columns)

    def _advance(self, time: int) -> Any:
        """Fires, as one batch, the windows whose ``end - 1`` is at or below ``time``
        (watermark or clock), in order of their end; then drops what is past its
        cleanup time: fired windows, and panes whose every window is."""
        size = self._size
        due = sorted(w for w in self._pending if w + size - 1 <= time)
        out = self._fire(due) if due else None
        self._pending.difference_update(due)
        self._fired.update(due)
        final = time == MAX_WATERMARK
        for w in [w for w in self._fired if final or self._cleanup(w) <= time]:
            self._fired.discard(w)
            self._bases.pop(w, None)
        for p in sorted(self._panes):
            if not final and self._cleanup(self._last_window(p)) > time:
                break  # the panes after it are in later windows still
            del self._panes[p]
        return [] if out is None else out

    def process_watermark(self, watermark: int) -> List[Any]:
        if watermark <= self.current_watermark:
            return []
        self.current_watermark = watermark
        if not self.assigner.is_event_time:
            return []
        return self._advance(watermark)  # type: ignore[no-any-return]

    def next_processing_time(self) -> Optional[int]:
        if self.assigner.is_event_time or not self._pending:
            return None
        return min(self._pending) + self._size - 1

    def on_processing_time(self, now: int) -> Any:
        return self._advance(now)

    def end_input(self) -> Any:
        """Processing-time windows still open fire at the end of bounded input."""
        return [] if self.assigner.is_event_time else self._advance(MAX_WATERMARK)


def _nulls_where_nothing(table: pa.Table, needed: Sequence[Any]) -> pa.Table:
    """A base from the layout before panes, which kept 0 where a key had no value of a
    column: its sum/min/max made null there (n(column) == 0), as a pane has them."""
    index = {(k, c): i for i, (k, c) in enumerate(needed)}
    columns = list(table.columns)
    for (kind, column), i in index.items():
        if kind in ("sum", "min", "max"):
            nothing = pc.equal(table.column(f"a{index[('n', column)]}"), 0)
            columns[i + 1] = pc.if_else(nothing, pa.scalar(None, columns[i + 1].type), columns[i + 1])
    return pa.table(columns, schema=table.schema)


def _pairs_in(out: pa.RecordBatch, touched: pa.Table, key_column: str) -> pa.Array:
    """Which rows of ``out`` are (window, key) pairs of ``touched``."""
    k = touched.schema.field("k").type
    pairs = pa.table(
        {
            "w": out.column("window_start"),
            "k": out.column(key_column).cast(k),
            "row": pa.array(np.arange(out.num_rows, dtype=np.int64)),
        }
    )
    joined = pairs.join(touched.group_by(["w", "k"], use_threads=False).aggregate([]), ["w", "k"], join_type="inner")
    mask = np.zeros(out.num_rows, bool)
    mask[joined.column("row").to_numpy()] = True
    return pa.array(mask)


def _one_buffer(batches: List[pa.RecordBatch]) -> Any:
    """What an operator returns is one buffer: the batches as one, or ``[]``."""
    if not batches:
        return []
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)
