"""Spark's own ``transformWithState`` test scenarios, as an acceptance suite for the adapter.

Apache Spark's Python tests for ``transformWithState`` (``python/pyspark/sql/tests/
pandas/helper/helper_pandas_transform_with_state.py`` and the tests driving it) are not
in the pyspark 4.3.0 wheel nor in its PyPI source distribution (checked: the sdist holds
``pyspark/sql/streaming/transform_with_state_driver_worker.py`` and no ``tests``), so they
cannot be loaded at test time from a pinned release. The processors here are our own,
written from what Spark's do and assert (the same state calls, the same checks, the
answers Spark's tests expect); where Spark 4.3's ``TwsTester`` disagrees with a Spark
run (a timer at or before the watermark), the run is followed.

Each runs the operator as a task drives it (``process`` per micro-batch,
``process_watermark``), in both flavours where Spark has both."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from typing import Any, Dict, Iterator, List, NamedTuple

import pandas as pd
import pytest
from pyspark.errors import PySparkRuntimeError
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)
from test_tws import Clock, make_operator, rows_of, snapshot_of

import pyengine as pe
from pyengine.runtime.keyed import key_selector
from pyengine.spark.tws import TransformWithStateOperator
from pyengine.spark.tws_schema import StateSchemaEvolutionError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def restart(op: TransformWithStateOperator, processor: Any, schema: Any, **kw: Any) -> TransformWithStateOperator:
    """A new attempt of ``op``'s job, restored from its snapshot, running ``processor``."""
    restored = snapshot_of(op)
    new = TransformWithStateOperator("tws", "tws", key_selector("user"), processor, schema, clock=Clock(), **kw)
    new.setup(op.ctx, restored)  # type: ignore[arg-type]
    new.open()
    return new


# -- a deleted state's handle fails on its next use (SimpleStatefulProcessor, its TTL variant) ---


class Violations(StatefulProcessor):
    """Counts readings over 100 per key; a state declared then deleted in ``init``
    must fail on use with Spark's error, which the processor asserts."""

    def __init__(self, pandas: bool, ttl: Any = None) -> None:
        self.pandas = pandas
        self.ttl = ttl
        self.checked = 0

    def init(self, handle: Any) -> None:
        self.violations = handle.getValueState("violations", "value int", self.ttl)
        self.scratch = handle.getValueState("scratch", StructType([StructField("value", IntegerType())]))
        handle.deleteIfExists("scratch")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        for call in (self.scratch.exists, self.scratch.get, lambda: self.scratch.update((1,))):
            with pytest.raises(PySparkRuntimeError, match=r"Error (checking|getting|updating) value state"):
                call()
        self.checked += 1
        old = self.violations.get()
        n = old[0] if old else 0
        count = 0
        for chunk in rows:
            temps = list(chunk["temperature"]) if self.pandas else [chunk.temperature]
            count += len(temps)
            n += sum(t > 100 for t in temps)
        self.violations.update((n,))
        if self.pandas:
            yield pd.DataFrame({"user": [key[0]], "count": [count], "violations": [n]})
        else:
            yield Row(user=key[0], count=count, violations=n)


@pytest.mark.parametrize("ttl", [None, 30_000])
@pytest.mark.parametrize("flavour", ["row", "pandas"])
def test_a_deleted_state_raises_sparks_error_on_its_next_use(flavour: str, ttl: Any) -> None:
    schema = "user string, count int, violations int"
    proc = Violations(flavour == "pandas", ttl)
    op = make_operator(proc, schema, flavour=flavour)
    batch1 = [{"user": "0", "temperature": t} for t in (123, 90)] + [
        {"user": "1", "temperature": t} for t in (190, 145)
    ]
    out = sorted(rows_of(op.process(batch1)), key=lambda r: r["user"])
    assert [(r["user"], r["violations"]) for r in out] == [("0", 1), ("1", 2)]  # Spark's batch 0
    batch2 = [{"user": "0", "temperature": t} for t in (101, 102, 103)] + [{"user": "1", "temperature": 200}]
    op = restart(op, Violations(flavour == "pandas", ttl), schema, flavour=flavour)
    out = sorted(rows_of(op.process(batch2)), key=lambda r: r["user"])
    assert [(r["user"], r["violations"]) for r in out] == [("0", 4), ("1", 3)]  # Spark's batch 1
    assert op.processor.checked == 2


