"""``KeyedStream.aggregate``: keyed count / sum / min / max / mean on whole Arrow batches.

Per input batch, Arrow's hash aggregation reduces the rows to one partial
result per key; the partials are merged into columnar keyed state (one int64 or
float64 value state per accumulator) with ``get_many``/``update_many``, so the
work per batch is a handful of vectorised calls whatever its length.

What it emits (``emit=``):

- ``"updates"`` (the default): per input batch, one row per key the batch
  touched, holding that key's aggregates so far, and ``_seq`` (int64), which
  grows from each row of a key to its next: the row of a key with the largest
  ``_seq`` is its final value, an update stream a reader can collapse (see
  ``KeyedStream.aggregate`` for the Spark recipe). ``_seq`` is the number of the
  output batch in its subtask (every key is in one subtask, and in a batch at
  most once), kept in operator state; a restore starts every subtask past the
  largest number any subtask had reached, so it keeps growing per key across
  failures and rescaling. It is not 1, 2, 3 per key: a per-key count would be
  one more keyed merge per batch (measured: a quarter of ``count()``'s
  throughput), where this costs nothing.
- ``"final"``: nothing while input comes; at end of input (bounded input), one
  row per key with its totals, no ``_seq``. Exactly once across failures: a flag
  in operator state, checkpointed with the totals, records that the final rows
  went out, so a restore from a checkpoint taken after them (the final
  checkpoint, whose transaction holds them) does not send them again, and one
  taken before sends them once.

Integer keys take the columnar path. Other keys (strings, say) are merged one
distinct key at a time through the same state: correct, and still no call per
record.

Records it cannot aggregate (a missing or non-numeric column, null keys) fail the
job at once, as ``NonRetryableError``s: a restart would replay the same records."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from ..agg import Aggregation
from ..connectors.base import check_columns
from ..errors import ColumnNotFoundError, NonRetryableError
from ..state import ListStateDescriptor, ValueStateDescriptor
from .base import batch_of
from .keyed import KeyedOperator

__all__ = ["EMIT_MODES", "SEQ_COLUMN", "AggregateInputError", "AggregateOperator", "check_aggregate"]

EMIT_MODES = ("updates", "final")
SEQ_COLUMN = "_seq"

# Arrow's hash-aggregate function behind each accumulator.
_ARROW_FN = {"n": "count", "sum": "sum", "min": "min", "max": "max"}
_ADDED = ("rows", "n", "sum")  # accumulators merged by adding
# per subtask: [final rows emitted (bool), the input schema the states were made for (IPC bytes),
# output batches so far (the last _seq)]
_PROGRESS = ListStateDescriptor("aggregate")


class AggregateInputError(NonRetryableError, TypeError):
    """Records ``aggregate`` cannot take: a non-numeric column to sum, null keys,
    records that are not dicts. Replaying them would fail the same way, so the job
    fails at once."""


def _one_key_type(key_column: Any) -> str:
    k = repr(key_column)
    return (
        "a vectorised aggregate groups an Arrow column of one type: make the keys one type before "
        f"key_by (e.g. .map(lambda r: {{**r, {k}: str(r[{k}])}})), or aggregate in a "
        "key_by(...).process(...) function, whose keys may be of any type"
    )


def not_a_table(where: str, records: Any, key_column: Any, exc: BaseException) -> AggregateInputError:
    """Why a buffer did not become an Arrow batch: keys of several types, named as
    such (Arrow's own message names neither the column nor the way out), or else
    Arrow's reason."""
    if isinstance(records, list) and records and all(isinstance(r, dict) for r in records):
        try:
            pa.array([r.get(key_column) for r in records])
        except (TypeError, pa.ArrowException) as keys_exc:  # the keys themselves make no column
            kinds = sorted({type(r.get(key_column)).__name__ for r in records})
            return AggregateInputError(
                f"{where}: the key column {key_column!r} holds keys of types {', '.join(kinds)} ({keys_exc}); "
                + _one_key_type(key_column)
            )
        names = dict.fromkeys(k for r in records for k in r)
        for name in names:
            values = [r.get(name) for r in records]
            try:
                pa.array(values)
            except (TypeError, pa.ArrowException) as column_exc:
                kinds = sorted({type(v).__name__ for v in values if v is not None})
                return AggregateInputError(
                    f"{where}: the records are not a table: the column {name!r} holds values of types "
                    f"{', '.join(kinds)}, which Arrow cannot make one type ({column_exc}); "
                    "give the column one type before the aggregate, e.g. "
                    f".map(lambda r: {{**r, {name!r}: float(r[{name!r}])}})"
                )
    return AggregateInputError(f"{where}: the records are not a table: {exc}")


_NEVER = lambda t: False  # noqa: E731
# pyarrow >= 16 has view types; the project takes pyarrow >= 14
_IS_STRING_VIEW = getattr(pa.types, "is_string_view", _NEVER)
_IS_BINARY_VIEW = getattr(pa.types, "is_binary_view", _NEVER)


def _key_kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        t = t.value_type
    for kind, test in (
        ("int", pa.types.is_integer),
        ("float", pa.types.is_floating),
        ("str", lambda u: pa.types.is_string(u) or pa.types.is_large_string(u) or _IS_STRING_VIEW(u)),
        ("bytes", lambda u: pa.types.is_binary(u) or pa.types.is_large_binary(u) or _IS_BINARY_VIEW(u)),
    ):
        if test(t):
            return kind
    return str(t)


def check_key_type(where: str, key_column: Any, expected: Optional[pa.DataType], batch: pa.RecordBatch) -> None:
    """A buffer's keys are of the kind of the first buffer's (the state's keys): ints
    after floats, strings after ints... would split keys or fail at the end. Widths
    may differ (int32 and int64 files of one dataset)."""
    found = batch.schema.field(key_column).type
    if pa.types.is_null(found):  # every key of the buffer None
        raise null_keys(where, key_column)
    if expected is not None and not found.equals(expected) and _key_kind(found) != _key_kind(expected):
        raise AggregateInputError(
            f"{where}: the key column {key_column!r} was {expected} and is now {found}; " + _one_key_type(key_column)
        )


def null_keys(where: str, key_column: Any) -> AggregateInputError:
    return AggregateInputError(
        f"{where}: the key column {key_column!r} has null keys (None); a vectorised aggregate's key column cannot "
        "hold nulls: map None to a key of the column's type before key_by, or use key_by(...).process(...), "
        "where None is a key like any other"
    )


def _numeric(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t) or pa.types.is_decimal(t))


