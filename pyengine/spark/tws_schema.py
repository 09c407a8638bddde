"""Spark schemas for the ``transformWithState`` adapter (``pyengine.spark.tws``):
a DDL string or a ``StructType`` parsed without a JVM, and the Arrow types a
state or the output is stored in.

pyspark is imported only when a schema is parsed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable, List, Optional, Tuple

import pyarrow as pa

from ..errors import NonRetryableError

__all__ = [
    "StateSchemaEvolutionError",
    "parse_schema",
    "spark_arrow_schema",
]


# -- schemas -----------------------------------------------------------------------------------

_SIMPLE_DDL = {
    "string": "StringType",
    "varchar": "StringType",
    "char": "StringType",
    "int": "IntegerType",
    "integer": "IntegerType",
    "bigint": "LongType",
    "long": "LongType",
    "smallint": "ShortType",
    "short": "ShortType",
    "tinyint": "ByteType",
    "byte": "ByteType",
    "double": "DoubleType",
    "float": "FloatType",
    "real": "FloatType",
    "boolean": "BooleanType",
    "bool": "BooleanType",
    "binary": "BinaryType",
    "date": "DateType",
    "timestamp": "TimestampType",
    "timestamp_ltz": "TimestampType",
    "timestamp_ntz": "TimestampNTZType",
}

_TOKEN = re.compile(r"\s*(`[^`]*`|[A-Za-z_][A-Za-z0-9_]*|\d+|[<>(),:])")


class _DDL:
    """A small parser of Spark's DDL (``"id string, counts array<bigint>"``): Spark
    parses DDL in the JVM (it needs a session), the adapter must not."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: List[str] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if m is None:
                raise ValueError(f"cannot parse schema {text!r} at {text[pos:]!r}")
            self.tokens.append(m.group(1))
            pos = m.end()
        self.i = 0

    def peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: Optional[str] = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok.lower() != expected):
            raise ValueError(f"cannot parse schema {self.text!r}: expected {expected or 'more'}, got {tok!r}")
        self.i += 1
        return tok

    def fields(self, end: Optional[str]) -> Any:
        from pyspark.sql.types import StructField, StructType

        out = []
        while self.peek() is not None and self.peek() != end:
            name = self.take().strip("`")
            if self.peek() == ":":
                self.take()
            dtype = self.type()
            nullable = True
            if (self.peek() or "").lower() == "not":
                self.take()
                self.take("null")
                nullable = False
            out.append(StructField(name, dtype, nullable))
            if self.peek() == ",":
                self.take()
            elif self.peek() is not None and self.peek() != end:  # Spark's PARSE_SYNTAX_ERROR
                raise ValueError(f"cannot parse schema {self.text!r}: expected ',' before {self.peek()!r}")
        return StructType(out)

    def type(self) -> Any:
        from pyspark.sql import types as T

        word = self.take().lower()
        if word in _SIMPLE_DDL:
            if self.peek() == "(" and word in ("varchar", "char"):
                self.take()
                self.take()
                self.take(")")
            return getattr(T, _SIMPLE_DDL[word])()
        if word in ("decimal", "dec", "numeric"):
            precision, scale = 10, 0
            if self.peek() == "(":
                self.take()
                precision = int(self.take())
                if self.peek() == ",":
                    self.take()
                    scale = int(self.take())
                self.take(")")
            return T.DecimalType(precision, scale)
        if word == "array":
            self.take("<")
            element = self.type()
            self.take(">")
            return T.ArrayType(element)
        if word == "map":
            self.take("<")
            key = self.type()
            self.take(",")
            value = self.type()
            self.take(">")
            return T.MapType(key, value)
        if word == "struct":
            self.take("<")
            struct = self.fields(">")
            self.take(">")
            return struct
        raise ValueError(f"cannot parse schema {self.text!r}: unknown type {word!r}")


