"""``pyengine.spark.transform_with_state`` on a DataFrame against Spark's own
``GroupedData.transformWithState``: the same processor, the same batch DataFrame,
on Spark ``local[2]``, equal results (Spark 4 runs transformWithState in batch
queries: every key's rows in one call)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor
from spark_sessions import local_spark

import pyengine as pe
from pyengine.spark.tws_dataframe import transform_with_state, transform_with_state_in_pandas

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # a local Spark per module

N = 400


@pytest.fixture(scope="module")
def spark():
    yield from local_spark(__name__, "pyengine-tws-tests", 2, {"spark.sql.shuffle.partitions": "2"})


class CountAndSum(StatefulProcessor):
    """A value and a list state, and an initial state: a count, and the last values seen."""

    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "count bigint")
        self.seen = handle.getListState("seen", "v bigint")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.count.update((initialState.start,))

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        n, total = 0, 0
        for row in rows:
            n += 1
            total += row.v
            self.seen.appendValue((row.v,))
        old = self.count.get()
        count = (old[0] if old else 0) + n
        self.count.update((count,))
        kept = sorted(v for (v,) in self.seen.get())[-3:]
        yield Row(user=key[0], count=count, total=total, top=kept[-1])

    def close(self) -> None:
        pass


class CountAndSumPandas(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "count bigint")
        self.seen = handle.getListState("seen", "v bigint")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.count.update((int(initialState["start"].iloc[0]),))

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        import pandas as pd

        n, total = 0, 0
        for df in rows:
            n += len(df)
            total += int(df["v"].sum())
            self.seen.appendList([(int(v),) for v in df["v"]])
        old = self.count.get()
        count = (old[0] if old else 0) + n
        self.count.update((count,))
        top = max(v for (v,) in self.seen.get())
        yield pd.DataFrame({"user": [key[0]], "count": [count], "total": [total], "top": [top]})

    def close(self) -> None:
        pass


SCHEMA = "user bigint, count bigint, total bigint, top bigint"


def _sorted(df: Any) -> list:
    return sorted(tuple(r) for r in df.collect())


def test_transform_with_state_on_a_dataframe_equals_sparks_own(tmp_path, spark) -> None:
    df = spark.createDataFrame([(i % 7, i) for i in range(N)], "user bigint, v bigint")
    initial = spark.createDataFrame([(u, 100 * u) for u in range(0, 7, 2)], "user bigint, start bigint")
    theirs = _sorted(
        df.groupBy("user").transformWithState(CountAndSum(), SCHEMA, "Update", "None", initial.groupBy("user"))
    )
    assert len(theirs) == 7 and theirs[2][1] == 200 + sum(1 for i in range(N) if i % 7 == 2)
    # local[2]: one subtask per chain (a job's tasks run at once, two chains of them).
    env = pe.StreamEnvironment(
        parallelism=1, checkpointing=pe.CheckpointConfig(interval_ms=50), checkpoint_storage=str(tmp_path / "ck")
    )
    ours = transform_with_state(
        df.groupBy("user"), CountAndSum(), SCHEMA, "Update", "None", initial.groupBy("user"),
        env=env, path=str(tmp_path / "rows"),
    )  # fmt: skip
    assert _sorted(ours) == theirs
    assert ours.schema.simpleString() == "struct<user:bigint,count:bigint,total:bigint,top:bigint>"
    # The pandas flavour of the same processor, an initial state keyed by another name.
    renamed = initial.withColumnRenamed("user", "u")
    pandas_out = transform_with_state_in_pandas(
        df.groupBy("user"), CountAndSumPandas(), SCHEMA, "Append", "none", renamed.groupBy("u"),
        path=str(tmp_path / "pandas"),
    )  # fmt: skip
    assert _sorted(pandas_out) == theirs


def test_what_a_dataframe_call_refuses(spark) -> None:
    df = spark.createDataFrame([(1, 1)], "user bigint, v bigint")
    from pyspark.sql import functions as F

    with pytest.raises(ValueError, match="EventTime"):
        transform_with_state(df.groupBy("user"), CountAndSum(), SCHEMA, "Update", "EventTime")
    with pytest.raises(ValueError, match="outputMode"):
        transform_with_state(df.groupBy("user"), CountAndSum(), SCHEMA, "Complete", "None")
    with pytest.raises(ValueError, match="columns only"):
        transform_with_state(df.groupBy(F.col("user") + 1), CountAndSum(), SCHEMA, "Update", "None")
    with pytest.raises(TypeError, match="GroupedData"):
        transform_with_state(df, CountAndSum(), SCHEMA, "Update", "None")
    with pytest.raises(TypeError, match="instance"):
        transform_with_state(df.groupBy("user"), CountAndSum, SCHEMA, "Update", "None")


class Sequence(StatefulProcessor):
    """One row per call: the key, how many rows the call got, and a digest of their
    order (so a call per buffer, or rows out of order, shows)."""

    def init(self, handle: Any) -> None:
        self.calls = handle.getValueState("calls", "n bigint")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        vs = [row.v for row in rows]
        old = self.calls.get()
        calls = (old[0] if old else 0) + 1
        self.calls.update((calls,))
        digest = 0
        for v in vs:
            digest = (digest * 1_000_003 + v) % 2**61
        yield Row(user=key[0], n=len(vs), calls=calls, digest=digest)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("pandas", [False, True])
def test_a_dataframe_is_one_batch_one_call_per_key_in_its_order(tmp_path, spark, pandas) -> None:
    """Spark's batch transformWithState: handleInputRows once per key with all its rows,
    one output per call; here in the DataFrame's order too, whatever the buffers and
    checkpoints (tiny buffers, checkpoints every 20 ms), the same on every run."""
    rows = [((i * 7919) % 50, i) for i in range(6000)]
    df = spark.createDataFrame(rows, "user bigint, v bigint").repartition(3)
    order = [tuple(r) for r in df.collect()]  # the DataFrame's own order
    expected = {}
    for user, v in order:
        n, digest = expected.get(user, (0, 0))
        expected[user] = (n + 1, (digest * 1_000_003 + v) % 2**61)
    schema = "user bigint, n bigint, calls bigint, digest bigint"
    theirs = _sorted(df.groupBy("user").transformWithState(Sequence(), schema, "Update", "None"))
    assert [(u, n, c) for u, n, c, _ in theirs] == [(u, expected[u][0], 1) for u in sorted(expected)]

    processor: Any = Sequence()
    if pandas:

        class SequencePandas(Sequence):
            def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
                import pandas as pd

                frames = list(rows)
                assert len(frames) == 1  # one DataFrame per key per batch
                for r in super().handleInputRows(key, iter(Row(v=int(v)) for v in frames[0]["v"]), timerValues):
                    yield pd.DataFrame([r.asDict()])

        processor = SequencePandas()
    for attempt in range(2):
        env = pe.StreamEnvironment(
            parallelism=1,
            buffer_size=7,
            checkpointing=pe.CheckpointConfig(interval_ms=20),
            checkpoint_storage=str(tmp_path / f"ck{attempt}"),
        )
        call = transform_with_state_in_pandas if pandas else transform_with_state
        ours = _sorted(
            call(df.groupBy("user"), processor, schema, "Update", "None", env=env, path=str(tmp_path / f"o{attempt}"))
        )
        assert ours == [(u, n, 1, d) for u, (n, d) in sorted(expected.items())]