def check_aggregate(
    schema: Optional[pa.Schema], key_column: str, aggregations: Sequence[Aggregation], emit: str
) -> None:
    """The checks ``KeyedStream.aggregate`` makes when the job is built: the emit mode,
    output names, and, when the stream's schema is known, that every column exists
    (``ColumnNotFoundError``) and every summed / compared column is numeric
    (``AggregateInputError``), so that a misspelt column fails here, not after
    ``restart_attempts`` restarts."""
    if emit not in EMIT_MODES:
        raise ValueError(f"aggregate emit must be one of {', '.join(map(repr, EMIT_MODES))}, got {emit!r}")
    if emit == "updates":
        taken = [a.output for a in aggregations if a.output == SEQ_COLUMN] + (
            [key_column] if key_column == SEQ_COLUMN else []
        )
        if taken:
            raise ValueError(
                f"aggregate(emit='updates') adds the column {SEQ_COLUMN!r}: name the key or the output otherwise "
                "(alias=...)"
            )
    check_columns(schema, [key_column], "aggregate (key)")
    for a in aggregations:
        if a.column is None:
            continue
        where = f"aggregate: pe.agg.{a.kind}({a.column!r})"
        check_columns(schema, [a.column], where)
        if schema is not None and a.kind != "count":
            t = schema.field(a.column).type
            if not _numeric(t):
                raise AggregateInputError(f"{where} needs a numeric column, got {t}")