def parse_schema(schema: Any, what: str = "schema") -> Any:
    """A ``StructType`` from a ``StructType`` or a DDL string, as Spark's handle takes them."""
    from pyspark.sql.types import DataType, StructField, StructType

    if isinstance(schema, StructType):
        return schema
    if isinstance(schema, str):
        parser = _DDL(schema)
        struct = parser.fields(None)
        if parser.peek() is not None or not struct.fields:
            raise ValueError(f"{what}: cannot parse schema {schema!r}")
        return struct
    if isinstance(schema, DataType):  # a bare type: one unnamed field, as Spark wraps it
        return StructType([StructField("value", schema)])
    raise TypeError(f"{what} must be a pyspark StructType or a DDL string, got {schema!r}")


def _arrow_type(dtype: Any, timezone: str = "UTC") -> pa.DataType:
    """Spark's type in Arrow terms. A ``timestamp`` needs a time zone from pyspark 4 on
    (pyspark 3.5 took none and gave UTC): Spark keeps UTC instants and the zone only
    says how to show them, so UTC unless the caller knows the session's."""
    from pyspark.sql.pandas.types import to_arrow_type

    try:
        return to_arrow_type(dtype, timezone=timezone)
    except TypeError:  # pyspark 3.5: no timezone argument
        return to_arrow_type(dtype)


def spark_arrow_schema(struct: Any, timezone: str = "UTC") -> pa.Schema:
    """A Spark ``StructType`` as an Arrow schema (``timestamp`` columns in ``timezone``)."""
    return pa.schema([pa.field(f.name, _arrow_type(f.dataType, timezone), f.nullable) for f in struct.fields])


_PRIMITIVE = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean, pa.types.is_string, pa.types.is_binary)


def _layout(schema: Any, what: str) -> Tuple[pa.DataType, bool]:
    """How values of ``schema`` are stored: (Arrow type, scalar). One primitive
    field: its value alone (int/float/bool columnar in memory); else the tuple, as
    an Arrow struct in the checkpoint."""
    struct = parse_schema(schema, what)
    fields = struct.fields
    if len(fields) == 1:
        t = _arrow_type(fields[0].dataType)
        if any(test(t) for test in _PRIMITIVE):
            return t, True
    return pa.struct([pa.field(f.name, _arrow_type(f.dataType)) for f in fields]), False


def _key_layout(schema: Any, what: str) -> Tuple[Optional[pa.DataType], bool]:
    """A map state's user keys: one primitive field unwrapped and typed; other keys
    stay tuples (untyped: an Arrow struct would come back from a checkpoint as a
    dict, which cannot be a key)."""
    t, scalar = _layout(schema, what)
    return (t, True) if scalar else (None, False)


# -- values as Spark hands them out --------------------------------------------------------------


def _row_maker(names: List[str]) -> Callable[[Iterable[Any]], Any]:
    from pyspark.sql.types import Row

    proto = Row(*names)
    return lambda values: proto(*values)


def value_reader(dtype: Any) -> Optional[Callable[[Any], Any]]:
    """What turns a stored value of Spark type ``dtype`` into the value Spark's state
    client gives: a struct as a ``Row`` (stored as a tuple, or as a dict when it came
    back from a checkpoint's Arrow file or was written as one), a map as a dict (Arrow
    gives (key, value) pairs), arrays with their elements so read. ``None`` when the
    value is given as stored (no struct or map inside): the common case pays nothing."""
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(dtype, StructType):
        names = [f.name for f in dtype.fields]
        inner = [value_reader(f.dataType) for f in dtype.fields]
        make = _row_maker(names)

        def struct(v: Any) -> Any:
            if v is None:
                return None
            values = [v.get(n) for n in names] if isinstance(v, dict) else list(v)
            return make(x if r is None or x is None else r(x) for x, r in zip(values, inner, strict=False))

        return struct
    if isinstance(dtype, ArrayType):
        element = value_reader(dtype.elementType)
        if element is None:
            return None
        return lambda v: None if v is None else [None if x is None else element(x) for x in v]
    if isinstance(dtype, MapType):
        value = value_reader(dtype.valueType)

        def mapping(v: Any) -> Any:  # always read: Arrow gives a map back as (key, value) pairs
            if v is None:
                return None
            items = v.items() if isinstance(v, dict) else v
            if value is None:
                return dict(items)
            return {k: None if x is None else value(x) for k, x in items}

        return mapping
    return None


