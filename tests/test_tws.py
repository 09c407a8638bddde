"""Spark's ``StatefulProcessor`` on pyengine (``pyengine.spark.tws``), against Spark's
own in-memory reference ``TwsTester``: the same processors fed the same batches give
the same outputs, in both flavours, timers in both time modes, with initial state.
TwsTester does not model TTL, so TTL is checked against Spark's definition
(``StateTTL``: expired once the batch timestamp reaches write time + ttl). Then
Spark's invocation order, exactly-once through failures (state and timers), state
read back with ``read_keyed_state``, and the errors a user must understand.

The operator is driven directly here (its ``clock`` is the batch timestamp), as a
task drives it: ``process`` per buffer, ``process_watermark``, ``on_processing_time``."""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Tuple

import pandas as pd
import pytest

pytest.importorskip("pyspark")

from chaos import Chaos
from pyspark.errors import PySparkValueError
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor
from pyspark.sql.streaming.tws_tester import TwsTester

import pyengine as pe
from pyengine.errors import JobFailedError
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.keyed import key_selector
from pyengine.spark.tws import (
    OutputSchemaError,
    StateNotFoundError,
    TransformWithStateOperator,
    parse_schema,
)
from pyengine.state import read_keyed_state

# -- processors: together they use every handle and state method ---------------------------------


class AllStates(StatefulProcessor):
    """Value, list and map state, every method of each, and initial state."""

    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "count bigint")
        self.last = handle.getValueState("last", "v bigint, tag string")
        self.seen = handle.getListState("seen", "v bigint")
        self.pairs = handle.getListState("pairs", "v bigint, tag string")
        self.per_tag = handle.getMapState("per_tag", "tag string", "n bigint")
        self.by_pair = handle.getMapState("by_pair", "v bigint, tag string", "n bigint, total bigint")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.count.update((initialState["start"],))
        self.per_tag.updateValue(("init",), (1,))

    def _rows(self, rows: Iterator[Any]) -> List[Tuple[int, str]]:
        return [(r["v"], r["tag"]) for r in rows]

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        got = self._rows(rows)
        had = self.count.exists()
        n = (self.count.get()[0] if had else 0) + len(got)
        self.count.update((n,))
        self.last.update(got[-1])
        assert self.last.get() == got[-1] and self.last.exists()
        for v, tag in got:
            if v % 7 == 0:
                self.seen.clear()
                self.pairs.clear()
            self.seen.appendValue((v,))
            self.pairs.appendList([(v, tag)])
            old = self.per_tag.getValue((tag,))
            self.per_tag.updateValue((tag,), ((old[0] if old else 0) + 1,))
            pair = self.by_pair.getValue((v % 3, tag))
            self.by_pair.updateValue((v % 3, tag), (1 + (pair[0] if pair else 0), v + (pair[1] if pair else 0)))
        if len(list(self.seen.get())) > 4:
            self.seen.put([(v,) for (v,) in list(self.seen.get())[-2:]])
        if self.per_tag.containsKey(("b",)) and n % 5 == 0:
            self.per_tag.removeKey(("b",))
        if n % 11 == 0:
            self.by_pair.clear()
        if n % 13 == 0:
            self.last.clear()
        yield Row(
            user=key[0],
            count=n,
            had=had,
            seen=",".join(str(v) for (v,) in self.seen.get()),
            pairs=len(list(self.pairs.get())),
            pairs_exist=self.pairs.exists(),
            tags=",".join(f"{k[0]}={v[0]}" for k, v in sorted(self.per_tag.iterator())),
            tag_keys=len(list(self.per_tag.keys())),
            tag_total=sum(v[0] for v in self.per_tag.values()),
            by_pair=str(sorted(self.by_pair.iterator())),
            map_exists=self.by_pair.exists(),
            last=str(self.last.get()),
        )


ALL_STATES_SCHEMA = (
    "user bigint, count bigint, had boolean, seen string, pairs bigint, pairs_exist boolean, tags string, "
    "tag_keys bigint, tag_total bigint, by_pair string, map_exists boolean, last string"
)


class AllStatesPandas(AllStates):
    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        super().handleInitialState(key, initialState.iloc[0], timerValues)

    def _rows(self, rows: Iterator[Any]) -> List[Tuple[int, str]]:
        return [(int(v), str(t)) for df in rows for v, t in zip(df["v"], df["tag"], strict=True)]

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        for row in super().handleInputRows(key, rows, timerValues):
            yield pd.DataFrame([row.asDict()])