def accumulator_type(where: str, kind: str, column: Optional[str], t: pa.DataType) -> pa.DataType:
    """The type of a ``kind`` accumulator over a column of type ``t``: int64 for whole
    numbers (and for a column seen only as nulls so far: it widens when values come),
    float64 for fractions."""
    if kind in ("rows", "n") or pa.types.is_null(t) or pa.types.is_integer(t) or pa.types.is_boolean(t):
        return pa.int64()
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return pa.float64()
    raise AggregateInputError(f"{where}: pe.agg.{kind}({column!r}) needs a numeric column, got {t}")


def unified_schema(where: str, schema: pa.Schema, found: pa.Schema, typed: Sequence[str]) -> pa.Schema:
    """``schema`` (the columns an aggregate has seen) widened to take ``found`` (a new
    buffer's), as Arrow unifies types (``promote_options="permissive"``: int64 and
    float64 make float64; a type is never narrowed). Whole numbers and booleans share
    their int64 accumulators, as before. A column in ``typed`` (summed, compared,
    averaged) whose two types do not unify is an ``AggregateInputError`` naming the
    column and both types: a replay would fail the same way."""
    fields = []
    for field in schema:
        name = field.name
        t = found.field(name).type if name in found.names else field.type
        if t.equals(field.type):
            fields.append(field)
            continue
        try:
            merged = pa.unify_schemas(
                [pa.schema([field]), pa.schema([pa.field(name, t)])], promote_options="permissive"
            ).field(name)
        except (pa.ArrowException, TypeError) as exc:
            kinds = {accumulator_type(where, "sum", name, u) for u in (field.type, t) if _numeric(u)}
            if name not in typed or (len(kinds) == 1 and _numeric(t) and _numeric(field.type)):
                merged = field  # counted only, or booleans among whole numbers: nothing to widen
            else:
                raise AggregateInputError(
                    f"{where}: the column {name!r} was {field.type} and is now {t}, and Arrow cannot make them one "
                    f"type ({exc}); give the column one type before the aggregate, e.g. "
                    f".map(lambda r: {{**r, {name!r}: float(r[{name!r}])}})"
                ) from None
        fields.append(merged)
    return pa.schema(fields)


def value_state(backend: Any, descriptor: ValueStateDescriptor[Any]) -> Any:
    """``backend.get_state(descriptor)``, converting what it holds when that is of
    another type: a restore can bring one state as int64 from a subtask that saw whole
    numbers only and as float64 from one that saw fractions."""
    table = backend._tables.get(descriptor.name)
    assert descriptor.type is not None
    if table is not None:
        dtype = getattr(table, "dtype", None)
        if dtype is not None:
            stale = dtype != np.dtype(descriptor.type.to_pandas_dtype())
        else:  # dict storage: keys of other types, or a restored chain across a type change
            want = float if pa.types.is_floating(descriptor.type) else int
            stale = any(type(v) is not want for group in table.groups for v in group.values()) or all(
                type(k) is int for group in table.groups for k in group
            )  # ints where floats belong, or int keys that columns take again
        if stale:
            return backend.retype_value_state(descriptor)
    return backend.get_state(descriptor)


def needed_accumulators(aggregations: Sequence[Aggregation]) -> List[Tuple[str, Optional[str]]]:
    """(kind, column) of every accumulator the aggregations need, each once; a row
    count or n(column) comes first (every key seen has an entry there). Shared by the
    keyed aggregate and the window aggregate, whose state has the same columns."""
    out: List[Tuple[str, Optional[str]]] = []
    for a in aggregations:
        parts: List[Tuple[str, Optional[str]]]
        if a.kind == "count":
            parts = [("rows", None)] if a.column is None else [("n", a.column)]
        elif a.kind == "mean":
            parts = [("n", a.column), ("sum", a.column)]
        else:
            parts = [("n", a.column), (a.kind, a.column)]
        out.extend(p for p in parts if p not in out)
    return out


