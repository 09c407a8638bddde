"""Spark schemas for the ``transformWithState`` adapter (``pyengine.spark.tws``):
a DDL string or a ``StructType`` parsed without a JVM, and the Arrow types a
state or the output is stored in.

pyspark is imported only when a schema is parsed.
"""

from __future__ import annotations

import re
from typing import Any, List, Optional, Tuple

import pyarrow as pa

__all__ = [
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
