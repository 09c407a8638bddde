"""Columnar window contents for ``AlignedWindowAggregateOperator``: panes.

A *pane* is a slice of event time ``gcd(size, slide)`` long (a tumbling window is
one pane). Every record goes into exactly one pane, whatever the number of sliding
windows it is in, so a sliding window costs what a tumbling one does per record;
when a window fires, its result is combined from its ``size / pane`` panes in one
Arrow ``group_by`` (Flink's sliding-window pane optimisation, the "window slicing"
of Cutty and Scotty).

A pane holds partial aggregates as Arrow tables (``k``: the key, ``a0, a1, ...``:
the accumulators, in the operator's ``needed`` order). A batch adds one table per
pane it touches (one ``group_by`` for the whole batch); a pane's tables are
combined into one when the ones added since outweigh twice what it had (amortised:
each row is re-aggregated O(1) times, and a pane holds at most about three times
its keys), so a hot window does not grow without bound and
a cold one costs nothing. Nothing here makes a Python call per key or per (key,
window): firing many windows is one concatenation and one ``group_by``, dropping a
pane is deleting a dict entry, and a snapshot re-encodes only the panes that
changed since the one before (the others' bytes are kept).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

__all__ = ["COMBINE", "Pane", "combine", "decode", "partial_spec"]

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


def combine(tables: List[pa.Table], kinds: Sequence[str], by: Sequence[str] = ("k",)) -> pa.Table:
    """Partial aggregates (columns ``by``, ``a0``, ``a1``, ...) combined into one row
    per distinct ``by``, in the order of first appearance: one concatenation and one
    Arrow ``group_by``. Accumulators whose every input was null stay null."""
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    names = [f"a{i}" for i in range(len(kinds))]
    spec = [(name, COMBINE[kind]) for name, kind in zip(names, kinds, strict=True)]
    grouped = table.group_by(list(by), use_threads=False).aggregate(spec)
    columns = [grouped.column(b) for b in by]
    columns += [grouped.column(f"{name}_{COMBINE[kind]}") for name, kind in zip(names, kinds, strict=True)]
    return pa.table(columns, names=list(by) + names)


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
