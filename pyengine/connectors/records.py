"""Records as a sink writes them: JSON lines, or an Arrow table that fits a schema.

Shared by ``FileSink`` and ``DeltaSink``: what is not JSON or does not fit the
declared schema is refused with ``RecordRejectedError`` naming the value, and a
column whose type widens across parts is unified once, not per part."""

from __future__ import annotations

import datetime
import json
import math
import numbers
from typing import Any, Dict, List, Optional, Tuple

import pyarrow as pa

from ..state.serializers import STORED_AS_LISTS
from ..state.serializers import unviewed as _unviewed
from .base import RecordRejectedError

__all__: list = []


def _rows(records: Any) -> List[Any]:
    if isinstance(records, (pa.Table, pa.RecordBatch)):
        return records.to_pylist()  # type: ignore[no-any-return]
    return list(records)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _not_json(value: Any, where: str = "") -> Optional[Tuple[str, Any]]:
    """(where, value) of the first value in ``value`` that is not JSON, or None."""
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (where, value)
    if isinstance(value, dict):
        for k, v in value.items():
            if not (k is None or isinstance(k, (str, int, bool)) or (isinstance(k, float) and math.isfinite(k))):
                return (f"{where}[{k!r}] (a key)", k)
            found = _not_json(v, f"{where}[{k!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)) or type(value) in STORED_AS_LISTS:
        for i, v in enumerate(value):
            found = _not_json(v, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    return (where, value)


def _json_default(value: Any) -> Any:
    """What JSON takes of a value it does not know: a ``ListState.view()`` (or another
    of the engine's read-only sequences) as the list it shows; anything else refused."""
    if type(value) in STORED_AS_LISTS:
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _jsonl(records: Any) -> bytes:
    """One JSON document per line; refuses what JSON cannot say (``RecordRejectedError``)
    instead of writing ``NaN`` or a value's ``str``."""
    lines = []
    for r in _rows(records):
        try:
            lines.append(json.dumps(r, separators=(",", ":"), allow_nan=False, default=_json_default))
        except (TypeError, ValueError, RecursionError) as exc:
            found = _not_json(r)
            if found is None:
                what = str(exc)
            else:
                where, bad = found
                kind = "NaN/Infinity" if isinstance(bad, float) else f"a {type(bad).__name__}"
                what = f"{_short(bad)} at record{where} is {kind}, not a JSON value"
            raise RecordRejectedError(
                f"jsonl FileSink cannot write record {_short(r)}: {what}. Convert it to JSON values (str, "
                "int, finite float, bool, None, list, dict) before the sink, or write parquet"
            ) from None
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _table_of(records: Any, schema: Optional[pa.Schema] = None, who: str = "FileSink") -> pa.Table:
    """The records as one table: with ``schema``, conformed to it (refusing what does
    not fit); without, with the union of the records' fields in first-seen order, each
    column's type inferred from all its values."""
    if isinstance(records, pa.RecordBatch):
        records = pa.Table.from_batches([records])
    if isinstance(records, pa.Table):
        return records if schema is None else _conform_table(records, schema, who)
    rows = list(records)
    is_dict = [isinstance(r, dict) for r in rows]
    if not any(is_dict):
        rows = [{"value": r} for r in rows]
    elif not all(is_dict):
        bad = rows[is_dict.index(False)]
        raise RecordRejectedError(
            f"{who} cannot write record {_short(bad)} (a {type(bad).__name__}) among dict records: "
            "a file's rows are all dicts (fields are columns) or all plain values (one 'value' column)"
        )
    if schema is not None:
        return _conform_rows(rows, schema, who)
    names: Dict[Any, None] = {}
    for r in rows:
        for k in r:
            names.setdefault(k, None)
    arrays = []
    for name in names:
        if not isinstance(name, str):
            raise RecordRejectedError(f"{who} cannot write field {name!r}: a field name must be a str")
        values = [r.get(name) for r in rows]
        try:
            arrays.append(pa.array(values))
            continue
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            problem = str(exc)
        unviewed = _unviewed(values)
        if unviewed is not None:
            try:
                arrays.append(pa.array(unviewed))
                continue
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                problem = str(exc)
        raise RecordRejectedError(
            f"{who} cannot write field {name!r}: its values do not make one column ({problem}); "
            "give them one type, or declare FileSink(..., schema=pyarrow.schema([...]))"
        )
    return pa.Table.from_arrays(arrays, names=list(names))


def _conform_rows(rows: List[Dict[str, Any]], schema: pa.Schema, who: str = "FileSink") -> pa.Table:
    known = set(schema.names)
    for r in rows:
        for k in r:
            if k not in known:
                raise RecordRejectedError(
                    f"{who} cannot write record {_short(r)}: field {k!r} is not in the declared schema "
                    f"(fields: {', '.join(schema.names)})"
                )
    arrays = []
    for field in schema:
        values = [r.get(field.name) for r in rows]
        arrays.append(_column(field, values, rows, who))
    return pa.Table.from_arrays(arrays, schema=schema)


def _column(field: pa.Field, values: List[Any], rows: List[Any], who: str = "FileSink") -> pa.Array:
    """``values`` as ``field``'s column, or ``RecordRejectedError`` naming the field and
    the first value that does not fit (a missing or None value in a non-nullable field,
    a value of another type; a float in an integer field, which Arrow would truncate)."""
    for i, v in enumerate(values):
        problem = _misfit(v, field.type) if v is not None else (None if field.nullable else "is missing or None")
        if problem is not None:
            raise RecordRejectedError(
                f"{who} cannot write record {_short(rows[i])}: field {field.name!r} ({field.type}) {problem}"
            )
    try:
        return pa.array(values, type=field.type)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    unviewed = _unviewed(values)
    if unviewed is not None:
        try:
            return pa.array(unviewed, type=field.type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            values = unviewed
    for i, v in enumerate(values):
        try:
            pa.array([v], type=field.type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise RecordRejectedError(
                f"{who} cannot write record {_short(rows[i])}: field {field.name!r} ({field.type}) "
                f"does not take {_short(v)} ({exc})"
            ) from None
    raise RecordRejectedError(f"{who} cannot write field {field.name!r} ({field.type})")


def _misfit(value: Any, type_: pa.DataType) -> Optional[str]:
    """Why ``value`` does not fit ``type_`` where Arrow's conversion would accept it
    and change it (a float truncated to an integer, a bool as 1.0, bytes decoded as
    text, an int read as a time since the epoch, unknown fields of a struct dropped),
    or None. As PySpark's ``verifySchema``: a value must already be of the field's kind."""
    if value is None:
        return None
    wrong = f"does not take {_short(value)} (a {type(value).__name__})"
    if pa.types.is_integer(type_):
        return wrong if isinstance(value, bool) or not isinstance(value, numbers.Integral) else None
    if pa.types.is_floating(type_):
        return wrong if isinstance(value, bool) or not isinstance(value, numbers.Real) else None
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return None if isinstance(value, str) else wrong
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_) or pa.types.is_fixed_size_binary(type_):
        return None if isinstance(value, (bytes, bytearray, memoryview)) else wrong
    if pa.types.is_timestamp(type_) or pa.types.is_date(type_):
        return None if isinstance(value, datetime.date) or type(value).__name__ == "datetime64" else wrong
    if pa.types.is_struct(type_) and isinstance(value, dict):
        names = {type_.field(i).name: type_.field(i).type for i in range(type_.num_fields)}
        for k, v in value.items():
            if k not in names:
                return f"has no field {k!r} (in {_short(value)})"
            problem = _misfit(v, names[k])
            if problem is not None:
                return f"[{k!r}] {problem}"
        return None
    if (pa.types.is_list(type_) or pa.types.is_large_list(type_)) and (
        isinstance(value, (list, tuple)) or type(value) in STORED_AS_LISTS
    ):
        for v in value:
            problem = _misfit(v, type_.value_type)
            if problem is not None:
                return f"[...] {problem}"
    return None


def _conform_table(table: pa.Table, schema: pa.Schema, who: str = "FileSink") -> pa.Table:
    """An Arrow table cast to the declared schema (safe casts only)."""
    known = set(schema.names)
    for name in table.column_names:
        if name not in known:
            raise RecordRejectedError(
                f"{who} cannot write column {name!r}: it is not in the declared schema "
                f"(fields: {', '.join(schema.names)})"
            )
    columns = []
    for field in schema:
        if field.name not in table.column_names:
            if not field.nullable:
                raise RecordRejectedError(f"{who} cannot write: field {field.name!r} ({field.type}) is missing")
            columns.append(pa.nulls(table.num_rows, type=field.type))
            continue
        column = table.column(field.name)
        textual = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())
        if column.type in textual and field.type not in textual:  # a cast would parse the text
            raise RecordRejectedError(
                f"{who} cannot write column {field.name!r} ({column.type}) as {field.type}: "
                "text is not parsed into other types; convert it before the sink"
            )
        if not field.nullable and column.null_count:
            raise RecordRejectedError(f"{who} cannot write: field {field.name!r} ({field.type}) holds nulls")
        try:
            columns.append(column.cast(field.type, safe=True))
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise RecordRejectedError(
                f"{who} cannot write column {field.name!r} ({column.type}) as {field.type}, the output's type for "
                f"it: {exc}; give the column the output's type before the sink, or write to an output declared "
                f"with the wider type ({who}(..., schema=pyarrow.schema([...])))"
            ) from None
    return pa.Table.from_arrays(columns, schema=schema)


# -- one type per column: Arrow's unification ---------------------------------------------------------------------


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def _unify_columns(known: Optional[pa.Schema], found: pa.Schema, who: str, where: str) -> pa.Schema:
    """``known`` and ``found`` as one schema, as Arrow unifies them
    (``promote_options="permissive"``: int64 and float64 make float64, null takes any
    type, nothing narrows); columns only one has are kept. Two types Arrow cannot make
    one are a ``RecordRejectedError`` naming the column and both types."""
    if known is None:
        return found
    try:
        return pa.unify_schemas([known, found], promote_options="permissive")
    except (pa.ArrowException, TypeError) as exc:
        for field in found:
            if field.name in known.names and not known.field(field.name).type.equals(field.type):
                try:
                    pa.unify_schemas(
                        [pa.schema([known.field(field.name)]), pa.schema([field])], promote_options="permissive"
                    )
                except (pa.ArrowException, TypeError):
                    raise RecordRejectedError(
                        f"{who} {where} cannot write column {field.name!r} as {field.type}: its output holds it as "
                        f"{known.field(field.name).type}, and Arrow cannot make the two one type; give the column "
                        f"one type before the sink, or declare {who}(..., schema=pyarrow.schema([...]))"
                    ) from None
        raise RecordRejectedError(f"{who} {where} cannot write columns ({_describe(found)}): {exc}") from None


def _needs_rewrite(schema: pa.Schema, target: pa.Schema) -> bool:
    """Some column of ``schema`` has another type in ``target``."""
    return any(f.name in target.names and not target.field(f.name).type.equals(f.type) for f in schema)


def _cast_columns(table: pa.Table, target: pa.Schema, who: str) -> pa.Table:
    """``table``'s columns cast to ``target``'s types (only widening casts reach here)."""
    if not _needs_rewrite(table.schema, target):
        return table
    fields = [target.field(f.name) if f.name in target.names else f for f in table.schema]
    try:
        return table.cast(pa.schema(fields), safe=True)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise RecordRejectedError(
            f"{who} cannot write columns ({_describe(table.schema)}) as the output's: {exc}"
        ) from None