def tuple_reader(struct: Any) -> Optional[Callable[[Any], Any]]:
    """A state value of several fields (``struct``) as the tuple Spark gives: its
    nested structs as ``Row`` (``value_reader``); ``None`` if nothing is nested."""
    readers = [value_reader(f.dataType) for f in struct.fields]
    if not any(readers):
        return None
    names = [f.name for f in struct.fields]

    def read(v: Any) -> Any:
        if v is None:
            return None
        values = [v.get(n) for n in names] if isinstance(v, dict) else v
        return tuple(x if r is None or x is None else r(x) for x, r in zip(values, readers, strict=False))

    return read


# -- schema evolution across a restart ----------------------------------------------------------


class StateSchemaEvolutionError(NonRetryableError, ValueError):
    """A state's schema changed across a restart in a way Spark refuses too (a
    narrowing type, a field's type changed to an unrelated one): the restored
    values cannot be read under the new schema."""


_UPCASTS = {  # Avro's promotions, which Spark's state schema evolution allows
    "byte": {"short", "integer", "long", "float", "double"},
    "short": {"integer", "long", "float", "double"},
    "integer": {"long", "float", "double"},
    "long": {"float", "double"},
    "float": {"double"},
    "string": {"binary"},
    "binary": {"string"},
}


def schema_json(struct: Any) -> str:
    return str(struct.json())


def evolution(old_json: str, new: Any, what: str) -> Optional[Callable[[Any], Any]]:
    """How a value stored under ``old_json`` (the schema a checkpoint recorded) reads
    under ``new``, as Spark evolves state schemas (Avro's rules): fields matched by
    name, a field added reads null, a removed one is dropped, a type widened (int to
    long, float to double...) is converted; a narrowing or unrelated change raises
    ``StateSchemaEvolutionError``. ``None``: the same schema, nothing to do."""
    from pyspark.sql.types import StructType

    old = StructType.fromJson(json.loads(old_json))
    if old.json() == new.json():
        return None
    old_fields = {f.name: f for f in old.fields}
    moves: List[Tuple[Optional[int], Optional[Callable[[Any], Any]]]] = []
    old_names = [f.name for f in old.fields]
    for f in new.fields:
        before = old_fields.get(f.name)
        if before is None:
            moves.append((None, None))
            continue
        a, b = before.dataType, f.dataType
        cast: Optional[Callable[[Any], Any]] = None
        if a.simpleString() != b.simpleString():
            if b.typeName() not in _UPCASTS.get(a.typeName(), set()):
                raise StateSchemaEvolutionError(
                    f"{what}: [STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION] Schema evolution is not possible: "
                    f"field {f.name!r} was {a.simpleString()} in the restored checkpoint and is "
                    f"{b.simpleString()} now, which does not hold every value it held (Spark refuses it too). "
                    f"Keep the field {a.simpleString()}, or widen it; or give the new type another field name"
                )
            if b.typeName() in ("float", "double"):
                cast = float
            elif b.typeName() == "string":
                cast = lambda x: x.decode() if isinstance(x, bytes) else x  # noqa: E731
            elif b.typeName() == "binary":
                cast = lambda x: x.encode() if isinstance(x, str) else x  # noqa: E731
        moves.append((old_names.index(f.name), cast))
    scalar_old = len(old.fields) == 1

    def evolve(v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, dict):
            values: Any = [v.get(n) for n in old_names]
        elif scalar_old and not isinstance(v, (tuple, list)):
            values = [v]
        else:
            values = v
        return tuple(
            None if i is None or values[i] is None else (values[i] if c is None else c(values[i])) for i, c in moves
        )

    return evolve
