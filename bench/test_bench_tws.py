"""Spark's ``StatefulProcessor`` through the adapter (``pyengine.spark.tws``).

1. A running count per key, the processor as a Spark user writes it (one output
   row per key per micro-batch), through ``KeyedStream.transform_with_state``,
   against the same count as a ``KeyedProcessFunction`` (its natural form: one
   output per record), in one run, interleaved: the issue's target is the adapter
   at >= 60% of the function's rows/s. The same with a processing-time timer per
   key (the count reset every hour).
2. One state call through the adapter (``ValueState.get`` / ``update`` of a
   one-field schema): the issue's target is <= 2 us at p50 (Spark: 65-78 us, a
   round trip to the JVM state server).
3. Opt-in (``PYENGINE_BENCH_SPARK_TWS=1``, minutes: Spark runs 1,000-3,300 rows/s
   here): the same two processors through Spark's own ``transformWithState`` and
   ``transformWithStateInPandas`` (``local[2]``, RocksDB state store, micro-batches
   of 20,000 rows over 10,000 keys): the issue's target is the adapter at >= 100x
   Spark's best rows/s.

Every row times the real work in pytest-benchmark's rounds, one row per variant:
whole jobs (in CPU seconds of this process, the benchmark's timer) and batches of
``PER_SAMPLE`` state calls (the table's times are per batch; per call in
``extra_info`` and the summary)."""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from conftest import SUMMARY, best_seconds, measured_again, start_spark
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

import pyengine as pe
from pyengine.state import ValueStateDescriptor

RECORDS = 100_000
KEYS = 10_000


class RunningCount(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "count bigint")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        n = 0
        for _ in rows:
            n += 1
        old = self.count.get()
        total = (old[0] if old else 0) + n
        self.count.update((total,))
        yield Row(user=key[0], count=total)


HOUR_MS = 3_600_000