class Timeouts(StatefulProcessor):
    """A session timeout per key: a timer ``gap`` after each row's time (the batch
    time or, in event time, the row's), the previous one deleted (found with listTimers)."""

    def __init__(self, event_time: bool, gap: int = 100) -> None:
        self.event_time = event_time
        self.gap = gap

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "count bigint")

    def _times(self, rows: Any, timerValues: Any) -> List[int]:
        if self.event_time:
            return [r["ts"] for r in rows]
        return [timerValues.getCurrentProcessingTimeInMs() for _ in rows]

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        times = self._times(rows, timerValues)
        old = self.count.get()
        n = (old[0] if old else 0) + len(times)
        self.count.update((n,))
        for t in list(self.handle.listTimers()):
            self.handle.deleteTimer(t)
        self.handle.registerTimer(max(times) + self.gap)
        yield Row(user=key[0], event="data", count=n, at=timerValues.getCurrentWatermarkInMs())

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        listed = list(self.handle.listTimers())  # Spark still lists the firing timer
        assert expiredTimerInfo.getExpiryTimeInMs() in listed
        old = self.count.get()
        self.count.clear()
        yield Row(user=key[0], event="expired", count=old[0] if old else -1, at=expiredTimerInfo.getExpiryTimeInMs())


TIMEOUTS_SCHEMA = "user bigint, event string, count bigint, at bigint"


class TimeoutsPandas(Timeouts):
    def _times(self, rows: Any, timerValues: Any) -> List[int]:
        frames = list(rows)
        if self.event_time:
            return [int(t) for df in frames for t in df["ts"]]
        return [timerValues.getCurrentProcessingTimeInMs() for df in frames for _ in range(len(df))]

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        for row in super().handleInputRows(key, rows, timerValues):
            yield pd.DataFrame([row.asDict()])

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        for row in super().handleExpiredTimer(key, timerValues, expiredTimerInfo):
            yield pd.DataFrame([row.asDict()])


# -- driving the operator and the reference side by side -----------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def make_operator(
    processor: Any,
    schema: str,
    *,
    flavour: str = "row",
    time_mode: str = "None",
    initial: Any = None,
    clock: Optional[Clock] = None,
    backend: str = "heap",
) -> TransformWithStateOperator:
    from pyengine.spark.tws_build import _initial_entries

    select = key_selector("user")
    op = TransformWithStateOperator(
        "tws",
        "tws",
        select,
        processor,
        schema,
        flavour=flavour,
        time_mode=time_mode,
        event_time=(lambda r: r["ts"]) if time_mode == "EventTime" else None,
        initial_state=_initial_entries(initial, flavour, select) if initial is not None else None,
        clock=clock or Clock(),
    )
    ctx = OperatorContext(
        job_name="t",
        subtask=0,
        parallelism=1,
        max_parallelism=128,
        state_backend=backend,
        local_recovery_dir=None,
        attempt=0,
    )
    op.setup(ctx, None)
    op.open()
    return op


def snapshot_of(op: TransformWithStateOperator) -> Any:
    """The operator's state as a restore gets it (one subtask at parallelism 1)."""
    import tempfile

    from pyengine.storage import checkpoint_storage
    from pyengine.storage.metadata import OperatorState

    storage = checkpoint_storage(tempfile.mkdtemp(), "job")
    state = op.snapshot(1, storage.location(1))()
    return OperatorState(parallelism=1, max_parallelism=128, subtasks={0: state})


def rows_of(out: Any) -> List[Dict[str, Any]]:
    return [] if isinstance(out, list) else out.to_pylist()


def canon(records: List[Dict[str, Any]]) -> List[str]:
    return sorted(repr(sorted(r.items())) for r in records)


def reference_rows(out: Any) -> List[Dict[str, Any]]:
    if isinstance(out, pd.DataFrame):
        return [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()} for r in out.to_dict("records")]
    return [r.asDict() for r in out]


def feed_reference(
    tester: TwsTester, batch: List[Dict[str, Any]], pandas: bool, watermark: Optional[int] = None
) -> List[Dict[str, Any]]:
    """One batch into TwsTester: per key, that key's rows in arrival order. With a
    watermark, keys whose rows are all late are left out: Spark drops late rows
    before grouping, so it never calls handleInputRows for them (TwsTester would,
    with no rows)."""
    by_key: Dict[Any, List[Dict[str, Any]]] = {}
    for r in batch:
        if watermark is not None and r["ts"] <= watermark:
            continue
        by_key.setdefault(r["user"], []).append(r)
    out: List[Dict[str, Any]] = []
    for key, rows in by_key.items():
        if pandas:
            out += reference_rows(tester.testInPandas(key, pd.DataFrame(rows)))
        else:
            out += reference_rows(tester.test(key, [Row(**r) for r in rows]))
    return out


def batches(seed: int, n: int, users: int = 6, size: int = 9) -> List[List[Dict[str, Any]]]:
    import random

    rnd = random.Random(seed)
    tags = "abc"
    return [
        [{"user": rnd.randrange(users), "v": rnd.randrange(100), "tag": rnd.choice(tags)} for _ in range(size)]
        for _ in range(n)
    ]


INITIAL = [{"user": 1, "start": 100}, {"user": 4, "start": 40}, {"user": 9, "start": 900}]