def test_a_deleted_state_used_without_catching_fails_the_job_at_once() -> None:
    class Careless(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.s = handle.getValueState("s", "v bigint")
            handle.deleteIfExists("s")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            self.s.update((1,))
            yield Row(user=key[0])

    op = make_operator(Careless(), "user bigint")
    with pytest.raises(pe.errors.NonRetryableError, match=r"Error updating value state.*deleteIfExists") as info:
        op.process([{"user": 1}])
    assert isinstance(info.value.__cause__, PySparkRuntimeError)


def test_a_state_declared_again_after_its_delete_works() -> None:
    class Again(StatefulProcessor):
        def init(self, handle: Any) -> None:
            handle.getMapState("m", "k string", "v bigint")
            handle.deleteIfExists("m")
            self.m = handle.getMapState("m", "k string", "v bigint")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            self.m.updateValue("a", (len(list(rows)),))
            yield Row(user=key[0], n=self.m.getValue(("a",))[0])

    op = make_operator(Again(), "user bigint, n bigint")
    assert rows_of(op.process([{"user": 1}, {"user": 1}])) == [{"user": 1, "n": 2}]


# -- event time: Spark's watermark, timers at or before it, late rows (EventTimeStatefulProcessor) --


class MaxEventTime(StatefulProcessor):
    """The max event time (s) seen per key; a timer at the watermark on every batch,
    which clears it when it fires (Spark's EventTimeStatefulProcessor's behaviour)."""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.max = handle.getValueState("max", "value string")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        seconds = [r.eventTime.timestamp() // 1 for r in rows]
        old = self.max.get()
        top = str(int(max([int(old[0]) if old else 0, *seconds])))
        self.max.update((top,))
        self.handle.registerTimer(timerValues.getCurrentWatermarkInMs())
        yield Row(id=key[0], timestamp=top, wm=timerValues.getCurrentWatermarkInMs())

    def handleExpiredTimer(self, key: Any, timerValues: Any, info: Any) -> Iterator[Any]:
        self.max.clear()
        self.handle.deleteTimer(info.getExpiryTimeInMs())
        yield Row(
            id=f"{key[0]}-expired", timestamp=str(info.getExpiryTimeInMs()), wm=timerValues.getCurrentWatermarkInMs()
        )


def _at(seconds: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc)


def test_timers_at_the_watermark_fire_in_the_same_batch_and_the_watermark_is_sparks() -> None:
    """Spark's batch 0 (watermark 0): the timer registered at 0 fires after the rows, in
    the same batch; with a 10 s delay after a max of 20 s, Spark's watermark is 10000 ms
    (pyengine's bounded-out-of-orderness generator gives 9999: Spark's shows one more)."""
    op = make_operator(MaxEventTime(), "id string, timestamp string, wm bigint", time_mode="EventTime")
    op.event_time = lambda r: int(r["eventTime"].timestamp() * 1000)
    batch = [{"user": "a", "eventTime": _at(s)} for s in (10, 15, 20)]
    assert sorted(map(tuple, (r.values() for r in rows_of(op.process(batch))))) == [
        ("a", "20", 0),
        ("a-expired", "0", 0),
    ]
    assert rows_of(op.process_watermark(20_000 - 10_000 - 1)) == []  # the generator's; no timer pending
    assert op.spark_watermark() == 10_000
    out = rows_of(op.process([{"user": "a", "eventTime": _at(10)}, {"user": "a", "eventTime": _at(11)}]))
    assert [(r["id"], r["timestamp"], r["wm"]) for r in out] == [("a", "11", 10_000), ("a-expired", "10000", 10_000)]
    assert op.late_records_dropped == 1  # 10 s is at the watermark: late on Spark


def test_the_watermark_a_bounded_out_of_orderness_generator_gives_reaches_the_processor_as_sparks() -> None:
    """``withWatermark("ts", "10 seconds")`` after a max of 28 s: Spark shows 18000 (not
    the generator's 17999), a row at 18 s is late (dropped), one at 19 s is not; and a
    count of one batch's rows is Spark's (EventTimeCountProcessor: 4, not 5)."""
    import numpy as np

    from pyengine.time.strategy import WatermarkGenerator

    class Seen(StatefulProcessor):
        def init(self, handle: Any) -> None:
            pass

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            ts = [r.ts for r in rows]
            yield Row(user=key[0], n=len(ts), wm=timerValues.getCurrentWatermarkInMs())

    generator = WatermarkGenerator(10_000, None, 0)
    generator.on_timestamps(np.array([28_000]), 0)
    op = make_operator(Seen(), "user bigint, n bigint, wm bigint", time_mode="EventTime")
    op.process_watermark(generator.current)
    assert generator.current == 17_999 and op.spark_watermark() == 18_000
    (row,) = rows_of(op.process([{"user": 1, "ts": t} for t in (17_000, 18_000, 18_001, 19_000, 25_000, 30_000)]))
    assert row == {"user": 1, "n": 4, "wm": 18_000}


# -- composite types: a bare one-field map key, nested structs as Row (StatefulProcessorCompositeType) --


class Address(NamedTuple):
    road_id: int
    city: str


TAGS = [["t1", "t2"], ["t3"]]
METADATA = [{"key": "env", "value": "prod"}, {"key": "region", "value": "us-west"}]
ADDRESS = [Address(1, "Seattle"), Address(3, "SF")]
OBJ = StructType(
    [
        StructField("id", ArrayType(IntegerType())),
        StructField("tags", ArrayType(ArrayType(StringType()))),
        StructField(
            "metadata", ArrayType(StructType([StructField("key", StringType()), StructField("value", StringType())]))
        ),
        StructField(
            "address", ArrayType(StructType([StructField("road_id", IntegerType()), StructField("city", StringType())]))
        ),
    ]
)
MAP_VALUE = StructType(
    [
        StructField("id", IntegerType()),
        StructField("attributes", MapType(StringType(), ArrayType(IntegerType()))),
        StructField("confs", MapType(StringType(), MapType(StringType(), IntegerType()))),
    ]
)


class Composite(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.obj = handle.getValueState("obj", OBJ)
        self.items = handle.getListState("items", OBJ)
        self.map = handle.getMapState("map", "name string", MAP_VALUE)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        name = key[0]
        total = sum(int(r.temperature) for r in rows)
        if self.obj.exists():
            ids, tags, metadata, address = self.obj.get()
            assert tags == TAGS
            assert metadata == [Row(**m) for m in METADATA] and all(isinstance(m, Row) for m in metadata)
            assert [m.asDict() for m in metadata] == METADATA
            assert address == [Row(**a._asdict()) for a in ADDRESS]
            ids = [x + total for x in ids]
        else:
            ids = [0]
        self.obj.update((ids, TAGS, METADATA, ADDRESS))
        updated = []
        for ids_, tags, metadata, address in self.items.get():
            ids_.append(total)
            updated.append((ids_, tags, [m.asDict() for m in metadata], address))  # Rows, as on Spark
        self.items.put(updated or [(ids, TAGS, METADATA, ADDRESS)])
        if not self.map.containsKey(name):  # a bare str for the one-field key, as Spark takes it
            self.map.updateValue(name, (0, {"k1": [1]}, {"e1": {"e2": 5}}))
        else:
            i, attributes, confs = self.map.getValue(name)
            attributes[name] = [total]
            confs.setdefault("e1", {})[name] = total
            self.map.updateValue(name, (i, attributes, confs))
        _, attributes, confs = self.map.getValue(name)
        flat = [x for ids_, *_ in self.items.get() for x in ids_]
        yield Row(
            user=name,
            value_arr=",".join(map(str, ids)),
            list_arr=",".join(map(str, flat)),
            map_arr=json.dumps(attributes, sort_keys=True),
            nested=json.dumps(confs, sort_keys=True),
        )


COMPOSITE_OUT = "user string, value_arr string, list_arr string, map_arr string, nested string"


@pytest.mark.parametrize("restore", [False, True])
def test_composite_state_gives_rows_for_structs_and_takes_a_bare_map_key(restore: bool) -> None:
    op = make_operator(Composite(), COMPOSITE_OUT)
    first = rows_of(op.process([{"user": "0", "temperature": 123}, {"user": "0", "temperature": 46}]))
    assert first[0]["value_arr"] == "0" and first[0]["map_arr"] == '{"k1": [1]}'
    if restore:  # from the checkpoint's Arrow files: structs come back as dicts there
        op = restart(op, Composite(), COMPOSITE_OUT)
    (row,) = rows_of(op.process([{"user": "0", "temperature": 10}]))
    assert row == {
        "user": "0",
        "value_arr": "10",
        "list_arr": "0,10",
        "map_arr": '{"0": [10], "k1": [1]}',
        "nested": '{"e1": {"0": 10, "e2": 5}}',
    }


# -- int -> decimal output coercion (IntToDecimalProcessor) ------------------------------------


@pytest.mark.parametrize("flavour", ["row", "pandas"])
def test_an_int_output_into_a_decimal_column_is_coerced(flavour: str) -> None:
    class IntToDecimal(StatefulProcessor):
        def init(self, handle: Any) -> None:
            pass

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            list(rows)
            if flavour == "pandas":
                yield pd.DataFrame({"user": [key[0]], "d": [12345]})
            else:
                yield Row(user=key[0], d=12345)

    op = make_operator(IntToDecimal(), "user string, d decimal(10,2)", flavour=flavour)
    out = rows_of(op.process([{"user": "1"}, {"user": "1"}, {"user": "2"}]))
    assert sorted((r["user"], r["d"]) for r in out) == [
        ("1", decimal.Decimal("12345.00")),
        ("2", decimal.Decimal("12345.00")),
    ]


# -- state schema evolution across restarts (Basic -> AddFields -> RemoveFields -> Reordered -> Upcast) --


def _evolving(fields: List[StructField], make: Any) -> Any:
    schema = StructType(fields)

    class Evolving(StatefulProcessor):
        state_schema = schema

        def init(self, handle: Any) -> None:
            self.state = handle.getValueState("state", schema)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            list(rows)
            old = self.state.get()
            value = make(int(key[0]), old)
            self.state.update(tuple(value[f.name] for f in schema.fields))
            yield Row(user=key[0], value=json.dumps(value, sort_keys=True))

    return Evolving()


ID, NAME = StructField("id", IntegerType()), StructField("name", StringType())
EXTRA = [StructField("count", IntegerType()), StructField("active", BooleanType()), StructField("score", FloatType())]


def basic() -> Any:
    return _evolving([ID, NAME], lambda i, old: {"id": i, "name": f"name-{i}"})


def add_fields() -> Any:
    def make(i: int, old: Any) -> Dict[str, Any]:
        if old is None:
            return {"id": i, "name": f"name-{i}", "count": 100, "active": True, "score": 99.9}
        return {"id": old[0], "name": old[1] + "0", "count": old[2], "active": old[3], "score": old[4]}

    return _evolving([ID, NAME, *EXTRA], make)


def remove_fields() -> Any:
    return _evolving([ID, NAME], lambda i, old: {"id": i, "name": old[1] if old else f"name-{i}"})


def reordered() -> Any:
    fields = [NAME, ID, EXTRA[2], EXTRA[0], EXTRA[1]]
    return _evolving(
        fields, lambda i, old: {"name": old[0], "id": old[1], "score": old[2], "count": old[3], "active": old[4]}
    )


def upcast() -> Any:
    long_id = StructField("id", LongType())
    return _evolving([long_id, NAME], lambda i, old: {"id": i + (old[0] + 1 if old else 0), "name": f"name-{i}"})


OUT = "user string, value string"


def test_state_schema_evolution_across_restarts_as_spark() -> None:
    op = make_operator(basic(), OUT)
    assert json.loads(rows_of(op.process([{"user": "0"}]))[0]["value"]) == {"id": 0, "name": "name-0"}
    op = restart(op, add_fields(), OUT)
    got = json.loads(rows_of(op.process([{"user": "0"}]))[0]["value"])
    assert got == {"id": 0, "name": "name-00", "count": None, "active": None, "score": None}  # added: null
    op = restart(op, remove_fields(), OUT)
    assert json.loads(rows_of(op.process([{"user": "0"}]))[0]["value"]) == {"id": 0, "name": "name-00"}
    op = restart(op, reordered(), OUT)
    got = json.loads(rows_of(op.process([{"user": "0"}]))[0]["value"])
    assert got["name"] == "name-00" and got["id"] == 0  # by name, not by position
    op = restart(op, upcast(), OUT)
    assert json.loads(rows_of(op.process([{"user": "0"}]))[0]["value"]) == {"id": 1, "name": "name-0"}


def test_a_downcast_of_a_state_field_is_refused_as_spark_refuses_it() -> None:
    op = make_operator(add_fields(), OUT)
    op.process([{"user": "0"}])
    op = restart(op, upcast(), OUT)  # id int -> bigint: taken
    op.process([{"user": "0"}])
    with pytest.raises(Exception, match=r"STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION.*'id' was bigint") as info:
        restart(op, basic(), OUT)  # bigint -> int: refused
    assert isinstance(info.value, pe.errors.NonRetryableError) or isinstance(
        info.value.__cause__, StateSchemaEvolutionError
    )


def test_a_checkpoint_without_recorded_schemas_restores_as_before() -> None:
    """A checkpoint of the current release records no schemas: its values are taken as they are."""
    op = make_operator(basic(), OUT)
    op.process([{"user": "0"}])
    op.state_schemas.clear()  # as main wrote it
    op = restart(op, remove_fields(), OUT)
    assert json.loads(rows_of(op.process([{"user": "0"}]))[0]["value"]) == {"id": 0, "name": "name-0"}


# -- micro-batches kept: one call per key per batch, processing-time timers between batches --------


def micro_operator(processor: Any, schema: str, **kw: Any) -> TransformWithStateOperator:
    op = make_operator(processor, schema, **kw)
    op.micro_batch = True
    op.micro_batch_max_delay_ms = None
    return op


def end_batch(op: TransformWithStateOperator, n: int) -> List[Dict[str, Any]]:
    """A checkpoint barrier: the micro-batch ends, its output goes out before it."""
    return rows_of(op.prepare_snapshot_pre_barrier(n))


class ChunkCount(StatefulProcessor):
    """Spark's ChunkCountProcessor: how many chunks (DataFrames) and rows a call got."""

    def init(self, handle: Any) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        chunks = list(rows)
        n = sum(len(c) for c in chunks)
        yield pd.DataFrame(
            {"user": [key[0]], "chunks": [len(chunks)], "n": [n], "first": [int(chunks[0]["v"].iloc[0])]}
        )


def test_a_micro_batch_is_one_call_per_key_whatever_the_buffers() -> None:
    op = micro_operator(ChunkCount(), "user bigint, chunks bigint, n bigint, first bigint", flavour="pandas")
    for i in range(10):  # ten buffers of one micro-batch
        assert rows_of(op.process([{"user": u, "v": 10 * i + u} for u in range(3)])) == []
    out = sorted(end_batch(op, 1), key=lambda r: r["user"])
    assert out == [{"user": u, "chunks": 1, "n": 10, "first": u} for u in range(3)]
    assert end_batch(op, 2) == []  # nothing gathered since
    op.process([{"user": 1, "v": 5}])
    assert rows_of(op.end_input()) == [{"user": 1, "chunks": 1, "n": 1, "first": 5}]


class ProcTimeCount(StatefulProcessor):
    """Spark's ProcTimeStatefulProcessor's behaviour: a running count per key; key "0"
    registers a timer 1 ms after each batch's time; when it fires, the key has two
    timers listed (the firing one, and the one its batch just set), and the count resets."""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "value string")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        old = self.count.get()
        count = (int(old[0]) if old else 0) + len(list(rows))
        if key == ("0",):
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 1)
        self.count.update((str(count),))
        yield Row(id=key[0], countAsString=str(count), timeValues=str(timerValues.getCurrentProcessingTimeInMs()))

    def handleExpiredTimer(self, key: Any, timerValues: Any, info: Any) -> Iterator[Any]:
        first = list(self.handle.listTimers())
        assert first == list(self.handle.listTimers())  # two iterations agree
        assert len(first) == 2, first
        self.count.clear()
        self.handle.deleteTimer(info.getExpiryTimeInMs())
        yield Row(id=key[0], countAsString="-1", timeValues=str(info.getExpiryTimeInMs()))


@pytest.mark.parametrize("micro_batch", [True, False])
def test_processing_time_timers_fire_between_micro_batches(micro_batch: bool) -> None:
    clock = Clock()
    clock.now = 1_000
    op = make_operator(ProcTimeCount(), "id string, countAsString string, timeValues string", clock=clock,
                       time_mode="ProcessingTime")  # fmt: skip
    op.micro_batch, op.micro_batch_max_delay_ms = micro_batch, None
    batch = [{"user": u} for u in ("0", "1", "0", "1", "1")]
    out = rows_of(op.process(batch[:2])) + rows_of(op.process(batch[2:])) + end_batch(op, 1)
    clock.now = 2_000
    out += rows_of(op.process(batch[:2])) + rows_of(op.process(batch[2:])) + end_batch(op, 2)
    got = sorted((r["id"], r["countAsString"], r["timeValues"]) for r in out)
    if micro_batch:  # Spark's answer: a batch's rows in one call; the timer set at 1001 fires in batch 2
        assert got == [
            ("0", "-1", "1001"),
            ("0", "2", "1000"),
            ("0", "4", "2000"),
            ("1", "3", "1000"),
            ("1", "6", "2000"),
        ]
    else:  # a call per buffer: two calls per key per batch, the timer fires with one listed
        assert len(got) > 5


def test_a_stream_keeps_its_micro_batches_end_to_end() -> None:
    """A bounded stream, no checkpoints, tiny buffers: the end of input is the only
    boundary, so each key gets one call with all its rows (in order); with
    micro_batch=False a call per key per buffer, as before."""

    class Gather(StatefulProcessor):
        def init(self, handle: Any) -> None:
            pass

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            vs = [r.v for r in rows]
            yield Row(user=key[0], n=len(vs), ordered=vs == sorted(vs))

    records = [{"user": i % 4, "v": i} for i in range(400)]
    results = {}
    for micro in (True, False):
        env = pe.StreamEnvironment(parallelism=2, buffer_size=5)
        env.from_collection(records).key_by("user").transform_with_state(
            Gather(), "user bigint, n bigint, ordered boolean", micro_batch=micro
        ).sink_to(pe.sinks.CollectSink())
        results[micro] = env.execute(f"micro-{micro}").records
    assert sorted((r["user"], r["n"], r["ordered"]) for r in results[True]) == [(u, 100, True) for u in range(4)]
    assert len(results[False]) > 4


@pytest.mark.parametrize("keys", ["int", "str", "bool"])
def test_a_large_pandas_batch_gives_each_key_its_rows_in_order_indexed_from_0(keys: str) -> None:
    """Past 64 rows of int or str keys the frames are cut from one sorted frame (not a
    take per key): each key's rows in arrival order, index 0..n-1, keys by first arrival."""

    class Frames(StatefulProcessor):
        def init(self, handle: Any) -> None:
            pass

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            (df,) = list(rows)
            assert list(df.index) == list(range(len(df)))
            yield pd.DataFrame(
                {"user": [str(key[0])], "vs": [",".join(map(str, df["v"]))], "at0": [int(df.at[0, "v"])]}
            )

    make = {"int": lambda i: i % 7, "str": lambda i: f"k{i % 7}", "bool": lambda i: i % 2 == 0}[keys]
    records = [{"user": make(i), "v": i} for i in range(300)]
    op = make_operator(Frames(), "user string, vs string, at0 bigint", flavour="pandas")
    out = rows_of(op.process(records))
    expected: Dict[str, List[int]] = {}
    for r in records:
        expected.setdefault(str(r["user"]), []).append(r["v"])
    assert [r["user"] for r in out] == list(expected)  # first-arrival order
    assert {r["user"]: r["vs"] for r in out} == {k: ",".join(map(str, v)) for k, v in expected.items()}
    assert all(r["at0"] == expected[r["user"]][0] for r in out)


# -- a checkpoint of the release before (no recorded schemas) restores ----------------------------


def test_a_checkpoint_written_before_schemas_were_recorded_restores(tmp_path: Any) -> None:
    """``tests/data/savepoint-tws-e145a3c`` (``make_tws_savepoint.py``, written by main at
    e145a3c): its value, list and map states come back, the nested struct as a ``Row``,
    and the next checkpoint records the schemas."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "data"))
    from make_tws_savepoint import FIXTURE, Keeper, build

    from pyengine.storage.metadata import load_metadata

    class Checked(Keeper):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            old = self.state.get()
            assert old is not None and isinstance(old[1], Row) and old[1].n == old[0]
            yield from super().handleInputRows(key, rows, timerValues)

    env = pe.StreamEnvironment(
        parallelism=3, checkpointing=pe.CheckpointConfig(interval_ms=50), checkpoint_storage=str(tmp_path)
    )
    sink = pe.sinks.CollectSink()
    build(env, 0, 60, sink, Checked, more=30)  # the fixture's source had ended: 30 more from another
    result = env.execute("tws-fixture-restored", restore_from=str(FIXTURE))
    final: Dict[int, Any] = {}
    for r in result.records:
        final[r["user"]] = max(final.get(r["user"], (0,)), (r["count"], r["listed"], r["mapped"]))
    # 12 restored rows each, and up to 6 new (a new row at or before the restored
    # watermark is late); the three states agree, so none lost what it held.
    assert sorted(final) == list(range(5))
    assert all(12 < c == listed == mapped <= 18 for c, listed, mapped in final.values()), final
    assert "keeper" in load_metadata(result.latest_checkpoint).operators


# -- the state reader: a list state one row per element, as Spark's ----------------------------


def test_the_state_reader_gives_a_list_state_one_row_per_element(tmp_path: Any) -> None:
    from pyengine.spark.state_source import _Request

    class Lists(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.seen = handle.getListState("seen", "v bigint")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            self.seen.appendList([(r.v,) for r in rows])
            yield Row(user=key[0])

    env = pe.StreamEnvironment(
        parallelism=1, checkpointing=pe.CheckpointConfig(interval_ms=50), checkpoint_storage=str(tmp_path)
    )
    records = [{"user": u, "v": 10 * u + i} for u in range(3) for i in range(u + 1)]
    env.from_collection(records).key_by("user").transform_with_state(Lists(), "user bigint").uid("lists").sink_to(
        pe.sinks.DiscardSink()
    )
    result = env.execute("lists")
    options = {"path": result.latest_checkpoint, "operator": "lists", "stateName": "seen"}
    table = _Request(options).table()
    assert sorted(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True)) == [
        (0, 0), (1, 10), (1, 11), (2, 20), (2, 21), (2, 22)
    ]  # fmt: skip
    whole = _Request({**options, "flattenCollectionTypes": "false"}).table()
    assert sorted(whole.column("key").to_pylist()) == [0, 1, 2]


def test_a_watermark_ends_a_micro_batch_its_rows_handled_under_the_watermark_they_came_with() -> None:
    op = micro_operator(MaxEventTime(), "id string, timestamp string, wm bigint", time_mode="EventTime")
    op.event_time = lambda r: int(r["eventTime"].timestamp() * 1000)
    op.process([{"user": "a", "eventTime": _at(s)} for s in (10, 15)])
    op.process([{"user": "a", "eventTime": _at(20)}])
    out = rows_of(op.process_watermark(9_999))  # Spark's 10 s: the batch first (at 0), then its timers
    assert [(r["id"], r["timestamp"], r["wm"]) for r in out] == [("a", "20", 0), ("a-expired", "0", 0)]
    op.process([{"user": "a", "eventTime": _at(s)} for s in (5, 12)])  # 5 s is late now
    out = rows_of(op.process_watermark(11_999))
    assert [(r["id"], r["timestamp"], r["wm"]) for r in out] == [("a", "12", 10_000), ("a-expired", "10000", 10_000)]
    assert op.late_records_dropped == 1


# -- eventTimeColumnName: an output column, its values the output's event time downstream -------


class FirstTimestamp(StatefulProcessor):
    """Spark's StatefulProcessorChainingOps: the first row's event time as ``outputTimestamp``."""

    def init(self, handle: Any) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        first = next(iter(rows))
        yield Row(id=key[0], outputTimestamp=_at(first.ts // 1000 + 3600))  # an hour later: not the input's


def test_event_time_column_names_an_output_column_whose_values_are_the_event_time_downstream() -> None:
    class Stamps(pe.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            yield {"id": value["id"], "ts": ctx.timestamp(), "out": value["outputTimestamp"]}

    records = [{"user": u, "ts": 1_000 * (i + 1)} for i, u in enumerate([1, 2, 1, 3])]
    env = pe.StreamEnvironment(parallelism=1)
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    stream = env.from_collection(records, watermark_strategy=strategy).key_by("user")
    out = stream.transform_with_state(
        FirstTimestamp(), "id bigint, outputTimestamp timestamp", time_mode="EventTime",
        event_time_column="outputTimestamp",
    )  # fmt: skip
    out.key_by("id").process(Stamps()).sink_to(pe.sinks.CollectSink())
    result = env.execute("chaining")
    assert result.records, result
    for r in result.records:
        assert r["ts"] == int(r["out"].timestamp() * 1000)  # the output column's time, not the input's
    with pytest.raises(pe.errors.ColumnNotFoundError, match="names an output column"):
        env.from_collection(records, watermark_strategy=strategy).key_by("user").transform_with_state(
            FirstTimestamp(), "id bigint, outputTimestamp timestamp", time_mode="EventTime", event_time_column="ts"
        )
    with pytest.raises(ValueError, match="is string in the output schema"):
        env.from_collection(records, watermark_strategy=strategy).key_by("user").transform_with_state(
            FirstTimestamp(), "id bigint, outputTimestamp string", time_mode="EventTime",
            event_time_column="outputTimestamp",
        )  # fmt: skip