def _next_hour(now_ms: int) -> int:
    return (now_ms // HOUR_MS + 1) * HOUR_MS


class RunningCountWithTimer(RunningCount):
    """The running count reset every hour of processing time: a timer per key (the
    same one, at the next full hour, registered again at every batch of the key)."""

    def init(self, handle: Any) -> None:
        super().init(handle)
        self.handle = handle

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        n = 0
        for _ in rows:
            n += 1
        old = self.count.get()
        total = (old[0] if old else 0) + n
        self.count.update((total,))
        self.handle.registerTimer(_next_hour(timerValues.getCurrentProcessingTimeInMs()))
        yield Row(user=key[0], count=total)

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        self.count.clear()
        return iter([])


COUNT = ValueStateDescriptor("count", 0, pa.int64())


class RunningCountFunction(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "count": n}


class RunningCountRowsFunction(RunningCountFunction):
    """The function yielding what the processor yields, a pyspark ``Row`` per output:
    what the processor's own code costs, so the adapter's share can be told apart."""

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield Row(user=ctx.current_key, count=n)


class RunningCountWithTimerFunction(RunningCountFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        timers = ctx.timer_service()
        timers.register_processing_time_timer(_next_hour(timers.current_processing_time()))
        yield {"user": ctx.current_key, "count": n}

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        self.count.clear()
        return []


def _run(records: List[Dict[str, Any]], kind: str) -> None:
    """One job, timed by the caller in CPU seconds of this process (its subtasks are
    threads here): on a 2-core machine shared with other builds, wall time swings
    2-3x with the load, CPU time far less; the ratio is taken between runs measured
    the same way."""
    env = pe.StreamEnvironment(parallelism=2, buffer_size=2048)
    keyed = env.from_collection(records).key_by("user")
    if kind == "adapter":
        stream = keyed.transform_with_state(RunningCount(), "user bigint, count bigint")
    elif kind == "adapter_timer":
        stream = keyed.transform_with_state(
            RunningCountWithTimer(), "user bigint, count bigint", time_mode="ProcessingTime"
        )
    else:
        stream = keyed.process(
            {
                "function": RunningCountFunction,
                "function_rows": RunningCountRowsFunction,
                "function_timer": RunningCountWithTimerFunction,
            }[kind]()
        )
    stream.sink_to(pe.sinks.DiscardSink())
    result = env.execute(f"tws-bench-{kind}")
    assert result.status == "FINISHED"


_WALL: Dict[str, List[float]] = {}  # wall seconds of each run, for the comparison with Spark's


def _cpu_seconds(kind: str, run: Callable[[], Any]) -> float:
    start, wall = time.process_time(), time.perf_counter()
    run()
    _WALL.setdefault(kind, []).append(time.perf_counter() - wall)
    return time.process_time() - start


@pytest.fixture(scope="module")
def records() -> List[Dict[str, Any]]:
    users = np.random.default_rng(3).integers(0, KEYS, RECORDS).tolist()
    return [{"user": u, "v": i} for i, u in enumerate(users)]


# CPU seconds of each run, per variant
_CPU: Dict[str, List[float]] = {
    k: [] for k in ("function", "function_rows", "adapter", "function_timer", "adapter_timer")
}
# The records one subtask's buffer holds (a buffer of 2,048 from the source, split
# between two subtasks by key): the processor is called per key per buffer.
SUBTASK_BUFFER = 1024
KINDS = [
    pytest.param("function", id="keyed-process-function"),
    pytest.param("function_rows", id="keyed-process-function-yielding-rows"),
    pytest.param("adapter", id="stateful-processor-adapter"),
]
TIMER_KINDS = [
    pytest.param("function_timer", id="keyed-process-function"),
    pytest.param("adapter_timer", id="stateful-processor-adapter"),
]
TARGET = 0.6  # the issue's: the adapter at >= 60% of the function's rows/s
# Guards (asserted; the target is reported while not met): the adapter at >= GUARD of
# the function. Measured (CPU time, 2 cores shared with other builds, load 3-8): 43-61%
# for the count (27-30% before the adapter kept its objects out of the garbage
# collector's way), 48-61% with a timer per key. Then the function's value state calls
# went to C (ColumnarValueCalls): the function ran 530 -> 768 k rows/s, the adapter
# 223 -> 261 k, its processor's pyspark Rows costing what they did, and the count fell
# to 33-34% (the timer variant, 48%). The guard holds a regression from there; the
# adapter's own cost is held by the Row-yielding function's ratio (ROW_GUARD, below).
GUARD = 0.25
# The adapter against the function yielding pyspark Rows as its processor does (what is
# left is the adapter's own cost). 74-101% in most runs, but one CI run measured 59% and
# two local runs of one commit 64% and 79%: the Row-yielding function's own best swings
# 240-430 k rows/s from run to run on this shared machine, the adapter's far less, and
# A/B runs of this code against the commit before (the two interleaved, three
# rounds each, twice) found no difference. The guard catches the adapter
# losing half of its share (an object per record kept alive again, say), not that noise.
ROW_GUARD = 0.5


def _compare(benchmark: Any, records: List[Dict[str, Any]], kind: str, adapter: str, baselines: List[str]) -> bool:
    """A baseline's row: three rounds. The adapter's row: three rounds, each but the first
    after an untimed run of every baseline (interleaved: the best of all each).
    True for the adapter's row, once every figure is in ``_CPU``."""
    if kind != adapter:
        benchmark.pedantic(lambda: _CPU[kind].append(_cpu_seconds(kind, lambda: _run(records, kind))), rounds=3)
        return False

    def between() -> None:
        for baseline in baselines:
            if _CPU[adapter] or not _CPU[baseline]:
                _CPU[baseline].append(_cpu_seconds(baseline, lambda b=baseline: _run(records, b)))

    benchmark.pedantic(
        lambda: _CPU[adapter].append(_cpu_seconds(adapter, lambda: _run(records, adapter))), setup=between, rounds=3
    )
    return True


def _best_after_misses(records: List[Dict[str, Any]], adapter: str, guards: Dict[str, float]) -> Dict[str, float]:
    """The best CPU seconds of each variant (``_CPU``), the adapter and its baselines
    run again alternately (``measured_again``, up to three times) while the adapter is
    under a baseline's guard (``guards``: baseline -> least ratio). One CI run's adapter
    was a quarter slower in all three of its rounds while its baselines ran as always
    (24%, against 31-34% in the seven CI runs before it, the one just before on the
    same code; 26-45% in four local runs of that code and the commit before it,
    interleaved): a slow spell of a shared machine, which a red CI says nothing of."""

    def margin() -> float:  # the worst ratio over its guard: >= 1 when every guard holds
        best = {k: min(v) for k, v in _CPU.items() if v}
        return min(best[b] / best[adapter] / g for b, g in guards.items())

    def again() -> float:
        for kind in (adapter, *guards):
            _CPU[kind].append(_cpu_seconds(kind, lambda k=kind: _run(records, k)))
        return margin()

    measured_again(margin(), 1.0, again, times=3)
    return {k: min(v) for k, v in _CPU.items() if v}


class _Slot:
    """The least a state can be: what both codes' state calls cost at the floor."""

    __slots__ = ("v",)

    def __init__(self, v: Any = None) -> None:
        self.v = v

    def get(self) -> Any:
        return self.v

    def value(self) -> Any:
        return self.v

    def update(self, v: Any) -> None:
        self.v = v


class _Handle:
    def getValueState(self, *args: Any, **kwargs: Any) -> _Slot:  # Spark's name
        return _Slot()


class _Ctx:
    current_key = 0


def _own_code_us(records: List[Dict[str, Any]]) -> Dict[str, float]:
    """Microseconds per record of the user's code alone, without the engine: the
    processor called as the adapter calls it (per key per buffer of ``SUBTASK_BUFFER``
    records, its rows in a list) and the function per record, both over a plain
    state object, in one interpreter loop each (best of five). With the function's
    job time, this bounds the adapter: an engine with no per-record cost of its own
    beyond the function's runs the processor at most at
    ``job / (job - function's code + processor's code)`` of the function's rows/s."""
    processor, function, ctx = RunningCount(), RunningCountFunction(), _Ctx()
    processor.init(_Handle())
    function.count = _Slot(0)
    calls: List[Any] = []
    for lo in range(0, len(records), SUBTASK_BUFFER):
        groups: Dict[Any, List[Any]] = {}
        for r in records[lo : lo + SUBTASK_BUFFER]:
            groups.setdefault((r["user"],), []).append(Row(**r))
        calls.extend(groups.items())
    handle, element = processor.handleInputRows, function.process_element

    def run_processor() -> None:
        for key, rows in calls:
            for _ in handle(key, iter(rows), None):
                pass

    def run_function() -> None:
        for r in records:
            for _ in element(r, ctx):
                pass

    best = {}
    gc.freeze()  # as the job runs (the embedded runner's _FrozenHeap)
    try:
        for name, run in (("processor", run_processor), ("function", run_function)):
            times = []
            for _ in range(5):
                start = time.process_time()
                run()
                times.append(time.process_time() - start)
            best[name] = min(times) / len(records) * 1e6
    finally:
        gc.unfreeze()
    best["calls_per_record"] = len(calls) / len(records)
    return best


@pytest.mark.benchmark(timer=time.process_time)
@pytest.mark.parametrize("kind", KINDS)
def test_running_count_through_the_adapter_against_a_keyed_process_function(
    benchmark: Any, records: List[Dict[str, Any]], kind: str
) -> None:
    """A row per variant, whole jobs in CPU seconds (``_compare``)."""
    benchmark.group = "tws: running count"
    if not _compare(benchmark, records, kind, "adapter", ["function", "function_rows"]):
        return
    best = _best_after_misses(records, "adapter", {"function": GUARD, "function_rows": ROW_GUARD})
    ratio = best["function"] / best["adapter"]
    ratio_rows = best["function_rows"] / best["adapter"]
    benchmark.extra_info.update(
        adapter_rows_per_cpu_s=RECORDS / best["adapter"], ratio_to_function=ratio, ratio_to_row_function=ratio_rows
    )
    met = "met" if ratio >= TARGET else "NOT MET, reported only"
    own = _own_code_us(records)
    job_us = best["function"] / RECORDS * 1e6
    ceiling = job_us / (job_us - own["function"] + own["processor"])
    benchmark.extra_info.update(own_code_us=own, ceiling=ceiling)
    SUMMARY.append(
        f"StatefulProcessor running count via transform_with_state, {RECORDS:,} records / {KEYS:,} keys, p=2, "
        f"per CPU second: {RECORDS / best['adapter'] / 1e3:.0f} k rows/s; the same as a KeyedProcessFunction "
        f"{RECORDS / best['function'] / 1e3:.0f} k rows/s -> {ratio:.0%} (target >= 60%: {met}); "
        f"a KeyedProcessFunction yielding pyspark Rows as the processor does "
        f"{RECORDS / best['function_rows'] / 1e3:.0f} k rows/s -> {ratio_rows:.0%}"
    )
    SUMMARY.append(
        f"  the user's code alone, without the engine: the processor {own['processor']:.2f} us a record "
        f"({own['calls_per_record']:.2f} calls a record), the function {own['function']:.2f} us; the function's job "
        f"{job_us:.2f} us a record -> an adapter costing nothing of its own would run at most {ceiling:.0%} "
        f"of the function (the target, 60%, is above this ceiling when it is under 60%)"
    )
    # What keeps the adapter under 60%: the processor's own code. Its pyspark Row
    # costs 1-2.4 us (a Python-level __new__ and __setattr__, a __dict__ per Row),
    # the function yielding one as the processor does runs at 37-45% of its
    # dict-yielding self, and the adapter now outruns that one (106-126%): grouping
    # a buffer per key (~0.3 us a record) and the per-key call are what is left.
    assert ratio >= GUARD, f"the adapter at {ratio:.0%} of the KeyedProcessFunction"
    assert ratio_rows >= ROW_GUARD, f"the adapter at {ratio_rows:.0%} of the Row-yielding KeyedProcessFunction"


@pytest.mark.benchmark(timer=time.process_time)
@pytest.mark.parametrize("kind", TIMER_KINDS)
def test_running_count_with_a_timer_per_key_against_a_keyed_process_function(
    benchmark: Any, records: List[Dict[str, Any]], kind: str
) -> None:
    """The count reset every hour: a processing-time timer per key (``RunningCountWithTimer``
    and its function), registered again at every batch of the key (every record of the
    function's); a row per variant, as above."""
    benchmark.group = "tws: running count, a timer per key"
    if not _compare(benchmark, records, kind, "adapter_timer", ["function_timer"]):
        return
    best = _best_after_misses(records, "adapter_timer", {"function_timer": GUARD})
    ratio = best["function_timer"] / best["adapter_timer"]
    benchmark.extra_info.update(adapter_rows_per_cpu_s=RECORDS / best["adapter_timer"], ratio_to_function=ratio)
    met = "met" if ratio >= TARGET else "NOT MET, reported only"
    SUMMARY.append(
        f"StatefulProcessor running count with a timer per key via transform_with_state (ProcessingTime), "
        f"{RECORDS:,} records / {KEYS:,} keys, p=2, per CPU second: {RECORDS / best['adapter_timer'] / 1e3:.0f} k "
        f"rows/s; the same as a KeyedProcessFunction {RECORDS / best['function_timer'] / 1e3:.0f} k rows/s -> "
        f"{ratio:.0%} (target >= 60%: {met})"
    )
    assert ratio >= GUARD, f"the adapter with timers at {ratio:.0%} of the KeyedProcessFunction"


@pytest.fixture(scope="module")
def adapter_state() -> Any:
    """A processor's ValueState through the adapter, on key 7, holding (1,)."""
    from pyengine.runtime.base import OperatorContext
    from pyengine.runtime.keyed import key_selector
    from pyengine.spark.tws import TransformWithStateOperator

    class Holder(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "count bigint")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            return iter([])

    processor = Holder()
    op = TransformWithStateOperator("b", "b", key_selector("user"), processor, "user bigint")
    op.setup(
        OperatorContext(
            job_name="b",
            subtask=0,
            parallelism=1,
            max_parallelism=128,
            state_backend="heap",
            local_recovery_dir=None,
            attempt=0,
        ),
        None,
    )
    op.open()
    state = processor.count
    op.backend.set_current_key(7)
    state.update((1,))
    return state


PER_SAMPLE = 200
_P50_US: Dict[str, float] = {}


@pytest.mark.parametrize("call", ["get", "update"])
def test_one_state_call_through_the_adapter(benchmark: Any, adapter_state: Any, call: str) -> None:
    """300 rounds of ``PER_SAMPLE`` calls; the p50 per call is the figure."""
    state = adapter_state
    value = (5,)
    fn: Callable[[], Any] = state.get if call == "get" else (lambda: state.update(value))
    r = range(PER_SAMPLE)

    def batch() -> None:
        for _ in r:
            fn()

    benchmark.group = "tws: state call"
    benchmark.pedantic(batch, rounds=300)
    best_seconds(benchmark)  # fails plainly when benchmarks are disabled
    _P50_US[call] = statistics.median(benchmark.stats.stats.data) / PER_SAMPLE * 1e6
    benchmark.extra_info["p50_us"] = _P50_US[call]
    if call == "get":
        return
    if "get" not in _P50_US:  # its row was not selected: measured here, untimed
        samples = []
        for _ in range(300):
            start = time.perf_counter()
            for _ in r:
                state.get()
            samples.append((time.perf_counter() - start) / PER_SAMPLE * 1e6)
        _P50_US["get"] = statistics.median(samples)
    get_us, update_us = _P50_US["get"], _P50_US["update"]
    met = "met" if max(get_us, update_us) <= 2 else "NOT MET"
    SUMMARY.append(
        f"StatefulProcessor state call through the adapter, p50: ValueState.get {get_us:.2f} us, "
        f"update {update_us:.2f} us (update through a lambda) (target <= 2 us: {met}; Spark 65-78 us)"
    )
    assert get_us <= 2 and update_us <= 2, f"get {get_us:.2f} us, update {update_us:.2f} us at p50"


# -- 3. against Spark's own transformWithState (opt-in) ------------------------------------------

SPARK_BATCHES = 3  # micro-batches per Spark query; the first (state store set-up, workers starting) is left out
SPARK_ROWS = 20_000  # per micro-batch, over KEYS keys: issue 14's measurement
_SPARK_ROWS_PER_S: Dict[str, float] = {}


class RunningCountPandas(StatefulProcessor):
    """``RunningCount`` for ``transformWithStateInPandas``: DataFrames in and out."""

    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "count bigint")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        import pandas as pd

        n = sum(len(df) for df in rows)
        old = self.count.get()
        total = (old[0] if old else 0) + n
        self.count.update((total,))
        yield pd.DataFrame({"user": [key[0]], "count": [total]})


class RunningCountWithTimerPandas(RunningCountPandas):
    def init(self, handle: Any) -> None:
        super().init(handle)
        self.handle = handle

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        self.handle.registerTimer(_next_hour(timerValues.getCurrentProcessingTimeInMs()))
        yield from super().handleInputRows(key, rows, timerValues)

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        self.count.clear()
        return iter([])


@pytest.fixture(scope="module")
def spark() -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = start_spark(
        SparkSession.builder.master("local[2]")
        .appName("pyengine-bench-tws")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config(
            "spark.sql.streaming.stateStore.providerClass",
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        )
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        # No batches without data: with processing-time timers pending, Spark runs them
        # back to back, and an availableNow query never ends (none fire within the hour).
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def spark_inputs() -> str:
    """The micro-batches as Spark reads them: one parquet file each."""
    import pyarrow.parquet as pq

    folder = tempfile.mkdtemp(prefix="pyengine-bench-tws-in-")
    rng = np.random.default_rng(5)
    for b in range(SPARK_BATCHES):
        users = rng.integers(0, KEYS, SPARK_ROWS)
        table = pa.table({"user": users, "v": np.arange(b * SPARK_ROWS, (b + 1) * SPARK_ROWS)})
        pq.write_table(table, os.path.join(folder, f"batch-{b:03d}.parquet"))
    return folder


def _spark_rows_per_s(
    spark: Any,
    inputs: str,
    flavour: str,
    timer: bool,
    rows: int = SPARK_ROWS,
    batches: int = SPARK_BATCHES,
    whole: Optional[Dict[str, float]] = None,
) -> float:
    """Spark's best batch of a streaming query of the processor (rows over Spark's own
    ``triggerExecution``, first batch left out): its best, as the target says. With
    ``whole``, its ``flavour`` entry is set to the whole query's rate (all rows over
    the wall time from ``start()`` to the query's end, start-up included)."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the bench is not installed on the workers
    grouped = (
        spark.readStream.schema("user long, v long").option("maxFilesPerTrigger", 1).parquet(inputs).groupBy("user")
    )
    mode = "ProcessingTime" if timer else "None"
    if flavour == "row":
        processor: Any = RunningCountWithTimer() if timer else RunningCount()
        df = grouped.transformWithState(processor, "user long, count long", "Update", mode)
    else:
        processor = RunningCountWithTimerPandas() if timer else RunningCountPandas()
        df = grouped.transformWithStateInPandas(processor, "user long, count long", "Update", mode)
    started = time.perf_counter()
    query = (
        df.writeStream.format("noop")
        .option("checkpointLocation", tempfile.mkdtemp(prefix="pyengine-bench-tws-"))
        .outputMode("update")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert query.exception() is None
    if whole is not None:
        whole[flavour] = rows * batches / (time.perf_counter() - started)
    durations = [p["durationMs"]["triggerExecution"] for p in query.recentProgress if p["numInputRows"] > 0]
    assert len(durations) == batches, durations
    return rows / (min(durations[1:]) / 1e3)


@pytest.mark.skipif(
    os.environ.get("PYENGINE_BENCH_SPARK_TWS") != "1",
    reason="opt-in (PYENGINE_BENCH_SPARK_TWS=1): Spark's transformWithState runs 1,000-3,300 rows/s here, minutes",
)
@pytest.mark.parametrize("timer", [False, True], ids=["running-count", "a-timer-per-key"])
@pytest.mark.parametrize("flavour", ["row", "pandas"], ids=["transformWithState", "transformWithStateInPandas"])
def test_sparks_own_transform_with_state(
    benchmark: Any, spark: Any, spark_inputs: str, records: List[Dict[str, Any]], flavour: str, timer: bool
) -> None:
    """A row per Spark query (one round: one streaming query of ``SPARK_BATCHES``
    micro-batches); the last of the four compares the adapter's rows/s, in wall time
    as Spark's (its best run of the rows above; run here if they were not selected),
    with Spark's best of the two flavours for the same processor."""
    benchmark.group = "tws: Spark's own transformWithState"
    benchmark.pedantic(
        lambda: _SPARK_ROWS_PER_S.__setitem__(
            f"{flavour}/{timer}", _spark_rows_per_s(spark, spark_inputs, flavour, timer)
        ),
        rounds=1,
    )
    if (flavour, timer) != ("pandas", True):
        return
    lines, worst = [], float("inf")
    for timed, adapter in ((False, "adapter"), (True, "adapter_timer")):
        while len(_WALL.get(adapter, ())) < 3:  # the best of three, as the rows above (the first warms up)
            _cpu_seconds(adapter, lambda a=adapter: _run(records, a))
        ours = RECORDS / min(_WALL[adapter])
        row, pandas_ = _SPARK_ROWS_PER_S.get(f"row/{timed}"), _SPARK_ROWS_PER_S.get(f"pandas/{timed}")
        best = max(x for x in (row, pandas_) if x is not None)
        worst = min(worst, ours / best)
        lines.append(
            f"{'a timer per key' if timed else 'running count'}: adapter {ours / 1e3:.0f} k rows/s (wall), Spark "
            f"transformWithState {row or 0:,.0f} rows/s, transformWithStateInPandas {pandas_ or 0:,.0f} rows/s -> "
            f"{ours / best:.0f}x Spark's best"
        )
    met = "met" if worst >= 100 else "NOT MET, reported only"
    SUMMARY.append(
        f"StatefulProcessor adapter vs Spark's own (local[2], RocksDB, {SPARK_ROWS:,}-row micro-batches over "
        f"{KEYS:,} keys): " + "; ".join(lines) + f" (target >= 100x: {met})"
    )
    # The 100x target asks the adapter for what a KeyedProcessFunction does (issue 14
    # measured 98x for one): it is the 60% target above seen from Spark's side. Spark
    # measured here: 2,087-2,854 rows/s (Row flavour), ~1,800 (pandas). The guard
    # holds the order of magnitude.
    assert worst >= 20, lines