@pytest.mark.parametrize("flavour", ["row", "pandas"])
def test_every_state_method_and_initial_state_match_twstester(flavour: str) -> None:
    pandas = flavour == "pandas"
    proc = AllStatesPandas() if pandas else AllStates()
    if pandas:
        initial = [(r["user"], pd.DataFrame([r])) for r in INITIAL]
        tester = TwsTester(AllStatesPandas(), initialStatePandas=initial)
    else:
        tester = TwsTester(AllStates(), initialStateRow=[(r["user"], Row(**r)) for r in INITIAL])
    op = make_operator(proc, ALL_STATES_SCHEMA, flavour=flavour, initial=INITIAL)
    for i, batch in enumerate(batches(seed=3, n=12)):
        mine = rows_of(op.process(batch))
        assert canon(mine) == canon(feed_reference(tester, batch, pandas)), f"batch {i}"
    for name, key in (("count", 1), ("count", 9)):
        op.backend.set_current_key(key)
        assert (
            op.backend.get_state(pe.state.ValueStateDescriptor(name, None, __import__("pyarrow").int64())).value()
            == (tester.peekValueState(name, key)[0])
        )
    op.close()


def test_state_from_a_checkpointed_arrow_file_reads_as_tuples_again() -> None:
    """Structs come back from a checkpoint as dicts and multi-field map keys as
    tuples: the adapter hands out tuples either way, so a restored run continues
    exactly as an unbroken one (compared with TwsTester across the restore)."""
    tester = TwsTester(AllStates())
    op = make_operator(AllStates(), ALL_STATES_SCHEMA, backend="incremental")
    data = batches(seed=5, n=10)
    for batch in data[:5]:
        assert canon(rows_of(op.process(batch))) == canon(feed_reference(tester, batch, False))
    op2 = TransformWithStateOperator("tws", "tws", key_selector("user"), AllStates(), ALL_STATES_SCHEMA, clock=Clock())
    op2.setup(op.ctx, snapshot_of(op))  # type: ignore[arg-type]
    op2.open()
    for i, batch in enumerate(data[5:]):
        assert canon(rows_of(op2.process(batch))) == canon(feed_reference(tester, batch, False)), f"batch {i}"


@pytest.mark.parametrize("flavour", ["row", "pandas"])
def test_processing_time_timers_match_twstester(flavour: str) -> None:
    pandas = flavour == "pandas"
    tester = TwsTester(TimeoutsPandas(False) if pandas else Timeouts(False), timeMode="ProcessingTime")
    clock = Clock()
    op = make_operator(
        TimeoutsPandas(False) if pandas else Timeouts(False),
        TIMEOUTS_SCHEMA,
        flavour=flavour,
        time_mode="ProcessingTime",
        clock=clock,
    )
    data = iter(batches(seed=11, n=40, users=5, size=3))
    t = 1000
    fired = 0
    for step in range(40):
        t += 10
        clock.now = t
        if step % 8 == 7:  # a quiet spell: timers fire from the mailbox
            t += 150
            clock.now = t
            assert op.next_processing_time() is not None and op.next_processing_time() <= t
            mine = rows_of(op.on_processing_time(t))
            theirs = reference_rows(tester.setProcessingTime(t))
            fired += len(mine)
        else:
            batch = next(data)
            tester.setProcessingTime(t)  # no timer is due at data times (each is 100 ms out)
            mine = rows_of(op.process(batch))
            theirs = feed_reference(tester, batch, pandas)
        assert canon(mine) == canon(theirs), f"step {step} at {t}"
    assert fired > 3, "the schedule never fired a timer: it tested nothing"


@pytest.mark.parametrize("flavour", ["row", "pandas"])
def test_event_time_timers_and_late_rows_match_twstester(flavour: str) -> None:
    import random

    pandas = flavour == "pandas"
    tester = TwsTester(
        TimeoutsPandas(True) if pandas else Timeouts(True),
        timeMode="EventTime",
        eventTimeExtractor=lambda r: int(r["ts"]),
    )
    op = make_operator(
        TimeoutsPandas(True) if pandas else Timeouts(True), TIMEOUTS_SCHEMA, flavour=flavour, time_mode="EventTime"
    )
    rnd = random.Random(7)
    wm, fired, late = 0, 0, 0
    for step in range(30):
        batch = [{"user": rnd.randrange(5), "ts": wm + rnd.randrange(-30, 200)} for _ in range(6)]
        late += sum(r["ts"] <= wm for r in batch)  # Spark's watermark starts at 0
        mine = rows_of(op.process(batch))
        assert canon(mine) == canon(feed_reference(tester, batch, pandas, wm)), f"data at step {step}"
        wm += rnd.randrange(20, 120)
        mine = rows_of(op.process_watermark(wm - 1))  # pyengine's (Flink's) W is Spark's W + 1
        theirs = reference_rows(tester.setWatermark(wm))
        fired += len(mine)
        assert canon(mine) == canon(theirs), f"watermark {wm} at step {step}"
    assert fired >= 3 and late > 3 and op.late_records_dropped == late


# -- TTL, against Spark's definition ------------------------------------------------------------


