"""Mistakes refused when the job is built, and failures no restart can fix (issue 11:
"errors that cannot succeed are retried", "wrong inputs accepted")."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pyengine as pe
from pyengine.connectors.base import check_columns
from pyengine.errors import ColumnNotFoundError, NonRetryableError, is_non_retryable
from pyengine.runtime.aggregate import AggregateInputError, check_aggregate

TRIPS = pa.table({"zone": [1, 2, 1], "fare": [3.0, 4.5, 1.0], "driver": ["a", "b", "a"]})


def execute(env: pe.StreamEnvironment, name: str) -> Any:
    """The job's result, FINISHED or FAILED (``execute`` raises ``JobFailedError`` on
    failure; the result rides on it)."""
    try:
        return env.execute(name)
    except pe.JobFailedError as exc:
        return exc.result


# -- columns checked against a known schema ------------------------------------------------


def test_check_columns_names_the_column_the_columns_and_the_closest() -> None:
    check_columns(None, ["anything"], "key_by('anything')")  # unknown schema: nothing to check
    check_columns(TRIPS.schema, ["zone", "fare"], "x")
    with pytest.raises(ColumnNotFoundError) as err:
        check_columns(TRIPS.schema, ["zone", "fair"], "aggregate: pe.agg.sum('fair')")
    message = str(err.value)
    assert "aggregate: pe.agg.sum('fair')" in message and "'fair'" in message
    assert "zone, fare, driver" in message and "did you mean 'fare'" in message
    assert isinstance(err.value, NonRetryableError) and isinstance(err.value, ValueError)


def test_check_aggregate_checks_columns_types_and_the_emit_mode() -> None:
    check_aggregate(TRIPS.schema, "zone", [pe.agg.sum("fare"), pe.agg.count("driver")], "updates")
    check_aggregate(None, "zone", [pe.agg.sum("nope")], "final")  # unknown schema
    with pytest.raises(ColumnNotFoundError, match="'zome'"):
        check_aggregate(TRIPS.schema, "zome", [pe.agg.count()], "updates")
    with pytest.raises(ColumnNotFoundError, match=r"pe.agg.max\('fares'\)"):
        check_aggregate(TRIPS.schema, "zone", [pe.agg.max("fares")], "updates")
    with pytest.raises(AggregateInputError, match="numeric"):
        check_aggregate(TRIPS.schema, "zone", [pe.agg.sum("driver")], "updates")
    with pytest.raises(ValueError, match="emit"):
        check_aggregate(TRIPS.schema, "zone", [pe.agg.count()], "last")
    with pytest.raises(ValueError, match="_seq"):
        check_aggregate(TRIPS.schema, "zone", [pe.agg.count(alias="_seq")], "updates")
    check_aggregate(TRIPS.schema, "zone", [pe.agg.count(alias="_seq")], "final")  # no _seq there


def test_a_misspelt_key_is_refused_when_the_job_is_built(tmp_path) -> None:
    env = pe.StreamEnvironment()
    with pytest.raises(ColumnNotFoundError, match=r"key_by\('zome'\).*zone, fare, driver.*did you mean 'zone'"):
        env.from_collection(TRIPS).key_by("zome")
    pq.write_table(TRIPS, tmp_path / "trips.parquet")
    with pytest.raises(ColumnNotFoundError, match="'zome'"):
        env.read_files(str(tmp_path)).key_by("zome")
    with pytest.raises(ColumnNotFoundError, match="'zone'"):  # read_files(columns=) narrows the schema
        env.read_files(str(tmp_path), columns=["fare"]).key_by("zone")
    with pytest.raises(ColumnNotFoundError, match="'zome'"):  # a filter keeps the columns
        env.from_collection(TRIPS).filter(lambda r: True).key_by("zome")


def test_a_misspelt_aggregate_column_is_refused_when_the_job_is_built() -> None:
    env = pe.StreamEnvironment()
    with pytest.raises(ColumnNotFoundError, match=r"pe.agg.sum\('fair'\).*did you mean 'fare'"):
        env.from_collection(TRIPS).key_by("zone").aggregate(pe.agg.sum("fair"))
    with pytest.raises(AggregateInputError, match="numeric"):
        env.from_collection(TRIPS).key_by("zone").aggregate(pe.agg.mean("driver"))


def test_after_a_map_the_schema_is_unknown_and_a_missing_column_fails_at_once_at_run_time() -> None:
    env = pe.StreamEnvironment(restart_attempts=3)
    (
        env.from_collection(TRIPS)
        .map_batches(lambda b: b.drop_columns(["fare"]))
        .key_by("zone")  # not checked: map_batches may change the columns
        .aggregate(pe.agg.sum("fare"))
        .sink_to(pe.sinks.CollectSink())
    )
    result = execute(env, "missing-at-run-time")
    assert result.status == "FAILED"
    assert is_non_retryable(result.cause) and "'fare'" in str(result.cause)
    assert result.restarts == 0


def test_a_non_numeric_column_fails_at_once_at_run_time() -> None:
    env = pe.StreamEnvironment(restart_attempts=3)
    records = [{"zone": 1, "driver": "a"}]  # a list of dicts: no schema before it runs
    env.from_collection(records).key_by("zone").aggregate(pe.agg.sum("driver")).sink_to(pe.sinks.CollectSink())
    result = execute(env, "text-at-run-time")
    assert result.status == "FAILED" and "numeric column" in str(result.cause)
    assert is_non_retryable(result.cause) and result.restarts == 0


# -- inputs of the wrong kind --------------------------------------------------------------


def _fake(module: str, name: str, **attrs: Any) -> Any:
    """An object whose type looks like ``module.name`` (pandas and pyspark need not be installed)."""
    cls = type(name, (), {"__module__": module, "__iter__": lambda self: iter(["col_a", "col_b"]), **attrs})
    return cls()


def test_from_collection_refuses_a_pandas_dataframe_naming_the_call() -> None:
    env = pe.StreamEnvironment()
    with pytest.raises(TypeError, match=r"pandas DataFrame.*from_collection\(pa.Table.from_pandas\(df\)\)"):
        env.from_collection(_fake("pandas.core.frame", "DataFrame"))


def test_from_collection_refuses_a_spark_dataframe_naming_from_dataframe() -> None:
    env = pe.StreamEnvironment()
    with pytest.raises(TypeError, match=r"Spark DataFrame: use env.from_dataframe\(df\)"):
        env.from_collection(_fake("pyspark.sql.dataframe", "DataFrame", isStreaming=False))
    with pytest.raises(TypeError, match=r"Spark DataFrame: use env.from_dataframe\(df\)"):  # Spark Connect
        env.from_collection(_fake("pyspark.sql.connect.dataframe", "DataFrame", isStreaming=False))
    with pytest.raises(TypeError, match=r"streaming Spark DataFrame.*spark.read.*foreachBatch"):
        env.from_collection(_fake("pyspark.sql.dataframe", "DataFrame", isStreaming=True))


def test_from_collection_refuses_strings_mappings_and_other_dataframes() -> None:
    env = pe.StreamEnvironment()
    with pytest.raises(TypeError, match=r"from_collection\(\[value\]\)"):
        env.from_collection("abc")
    with pytest.raises(TypeError, match=r"pa.table\(d\)"):
        env.from_collection({"a": [1, 2]})
    with pytest.raises(TypeError, match=r"df.to_arrow\(\)"):
        env.from_collection(_fake("polars.dataframe.frame", "DataFrame"))
    with pytest.raises(TypeError, match="got int"):
        env.from_collection(42)  # type: ignore[arg-type]
    env.from_collection(iter([{"a": 1}]))  # any other iterable of records is fine
    env.from_collection(pa.record_batch({"a": [1]}))


def test_from_dataframe_refuses_a_streaming_dataframe_naming_the_right_way() -> None:
    env = pe.StreamEnvironment()
    with pytest.raises(TypeError, match=r"streaming.*spark.read.*foreachBatch"):
        env.from_dataframe(_fake("pyspark.sql.dataframe", "DataFrame", isStreaming=True))


class _HoldsALock(pe.KeyedProcessFunction):
    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()

    def process_element(self, value: Any, ctx: Any) -> Any:
        yield value


def test_a_function_that_cannot_be_copied_per_subtask_is_named_with_the_fix() -> None:
    """Each subtask runs its own copy of a function: one holding a lock is refused on
    the threads executor too, naming the step, the attribute and open(), not with
    copy's bare 'cannot pickle' (the process runner names it the same way)."""
    env = pe.StreamEnvironment(parallelism=2, monitoring=None)
    env.from_collection([{"k": 1}]).key_by("k").process(_HoldsALock()).sink_to(pe.sinks.CollectSink())
    with pytest.raises(TypeError) as refused:
        env.execute("holds-a-lock")
    message = str(refused.value)
    assert "process" in message and "attribute 'lock' of _HoldsALock" in message and "open()" in message, message
