"""Spark's ``GroupedData.transformWithState`` / ``transformWithStateInPandas``, run by pyengine.

``transform_with_state(df.groupBy("user"), processor, outputStructType, outputMode,
timeMode)`` takes what Spark's method takes and returns a DataFrame, as Spark's
does; the processor runs through the adapter (``pyengine.spark.tws``) as a pyengine
job on the Spark executors (the Spark runner, on the
DataFrame's session, which must be the active one):

* the input is ``env.from_dataframe(df)`` (a replayable source: a restore replays
  exactly what a checkpoint did not cover);
* the output goes to a ``FileSink`` of parquet part files, which commit with the
  job's checkpoints, exactly once per run even when tasks fail and restart;
* the DataFrame returned is ``spark.read`` of those committed files (Spark skips
  the sink's ``_staging`` and ``_pyengine`` directories, as every name starting with
  ``_``), typed by ``outputStructType``.

Why files, not ``createDataFrame`` of collected rows: the output can be larger than
the driver, and committed files are what the exactly-once protocol already makes;
reading them back is one scan.

As Spark's batch ``transformWithState``: the DataFrame is one batch, so
``handleInputRows`` is called once per key with all its rows, in the DataFrame's order
(``monotonically_increasing_id``, added as a column the processor never sees), one
output per call; the rows wait in keyed state until the input ends, so a checkpoint
in between keeps them and a restore goes on from there (deterministic whatever the
buffers, checkpoints or failures).

Differences from Spark, on purpose: ``timeMode="EventTime"`` is refused (a batch
DataFrame has no watermark for pyengine to start from; use
``KeyedStream.transform_with_state`` with a watermark strategy); the grouping must
be by columns (``groupBy("a", "b")`` or ``groupBy(col("a"))``), not expressions;
``initialState`` is collected on the driver and shipped with the job (it should fit
in memory, as a broadcast)."""

from __future__ import annotations

import tempfile
from typing import Any, List, Optional

from .tws import ORDER_COLUMN, check_processor, parse_schema, time_mode_of
from .tws_build import build

__all__ = ["transform_with_state", "transform_with_state_in_pandas"]

_OUTPUT_MODES = ("append", "update")


def transform_with_state(
    grouped: Any,
    statefulProcessor: Any,
    outputStructType: Any,
    outputMode: str,
    timeMode: str,
    initialState: Any = None,
    eventTimeColumnName: str = "",
    *,
    env: Any = None,
    path: Optional[str] = None,
) -> Any:
    """As ``grouped.transformWithState(...)`` (Spark 4), run by pyengine on Spark's
    executors; returns the output as a DataFrame. ``env``: the ``StreamEnvironment``
    to run in (its parallelism, checkpointing, state backend); by default one with
    the session's default parallelism. ``path``: where the committed output files go
    (by default a new temporary directory; it must be readable by the executors)."""
    return _run(
        grouped, statefulProcessor, outputStructType, outputMode, timeMode, initialState, eventTimeColumnName,
        env=env, path=path, pandas=False,
    )  # fmt: skip


def transform_with_state_in_pandas(
    grouped: Any,
    statefulProcessor: Any,
    outputStructType: Any,
    outputMode: str,
    timeMode: str,
    initialState: Any = None,
    eventTimeColumnName: str = "",
    *,
    env: Any = None,
    path: Optional[str] = None,
) -> Any:
    """As ``grouped.transformWithStateInPandas(...)``: the processor gets and yields
    pandas DataFrames. Otherwise as ``transform_with_state``."""
    return _run(
        grouped, statefulProcessor, outputStructType, outputMode, timeMode, initialState, eventTimeColumnName,
        env=env, path=path, pandas=True,
    )  # fmt: skip


def grouping_columns(grouped: Any) -> List[str]:
    """The column names a ``GroupedData`` groups by. Classic PySpark keeps them in
    the JVM (``RelationalGroupedDataset.groupingExprs``), Spark Connect in
    ``_grouping_cols``; expressions other than columns are refused."""
    names: List[str] = []
    connect = getattr(grouped, "_grouping_cols", None)
    if connect is not None:
        for c in connect:
            name = getattr(c, "_expr", None)
            text = str(name) if name is not None else str(c)
            if not text.replace("_", "").isalnum():
                raise ValueError(f"transform_with_state groups by columns only, got the expression {text!r}")
            names.append(text)
        return names
    exprs = grouped._jgd.groupingExprs()
    for i in range(exprs.size()):
        expr = exprs.apply(i)
        kind = expr.getClass().getSimpleName()
        if kind not in ("UnresolvedAttribute", "AttributeReference"):
            raise ValueError(
                f"transform_with_state groups by columns only, got {expr.toString()!r} ({kind}): "
                "add it as a column first (df.withColumn(name, expression)) and group by that name"
            )
        names.append(str(expr.name()))
    return names