class AggregateOperator(KeyedOperator):
    """The operator behind ``KeyedStream.aggregate``; see the module docstring."""

    def __init__(
        self, uid: str, name: str, key_column: str, aggregations: Sequence[Aggregation], emit: str = "updates"
    ) -> None:
        super().__init__(uid, name)
        if emit not in EMIT_MODES:
            raise ValueError(f"aggregate emit must be one of {', '.join(map(repr, EMIT_MODES))}, got {emit!r}")
        self.key_column = key_column
        self.aggregations = list(aggregations)
        self.emit = emit
        # accumulator name -> (kind, column, value state); made at the first batch, when
        # the column types are known (sum of an int column is int64, of a float column
        # float64), or at restore from the schema kept in operator state
        self._acc: Dict[str, Tuple[str, Optional[str], Any]] = {}
        self._types: Dict[str, pa.DataType] = {}
        # the key and aggregated columns of the input, each of the widest type seen so far
        self._schema: Optional[pa.Schema] = None
        self._typed: List[str] = []  # the columns summed, compared or averaged
        self._emitted = False  # emit="final": the final rows went out
        self._batches = 0  # emit="updates": output batches so far, the _seq of the last one
        self._progress: Any = None

    # -- state -----------------------------------------------------------------------------

    def setup(self, ctx: Any, restored: Any) -> None:
        super().setup(ctx, restored)
        assert self.operator_state is not None
        self._progress = self.operator_state.get_union_list_state(_PROGRESS)
        entries = list(self._progress.get()) if restored is not None else []
        # Every subtask sees the end of input before the same barrier, so the flags agree.
        self._emitted = any(bool(e[0]) for e in entries)
        self._batches = max((int(e[2]) for e in entries if len(e) > 2), default=0)
        schemas = [pa.ipc.read_schema(pa.py_buffer(e[1])) for e in entries if e[1]]
        if schemas:
            # every subtask's columns as one: one that saw fractions widens the others' states
            schema = schemas[0]
            for other in schemas[1:]:
                schema = unified_schema(self.where(), schema, other, self._typed_columns())
            self._make_states(schema)

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        schema = self._schema.serialize().to_pybytes() if self._schema is not None else b""
        self._progress.update([[self._emitted, schema, self._batches]])
        return super().snapshot(checkpoint_id, location)

    # -- accumulators ------------------------------------------------------------------------

    def _make_states(self, schema: pa.Schema) -> None:
        """The accumulators for the columns' types in ``schema``; called again when a
        column widens (whole numbers, then fractions), which converts the int64
        accumulators of that column to float64 in place (``retype_value_state``)."""
        for kind, column in needed_accumulators(self.aggregations):
            t = schema.field(column).type if column is not None else pa.int64()
            arrow_type = accumulator_type(self.where(), kind, column, t)
            name = f"{kind}({column})" if column is not None else "count(*)"
            if name in self._types and self._types[name].equals(arrow_type):
                continue
            descriptor = ValueStateDescriptor(name, 0, arrow_type)
            self._acc[name] = (kind, column, value_state(self.backend, descriptor))
            self._types[name] = arrow_type
        columns = [self.key_column] + [a.column for a in self.aggregations if a.column is not None]
        self._schema = pa.schema([schema.field(c) for c in dict.fromkeys(columns)])
        self._typed = self._typed_columns()

    def _typed_columns(self) -> List[str]:
        return [c for k, c in needed_accumulators(self.aggregations) if c is not None and k != "n"]

    # -- processing ----------------------------------------------------------------------

    def process(self, records: Any) -> Any:
        if not len(records):
            return []
        try:
            batch = batch_of(records)
        except (TypeError, pa.ArrowException) as exc:
            raise not_a_table(self.where(), records, self.key_column, exc) from exc
        names = batch.schema.names
        wanted = [self.key_column] + [a.column for a in self.aggregations if a.column is not None]
        missing = [c for c in wanted if c not in names]
        if missing:
            raise ColumnNotFoundError(
                f"{self.where()}: the records have no column {missing[0]!r} (columns: {', '.join(names)})"
            )
        if not self._acc:
            self._make_states(batch.schema)
        else:
            assert self._schema is not None
            check_key_type(self.where(), self.key_column, self._schema.field(self.key_column).type, batch)
            schema = self._schema
            if not all(batch.schema.field(f.name).type.equals(f.type) for f in schema):  # else: the fast path
                widened = unified_schema(self.where(), schema, batch.schema, self._typed)
                if not widened.equals(schema):
                    self._make_states(widened)
        spec: List[Tuple[Any, str]] = [([], "count_all")]
        for kind, column, _ in self._acc.values():
            if column is not None:
                spec.append((column, _ARROW_FN[kind]))
        grouped = pa.Table.from_batches([batch]).group_by(self.key_column, use_threads=False).aggregate(spec)
        keys = grouped.column(self.key_column)
        if keys.null_count:
            raise null_keys(self.where(), self.key_column)
        partial = {}
        for name, (kind, column, _) in self._acc.items():
            source = "count_all" if kind == "rows" else f"{column}_{_ARROW_FN[kind]}"
            partial[name] = grouped.column(source)
        if pa.types.is_integer(keys.type):
            totals = self._merge_columnar(keys.to_numpy().astype(np.int64, copy=False), partial)
        else:
            totals = self._merge_per_key(keys.to_pylist(), partial)
        if self.emit == "final":
            return []
        self._batches += 1
        return self._output(keys, totals, seq=self._batches)

    def end_input(self) -> Any:
        """emit="final": every key's totals, once (see the module docstring)."""
        if self.emit != "final" or self._emitted:
            return []
        self._emitted = True
        if not self._acc:
            return []
        assert self._schema is not None
        key_type = self._schema.field(self.key_column).type
        first = next(iter(self._acc))  # a row count or n(column): every key seen has an entry
        keys: Any
        integer = pa.types.is_integer(key_type)
        keys = np.sort(np.fromiter(self.backend.keys(first), np.int64)) if integer else list(self.backend.keys(first))
        if not len(keys):
            return []
        totals = self._totals_columnar(keys) if integer else self._totals_per_key(keys)
        return self._output(pa.array(keys, type=key_type), totals)

    def _totals_columnar(self, keys: np.ndarray) -> Dict[str, Tuple[np.ndarray, Any]]:
        totals: Dict[str, Tuple[np.ndarray, Any]] = {}
        states = list(self._acc.values())
        split = states[0][2].split_keys(keys)
        values = {name: state.get_many(keys, split)[1] for name, (_, _, state) in self._acc.items()}
        for name, (kind, column, _) in self._acc.items():
            totals[name] = (values[name], None if kind not in ("min", "max") else values[f"n({column})"] > 0)
        return totals

    def _totals_per_key(self, keys: List[Any]) -> Dict[str, Tuple[np.ndarray, Any]]:
        out: Dict[str, List[Any]] = {name: [] for name in self._acc}
        backend = self.backend
        for key in keys:
            backend.set_current_key(key)
            for name, (_, _, state) in self._acc.items():
                out[name].append(state.value())
        totals: Dict[str, Tuple[np.ndarray, Any]] = {}
        for name, (kind, column, _) in self._acc.items():
            array = np.array(out[name], dtype=np.int64 if self._types[name] == pa.int64() else np.float64)
            valid = None if kind not in ("min", "max") else np.array(out[f"n({column})"], np.int64) > 0
            totals[name] = (array, valid)
        return totals

    def _merge_columnar(self, keys: np.ndarray, partial: Dict[str, Any]) -> Dict[str, Tuple[np.ndarray, Any]]:
        """New totals (values, valid mask or None) per accumulator, written back to state."""
        totals: Dict[str, Tuple[np.ndarray, Any]] = {}
        states = list(self._acc.values())
        split = states[0][2].split_keys(keys)  # one sort by key group for every accumulator
        for name, (kind, _, state) in self._acc.items():
            dtype = np.int64 if self._types[name] == pa.int64() else np.float64
            p = partial[name]
            values = np.asarray(p.fill_null(0).to_numpy(zero_copy_only=False) if p.null_count else p.to_numpy(), dtype)
            if kind in _ADDED:
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
                if kind in _ADDED:
                    old = state.value()
                    if kind == "n":  # n(column) comes before min/max(column): see needed_accumulators
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

    def _output(
        self, keys: Any, totals: Dict[str, Tuple[np.ndarray, Any]], seq: Optional[int] = None
    ) -> pa.RecordBatch:
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
        if seq is not None:
            columns.append(pa.array(np.full(len(keys), seq, np.int64)))
            fields.append(pa.field(SEQ_COLUMN, pa.int64()))
        return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields))
