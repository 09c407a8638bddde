"""Building a Spark ``StatefulProcessor`` into a pyengine job: what
``KeyedStream.transform_with_state[_in_pandas]`` does (``build``), the initial state
as the operator takes it, and Spark's ``eventTimeColumnName`` on the output.

The operator itself is in ``tws``; pyspark is imported only when a job is built."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyarrow as pa

from ..errors import ColumnNotFoundError
from .tws import TransformWithStateOperator, check_processor, time_mode_of
from .tws_handle import _plain
from .tws_schema import parse_schema

__all__ = ["build"]


# -- building it into a job --------------------------------------------------------------------


def _initial_entries(
    initial_state: Any, flavour: str, select: Callable[[Any], Any]
) -> Callable[[], List[Tuple[Any, Any]]]:
    """The initial state as (key, value) pairs, made when a subtask opens: Rows (one
    call per row, as Spark's ``transformWithState``) or one DataFrame per key (as
    ``transformWithStateInPandas``). Takes records (dicts or Rows), a pyarrow Table
    or a pandas DataFrame; keys are taken with the stream's key selector."""

    def rows() -> List[Any]:
        if isinstance(initial_state, (pa.Table, pa.RecordBatch)):
            return list(initial_state.to_pylist())
        if hasattr(initial_state, "to_dict") and hasattr(initial_state, "columns"):  # pandas
            return list(initial_state.to_dict("records"))
        return list(initial_state)

    def make() -> List[Tuple[Any, Any]]:
        from pyspark.sql.types import Row

        records = rows()
        if flavour == "row":
            out = []
            for r in records:
                if isinstance(r, dict):
                    row = tuple.__new__(Row, [_plain(v) for v in r.values()])
                    row.__fields__ = list(r)
                else:
                    row = r
                out.append((select(r), row))
            return out
        import pandas as pd

        grouped: Dict[Any, List[Any]] = {}
        for r in records:
            grouped.setdefault(select(r), []).append(r if isinstance(r, dict) else r.asDict())
        return [(k, pd.DataFrame.from_records(v)) for k, v in grouped.items()]

    rows()  # refuses a wrong type now, not on a subtask
    return make


def _output_event_time(column: str, struct: Any) -> Any:
    """Spark's ``eventTimeColumnName``: the OUTPUT column whose values are the output
    rows' event time, for the operators after this one (their timestamps; the
    watermark goes on as it came). Refused unless the output schema has it as a
    timestamp or a whole number of milliseconds."""
    from pyspark.sql.types import ByteType, IntegerType, LongType, ShortType, TimestampNTZType, TimestampType

    from ..time import TimestampAssigner

    fields = {f.name: f for f in struct.fields}
    field = fields.get(column)
    if field is None:
        raise ColumnNotFoundError(
            f"event_time_column {column!r} names an output column, as Spark's eventTimeColumnName does (the "
            f"event time of the rows this operator emits, carried downstream), and the output schema has none: "
            f"{struct.simpleString()}. Add it to the output schema and to the rows the processor yields; late "
            "input rows are dropped by the stream's own timestamps (assign_timestamps_and_watermarks)"
        )
    kinds = (TimestampType, TimestampNTZType, LongType, IntegerType, ShortType, ByteType)
    if not isinstance(field.dataType, kinds):
        raise ValueError(
            f"event_time_column {column!r} is {field.dataType.simpleString()} in the output schema: an event time "
            "is a timestamp (or a bigint of epoch milliseconds)"
        )
    return TimestampAssigner(column=column)


def build(
    keyed: Any,
    processor: Any,
    output_schema: Any,
    *,
    flavour: str,
    time_mode: str,
    event_time_column: Optional[str],
    initial_state: Any,
    micro_batch: bool = True,
    whole_input: bool = False,
) -> Any:
    """What ``KeyedStream.transform_with_state[_in_pandas]`` does: checks everything
    it can before the job runs, and adds the operator (a deep copy of ``processor``
    per subtask and attempt, as for a ``KeyedProcessFunction``)."""
    check_processor(processor)
    if not isinstance(micro_batch, bool):
        raise TypeError(f"micro_batch must be True or False, got {micro_batch!r}")
    mode = time_mode_of(time_mode)
    struct = parse_schema(output_schema, "output schema")  # refused now, not in a subtask
    stream = keyed._stream
    select = keyed._select
    event_time = None
    output_time = None
    if mode == "EventTime":
        timestamps = stream._timestamps
        if timestamps is None:
            raise ValueError(
                "time_mode='EventTime' needs watermarks: give the stream timestamps first "
                "(assign_timestamps_and_watermarks(pe.WatermarkStrategy...), or a source's watermark_strategy)"
            )
        event_time = timestamps.of_record
        if event_time_column is not None:
            output_time = _output_event_time(event_time_column, struct)
    elif event_time_column is not None:
        raise ValueError(f"event_time_column is for time_mode='EventTime', not {mode!r}")
    initial = _initial_entries(initial_state, flavour, select) if initial_state is not None else None
    name = "transform_with_state" if flavour == "row" else "transform_with_state_in_pandas"

    def factory(uid: str, n: str, _checkpointing: bool) -> TransformWithStateOperator:
        return TransformWithStateOperator(
            uid,
            n,
            select,
            copy.deepcopy(processor),
            output_schema,
            flavour=flavour,
            time_mode=mode,
            event_time=event_time,
            initial_state=initial,
            micro_batch=micro_batch,
            whole_input=whole_input,
        )

    out = stream._op(name, factory)
    out._steps[-1].event_time = mode == "EventTime"
    if output_time is not None:
        out._timestamps = output_time
    return out
