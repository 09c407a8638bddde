"""The ``transformWithState`` adapter's output side: what a processor yields (Spark
``Row``s or pandas DataFrames) checked against the declared output schema and turned
into one Arrow batch per call of the operator (``TwsOutput``, a mixin of
``TransformWithStateOperator``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pyarrow as pa

from ..errors import NonRetryableError

__all__ = ["OutputSchemaError", "TwsOutput", "exact"]


class OutputSchemaError(NonRetryableError, ValueError):
    """What a processor returned does not fit the output schema (the message names
    the column). A bug in the processor: no restart can fix it."""


class TwsOutput:
    """The output conversion of ``TransformWithStateOperator``: the attributes below
    are the operator's."""

    flavour: str
    output_names: List[str]
    _exact: Dict[str, bool]  # per output column: Arrow's conversion is exact (``exact``)
    output_schema: pa.Schema
    output_struct: Any

    where: Callable[[], str]  # the operator's (``Operator.where``)

    # -- output --------------------------------------------------------------------------------

    def _output(self, produced: List[Any]) -> Any:
        if not produced:
            return []
        if self.flavour == "row":
            return self._rows_batch(produced)
        return self._frames_batch(produced)

    def _fail(self, message: str) -> OutputSchemaError:
        return OutputSchemaError(f"{self.where()}: {message} (output schema: {self.output_struct.simpleString()})")

    def _rows_batch(self, flat: List[Any]) -> pa.RecordBatch:
        """The output rows, flat (``_take``: every row's values in schema order, one
        row after another), as one batch: a column is a C-level slice of the list."""
        width = len(self.output_names)
        arrays = [self._column(field, flat[i::width]) for i, field in enumerate(self.output_schema)]
        return pa.RecordBatch.from_arrays(arrays, schema=self.output_schema)

    def _fit_row(self, row: Any) -> Tuple[Any, ...]:
        """An output row that is not a Row of the schema's fields in its order: its
        values in the schema's order, matched by name (a Row, a dict) or by position
        (a plain tuple), or an ``OutputSchemaError`` naming the column."""
        names = self.output_names
        if isinstance(row, dict):
            mapping = row
        elif getattr(row, "__fields__", None) is not None:
            if len(row.__fields__) != len(row):
                raise self._fail(f"output row has {len(row)} values for its {len(row.__fields__)} fields: {row!r}")
            mapping = dict(zip(row.__fields__, row, strict=True))
        elif isinstance(row, tuple):
            if len(row) != len(names):
                raise self._fail(f"output row has {len(row)} values, the schema {len(names)} columns: {row!r}")
            return row
        else:
            raise self._fail(f"handleInputRows must yield Rows, got {type(row).__name__}: {row!r}")
        missing = [n for n in names if n not in mapping]
        if missing:
            raise self._fail(f"output row has no column {missing[0]!r}: {row!r}")
        extra = [n for n in mapping if n not in names]
        if extra:
            raise self._fail(f"output row has column {extra[0]!r}, which the output schema does not")
        return tuple(mapping[n] for n in names)

    def _column(self, field: pa.Field, values: List[Any]) -> pa.Array:
        array = None
        if self._exact[field.name]:
            # pandas' null semantics change nothing here but a failure (NaN, NA as
            # null) and cost 3x per value: the plain conversion first, pandas' only
            # if that one refuses.
            try:
                array = pa.array(values, type=field.type)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                pass
        try:
            if array is None:
                array = pa.array(values, type=field.type, from_pandas=True)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            bad = next((v for v in values if not _fits(v, field.type)), None)
            raise self._fail(f"output column {field.name!r} ({field.type}) cannot hold {bad!r}: {exc}") from None
        if not field.nullable and array.null_count:
            raise self._fail(f"output column {field.name!r} is not nullable, got a null")
        return array

    def _frames_batch(self, frames: List[Any]) -> Any:
        """The DataFrames the processor yielded as one batch: each checked (the
        message names a missing or extra column), then concatenated once and
        converted column by column (a conversion per frame cost twice as much)."""
        import pandas as pd

        names = self.output_names
        expected = tuple(names)
        kept = []
        for df in frames:
            if not isinstance(df, pd.DataFrame):
                raise self._fail(f"handleInputRows must yield pandas DataFrames, got {type(df).__name__}")
            if df.empty and len(df.columns) == 0:
                continue
            if tuple(df.columns) != expected:
                missing = [n for n in names if n not in df.columns]
                if missing:
                    raise self._fail(f"output DataFrame has no column {missing[0]!r}; it has {list(df.columns)}")
                extra = [c for c in df.columns if c not in names]
                if extra:
                    raise self._fail(f"output DataFrame has column {extra[0]!r}, which the output schema does not")
                df = df[names]  # the schema's order
            kept.append(df)
        if not kept:
            return []
        whole = kept[0] if len(kept) == 1 else pd.concat(kept, ignore_index=True)
        arrays = [self._pandas_column(field, whole[field.name]) for field in self.output_schema]
        return pa.RecordBatch.from_arrays(arrays, schema=self.output_schema)

    def _pandas_column(self, field: pa.Field, series: Any) -> pa.Array:
        try:
            try:
                array = pa.Array.from_pandas(series, type=field.type)
            except (pa.ArrowException, TypeError, ValueError) as first:
                if not (pa.types.is_decimal(field.type) and series.dtype.kind in "iu"):
                    raise first
                # Spark coerces an int column to a decimal one (intToDecimalCoercion);
                # Arrow takes ints as decimals value by value, not as an int64 array.
                array = pa.array([None if v is None else int(v) for v in series.astype(object)], type=field.type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise self._fail(
                f"output column {field.name!r} ({field.type}) cannot hold the values given: {exc}"
            ) from None
        if not field.nullable and array.null_count:
            raise self._fail(f"output column {field.name!r} is not nullable, got a null")
        return array


_EXACT = (pa.types.is_integer, pa.types.is_boolean, pa.types.is_string, pa.types.is_large_string, pa.types.is_binary)


def exact(t: pa.DataType) -> bool:
    """Whether Arrow's own conversion of Python values to ``t`` gives what pandas'
    (NaN, NaT and NA as null) gives, whenever it succeeds. Not for floats (NaN
    stays NaN), dates and times (pd.NaT passes as a date) or nested types; checked
    value by value for these primitives (None, NaN, NaT, NA, NumPy scalars)."""
    return any(test(t) for test in _EXACT)


def _fits(value: Any, arrow_type: pa.DataType) -> bool:
    try:
        pa.array([value], type=arrow_type, from_pandas=True)
        return True
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return False
