"""Columnar window contents for ``AlignedWindowAggregateOperator``: panes.

A *pane* is a slice of event time ``gcd(size, slide)`` long (a tumbling window is
one pane). Every record goes into exactly one pane, whatever the number of sliding
windows it is in, so a sliding window costs about what a tumbling one does per
record; when windows fire, their results are combined from their ``size / pane``
panes in one step (``combine``) (Flink's sliding-window pane optimisation, the
"window slicing" of Cutty and Scotty).

A pane holds partial aggregates as Arrow tables (``k``: the key, ``a0, a1, ...``:
the accumulators, in the operator's ``needed`` order). A batch adds one table per
pane it touches (one ``group_by`` for the whole batch); a pane's tables are
combined into one when the ones added since outweigh twice what it had (amortised:
each row is re-aggregated O(1) times, and a pane holds at most about three times
its keys), so a hot window does not grow without bound and a cold one costs nothing.
Nothing here makes a Python call per key or per (key, window): firing many windows
is one concatenation and one ``combine``, dropping a pane is deleting a dict entry,
and a snapshot re-encodes only the panes that changed since the one before (the
others' bytes are kept).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

__all__ = ["COMBINE", "Pane", "combine", "decode", "group_packed", "partial_spec"]

# how the partial accumulators of one (key, window) combine: counts and sums add
COMBINE = {"rows": "sum", "n": "sum", "sum": "sum", "min": "min", "max": "max"}
_ARROW_FN = {"n": "count", "sum": "sum", "min": "min", "max": "max"}


def partial_spec(needed: Sequence[Tuple[str, Optional[str]]], columns: Dict[str, str]) -> List[Tuple[Any, str]]:
    """Arrow ``aggregate`` specs for each accumulator of ``needed``, over the input's
    columns renamed ``columns[name]``; ``rows`` counts every row."""
    spec: List[Tuple[Any, str]] = []
    for kind, column in needed:
        if kind == "rows":
            spec.append(([], "count_all"))
        else:
            assert column is not None
            spec.append((columns[column], _ARROW_FN[kind]))
    return spec


def partial_names(needed: Sequence[Tuple[str, Optional[str]]], columns: Dict[str, str]) -> List[str]:
    """The names Arrow gives the columns of ``partial_spec``'s aggregation."""
    return ["count_all" if kind == "rows" else f"{columns[c]}_{_ARROW_FN[kind]}" for kind, c in needed]  # type: ignore[index]


def combine(tables: List[pa.Table], kinds: Sequence[str], by: Sequence[str] = ("k",), step: int = 0) -> pa.Table:
    """Partial aggregates (columns ``by``, ``a0``, ``a1``, ...) combined into one row
    per distinct ``by``. Accumulators whose every input was null stay null.

    ``by`` an int64 key, or a window or pane start (multiples of ``step`` apart) and
    an int64 key packed into one int64 (``_packed``): sorted and reduced with NumPy,
    rows in the order of ``by``; Arrow's hash aggregation ran at ~0.7 us a row over
    hundreds of thousands of groups, and 5-20x slower still over two columns of many
    chunks. Other keys: one Arrow ``group_by``, rows in order of first appearance."""
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    names = [f"a{i}" for i in range(len(kinds))]
    if len(by) == 1 and pa.types.is_int64(table.schema.field(by[0]).type):
        key = table.column(by[0]).to_numpy()
        return _reduce_sorted(table, names, kinds, key, lambda k: [pa.array(k)], by)
    packed = _packed(table, by, step) if step and len(by) == 2 else None
    if packed is not None:
        return _reduce_sorted(table, names, kinds, packed[0], packed[1], by)
    spec = [(name, COMBINE[kind]) for name, kind in zip(names, kinds, strict=True)]
    grouped = table.combine_chunks().group_by(list(by), use_threads=False).aggregate(spec)
    columns = [grouped.column(b) for b in by]
    columns += [grouped.column(f"{name}_{COMBINE[kind]}") for name, kind in zip(names, kinds, strict=True)]
    return pa.table(columns, names=list(by) + names)


_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum}


def _reduce_sorted(
    table: pa.Table, names: List[str], kinds: Sequence[str], key: np.ndarray, unpack: Any, by: Sequence[str]
) -> pa.Table:
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]])) if len(ordered) else ordered
    columns: List[Any] = unpack(ordered[starts])
    for name, kind in zip(names, kinds, strict=True):
        how = COMBINE[kind]
        column = table.column(name)
        if not len(starts):
            columns.append(column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column)
            continue
        if column.null_count:
            valid = np.asarray(column.is_valid())[order]
            dtype = column.type.to_pandas_dtype()
            fill = 0 if how == "sum" else _extreme(np.dtype(dtype), how)
            values = column.fill_null(pa.scalar(fill, column.type)).to_numpy()[order]
            reduced = _REDUCE[how].reduceat(values, starts)
            columns.append(pa.array(reduced, column.type, mask=~np.logical_or.reduceat(valid, starts)))
        else:
            columns.append(pa.array(_REDUCE[how].reduceat(column.to_numpy()[order], starts), column.type))
    return pa.table(columns, names=list(by) + names)


