"""``SessionWindowAggregateOperator``: event-time session windows with ``.aggregate``
over a stream keyed by a column, vectorised on Arrow batches.

``pyengine.windows.WindowedStream.aggregate`` chooses it for ``session(gap)`` in event
time; ``.process(fn)``, keys by function and processing time keep the per-record
``runtime.windows.WindowOperator``, whose output this operator's equals row for row
(the key, ``window_start``, ``window_end``, one column per aggregation).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from .._native import get_groups, merge_groups
from ..agg import Aggregation
from ..errors import ColumnNotFoundError, NonRetryableError
from ..io.events import MAX_WATERMARK, MIN_WATERMARK
from ..state import ListStateDescriptor, ValueStateDescriptor
from ..state.keygroups import key_groups_of_int64
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
from .windows import _LATE, WindowAssigner, _acc_name

__all__ = ["SessionWindowAggregateOperator"]

_ADDED = ("rows", "n", "sum")
_SCHEMA = ListStateDescriptor("session-schema")  # [the input schema the accumulators were made for (IPC bytes)]
_MORE = ValueStateDescriptor("session/more")  # key -> [[start, end, *accumulators], ...] in order of start
# The per-record WindowOperator's state, with which releases up to e145a3c ran session
# aggregates: read once at a restore and moved into this operator's layout.
_OLD_CONTENTS = "window-contents"


def _int_keys(t: pa.DataType) -> bool:
    """Keys the columnar head takes: integers that fit int64."""
    return bool(pa.types.is_integer(t) and not pa.types.is_uint64(t))


class SessionWindowAggregateOperator(EventTimeOperatorMixin, KeyedOperator):
    """Event-time session windows with ``pe.agg`` aggregations, vectorised.

    Per input batch: rows are sorted by (key, timestamp) and cut into runs where a
    key changes or two timestamps are more than ``gap`` apart (a window touching the
    next merges, as Flink's); each run's accumulators come from one NumPy
    ``reduceat``; then the runs and the keys' open sessions are merged in one sweep
    and written back. No Python step per record; one per key only where a key's
    older sessions (below) take part.

    Where a key's sessions live (all in the keyed backend, so both backends snapshot
    them by entry and a rescale moves them with their key groups): its latest
    session, the *head*, in typed columnar value states (``session/start``,
    ``session/end``, ``session/<accumulator>``: int64 keys to NumPy columns); its
    older open sessions, which the watermark has not closed yet (out-of-order data, a
    watermark far behind), in ``session/more``, one list per key. Keys that are not
    integers keep every session there: correct, one Python step per key.

    Firing needs no timer: when the watermark moves from ``w0`` to ``w1``, every
    session with ``w0 < end - 1 <= w1`` fires (read from the columns, all keys at
    once) and every one whose ``end - 1 + allowed_lateness`` is at or below ``w1``
    goes.

    A record behind the watermark (its own window ``[ts, ts + gap)`` has fired) is
    decided by the session it joins, as ``WindowOperator`` decides it: joining an open
    session it is on time; joining one that fired but is within the allowed lateness,
    that session's updated row goes out at once; joining nothing (its window cleaned
    up too) it is late, dropped and counted or sent to the late side output. What it
    joins depends on the records before it, so the keys with such a record in a batch
    run record by record, in arrival order, for that batch."""

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
        if not (assigner.merging and assigner.is_event_time):
            raise ValueError(
                f"SessionWindowAggregateOperator runs event-time session windows, not {assigner.describe()}"
            )
        super().__init__(uid, name)
        self.late_tag = late_tag
        self.key_column = key_column
        self.assigner = assigner
        self.gap = assigner.gap
        self.lateness = lateness
        self.timestamps = timestamps
        self.aggregations = list(aggregations)
        self.needed = needed_accumulators(aggregations)
        self.names = [_acc_name(k, c) for k, c in self.needed]
        # for each accumulator, the index of the count that says whether it has a value
        self._n_of = [
            i if kind in ("rows", "n") else self.needed.index(("n", column))
            for i, (kind, column) in enumerate(self.needed)
        ]
        self._types: Dict[str, pa.DataType] = {}
        self._schema: Optional[pa.Schema] = None
        self._key_type: Optional[pa.DataType] = None
        self._head: Dict[str, Any] = {}  # "start", "end", accumulator name -> columnar value state
        self._more: Any = None
        # keys with a session/more entry -> the end of their oldest session there: what the
        # backend has, indexed, so a watermark visits only the keys it closes a session of
        self._more_keys: Dict[Any, int] = {}
        self._columnar_keys = False  # int keys: heads in the columns; else every session in session/more
        self._schema_state: Any = None
        self._late: Any = None

    # -- state -----------------------------------------------------------------------------

    def setup(self, ctx: Any, restored: Any) -> None:
        super().setup(ctx, restored)
        self._restore_watermark(restored)
        assert self.operator_state is not None
        self._schema_state = self.operator_state.get_union_list_state(_SCHEMA)
        self._late = self.operator_state.get_list_state(_LATE)
        self._more = self.backend.get_state(_MORE)
        if restored is None:
            return
        self.late_records_dropped = sum(int(v) for v in self._late.get())
        schemas = [pa.ipc.read_schema(pa.py_buffer(e[0])) for e in self._schema_state.get() if e[0]]
        if schemas:
            schema = schemas[0]
            for other in schemas[1:]:
                schema = unified_schema(self.where(), schema, other, self._typed_columns())
            self._make_accumulators(schema)
        table = self.backend._tables.get(_MORE.name)
        for group in table.groups if table is not None else []:
            self._more_keys.update((key, int(sessions[0][1])) for key, sessions in group.items() if sessions)
        self._migrate_window_contents()

    def _migrate_window_contents(self) -> None:
        """A checkpoint of the per-record ``WindowOperator`` (what ran session
        aggregates before this operator): each key's ``{(start, end): accumulators}``
        becomes its sessions here, in ``session/more`` (the next batch of the key
        moves its latest to the columns), and the old value is deleted. Its timers stay
        in the state, inert: this operator fires from the sessions and has none."""
        table = self.backend._tables.get(_OLD_CONTENTS)
        if table is None:
            return
        entries = [(k, v) for group in table.groups for k, v in group.items()]
        if not entries:
            return
        backend = self.backend
        old = backend.get_state(ValueStateDescriptor(_OLD_CONTENTS))
        fractions = [False] * len(self.names)
        for key, contents in entries:
            backend.set_current_key(key)
            sessions = sorted([int(b[0]), int(b[1]), *acc] for b, acc in (contents or {}).items())
            for session in sessions:
                for i, v in enumerate(session[2:]):
                    fractions[i] = fractions[i] or isinstance(v, float)
            if sessions:
                self._more.update(sessions)
                self._more_keys[key] = sessions[0][1]
            old.clear()  # a deletion, so an incremental checkpoint's next delta drops it too
        if not self._types:  # that layout kept no schema: the values' own types, until a batch says
            self._types = {n: pa.float64() if f else pa.int64() for n, f in zip(self.names, fractions, strict=True)}

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        self._save_watermark()
        schema = self._schema.serialize().to_pybytes() if self._schema is not None else b""
        self._schema_state.update([[schema]])
        self._late.update([self.late_records_dropped])
        return super().snapshot(checkpoint_id, location)

    def _typed_columns(self) -> List[str]:
        return [c for k, c in self.needed if c is not None and k != "n"]

    def _make_accumulators(self, schema: pa.Schema) -> None:
        """The head's columns for the input's types; called again when a column widens
        (whole numbers, then fractions): int64 states become float64 (``value_state``)."""
        for kind, column in self.needed:
            name = _acc_name(kind, column)
            t = schema.field(column).type if column is not None else pa.int64()
            arrow_type = accumulator_type(self.where(), kind, column, t)
            if self._types.get(name) == pa.float64():  # never narrowed (fractions moved from window-contents)
                arrow_type = pa.float64()
            self._types[name] = arrow_type
        specs = {"start": pa.int64(), "end": pa.int64(), **self._types}
        for name, arrow_type in specs.items():
            state = self._head.get(name)
            if state is None or not state._table.dtype == np.dtype(arrow_type.to_pandas_dtype()):
                self._head[name] = value_state(self.backend, ValueStateDescriptor(f"session/{name}", 0, arrow_type))
        columns = [self.key_column] + [c for _, c in self.needed if c is not None]
        self._schema = pa.schema([schema.field(c) for c in dict.fromkeys(columns)])
        self._key_type = schema.field(self.key_column).type
        self._columnar_keys = _int_keys(self._key_type)

    def _dtype(self, name: str) -> Any:
        return np.int64 if self._types[name] == pa.int64() else np.float64

    def _empty(self, i: int) -> Any:
        """The identity of an accumulator's fold, for a row or session with no value
        (the columns store 0 there: ``_stored``)."""
        kind, name = self.needed[i][0], self.names[i]
        if kind in _ADDED:
            return 0
        dtype = self._dtype(name)
        if dtype is np.float64:
            return np.inf if kind == "min" else -np.inf
        info = np.iinfo(np.int64)
        return info.max if kind == "min" else info.min

    # -- records -----------------------------------------------------------------------------

    def process(self, records: Any) -> Any:
        if not len(records):
            return []
        try:
            batch = batch_of(records)
        except (TypeError, pa.ArrowException) as exc:
            raise not_a_table(self.where(), records, self.key_column, exc) from exc
        self._check_schema(batch)
        assert self.timestamps is not None
        try:
            ts = self.timestamps.of_buffer(batch)
        except NonRetryableError as exc:
            raise type(exc)(f"{self.where()}: {exc}") from None
        ts = np.asarray(ts, np.int64)
        bad = self.assigner.out_of_range(ts)
        if bad is not None:
            raise TimestampError(
                f"{self.where()}: record {_short(batch.slice(bad, 1).to_pylist()[0])}, timestamp from "
                f"{self.timestamps.describe()}: {self.assigner.range_error(int(ts[bad]))}"
            )
        key_column = batch.column(self.key_column)
        if key_column.null_count:
            raise null_keys(self.where(), self.key_column)
        values = self._values(batch)
        out: List[pa.RecordBatch] = []
        late: List[int] = []
        if not self._columnar_keys:
            self._per_record(batch, key_column.to_pylist(), ts, values, np.arange(len(ts)), out, late)
        else:
            keys = np.asarray(key_column.to_numpy(zero_copy_only=False), np.int64)
            # A record whose own window [ts, ts + gap) has fired (its end - 1 is at or below the
            # watermark) emits at once if it joins a fired session, is late if it joins
            # nothing (dropped, or to the side output), and is saved by joining an open session:
            # its key's rows run record by record, in arrival order, as WindowOperator runs them.
            fired = self.current_watermark - (self.gap - 1)
            behind = ts <= fired if fired >= MIN_WATERMARK else None
            rows: Optional[np.ndarray] = None
            if behind is not None and behind.any():
                slow = np.isin(keys, np.unique(keys[behind]))
                self._per_record(batch, keys.tolist(), ts, values, np.flatnonzero(slow), out, late)
                rows = np.flatnonzero(~slow)
            if rows is None or len(rows):
                self._merge_batch(keys, ts, values, rows)
        if late:
            if self.late_tag is None:
                self.late_records_dropped += len(late)
            elif self.side_output is not None:  # as Flink: to the side output, not counted as dropped
                self.side_output(self.late_tag, batch.take(pa.array(sorted(late), pa.int64())))
        return _one_buffer(out)

    def _check_schema(self, batch: pa.RecordBatch) -> None:
        names = batch.schema.names
        wanted = [self.key_column] + [c for _, c in self.needed if c is not None]
        missing = [c for c in wanted if c not in names]
        if missing:
            raise ColumnNotFoundError(
                f"{self.where()}: the records have no column {missing[0]!r} (columns: {', '.join(names)})"
            )
        if self._schema is None:
            self._make_accumulators(batch.schema)
            return
        check_key_type(self.where(), self.key_column, self._key_type, batch)
        schema = self._schema
        assert schema is not None
        if not all(batch.schema.field(f.name).type.equals(f.type) for f in schema):
            widened = unified_schema(self.where(), schema, batch.schema, self._typed_columns())
            if not widened.equals(schema):
                self._make_accumulators(widened)

    def _values(self, batch: pa.RecordBatch) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        """Each aggregated column as (values in the accumulator's dtype, valid mask)."""
        out: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
        for _, column in self.needed:
            if column is None or column in out:
                continue
            array = batch.column(column)
            dtype = np.float64 if pa.types.is_floating(array.type) or pa.types.is_decimal(array.type) else np.int64
            for k, c in self.needed:
                if c == column and k != "n" and self._dtype(_acc_name(k, c)) is np.float64:
                    dtype = np.float64
            if array.null_count:
                valid = np.asarray(array.is_valid())
                filled = array.fill_null(0) if not pa.types.is_null(array.type) else pa.array(np.zeros(len(array)))
                v = np.asarray(filled.to_numpy(zero_copy_only=False), dtype)
            else:
                valid = np.ones(len(array), bool)
                v = np.asarray(array.to_numpy(zero_copy_only=False), dtype)
            out[column] = (v, valid)
        return out

    def _contributions(self, values: Dict[str, Tuple[np.ndarray, np.ndarray]], rows: Any, n: int) -> List[np.ndarray]:
        """Per accumulator, each row's part (the fold's identity where the column is null)."""
        parts = []
        for i, (kind, column) in enumerate(self.needed):
            if column is None:  # count(*): every row
                parts.append(np.ones(n, np.int64))
                continue
            v, valid = values[column]
            v, valid = (v, valid) if rows is None else (v[rows], valid[rows])
            if kind == "n":
                parts.append(valid.astype(np.int64))
            else:
                fill = self._empty(i)
                dtype = self._dtype(self.names[i])
                parts.append(np.where(valid, v, fill).astype(dtype, copy=False))
        return parts

    # -- the vectorised merge ---------------------------------------------------------------------

    def _merge_batch(self, keys: np.ndarray, ts: np.ndarray, values: Any, rows: Optional[np.ndarray]) -> None:
        k = keys if rows is None else keys[rows]
        t = ts if rows is None else ts[rows]
        n = len(k)
        order = np.lexsort((t, k))
        ks, tsorted = k[order], t[order]
        cut = np.empty(n, bool)
        cut[0] = True
        np.logical_or(ks[1:] != ks[:-1], tsorted[1:] - tsorted[:-1] > self.gap, out=cut[1:])
        starts = np.flatnonzero(cut)
        lasts = np.empty_like(starts)
        lasts[:-1] = starts[1:] - 1
        lasts[-1] = n - 1
        parts = self._contributions(values, rows, n)
        run_accs = [self._reduce(i, p[order], starts) for i, p in enumerate(parts)]
        run_key, run_start, run_end = ks[starts], tsorted[starts], tsorted[lasts] + self.gap

        first_run = np.empty(len(run_key), bool)
        first_run[0] = True
        np.not_equal(run_key[1:], run_key[:-1], out=first_run[1:])
        uk = run_key[first_run]
        split = self._split(uk)
        head = self._head
        found, h_end = self._get(head["end"], split)
        e_keys: List[np.ndarray] = []
        e_starts: List[np.ndarray] = []
        e_ends: List[np.ndarray] = []
        e_accs: List[List[np.ndarray]] = []
        early: List[int] = []  # keys with a run before their head: their older sessions take part
        if found.any():
            h_start = self._get(head["start"], split)[1]
            e_keys.append(uk[found])
            e_starts.append(h_start[found])
            e_ends.append(h_end[found])
            e_accs.append(self._normalized([self._get(head[name], split)[1][found] for name in self.names]))
        if self._more_keys:
            # A key's older sessions end before its head starts: only a run that starts
            # before the head can meet them (or any run of a key with no head: sessions
            # moved from the per-record layout at a restore are all older ones).
            run_of = np.cumsum(first_run) - 1  # each run's key, as an index of uk
            before = ~found[run_of]
            if found.any():
                before |= run_start < h_start[run_of]
            if before.any():
                early = [key for key in np.unique(run_key[before]).tolist() if key in self._more_keys]
        if early:
            m_keys, m_sessions = self._more_of(early)
            if m_sessions:
                m_starts, m_ends, m_accs = self._columns(m_sessions)
                e_keys.append(np.asarray(m_keys, np.int64))
                e_starts.append(m_starts)
                e_ends.append(m_ends)
                e_accs.append(self._normalized(m_accs))
        if e_keys:
            all_key = np.concatenate([run_key, *e_keys])
            all_start = np.concatenate([run_start, *e_starts])
            all_end = np.concatenate([run_end, *e_ends])
            all_accs = [
                np.concatenate([run_accs[i], *[e[i] for e in e_accs]]).astype(self._dtype(name), copy=False)
                for i, name in enumerate(self.names)
            ]
            o = np.lexsort((all_start, all_key))
            all_key, all_start, all_end = all_key[o], all_start[o], all_end[o]
            all_accs = [a[o] for a in all_accs]
            group = self._sweep(all_key, all_start, all_end)
            g_key, g_start = all_key[group], all_start[group]
            g_end = np.maximum.reduceat(all_end, group)
            g_accs = [self._reduce(i, a, group) for i, a in enumerate(all_accs)]
        else:
            g_key, g_start, g_end, g_accs = run_key, run_start, run_end, run_accs
        last = np.empty(len(g_key), bool)
        last[-1] = True
        np.not_equal(g_key[1:], g_key[:-1], out=last[:-1])
        # g_key[last] is uk, in the same order: one split serves every state of the head
        self._put(head["start"], g_start[last], split)
        self._put(head["end"], g_end[last], split)
        for name, acc in zip(self.names, self._stored([a[last] for a in g_accs]), strict=True):
            self._put(head[name], acc, split)
        older = np.flatnonzero(~last)
        if len(older) or early:
            self._write_more(g_key, g_start, g_end, g_accs, older, early)

    def _split(self, keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray, List[int]]:
        """Distinct int64 keys sorted by key group: (order, keys in that order, bounds, active groups)."""
        r = self.backend.key_group_range
        groups_of = key_groups_of_int64(keys, self.backend.max_parallelism) - r.start
        if len(groups_of) and (groups_of.min() < 0 or groups_of.max() >= len(r)):
            raise ValueError(f"{self.where()}: some keys are outside this subtask's key groups")
        order = np.argsort(groups_of, kind="stable")
        bounds = np.searchsorted(groups_of[order], np.arange(len(r) + 1))
        return order, keys[order], bounds, np.nonzero(np.diff(bounds))[0].tolist()

    @staticmethod
    def _get(state: Any, split: Tuple[np.ndarray, np.ndarray, np.ndarray, List[int]]) -> Tuple[Any, Any]:
        """(found, values) of a columnar state for the split's keys, in their order: one C call."""
        order, sorted_keys, bounds, active = split
        found, values = get_groups(state._table.groups, sorted_keys, bounds, active)
        f, v = np.empty_like(found), np.empty_like(values)
        f[order], v[order] = found, values
        return f, v

    @staticmethod
    def _put(state: Any, values: np.ndarray, split: Tuple[np.ndarray, np.ndarray, np.ndarray, List[int]]) -> None:
        order, sorted_keys, bounds, active = split
        groups = state._table.groups
        dtype = groups[0].dtype if groups else values.dtype
        merge_groups(groups, sorted_keys, np.ascontiguousarray(values[order], dtype), bounds, active, "set")

    def _reduce(self, i: int, values: np.ndarray, at: np.ndarray) -> np.ndarray:
        kind = self.needed[i][0]
        if kind in _ADDED:
            return np.add.reduceat(values, at)
        return (np.minimum if kind == "min" else np.maximum).reduceat(values, at)

    @staticmethod
    def _sweep(key: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Where each merged session begins in intervals sorted by (key, start): a key
        changes, or a start after every earlier end of its key (touching merges). The
        running end per key is one ``maximum.accumulate`` over (key rank, end rank)."""
        n = len(key)
        new_key = np.empty(n, bool)
        new_key[0] = True
        np.not_equal(key[1:], key[:-1], out=new_key[1:])
        code = np.cumsum(new_key) - 1
        ends, rank = np.unique(end, return_inverse=True)
        width = len(ends)
        running = np.maximum.accumulate(code * width + rank)
        before = ends[running[:-1] - code[:-1] * width]
        new = new_key
        new[1:] |= start[1:] > before
        return np.flatnonzero(new)

    def _stored(self, accs: List[np.ndarray]) -> List[np.ndarray]:
        """Accumulators as the columns keep them: 0 for a min/max with no value (the
        fold's identity, an int64 extreme, would not survive a widening to float64)."""
        out = []
        for i, a in enumerate(accs):
            if self.needed[i][0] in ("min", "max"):
                a = np.where(accs[self._n_of[i]] > 0, a, 0).astype(a.dtype, copy=False)
            out.append(a)
        return out

    def _normalized(self, accs: List[np.ndarray]) -> List[np.ndarray]:
        """Accumulators read back: min/max with no value get their fold's identity."""
        out = []
        for i, a in enumerate(accs):
            if self.needed[i][0] in ("min", "max"):
                a = np.where(accs[self._n_of[i]] > 0, a, self._empty(i)).astype(a.dtype, copy=False)
            out.append(a)
        return out

    def _columns(self, sessions: List[Any]) -> Tuple[np.ndarray, np.ndarray, List[np.ndarray]]:
        """(starts, ends, accumulators) of sessions as ``session/more`` keeps them,
        ``[start, end, *accumulators]``, transposed in C (``zip``). A min/max with
        no value (its count 0) may be None or 0 there; what it becomes here is
        masked or replaced by the count (``_output``, ``_normalized``)."""
        columns = list(zip(*sessions, strict=True))
        accs = []
        for i, name in enumerate(self.names):
            values = columns[2 + i]
            try:
                accs.append(np.array(values, self._dtype(name)))
            except TypeError:  # None in an int64 min/max
                accs.append(np.array([0 if v is None else v for v in values], self._dtype(name)))
        return np.array(columns[0], np.int64), np.array(columns[1], np.int64), accs

    def _more_of(self, keys: List[int]) -> Tuple[List[int], List[List[Any]]]:
        """The older sessions of ``keys``: (key per session, sessions)."""
        backend, state = self.backend, self._more
        out_keys: List[int] = []
        sessions: List[List[Any]] = []
        for key in keys:
            backend.set_current_key(key)
            mine = state.value() or []
            out_keys.extend([key] * len(mine))
            sessions.extend(mine)
        return out_keys, sessions

    def _write_more(
        self,
        g_key: np.ndarray,
        g_start: np.ndarray,
        g_end: np.ndarray,
        g_accs: List[np.ndarray],
        older: Any,
        early: Any,
    ) -> None:
        """``session/more`` after a merge: the sessions before each key's head. A key
        in ``early`` had them all in the merge (replaced); any other key's sessions
        before the head were not touched, and what the batch left before the new head
        comes after them (appended)."""
        by_key: Dict[int, List[List[Any]]] = defaultdict(list)
        cols = [a.tolist() for a in self._stored([a[older] for a in g_accs])]
        for key, *session in zip(
            g_key[older].tolist(), g_start[older].tolist(), g_end[older].tolist(), *cols, strict=True
        ):
            by_key[key].append(session)
        backend, state, known = self.backend, self._more, self._more_keys
        replaced = set(early)
        for key in replaced - set(by_key):
            backend.set_current_key(key)
            state.clear()
            known.pop(key, None)
        for key, sessions in by_key.items():
            backend.set_current_key(key)
            if key in known and key not in replaced:
                sessions = (state.value() or []) + sessions
            state.update(sessions)
            known[key] = sessions[0][1]

    # -- record by record: keys with a late record inside the allowed lateness, other keys ---------

    def _load(self, key: Any) -> List[List[Any]]:
        """A key's sessions as [start, end, *accumulators] in order of start (None: an empty min/max)."""
        backend = self.backend
        backend.set_current_key(key)
        sessions = [list(s) for s in (self._more.value() or [])]
        minmax = [i for i, (kind, _) in enumerate(self.needed) if kind in ("min", "max")]
        for session in sessions:  # an empty min/max is 0 there when the columns wrote it
            for i in minmax:
                if not session[2 + self._n_of[i]]:
                    session[2 + i] = None
        if self._columnar_keys and self._head:
            index = backend._key_index
            head = {name: state._table.groups[index] for name, state in self._head.items()}
            if head["end"].contains(key):
                accs = [head[name].get(key) for name in self.names]
                accs = [a.item() if hasattr(a, "item") else a for a in accs]
                for i, kind in enumerate(self.needed):
                    if kind[0] in ("min", "max") and not accs[self._n_of[i]]:
                        accs[i] = None
                sessions.append([int(head["start"].get(key)), int(head["end"].get(key)), *accs])
        return sessions

    def _store(self, key: Any, sessions: List[List[Any]]) -> None:
        backend = self.backend
        backend.set_current_key(key)
        if self._columnar_keys and self._head:
            head = {name: state._table.groups[backend._key_index] for name, state in self._head.items()}
            if sessions:
                latest, sessions = sessions[-1], sessions[:-1]
                head["start"].put(key, latest[0])
                head["end"].put(key, latest[1])
                for i, name in enumerate(self.names):
                    v = latest[2 + i]
                    head[name].put(key, 0 if v is None else v)
            else:
                for group in head.values():
                    group.remove(key)
        if sessions:
            self._more.update(sessions)
            self._more_keys[key] = sessions[0][1]
        elif key in self._more_keys:
            self._more.clear()
            del self._more_keys[key]

    def _per_record(
        self,
        batch: pa.RecordBatch,
        keys: List[Any],
        ts: np.ndarray,
        values: Any,
        rows: np.ndarray,
        out: List[Any],
        late: List[int],
    ) -> None:
        """``WindowOperator``'s steps, in arrival order, for the given rows; the rows
        too late for every window go to ``late``."""
        if not len(rows):
            return
        columns = {c: (v[rows].tolist(), valid[rows].tolist()) for c, (v, valid) in values.items()}
        by_key: Dict[Any, List[int]] = defaultdict(list)
        row_of = rows.tolist()
        for pos, row in enumerate(row_of):
            by_key[keys[row]].append(pos)
        stamps = ts[rows].tolist()
        wm, gap, lateness = self.current_watermark, self.gap, self.lateness
        emitted: List[Tuple[Any, List[Any]]] = []
        for key, positions in by_key.items():
            sessions = self._load(key)
            for pos in positions:
                start = stamps[pos]
                end = start + gap
                hits = [i for i, s in enumerate(sessions) if s[0] <= end and s[1] >= start]
                if hits:
                    merged = sessions[hits[0]]
                    for i in hits[1:]:
                        merged = [0, 0, *self._merge(merged[2:], sessions[i][2:])]
                    cover = [min(start, sessions[hits[0]][0]), max(end, sessions[hits[-1]][1]), *merged[2:]]
                    sessions[hits[0] : hits[-1] + 1] = [cover]
                elif min(end - 1 + lateness, MAX_WATERMARK) <= wm:  # in no window still open: late
                    late.append(row_of[pos])
                    continue
                else:
                    cover = [start, end, *self._create()]
                    at = 0
                    while at < len(sessions) and sessions[at][0] < start:
                        at += 1
                    sessions.insert(at, cover)
                self._add(cover, columns, pos)
                if cover[1] - 1 <= wm:  # late but allowed: the updated row now
                    emitted.append((key, list(cover)))
            self._store(key, sessions)
        if emitted:
            out.append(self._output_rows(emitted))

    def _create(self) -> List[Any]:
        return [None if kind in ("min", "max") else 0 for kind, _ in self.needed]

    def _merge(self, a: List[Any], b: List[Any]) -> List[Any]:
        out = []
        for i, (kind, _) in enumerate(self.needed):
            x, y = a[i], b[i]
            if kind in _ADDED:
                out.append(x + y)
            elif x is None or y is None:
                out.append(y if x is None else x)
            else:
                out.append(min(x, y) if kind == "min" else max(x, y))
        return out

    def _add(self, session: List[Any], columns: Dict[str, Tuple[List[Any], List[bool]]], pos: int) -> None:
        for i, (kind, column) in enumerate(self.needed):
            j = 2 + i
            if column is None:  # count(*): every row
                session[j] += 1
                continue
            v, valid = columns[column]
            if not valid[pos]:
                continue
            x = v[pos]
            if kind == "n":
                session[j] += 1
            elif kind == "sum":
                session[j] += x
            elif kind == "min":
                session[j] = x if session[j] is None or x < session[j] else session[j]
            else:
                session[j] = x if session[j] is None or x > session[j] else session[j]

    # -- firing ------------------------------------------------------------------------------

    def process_watermark(self, watermark: int) -> List[Any]:
        if watermark <= self.current_watermark:
            return []
        before, self.current_watermark = self.current_watermark, watermark
        if not self._head and not self._more_keys:
            return []
        return self._advance(before, watermark)  # type: ignore[no-any-return]

    def _advance(self, before: int, wm: int) -> Any:
        """Fires the sessions with ``before < end - 1 <= wm`` and drops those whose
        ``end - 1 + allowed_lateness`` is at or below ``wm`` (all at the end of input)."""
        everything = wm >= MAX_WATERMARK
        gone_below = wm - self.lateness  # end - 1 at or below this: cleaned up
        fired: List[Tuple[Any, List[Any]]] = []
        if self._more_keys:
            backend, state, known = self.backend, self._more, self._more_keys
            # sessions in order of start are in order of end: a key whose oldest has not
            # ended by wm has nothing due and nothing gone
            for key in [k for k, end in known.items() if end - 1 <= wm]:
                backend.set_current_key(key)
                sessions = state.value() or []
                for s in sessions:
                    if before < s[1] - 1 <= wm:
                        fired.append((key, s))
                kept = [s for s in sessions if not (everything or s[1] - 1 <= gone_below)]
                if len(kept) != len(sessions):
                    if kept:
                        state.update(kept)
                        known[key] = kept[0][1]
                    else:
                        state.clear()
                        del known[key]
        parts: List[Tuple[np.ndarray, ...]] = []
        if self._head:
            ends_table = self._head["end"]._table
            tables = [self._head["start"]._table] + [self._head[name]._table for name in self.names]
            for index, group in enumerate(ends_table.groups):
                if not len(group):
                    continue
                keys, ends = group.arrays()
                last = ends - 1
                due = (last > before) & (last <= wm)
                if due.any():
                    dk = keys[due].copy()
                    got = [t.groups[index].get_many(dk)[1] for t in tables]
                    parts.append((dk, got[0], ends[due].copy(), *got[1:]))
                gone = np.ones(len(keys), bool) if everything else last <= gone_below
                if gone.any():
                    for key in keys[gone].tolist():
                        group.remove(key)
                        for t in tables:
                            t.groups[index].remove(key)
        if not parts and not fired:
            return []
        batches = []
        if parts:
            columns = [np.concatenate(c) for c in zip(*parts, strict=True)]
            batches.append(self._output(pa.array(columns[0], self._key_type), columns[1], columns[2], columns[3:]))
        if fired:
            batches.append(self._output_rows(fired))
        out = pa.concat_batches(batches) if len(batches) > 1 else batches[0]
        order = np.lexsort((out.column(1).to_numpy(), out.column(2).to_numpy()))
        return out.take(pa.array(order))

    def _output_rows(self, sessions: List[Tuple[Any, List[Any]]]) -> pa.RecordBatch:
        keys = pa.array([k for k, _ in sessions], self._key_type)
        starts, ends, accs = self._columns([s for _, s in sessions])
        return self._output(keys, starts, ends, accs)

    def _output(self, keys: pa.Array, starts: np.ndarray, ends: np.ndarray, accs: List[np.ndarray]) -> pa.RecordBatch:
        """One row per session, as ``WindowOperator`` emits it: the key, the bounds, the aggregations."""
        totals = dict(zip(self.names, accs, strict=True))
        columns: Dict[str, Any] = {
            self.key_column: keys,
            "window_start": pa.array(starts, pa.int64()),
            "window_end": pa.array(ends, pa.int64()),
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
                name = _acc_name(a.kind, a.column)
                values = np.asarray(totals[name], self._dtype(name))
                columns[a.output] = pa.array(values, self._types[name], mask=count == 0)
        return pa.RecordBatch.from_pydict(columns)


def _one_buffer(batches: List[pa.RecordBatch]) -> Any:
    if not batches:
        return []
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)