class WithTtl(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.v = handle.getValueState("v", "x bigint", 100)
        self.items = handle.getListState("items", "x bigint", 100)
        self.m = handle.getMapState("m", "k string", "x bigint", 100)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        for r in rows:
            if r["op"] == "write":
                self.v.update((r["x"],))
                self.items.appendValue((r["x"],))
                self.m.updateValue((f"k{r['x']}",), (r["x"],))
        yield Row(
            user=key[0],
            v=str(self.v.get()),
            v_exists=self.v.exists(),
            items=str(list(self.items.get())),
            m=str(sorted(self.m.iterator())),
            m_has1=self.m.containsKey(("k1",)),
        )


def test_ttl_is_processing_time_at_the_batch_reset_by_writes_and_never_returns_expired() -> None:
    clock = Clock()
    op = make_operator(
        WithTtl(), "user bigint, v string, v_exists boolean, items string, m string, m_has1 boolean", clock=clock
    )

    def at(t: int, op_name: str, x: int = 0) -> Dict[str, Any]:
        clock.now = t
        (row,) = rows_of(op.process([{"user": 1, "op": op_name, "x": x}]))
        return row

    at(1000, "write", 1)
    row = at(1099, "read")
    assert row["v"] == "(1,)" and row["items"] == "[(1,)]" and row["m_has1"]
    at(1050 + 40, "write", 2)  # 1090: v and its stamp renewed, a second element and entry
    row = at(1100, "read")  # 1000 + 100: the first element and entry expired, v (written at 1090) not
    assert row["v"] == "(2,)" and row["items"] == "[(2,)]" and row["m"] == "[(('k2',), (2,))]"
    assert not row["m_has1"]
    row = at(1190, "read")  # 1090 + 100: all expired, never returned
    assert row == {**row, "v": "None", "v_exists": False, "items": "[]", "m": "[]", "m_has1": False}


# -- Spark's invocation order ------------------------------------------------------------------


class Recorder(StatefulProcessor):
    log: ClassVar[List[Any]] = []

    def init(self, handle: Any) -> None:
        self.handle = handle
        Recorder.log.append(("init",))

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        Recorder.log.append(("initial", key, initialState["start"]))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        vs = [r["v"] for r in rows]
        Recorder.log.append(("rows", key, vs, timerValues.getCurrentProcessingTimeInMs()))
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs())  # due now: fires after the data
        return iter([])

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        Recorder.log.append(("timer", key, expiredTimerInfo.getExpiryTimeInMs()))
        return iter([])

    def close(self) -> None:
        Recorder.log.append(("close",))


def test_spark_invocation_order() -> None:
    Recorder.log = []
    clock = Clock()
    clock.now = 500
    op = make_operator(Recorder(), "user bigint", time_mode="ProcessingTime", initial=INITIAL[:2], clock=clock)
    op.process([{"user": 2, "v": 1}, {"user": 1, "v": 2}, {"user": 2, "v": 3}])
    op.close()
    log = Recorder.log
    assert log[0] == ("init",)
    assert sorted(log[1:3]) == [("initial", (1,), 100), ("initial", (4,), 40)]
    assert log[3:5] == [("rows", (2,), [1, 3], 500), ("rows", (1,), [2], 500)]  # once per key, arrival order
    assert sorted(log[5:7]) == [("timer", (1,), 500), ("timer", (2,), 500)]  # after all the data
    assert log[7:] == [("close",)]
    op.backend.set_current_key(2)
    assert list(op._handle.listTimers()) == []  # type: ignore[union-attr]  # deleted once fired


class Shapes(StatefulProcessor):
    """Echoes each key's rows in the output shape ``how`` names: the adapter's fast
    path (a Row of the schema's fields in order) and every other shape it accepts."""

    def __init__(self, how: str) -> None:
        self.how = how

    def init(self, handle: Any) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        for r in rows:
            assert isinstance(r, Row) and r["user"] == key[0] and r.user == key[0]
            v = r.asDict()["v"]
            if self.how == "row":
                yield Row(user=key[0], v=v)
            elif self.how == "reordered":
                yield Row(v=v, user=key[0])
            elif self.how == "factory":
                yield Row("user", "v")(key[0], v)
            elif self.how == "dict":
                yield {"v": v, "user": key[0]}
            elif self.how == "tuple":
                yield (key[0], v)
            elif self.how == "long-tuple":
                yield (key[0], v, v)
            else:  # a Row of the factory given fewer values than its fields
                yield Row("user", "v")(key[0])


ECHO_IN = [{"user": 2, "v": 1}, {"user": 1, "v": 2}, {"user": 2, "v": 3}, {"user": 3, "v": 4}, {"user": 2, "v": 5}]