def _extreme(dtype: np.dtype, how: str) -> Any:
    """The value that never wins a ``how`` (min or max) of ``dtype``: a null's stand-in."""
    if np.issubdtype(dtype, np.floating):
        return float("inf") if how == "min" else float("-inf")
    info = np.iinfo(dtype)
    return int(info.max) if how == "min" else int(info.min)


def group_packed(table: pa.Table, by: Sequence[str], step: int, spec: List[Tuple[Any, str]]) -> pa.Table:
    """``table.group_by(by).aggregate(spec)``, over one packed int64 when ``_packed``
    can (``by``: a start column and an integer key column), with ``by`` as columns."""
    packed = _packed(table, by, step)
    if packed is None:
        return table.combine_chunks().group_by(list(by), use_threads=False).aggregate(spec)
    key, unpack = packed
    grouped = table.drop_columns(list(by)).append_column("__by", pa.array(key))
    grouped = grouped.group_by("__by", use_threads=False).aggregate(spec)
    first, second = unpack(grouped.column("__by").to_numpy())
    return grouped.drop_columns(["__by"]).append_column(by[0], first).append_column(by[1], second)


def _packed(table: pa.Table, by: Sequence[str], step: int) -> Any:
    """(one int64 per row packing ``by`` = (start, integer key), a function unpacking
    it into the two columns), or None when they do not fit in 62 bits."""
    first, second = table.column(by[0]), table.column(by[1])
    if not (pa.types.is_int64(first.type) and pa.types.is_int64(second.type)) or not table.num_rows:
        return None
    starts, keys = first.to_numpy(), second.to_numpy()
    low, high = int(starts.min()), int(starts.max())
    k_low, k_high = int(keys.min()), int(keys.max())
    span = k_high - k_low + 1
    if high - low >= 2**62 or ((high - low) // step + 1) * span >= 2**62:
        return None
    key = (starts - low) // step * span + (keys - k_low)

    def unpack(packed: np.ndarray) -> List[pa.Array]:
        index, rest = np.divmod(packed, span)
        return [pa.array(index * step + low), pa.array(rest + k_low)]

    return key, unpack


class Pane:
    """One pane's partial aggregates: ``tables``, combined into one when they grow."""

    __slots__ = ("added_rows", "combined_rows", "encoded", "tables")

    def __init__(self, tables: Optional[List[pa.Table]] = None) -> None:
        self.tables: List[pa.Table] = tables or []
        self.combined_rows = 0  # rows of tables[0] when it is a combination
        self.added_rows = sum(t.num_rows for t in self.tables)
        self.encoded: Optional[bytes] = None  # its bytes in the last snapshot, while unchanged

    @property
    def combined(self) -> bool:
        """One table, one row per key."""
        return len(self.tables) == 1 and not self.added_rows

    def set_combined(self, table: pa.Table) -> None:
        self.tables = [table]
        self.combined_rows, self.added_rows = table.num_rows, 0

    def add(self, table: pa.Table, kinds: Sequence[str]) -> None:
        """``table``: one batch's partial aggregates of this pane, one row per key."""
        if not self.tables:
            self.set_combined(table)
            self.encoded = None
            return
        self.tables.append(table)
        self.added_rows += table.num_rows
        self.encoded = None
        if len(self.tables) > 1 and (self.added_rows > max(2 * self.combined_rows, 8192) or len(self.tables) > 64):
            self.compact(kinds)

    def compact(self, kinds: Sequence[str]) -> pa.Table:
        """This pane as one table, one row per key."""
        if not self.combined:
            self.set_combined(combine(self.tables, kinds))
        return self.tables[0]

    def encode(self, kinds: Sequence[str]) -> bytes:
        """The pane as Arrow IPC stream bytes (kept until the pane changes)."""
        if self.encoded is None:
            table = self.compact(kinds)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            self.encoded = sink.getvalue().to_pybytes()
        return self.encoded


def decode(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def cast_to(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with ``schema``'s column types (accumulators widened from int64 to
    float64 after they were made); the same table when nothing differs."""
    return table if table.schema.equals(schema) else table.cast(schema)


def split_by(values: np.ndarray) -> Tuple[np.ndarray, List[int], np.ndarray]:
    """(stable order sorting ``values``, the distinct values, the bounds of each run in that order)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    edges = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    starts = np.concatenate([[0], edges, [len(ordered)]])
    return order, ordered[starts[:-1]].tolist(), starts
