"""``KeyedStream.aggregate``: keyed count / sum / min / max / mean on whole Arrow batches.

Per input batch, Arrow's hash aggregation reduces the rows to one partial
result per key; the partials are merged into columnar keyed state (one int64 or
float64 value state per accumulator) with ``get_many``/``update_many``, so the
work per batch is a handful of vectorised calls whatever its length. The
operator then emits one row per key the batch touched, holding that key's
aggregates so far — the mini-batch form of an updating aggregate: the last row
of a key is its final value.

Integer keys take that path. Other keys (strings, say) are merged one distinct
key at a time through the same state: correct, and still no call per record."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from ..agg import Aggregation
from ..state import ValueStateDescriptor
from .operators import KeyedOperator, UserFunctionError, batch_of

__all__ = ["AggregateOperator"]

# Arrow's hash-aggregate function behind each accumulator.
_ARROW_FN = {"n": "count", "sum": "sum", "min": "min", "max": "max"}


class AggregateOperator(KeyedOperator):
    def __init__(self, uid: str, name: str, key_column: str, aggregations: Sequence[Aggregation]) -> None:
        super().__init__(uid, name)
        self.key_column = key_column
        self.aggregations = list(aggregations)
        # accumulator name -> (kind, column, value state); made at the first batch, when
        # the column types are known (sum of an int column is int64, of a float column float64)
        self._acc: Dict[str, Tuple[str, Optional[str], Any]] = {}
        self._types: Dict[str, pa.DataType] = {}

    # -- accumulators --------------------------------------------------------------------

    def _needed(self) -> List[Tuple[str, Optional[str]]]:
        """(kind, column) of every accumulator the aggregations need, each once."""
        out: List[Tuple[str, Optional[str]]] = []
        for a in self.aggregations:
            parts: List[Tuple[str, Optional[str]]]
            if a.kind == "count":
                parts = [("rows", None)] if a.column is None else [("n", a.column)]
            elif a.kind == "mean":
                parts = [("n", a.column), ("sum", a.column)]
            else:
                parts = [("n", a.column), (a.kind, a.column)]
            out.extend(p for p in parts if p not in out)
        return out

    def _make_states(self, schema: pa.Schema) -> None:
        for kind, column in self._needed():
            if kind in ("rows", "n"):
                arrow_type: pa.DataType = pa.int64()
            else:
                assert column is not None
                t = schema.field(column).type
                if pa.types.is_integer(t) or pa.types.is_boolean(t):
                    arrow_type = pa.int64()
                elif pa.types.is_floating(t) or pa.types.is_decimal(t):
                    arrow_type = pa.float64()
                else:
                    raise TypeError(f"{self.where()}: pe.agg.{kind}({column!r}) needs a numeric column, got {t}")
            name = f"{kind}({column})" if column is not None else "count(*)"
            descriptor = ValueStateDescriptor(name, 0, arrow_type)
            self._acc[name] = (kind, column, self.backend.get_state(descriptor))
            self._types[name] = arrow_type

    # -- processing ----------------------------------------------------------------------

    def process(self, records: Any) -> Any:
        if not len(records):
            return []
        batch = self._call(batch_of, records)
        names = batch.schema.names
        wanted = [self.key_column] + [a.column for a in self.aggregations if a.column is not None]
        missing = [c for c in wanted if c not in names]
        if missing:
            raise UserFunctionError(f"{self.where()}: the records have no column {missing[0]!r} (columns: {names})")
        if not self._acc:
            self._make_states(batch.schema)
        spec: List[Tuple[Any, str]] = [([], "count_all")]
        for kind, column, _ in self._acc.values():
            if column is not None:
                spec.append((column, _ARROW_FN[kind]))
        grouped = pa.Table.from_batches([batch]).group_by(self.key_column, use_threads=False).aggregate(spec)
        keys = grouped.column(self.key_column)
        if keys.null_count:
            raise UserFunctionError(f"{self.where()}: key column {self.key_column!r} has null keys")
        partial = {}
        for name, (kind, column, _) in self._acc.items():
            source = "count_all" if kind == "rows" else f"{column}_{_ARROW_FN[kind]}"
            partial[name] = grouped.column(source)
        if pa.types.is_integer(keys.type):
            totals = self._merge_columnar(keys.to_numpy().astype(np.int64, copy=False), partial)
        else:
            totals = self._merge_per_key(keys.to_pylist(), partial)
        return self._output(keys, totals)

    def _merge_columnar(self, keys: np.ndarray, partial: Dict[str, Any]) -> Dict[str, Tuple[np.ndarray, Any]]:
        """New totals (values, valid mask or None) per accumulator, written back to state."""
        totals: Dict[str, Tuple[np.ndarray, Any]] = {}
        states = list(self._acc.values())
        split = states[0][2].split_keys(keys)  # one sort by key group for every accumulator
        for name, (kind, _, state) in self._acc.items():
            dtype = np.int64 if self._types[name] == pa.int64() else np.float64
            p = partial[name]
            values = np.asarray(p.fill_null(0).to_numpy(zero_copy_only=False) if p.null_count else p.to_numpy(), dtype)
            if kind in ("rows", "n", "sum"):
                totals[name] = (state.merge_many(keys, values, "add", split), None)
            elif not p.null_count:
                totals[name] = (state.merge_many(keys, values, kind, split), None)
            else:  # some keys saw only nulls in this batch: they keep what they had, if anything
                has = ~np.asarray(p.is_null())
                found, new = state.get_many(keys, split)
                new[has] = state.merge_many(keys[has], values[has], kind)
                totals[name] = (new, found | has)
        return totals

    def _merge_per_key(self, keys: List[Any], partial: Dict[str, Any]) -> Dict[str, Tuple[np.ndarray, Any]]:
        columns = {name: p.to_pylist() for name, p in partial.items()}
        out: Dict[str, List[Any]] = {name: [] for name in self._acc}
        backend = self.backend
        for i, key in enumerate(keys):
            backend.set_current_key(key)
            seen_before: Dict[Optional[str], bool] = {}
            for name, (kind, column, state) in self._acc.items():
                p = columns[name][i]
                if kind in ("rows", "n", "sum"):
                    old = state.value()
                    if kind == "n":  # n(column) comes before min/max(column): see _needed
                        seen_before[column] = old > 0
                    v = old + (p or 0)
                    state.update(v)
                elif not seen_before[column]:
                    v = p
                    if p is not None:
                        state.update(p)
                elif p is None:
                    v = state.value()
                else:
                    v = (min if kind == "min" else max)(state.value(), p)
                    state.update(v)
                out[name].append(v)
        totals: Dict[str, Tuple[np.ndarray, Any]] = {}
        for name, values in out.items():
            valid = np.array([v is not None for v in values], bool)
            array = np.array([0 if v is None else v for v in values])
            totals[name] = (array, None if valid.all() else valid)
        return totals

    def _output(self, keys: Any, totals: Dict[str, Tuple[np.ndarray, Any]]) -> pa.RecordBatch:
        columns = [keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys]
        fields = [pa.field(self.key_column, keys.type)]
        for a in self.aggregations:
            if a.kind == "count":
                name = "count(*)" if a.column is None else f"n({a.column})"
                array = pa.array(totals[name][0], pa.int64())
            elif a.kind == "mean":
                n, _ = totals[f"n({a.column})"]
                s, _ = totals[f"sum({a.column})"]
                with np.errstate(invalid="ignore", divide="ignore"):
                    mean = s / n
                array = pa.array(mean, pa.float64(), mask=n == 0)
            else:
                values, valid = totals[f"{a.kind}({a.column})"]
                array = pa.array(values, mask=None if valid is None else ~valid)
            columns.append(array)
            fields.append(pa.field(a.output, array.type))
        return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields))