@pytest.mark.parametrize("how", ["row", "reordered", "factory", "dict", "tuple"])
@pytest.mark.parametrize("given", ["dicts", "mixed-dicts", "arrow"])
def test_every_input_and_output_shape_gives_the_same_rows(how: str, given: str) -> None:
    """A buffer's rows reach the processor per key in arrival order (keys with one
    record and with several, dicts of one shape, of varying shapes, an Arrow batch),
    and every output shape it may yield lands in the schema's columns."""
    import pyarrow as pa

    records: Any = [dict(r) for r in ECHO_IN]
    if given == "mixed-dicts":
        records[1] = {"v": 2, "user": 1}  # another field order: matched by name
    elif given == "arrow":
        records = pa.RecordBatch.from_pylist(records)
    op = make_operator(Shapes(how), "user bigint, v bigint")
    out = op.process(records)
    assert out.to_pylist() == [
        {"user": u, "v": v} for u, v in [(2, 1), (2, 3), (2, 5), (1, 2), (3, 4)]
    ]  # keys in order of first arrival, each key's rows in arrival order


@pytest.mark.parametrize(
    "how, words", [("short", "1 values for its 2 fields"), ("long-tuple", "3 values, the schema 2 columns")]
)
def test_a_row_of_the_wrong_width_is_refused(how: str, words: str) -> None:
    op = make_operator(Shapes(how), "user bigint, v bigint")
    with pytest.raises(OutputSchemaError, match=words):
        op.process([{"user": 1, "v": 2}])


@pytest.mark.parametrize("ddl", ["v bigint", "v int", "v boolean", "v string", "v binary", "v double", "v date"])
def test_output_columns_hold_what_pandas_conversion_holds(ddl: str) -> None:
    """The output's Arrow conversion (plain first where that cannot differ) gives what
    the conversion with pandas' null semantics gives: NaN, NaT and NA are nulls."""
    import datetime as dt
    import decimal

    import numpy as np
    import pyarrow as pa

    op = make_operator(Shapes("row"), f"user bigint, {ddl}")
    field = op.output_schema.field("v")
    odd = [None, np.nan, float("nan"), pd.NA, pd.NaT, np.datetime64("NaT"), decimal.Decimal("NaN")]
    fine = [1, np.int32(3), True, np.bool_(False), 2.5, "x", np.str_("y"), b"z", dt.date(2020, 1, 2)]
    for value in odd + fine:
        try:
            want = pa.array([value, None], type=field.type, from_pandas=True).to_pylist()
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            with pytest.raises(OutputSchemaError, match="'v'"):
                op._column(field, [value, None])
            continue
        got = op._column(field, [value, None]).to_pylist()
        assert got == want or (got[0] != got[0] and want[0] != want[0]), (value, got, want)


def test_initial_state_only_on_a_first_run() -> None:
    Recorder.log = []
    op = make_operator(Recorder(), "user bigint", initial=INITIAL[:1], time_mode="ProcessingTime")
    op.process([{"user": 1, "v": 1}])
    restarted = TransformWithStateOperator(
        "tws",
        "tws",
        key_selector("user"),
        Recorder(),
        "user bigint",
        time_mode="ProcessingTime",
        initial_state=lambda: [(1, Row(user=1, start=5))],
        clock=Clock(),
    )
    restarted.setup(op.ctx, snapshot_of(op))  # type: ignore[arg-type]
    restarted.open()
    assert [e[0] for e in Recorder.log] == ["init", "initial", "rows", "timer", "init"]


# -- errors ------------------------------------------------------------------------------------


def test_clear_errors_when_the_job_is_built() -> None:
    env = pe.StreamEnvironment()
    keyed = env.from_collection([{"user": 1}]).key_by("user")
    with pytest.raises(TypeError, match="StatefulProcessor"):
        keyed.transform_with_state(object(), "user bigint")
    with pytest.raises(TypeError, match=r"pass AllStates\(\)"):
        keyed.transform_with_state(AllStates, "user bigint")
    with pytest.raises(ValueError, match=r"EventTime.*needs watermarks"):
        keyed.transform_with_state(AllStates(), "user bigint", time_mode="EventTime")
    with pytest.raises(ValueError, match="time_mode must be one of"):
        keyed.transform_with_state(AllStates(), "user bigint", time_mode="Event")
    assert [f.name for f in parse_schema("a int, b array<bigint>, c struct<x: string>, d decimal(10,2)").fields] == [
        "a",
        "b",
        "c",
        "d",
    ]


class Wrong(StatefulProcessor):
    def __init__(self, how: str) -> None:
        self.how = how

    def init(self, handle: Any) -> None:
        self.handle = handle
        if self.how == "delete":
            handle.deleteIfExists("no_such_state")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        list(rows)
        if self.how == "timer":
            self.handle.registerTimer(10)
        if self.how == "column":
            yield Row(user=key[0], cnt=1)
        if self.how == "type":
            yield Row(user=key[0], count="many")
        yield Row(user=key[0], count=1)