def _key_selector(columns: List[str]) -> Any:
    if len(columns) == 1:
        return columns[0]  # a column name: the adapter's columnar grouping applies
    cols = tuple(columns)

    def key(record: Any) -> Any:
        return tuple(record[c] for c in cols)

    return key


def _run(
    grouped: Any,
    processor: Any,
    output: Any,
    output_mode: str,
    time_mode: str,
    initial_state: Any,
    event_time_column: str,
    *,
    env: Any,
    path: Optional[str],
    pandas: bool,
) -> Any:
    from pyspark.sql import GroupedData

    import pyengine as pe

    from .tws import spark_arrow_schema

    if not isinstance(grouped, GroupedData):
        raise TypeError(f"transform_with_state takes df.groupBy(...) (a GroupedData), got {type(grouped).__name__}")
    check_processor(processor)
    mode = time_mode_of(time_mode)
    if mode == "EventTime" or event_time_column:
        raise ValueError(
            "timeMode='EventTime' is not supported on a DataFrame by pyengine (a batch DataFrame has no "
            "watermark to start from): use env.from_dataframe(df).assign_timestamps_and_watermarks(...)"
            ".key_by(...).transform_with_state(..., time_mode='EventTime')"
        )
    if not isinstance(output_mode, str) or output_mode.lower() not in _OUTPUT_MODES:
        raise ValueError(
            f"outputMode must be 'Append' or 'Update' (as Spark's transformWithState), got {output_mode!r}"
        )
    struct = parse_schema(output, "outputStructType")
    df = grouped._df
    spark = df.sparkSession
    columns = grouping_columns(grouped)
    initial = None
    if initial_state is not None:
        if not isinstance(initial_state, GroupedData):
            raise TypeError(f"initialState must be a GroupedData (initial_df.groupBy(...)), got {initial_state!r}")
        initial_df = initial_state._df
        initial_columns = grouping_columns(initial_state)
        if len(initial_columns) != len(columns):
            raise ValueError(f"initialState groups by {initial_columns}, the input by {columns}: not the same key")
        for theirs, ours in zip(initial_columns, columns, strict=True):
            if theirs != ours:  # keyed by the input's names, so one key selector serves both
                initial_df = initial_df.withColumnRenamed(theirs, ours)
        initial = initial_df.toArrow()
    if env is None:
        # The job's tasks run at once (a barrier stage), two operator chains of them
        # (the source's and the processor's): as many as the cluster's slots allow.
        env = pe.StreamEnvironment(parallelism=max(1, int(spark.sparkContext.defaultParallelism) // 2))
    out = path or tempfile.mkdtemp(prefix="pyengine-tws-")
    sink = pe.sinks.FileSink(out, format="parquet", mode="overwrite", schema=spark_arrow_schema(struct))
    # Spark's batch semantics: the whole DataFrame is one batch, each key's rows in one
    # call, in the DataFrame's order (the order column says it; a key's rows reach the
    # operator from several source subtasks in any interleaving).
    from pyspark.sql import functions as F

    ordered = df.withColumn(ORDER_COLUMN, F.monotonically_increasing_id())
    keyed = env.from_dataframe(ordered, "transform_with_state-input").key_by(_key_selector(columns))
    build(
        keyed, processor, struct, flavour="pandas" if pandas else "row", time_mode=mode, event_time_column=None,
        initial_state=initial, whole_input=True,
    ).uid("transform_with_state").sink_to(sink)  # fmt: skip
    name = f"transform_with_state-{type(processor).__name__}"
    # runner="spark" runs on the active session (pyengine.spark may not import the
    # runners: a layer below it); the DataFrame's own session must be that one.
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is not spark:
        raise ValueError("the DataFrame's SparkSession is not the active one: the job runs on the active session")
    result = env.execute(name, runner="spark")
    if result.status != "FINISHED":  # a failure raises JobFailedError; a cancel ends here
        raise RuntimeError(f"{name} did not finish: {result.status}")
    return spark.read.schema(struct).parquet(out)