@pytest.mark.parametrize(
    "how, error, words",
    [
        ("column", OutputSchemaError, ["'count'"]),
        ("type", OutputSchemaError, ["'count'", "many"]),
        ("timer", PySparkValueError, ["UNSUPPORTED_OPERATION", "TimeMode.None", "time_mode='ProcessingTime'"]),
        ("delete", StateNotFoundError, ["'no_such_state'", "Spark does nothing here", "except KeyError"]),
    ],
)
def test_clear_errors_fail_the_job_at_once(how: str, error: type, words: List[str]) -> None:
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    sink = pe.sinks.CollectSink()
    env.from_collection([{"user": 1}, {"user": 2}]).key_by("user").transform_with_state(
        Wrong(how), "user bigint, count bigint"
    ).sink_to(sink)
    with pytest.raises(JobFailedError) as info:
        env.execute(f"tws-wrong-{how}")
    chain = []
    exc: Optional[BaseException] = info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert any(isinstance(e, error) for e in chain), chain
    message = " ".join(str(e) for e in chain)
    assert all(w in message for w in words), message
    assert info.value.result.restarts == 0  # a restart cannot fix these


def test_an_event_time_timer_not_after_the_watermark_fires_after_the_rows_as_on_spark() -> None:
    """Spark takes a timer at or before the watermark and fires it in the same micro-batch,
    after the rows (its TwsTester refuses it: Spark's run is followed here)."""
    op = make_operator(Timeouts(True, gap=-1000), TIMEOUTS_SCHEMA, time_mode="EventTime")
    op.process_watermark(499)  # Spark's 500
    out = rows_of(op.process([{"user": 1, "ts": 600}]))  # registers 600 - 1000 <= 500
    assert [(r["event"], r["at"]) for r in out] == [("data", 500), ("expired", -400)]


def test_delete_if_exists_purges_a_restored_state_for_every_key() -> None:
    op = make_operator(AllStates(), ALL_STATES_SCHEMA)
    op.process([{"user": u, "v": u, "tag": "a"} for u in range(5)])
    restored = snapshot_of(op)

    class V2(AllStates):
        def init(self, handle: Any) -> None:
            handle.deleteIfExists("count")
            super().init(handle)

    op2 = TransformWithStateOperator("tws", "tws", key_selector("user"), V2(), ALL_STATES_SCHEMA, clock=Clock())
    op2.setup(op.ctx, restored)  # type: ignore[arg-type]
    op2.open()
    (row,) = rows_of(op2.process([{"user": 3, "v": 1, "tag": "a"}]))
    assert row["count"] == 1 and not row["had"]  # count is gone; the other states are kept
    assert row["pairs"] == 2


# -- end to end: exactly-once through a failure, state readable -----------------------------------


class CountWithTimers(StatefulProcessor):
    """A row out per row in (its running count), and an event-time timer per row
    that fires once (its output names the row)."""

    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos

    def __deepcopy__(self, memo: Any) -> CountWithTimers:
        return CountWithTimers(self.chaos)  # one chaos for every subtask and attempt

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "count bigint")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        old = self.count.get()
        n = old[0] if old else 0
        for r in rows:
            self.chaos.hit("row")
            n += 1
            self.handle.registerTimer(r["ts"] + 1)
            yield Row(user=key[0], n=n)
        self.count.update((n,))

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        yield Row(user=key[0], n=-expiredTimerInfo.getExpiryTimeInMs())


N = 1200
RECORDS = [{"user": i % 11, "ts": 10 * i + 10} for i in range(N)]  # after Spark's first watermark, 0


@pytest.mark.parametrize("backend, at", [("heap", 700), ("incremental", 450)])
def test_exactly_once_with_a_failure_state_and_timers(tmp_path: Any, backend: str, at: int) -> None:
    chaos = Chaos("row", at)
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        state_backend=backend,
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=32,
        buffer_timeout_ms=1,
        restart_attempts=3,
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"))
    (
        env.from_collection(RECORDS)
        .assign_timestamps_and_watermarks(
            pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
        )
        .key_by("user")
        .transform_with_state(CountWithTimers(chaos), "user bigint, n bigint", time_mode="EventTime")
        .uid("counter")
        .sink_to(sink)
    )
    result = env.execute(f"tws-exactly-once-{backend}")
    assert chaos.fired and result.restarts >= 1
    out = Counter((r["user"], r["n"]) for r in sink.read_committed())
    per_user = Counter(r["user"] for r in RECORDS)
    expected = Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})
    expected.update((r["user"], -(r["ts"] + 1)) for r in RECORDS)
    assert out == expected
    table = read_keyed_state(result.latest_checkpoint, "counter", "count")
    assert dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True)) == dict(per_user)


class SlowCountWithTimers(CountWithTimers):
    """CountWithTimers that takes its time, so a savepoint stops it midway."""

    def __init__(self) -> None:
        super().__init__(Chaos("row", 10**9))

    def __deepcopy__(self, memo: Any) -> SlowCountWithTimers:
        return SlowCountWithTimers()

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        time.sleep(0.001)
        yield from super().handleInputRows(key, rows, timerValues)


def _rescaled_job(env: Any, out: str) -> Any:
    sink = pe.sinks.FileSink(out)
    (
        env.from_collection(RECORDS)
        .assign_timestamps_and_watermarks(
            pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
        )
        .key_by("user")
        # A call per buffer: each is slow, so the source is held back and the savepoint
        # comes midway (micro-batches would take the whole input in before a boundary).
        .transform_with_state(SlowCountWithTimers(), "user bigint, n bigint", time_mode="EventTime", micro_batch=False)
        .uid("counter")
        .sink_to(sink)
    )
    return sink


def test_a_savepoint_at_parallelism_2_resumes_at_3_with_state_and_timers(tmp_path: Any) -> None:
    """Value state and pending event-time timers of the adapter move by key group:
    stopped with a savepoint at 2 subtasks, resumed at 3, the output is exactly an
    uninterrupted run's (every count once, every timer fired once)."""
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=8,
        buffer_timeout_ms=1,
    )
    sink = _rescaled_job(env, str(tmp_path / "out"))
    client = env.execute_async("tws-rescale-first")
    time.sleep(0.3)
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    assert client.wait(60).status == "FINISHED"
    assert len(sink.read_committed()) < 2 * N, "the job ended before the savepoint stopped it"
    timers = read_keyed_state(savepoint, "counter", "_timer_state/event_timers")
    assert timers.num_rows > 0, "no timer was pending in the savepoint: nothing moved"
    env3 = pe.StreamEnvironment(parallelism=3, checkpointing=pe.CheckpointConfig(interval_ms=10), buffer_size=8)
    _rescaled_job(env3, str(tmp_path / "out"))
    resumed = env3.execute("tws-rescale-second", restore_from=savepoint)
    assert resumed.status == "FINISHED", resumed.cause
    out = Counter((r["user"], r["n"]) for r in sink.read_committed())
    per_user = Counter(r["user"] for r in RECORDS)
    expected = Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})
    expected.update((r["user"], -(r["ts"] + 1)) for r in RECORDS)
    assert out == expected


def test_a_processor_dropping_an_old_state_portably_runs_on_a_fresh_job() -> None:
    """The guide's way to drop a state an older version may have left: the refusal of an
    unknown name is a KeyError, and Spark never raises, so this runs the same on both."""

    class V2(StatefulProcessor):
        def init(self, handle: Any) -> None:
            try:
                handle.deleteIfExists("old_total")
            except KeyError:
                pass
            self.count = handle.getValueState("count", "count bigint")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            n = sum(1 for _ in rows)
            self.count.update(((self.count.get() or (0,))[0] + n,))
            yield Row(user=key[0], count=self.count.get()[0])

    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    sink = pe.sinks.CollectSink()
    env.from_collection([{"user": 1}, {"user": 1}]).key_by("user").transform_with_state(
        V2(), "user bigint, count bigint"
    ).sink_to(sink)
    assert env.execute("tws-drop-old").status == "FINISHED"
    counts = [r["count"] if isinstance(r, dict) else r[1] for r in sink.records]
    assert counts and max(counts) == 2, sink.records


# -- found by a new user's trial: timestamps, arrays, the end of input, a restored name -----------


class LastSeen(StatefulProcessor):
    """A timestamp in state and in the output (pyspark 4 wants a time zone for one)."""

    def init(self, handle: Any) -> None:
        self.last = handle.getValueState("last", "seen timestamp")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        for r in rows:
            self.last.update((r["at"],))
        yield Row(user=key[0], seen=self.last.get()[0])


def test_timestamp_columns_in_state_and_output_run() -> None:
    import datetime as dt

    at = [dt.datetime(2024, 1, 1, 0, 0, s, tzinfo=dt.timezone.utc) for s in range(3)]
    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    sink = pe.sinks.CollectSink()
    env.from_collection([{"user": 1, "at": a} for a in at]).key_by("user").transform_with_state(
        LastSeen(), "user bigint, seen timestamp"
    ).sink_to(sink)
    (row,) = env.execute("timestamps").records
    assert row["user"] == 1 and row["seen"] == at[-1]  # the same instant (shown in UTC)

    # the value state's timestamp through a checkpoint and a restore (untyped state: MessagePack)
    op = make_operator(Previous(), "user bigint, seen timestamp")
    op.process([{"user": 1, "at": at[0]}])
    restored = snapshot_of(op)
    op2 = TransformWithStateOperator(
        "tws", "tws", key_selector("user"), Previous(), "user bigint, seen timestamp", clock=Clock()
    )
    op2.setup(op.ctx, restored)  # type: ignore[arg-type]
    op2.open()
    (row,) = rows_of(op2.process([{"user": 1, "at": at[2]}]))
    assert row["seen"] == at[0]


class Previous(LastSeen):
    """Yields the timestamp stored before this call's rows."""

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        before = self.last.get()
        for r in rows:
            self.last.update((r["at"],))
        yield Row(user=key[0], seen=before[0] if before else None)


class Tags(StatefulProcessor):
    """An array field in state: Spark hands it back as a list, so ``+ [x]`` works."""

    def init(self, handle: Any) -> None:
        self.tags = handle.getValueState("tags", "tags array<string>")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        for r in rows:
            old = self.tags.get()
            self.tags.update(((old[0] if old else []) + [f"p{r['page']}"],))
        got = self.tags.get()[0]
        yield Row(user=key[0], kind=type(got).__name__, tags=",".join(got))


def test_an_array_field_in_state_is_a_list_as_on_spark() -> None:
    op = make_operator(Tags(), "user bigint, kind string, tags string")
    rows = rows_of(op.process([{"user": 0, "page": i} for i in range(3)]))
    assert rows == [{"user": 0, "kind": "list", "tags": "p0,p1,p2"}]
    (again,) = rows_of(op.process([{"user": 0, "page": 9}]))  # read back from state, not the call's own list
    assert again == {"user": 0, "kind": "list", "tags": "p0,p1,p2,p9"}


class Rearming(StatefulProcessor):
    """Each expiry re-arms the key's timer 10 s past the watermark it is shown."""

    def init(self, handle: Any) -> None:
        self.handle = handle

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        for r in rows:
            self.handle.registerTimer(r["ts"] + 1_000)
        return iter(())

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        wm = timerValues.getCurrentWatermarkInMs()
        self.handle.registerTimer(wm + 10_000)
        yield Row(user=key[0], at=expiredTimerInfo.getExpiryTimeInMs(), wm=wm)


def test_the_end_of_input_shows_a_watermark_spark_would_and_re_armed_timers_end() -> None:
    """A bounded input ends with pyengine's maximum watermark, which Spark never shows:
    the final firing shows the latest pending timer's time, fires every pending timer,
    and a timer re-armed past it stays pending (as when a Spark query ends)."""
    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    sink = pe.sinks.CollectSink()
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    records = [{"user": 1, "ts": 100}, {"user": 2, "ts": 500}, {"user": 1, "ts": 5_000}]  # ts 0: late on Spark
    env.from_collection(records, watermark_strategy=strategy).key_by("user").transform_with_state(
        Rearming(), "user bigint, at bigint, wm bigint", time_mode="EventTime"
    ).sink_to(sink)
    result = env.execute("re-arming")
    fired = sorted((r["user"], r["at"]) for r in result.records)
    assert all(r["wm"] < 2**62 for r in result.records), result.records
    assert all(r["at"] <= r["wm"] for r in result.records)  # as on Spark: expiry at or before the watermark
    assert {(1, 1_100), (2, 1_500), (1, 6_000)} <= set(fired)
    final = max(r["wm"] for r in result.records)  # the end of input's: the latest timer then pending
    assert all(r["at"] <= final for r in result.records) and len(fired) <= 5, result.records


def test_delete_if_exists_of_a_restored_state_with_no_key_in_this_subtask_does_nothing() -> None:
    """The checkpoint has the state, but none of its keys lands in this subtask's key
    groups: nothing to purge here, and no refusal (another subtask purges its part)."""
    op = make_operator(AllStates(), ALL_STATES_SCHEMA)
    op.process([{"user": 3, "v": 1, "tag": "a"}])
    restored = snapshot_of(op)
    from pyengine.state import assign_to_key_group

    group = assign_to_key_group(3, 128)
    other = OperatorContext(
        job_name="t",
        subtask=0 if group >= 64 else 1,  # the half of the key groups without key 3's
        parallelism=2,
        max_parallelism=128,
        state_backend="heap",
        local_recovery_dir=None,
        attempt=0,
    )

    class V2(StatefulProcessor):  # drops "count" and no longer uses it
        def init(self, handle: Any) -> None:
            handle.deleteIfExists("count")
            self.seen = handle.getValueState("seen", "n bigint")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            return iter(())

    op2 = TransformWithStateOperator("tws", "tws", key_selector("user"), V2(), ALL_STATES_SCHEMA, clock=Clock())
    op2.setup(other, restored)  # type: ignore[arg-type]
    assert "count" not in op2.backend.state_names and "count" in op2.backend.restored_state_names
    op2.open()  # deleteIfExists("count") accepted

    # ... and again after the next restore: the name stays in this subtask's checkpoints
    from pyengine.storage import checkpoint_storage
    from pyengine.storage.metadata import OperatorState

    storage = checkpoint_storage(tempfile.mkdtemp(), "job")
    again = OperatorState(
        parallelism=2, max_parallelism=128, subtasks={other.subtask: op2.snapshot(2, storage.location(2))()}
    )
    op4 = TransformWithStateOperator("tws", "tws", key_selector("user"), V2(), ALL_STATES_SCHEMA, clock=Clock())
    op4.setup(other, again)  # type: ignore[arg-type]
    op4.open()

    class Typo(AllStates):
        def init(self, handle: Any) -> None:
            handle.deleteIfExists("cuont")

    op3 = TransformWithStateOperator("tws", "tws", key_selector("user"), Typo(), ALL_STATES_SCHEMA, clock=Clock())
    op3.setup(other, restored)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="no state 'cuont'"):
        op3.open()
