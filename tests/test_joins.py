"""Joins (issue #20): the interval join and the window join, with a Python function
and on Arrow batches (``project``), against brute-force answers computed from the
whole inputs: random event-time disorder within the watermark bound, parallelism 1
to 3, both state backends. Then late records (dropped and counted, or to a side
output), exactly-once across injected failures, a savepoint at 2 resumed at 3, one
run on the Spark runner, and misuse refused with the way out."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Tuple

import pyarrow as pa
import pytest
from chaos import Chaos, ChaosSink
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spark_sessions import local_spark

import pyengine as pe
from pyengine.errors import ColumnNotFoundError
from pyengine.joins import JoinFunction, ProcessJoinFunction
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.joins import ArrowIntervalJoinOperator, IntervalJoinOperator
from pyengine.runtime.keyed import key_selector
from pyengine.time.strategy import TimestampAssigner

Record = Dict[str, Any]


def side(n: int, keys: int, step: int, jitter: int, seed: int, base: int) -> List[Record]:
    """Records in sequence order at ``i*step + jitter'``: any subsequence (a source
    split) is out of order by at most ``jitter`` ms, so nothing is ever late with a
    bound of ``jitter``."""
    rng = random.Random(seed)
    return [{"k": rng.randrange(keys), "ts": i * step + rng.randrange(jitter + 1), "v": base + i} for i in range(n)]


def interval_reference(left: List[Record], right: List[Record], lower: int, upper: int) -> Counter:
    return Counter(
        (a["v"], b["v"], max(a["ts"], b["ts"]))
        for a in left
        for b in right
        if a["k"] == b["k"] and a["ts"] + lower <= b["ts"] <= a["ts"] + upper
    )


def window_reference(left: List[Record], right: List[Record], assigner: Any) -> Counter:
    """(left v, right v, window start) for every pair of a key in a common window."""
    out: Counter = Counter()
    if assigner.kind == "session":
        by_key: Dict[int, List[Tuple[int, int, Record]]] = {}
        for s, records in enumerate((left, right)):
            for r in records:
                by_key.setdefault(r["k"], []).append((r["ts"], s, r))
        for events in by_key.values():
            events.sort(key=lambda e: e[0])
            sessions: List[List[Tuple[int, int, Record]]] = []
            end = None
            for e in events:
                if end is not None and e[0] <= end:  # [ts, ts + gap) touching the session merges
                    sessions[-1].append(e)
                    end = max(end, e[0] + assigner.gap)
                else:
                    sessions.append([e])
                    end = e[0] + assigner.gap
            for members in sessions:
                start = members[0][0]
                lefts = [r for _, s, r in members if s == 0]
                rights = [r for _, s, r in members if s == 1]
                out.update((a["v"], b["v"], start) for a in lefts for b in rights)
        return out
    for a in left:
        for b in right:
            if a["k"] != b["k"]:
                continue
            for w in assigner.assign(a["ts"]):
                if w.start <= b["ts"] < w.end:
                    out[(a["v"], b["v"], w.start)] += 1
    return out


class Pairs(ProcessJoinFunction):
    def process_element(self, left: Any, right: Any, ctx: ProcessJoinFunction.Context) -> Any:
        assert ctx.left_timestamp() == left["ts"] and ctx.right_timestamp() == right["ts"]
        yield (left["v"], right["v"], ctx.timestamp())


def env_for(parallelism: int, backend: str, **kwargs: Any) -> pe.StreamEnvironment:
    kwargs.setdefault("buffer_size", 16)
    return pe.StreamEnvironment(
        parallelism=parallelism,
        state_backend=backend,
        buffer_timeout_ms=1,
        auto_watermark_interval_ms=1,
        monitoring=None,
        **kwargs,
    )


def strategy(jitter: int) -> pe.WatermarkStrategy:
    return pe.WatermarkStrategy.for_bounded_out_of_orderness(jitter).with_timestamp_assigner("ts")


def sources(env: pe.StreamEnvironment, left: List[Record], right: List[Record], jitter: int, arrow: bool) -> Any:
    if arrow:  # Arrow batches on both sides (one source subtask each: the table's order)
        return (
            env.from_collection(pa.Table.from_pylist(left), name="left", watermark_strategy=strategy(jitter)),
            env.from_collection(pa.Table.from_pylist(right), name="right", watermark_strategy=strategy(jitter)),
        )
    return (
        env.from_generator(lambda i: left[i], len(left), name="left", watermark_strategy=strategy(jitter)),
        env.from_generator(lambda i: right[i], len(right), name="right", watermark_strategy=strategy(jitter)),
    )


inputs = st.tuples(
    st.integers(10, 70),  # records per side
    st.integers(1, 4),  # keys
    st.integers(1, 6),  # step
    st.integers(0, 12),  # jitter = the watermark bound
    st.integers(0, 10_000),  # seed
)
common = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- interval join against brute force ------------------------------------------------------------


@common
@given(
    shape=inputs,
    bounds=st.tuples(st.integers(-30, 30), st.integers(0, 40)),
    exclusive=st.tuples(st.booleans(), st.booleans()),
    parallelism=st.integers(1, 3),
    backend=st.sampled_from(["heap", "incremental"]),
    arrow=st.booleans(),
)
def test_interval_join_equals_brute_force(
    shape: Any, bounds: Any, exclusive: Any, parallelism: int, backend: str, arrow: bool
) -> None:
    n, keys, step, jitter, seed = shape
    lower, upper = bounds[0], bounds[0] + bounds[1]
    upper = max(upper, lower + exclusive[0] + exclusive[1])  # an interval left once the bounds are open
    left = side(n, keys, step, jitter, seed, 0)
    right = side(n + 3, keys, step, jitter, seed + 1, 100_000)
    env = env_for(parallelism, backend)
    a, b = sources(env, left, right, jitter, arrow)
    joined = a.key_by("k").interval_join(b.key_by("k")).between(lower, upper)
    if exclusive[0]:
        joined = joined.lower_bound_exclusive()
    if exclusive[1]:
        joined = joined.upper_bound_exclusive()
    sink = pe.sinks.CollectSink()
    (joined.project(left=["v"], right=["v"]) if arrow else joined.process(Pairs())).sink_to(sink)
    result = env.execute("interval-join")
    assert result.status == "FINISHED", result.cause
    inclusive = (lower + 1 if exclusive[0] else lower, upper - 1 if exclusive[1] else upper)
    if arrow:
        got = Counter((r["v"], r["v_right"], max(r["left_ts"], r["right_ts"])) for r in result.records)
    else:
        got = Counter(tuple(r) for r in result.records)
    assert got == interval_reference(left, right, *inclusive)
    assert result.event_time.late_records_dropped == 0, "within the watermark bound nothing is late"


# -- window join against brute force --------------------------------------------------------------


@common
@given(
    shape=inputs,
    window=st.sampled_from([("tumbling", 20), ("tumbling", 45), ("sliding", 40, 15), ("session", 8)]),
    parallelism=st.integers(1, 3),
    backend=st.sampled_from(["heap", "incremental"]),
    arrow=st.booleans(),
)
def test_window_join_equals_brute_force(shape: Any, window: Any, parallelism: int, backend: str, arrow: bool) -> None:
    n, keys, step, jitter, seed = shape
    assigner = getattr(pe.windows, window[0])(*window[1:])
    arrow = arrow and assigner.kind != "session"
    left = side(n, keys, step, jitter, seed, 0)
    right = side(n + 5, keys, step, jitter, seed + 7, 100_000)
    env = env_for(parallelism, backend)
    a, b = sources(env, left, right, jitter, arrow)
    windowed = a.join(b).where("k").equal_to("k").window(assigner)
    sink = pe.sinks.CollectSink()
    if arrow:
        windowed.project(left=["v"], right=["v"]).sink_to(sink)
    else:
        windowed.apply(lambda x, y: (x["v"], y["v"])).sink_to(sink)
    result = env.execute("window-join")
    assert result.status == "FINISHED", result.cause
    expected = window_reference(left, right, assigner)
    if arrow:
        assert all(r["window_end"] - r["window_start"] == assigner.size for r in result.records)
        assert Counter((r["v"], r["v_right"], r["window_start"]) for r in result.records) == expected
    else:  # the function sees pairs, not windows
        per_pair: Counter = Counter()
        for (x, y, _), c in expected.items():
            per_pair[(x, y)] += c  # a pair in 3 sliding windows: 3 outputs
        assert Counter(tuple(r) for r in result.records) == per_pair


def test_a_join_function_object_and_the_key_by_function() -> None:
    """``apply`` takes a ``JoinFunction`` (Flink's ``join(first, second)``), keys may be functions."""

    class Sum(JoinFunction):
        def join(self, left: Any, right: Any) -> Any:
            return left["v"] + right["v"]

    left = side(40, 3, 2, 4, 1, 0)
    right = side(40, 3, 2, 4, 2, 1000)
    env = env_for(2, "heap")
    a, b = sources(env, left, right, 4, arrow=False)
    sink = pe.sinks.CollectSink()
    a.join(b).where(lambda r: r["k"]).equal_to(lambda r: r["k"]).window(pe.windows.tumbling(10)).apply(Sum()).sink_to(
        sink
    )
    env.execute("join-fn")
    expected: Counter = Counter()
    for (x, y, _), c in window_reference(left, right, pe.windows.tumbling(10)).items():
        expected[x + y] += c
    assert Counter(sink.records) == expected and expected


# -- late records ---------------------------------------------------------------------------------


def _ctx(backend: str = "heap") -> OperatorContext:
    return OperatorContext(
        job_name="j",
        subtask=0,
        parallelism=1,
        max_parallelism=128,
        state_backend=backend,
        local_recovery_dir=None,
        attempt=0,
    )


def _interval_op(late_tags: Any = (None, None)) -> IntervalJoinOperator:
    select = key_selector("k")
    stamps = (TimestampAssigner(column="ts"), TimestampAssigner(column="ts"))
    op = IntervalJoinOperator("j", "join", (select, select), stamps, -10, 5, Pairs(), late_tags)
    op.setup(_ctx(), None)
    op.open()
    return op


def _buffered(op: IntervalJoinOperator, key: Any, side: int) -> List[Any]:
    """What the join holds of one side of ``key``: (timestamp, record) in time order."""
    buffer = op._views[key][side]
    return list(zip(buffer.times, buffer.records, strict=True))


def test_interval_join_drops_and_counts_late_records_and_cleans_its_buffers() -> None:
    op = _interval_op()
    assert op.process([{"k": 1, "ts": 100, "v": 1}]) == []
    assert op.process2([{"k": 1, "ts": 95, "v": 2}]) == [(1, 2, 100)], "in [100 - 10, 100 + 5]"
    op.process_watermark(100)
    assert op.process2([{"k": 1, "ts": 99, "v": 3}]) == [], "behind the watermark: late, not joined"
    assert op.late_records_dropped == 1
    assert op.process2([{"k": 1, "ts": 104, "v": 4}]) == [(1, 4, 104)]
    assert _buffered(op, 1, 0) == [(100, {"k": 1, "ts": 100, "v": 1})]
    op.process_watermark(105)  # the left record's cleanup time: 100 + 5
    assert _buffered(op, 1, 0) == [], "no right record from now on can pair with it"
    assert _buffered(op, 1, 1) == [(104, {"k": 1, "ts": 104, "v": 4})], "a right one waits until ts + 10"
    op.process_watermark(114)
    assert 1 not in op._views, "nothing left of the key"
    assert op.process([{"k": 1, "ts": 104, "v": 5}]) == [] and op.late_records_dropped == 2


def test_late_records_of_each_side_can_go_to_a_side_output() -> None:
    op = _interval_op(("late-left", "late-right"))
    sent: List[Any] = []
    op.side_output = lambda name, records: sent.append((name, list(records)))
    op.process_watermark(50)
    op.process([{"k": 1, "ts": 40, "v": 1}])
    op.process2([{"k": 1, "ts": 30, "v": 2}])
    assert sent == [("late-left", [{"k": 1, "ts": 40, "v": 1}]), ("late-right", [{"k": 1, "ts": 30, "v": 2}])]
    assert op.late_records_dropped == 0, "sent aside, not dropped (as Flink counts)"


def test_the_arrow_interval_join_drops_late_rows_and_trims_its_buffers() -> None:
    stamps = (TimestampAssigner(column="ts"), TimestampAssigner(column="ts"))
    op = ArrowIntervalJoinOperator("j", "join", 0, 10, ("left_ts", "right_ts"), ("k", "k"), stamps, (None, None), "_r")
    op.setup(_ctx(), None)
    left = pa.RecordBatch.from_pylist([{"k": 1, "ts": 100, "x": 1.5}, {"k": 2, "ts": 101, "x": 2.5}])
    assert op.process(left) == []
    out = op.process2(pa.RecordBatch.from_pylist([{"k": 1, "ts": 105, "x": 9.0}, {"k": 2, "ts": 120, "x": 8.0}]))
    assert out.to_pylist() == [{"k": 1, "ts": 100, "x": 1.5, "ts_r": 105, "x_r": 9.0, "left_ts": 100, "right_ts": 105}]
    op.process_watermark(108)
    late = op.process2(pa.RecordBatch.from_pylist([{"k": 2, "ts": 107, "x": 7.0}]))
    assert late == [] and op.late_records_dropped == 1
    op.process_watermark(111)  # left rows' cleanup: ts + 10 <= 111 for both
    assert sum(b.num_rows for b in op._buckets[(0, 0)]) == 0
    assert sum(b.num_rows for b in op._buckets[(0, 1)]) == 1, "a right row waits for nothing (lower 0): kept to ts"


# -- exactly once across failures, and a restore at another parallelism ---------------------------


EO_CASES = [
    ("interval", False, "heap", False),
    ("interval", False, "incremental", True),  # the buffers' segments as incremental deltas
    ("interval", True, "incremental", True),
    ("window", False, "incremental", True),
    ("window", True, "heap", False),
]


@pytest.mark.parametrize(
    ("join", "arrow", "backend", "unaligned"),
    EO_CASES,
    ids=[f"{j}-{'arrow' if a else 'python'}-{b}-{'unaligned' if u else 'aligned'}" for j, a, b, u in EO_CASES],
)
def test_joins_are_exactly_once_across_failures(
    tmp_path: Any, join: str, arrow: bool, backend: str, unaligned: bool
) -> None:
    left = side(600, 7, 2, 6, 11, 0)
    right = side(500, 7, 2, 6, 12, 100_000)
    chaos = Chaos([("record", 350), ("commit", 2)])  # the second commit: a short run may make only a few
    env = env_for(
        2,
        backend,
        checkpointing=pe.CheckpointConfig(interval_ms=5, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / "ckpt"),
        restart_attempts=4,
        channel_capacity=2,
    )

    def watch(record: Any) -> Any:
        chaos.hit("record")
        return record

    a, b = sources(env, left, right, 6, arrow=False)
    a = a.map(watch)
    sink = ChaosSink(chaos)
    if join == "interval":
        joined = a.key_by("k").interval_join(b.key_by("k")).between(-8, 4)
        out = joined.project(left=["v"], right=["v"]) if arrow else joined.process(Pairs())
        expected = interval_reference(left, right, -8, 4)
    else:
        windowed = a.join(b).where("k").equal_to("k").window(pe.windows.sliding(30, 10))
        out = windowed.project(left=["v"], right=["v"]) if arrow else windowed.apply(lambda x, y: (x["v"], y["v"], 0))
        expected = window_reference(left, right, pe.windows.sliding(30, 10))
    out.uid("join").sink_to(sink)
    result = env.execute("join-exactly-once")
    assert result.status == "FINISHED", result.cause
    # both failures happened; they may fall in one attempt (one restart) or two
    assert len(chaos.fired) == 2 and result.restarts in (1, 2), (chaos.fired, result.restarts)
    if join == "interval":
        key = (lambda r: (r["v"], r["v_right"], max(r["left_ts"], r["right_ts"]))) if arrow else tuple
    else:
        key = (lambda r: (r["v"], r["v_right"], r["window_start"])) if arrow else tuple
        if not arrow:
            per_pair: Counter = Counter()
            for (x, y, _), c in expected.items():
                per_pair[(x, y, 0)] += c  # a pair in 3 sliding windows: 3 outputs
            expected = per_pair
    assert Counter(key(r) for r in result.records) == expected


@pytest.mark.parametrize("arrow", [False, True], ids=["python", "arrow"])
def test_savepoint_of_joins_at_2_resumed_at_3_is_exact(tmp_path: Any, arrow: bool) -> None:
    """Buffered rows of both sides (keyed state for the Python joins, key-group-split
    Arrow buffers for ``project``) move to the subtask that owns their key now."""
    from test_windows_lateness import Held

    left = side(500, 11, 2, 5, 21, 0)
    right = side(500, 11, 2, 5, 22, 100_000)
    sink = pe.sinks.CollectSink()  # one for both runs: the resumed run commits what the savepoint covers

    def job(parallelism: int, release: threading.Event) -> pe.StreamEnvironment:
        env = env_for(
            parallelism,
            "heap" if arrow else "incremental",
            checkpointing=pe.CheckpointConfig(interval_ms=10),
            checkpoint_storage=str(tmp_path / f"ckpt{parallelism}"),
        )
        a = env.from_source(Held(left, 150, release), name="left", watermark_strategy=strategy(5))
        b = env.from_source(Held(right, 150, release), name="right", watermark_strategy=strategy(5))
        joined = a.key_by("k").interval_join(b.key_by("k")).between(-40, 40)
        (joined.project(left=["v"], right=["v"]) if arrow else joined.process(Pairs())).uid("join").sink_to(sink)
        return env

    client = job(2, threading.Event()).execute_async("join-sp")
    deadline = time.monotonic() + 30
    while (client.checkpoints is None or client.checkpoints.counts["completed"] < 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    savepoint = client.stop_with_savepoint(str(tmp_path / "savepoint"))
    client.wait(30)
    expected = interval_reference(left, right, -40, 40)
    assert 0 < len(sink.records) < sum(expected.values()), "the savepoint was taken mid-join"
    released = threading.Event()
    released.set()
    result = job(3, released).execute("join-sp", restore_from=savepoint)
    assert result.status == "FINISHED", result.cause
    if arrow:
        got = Counter((r["v"], r["v_right"], max(r["left_ts"], r["right_ts"])) for r in sink.records)
    else:
        got = Counter(tuple(r) for r in sink.records)
    assert got == expected


# -- on Spark ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spark() -> Any:
    pytest.importorskip("pyspark", reason="the Spark runner needs pyspark (the test extra installs it)")
    yield from local_spark(__name__, "pyengine-join-tests", 4)


@pytest.mark.spark
@pytest.mark.slow
def test_an_interval_join_runs_on_spark(tmp_path: Any, spark: Any) -> None:
    left = side(300, 5, 2, 4, 31, 0)
    right = side(300, 5, 2, 4, 32, 100_000)
    env = pe.StreamEnvironment(
        parallelism=1,
        checkpointing=pe.CheckpointConfig(interval_ms=20),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=16,
        buffer_timeout_ms=2,
        auto_watermark_interval_ms=1,
        monitoring=None,
    )
    a = env.from_collection(left, name="left", watermark_strategy=strategy(4))
    b = env.from_collection(right, name="right", watermark_strategy=strategy(4))
    out = pe.sinks.FileSink(str(tmp_path / "out"), format="jsonl")
    a.key_by("k").interval_join(b.key_by("k")).between(-6, 6).process(DictPairs()).sink_to(out)
    result = env.execute("join-on-spark", runner=pe.runners.SparkRunner(spark))
    assert result.status == "FINISHED", result.cause
    got = Counter((r["l"], r["r"], r["ts"]) for r in out.read_committed())
    assert got == interval_reference(left, right, -6, 6)


class DictPairs(ProcessJoinFunction):
    def process_element(self, left: Any, right: Any, ctx: ProcessJoinFunction.Context) -> Any:
        yield {"l": left["v"], "r": right["v"], "ts": ctx.timestamp()}


# -- misuse -----------------------------------------------------------------------------------------


def _two(env: pe.StreamEnvironment, with_time: bool = True) -> Any:
    s = strategy(0) if with_time else None
    rows = [{"k": 1, "ts": 1, "v": 1}]
    return env.from_collection(rows, watermark_strategy=s), env.from_collection(rows, watermark_strategy=s)


def test_misuse_is_refused_with_the_way_out() -> None:
    env = env_for(1, "heap")
    a, b = _two(env)
    with pytest.raises(TypeError, match=r"keyed stream.*key_by"):
        a.key_by("k").interval_join(b)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"lower_ms .* must be <= upper_ms"):
        a.key_by("k").interval_join(b.key_by("k")).between(5, 1)
    with pytest.raises(TypeError, match="int of milliseconds"):
        a.key_by("k").interval_join(b.key_by("k")).between(0.5, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="leaves no interval"):
        joined = a.key_by("k").interval_join(b.key_by("k")).between(0, 1)
        joined.lower_bound_exclusive().upper_bound_exclusive().process(Pairs())
    with pytest.raises(TypeError, match="ProcessJoinFunction"):
        a.key_by("k").interval_join(b.key_by("k")).between(0, 1).process(lambda x, y: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key the left stream by a column"):
        a.key_by(lambda r: r["k"]).interval_join(b.key_by("k")).between(0, 1).project()
    with pytest.raises(TypeError, match="not keyed"):
        a.join(b.key_by("k"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="event time only"):
        a.join(b).where("k").equal_to("k").window(pe.windows.tumbling(10, time="processing"))
    with pytest.raises(ValueError, match=r"session windows .* use apply"):
        a.join(b).where("k").equal_to("k").window(pe.windows.session(10)).project()
    with pytest.raises(TypeError, match="JoinFunction"):
        a.join(b).where("k").equal_to("k").window(pe.windows.tumbling(10)).apply(42)
    plain, other = _two(env_for(1, "heap"), with_time=False)
    with pytest.raises(ValueError, match=r"left stream has no timestamps.*watermark_strategy"):
        plain.key_by("k").interval_join(other.key_by("k"))
    with pytest.raises(ValueError, match=r"no timestamps.*assign_timestamps_and_watermarks"):
        plain.join(other).where("k").equal_to("k").window(pe.windows.tumbling(10))


def test_project_checks_columns_when_the_schemas_are_known() -> None:
    env = env_for(1, "heap")
    table = pa.Table.from_pylist([{"k": 1, "ts": 1, "v": 1}])
    a = env.from_collection(table, watermark_strategy=strategy(0))
    b = env.from_collection(table, watermark_strategy=strategy(0))
    with pytest.raises(ColumnNotFoundError, match="right stream has no column 'nope'"):
        a.key_by("k").interval_join(b.key_by("k")).between(0, 1).project(right=["nope"])
    with pytest.raises(ValueError, match="repeat"):
        a.key_by("k").interval_join(b.key_by("k")).between(0, 1).project(timestamp_columns=("v", "ts_right"))
    stream = a.join(b).where("k").equal_to("k").window(pe.windows.tumbling(5)).project()
    assert stream._schema.names == ["k", "ts", "v", "ts_right", "v_right", "window_start", "window_end"]


# -- late records in a job ----------------------------------------------------------------------------


class Gated(pe.runtime.Source):
    """``records`` up to ``hold``, the rest once ``release`` is set (one subtask)."""

    def __init__(self, records: List[Record], hold: int, release: threading.Event) -> None:
        self.records, self.hold, self.release = records, hold, release

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if position >= self.hold and not self.release.is_set():
            return []
        if position >= len(self.records):
            return None
        end = len(self.records) if self.release.is_set() else self.hold
        return self.records[position : min(end, position + n)]


@pytest.mark.parametrize("to_side_output", [False, True], ids=["dropped", "side-output"])
def test_a_record_behind_the_joins_watermark_is_dropped_and_counted_or_sent_aside(to_side_output: bool) -> None:
    left = [{"k": 1, "ts": 10 * i, "v": i} for i in range(100)] + [{"k": 1, "ts": 15, "v": -1}]  # the last: late
    right = [{"k": 1, "ts": 10 * i + 1, "v": 1000 + i} for i in range(100)]
    release = threading.Event()
    env = env_for(1, "heap")
    a = env.from_source(Gated(left, 100, release), name="left", watermark_strategy=strategy(0))
    b = env.from_source(Gated(right, 100, release), name="right", watermark_strategy=strategy(0))
    joined = a.key_by("k").interval_join(b.key_by("k")).between(0, 5)
    late_tag = pe.OutputTag("late-left")
    if to_side_output:
        joined = joined.side_output_left_late_data(late_tag)
    pairs = joined.process(Pairs()).uid("join")
    sink, late_sink = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    pairs.sink_to(sink)
    if to_side_output:
        pairs.get_side_output(late_tag).sink_to(late_sink)
    client = env.execute_async("late-join")
    deadline = time.monotonic() + 30
    while not all(marks and min(marks) >= 900 for marks in client.watermarks().values()):
        assert time.monotonic() < deadline, client.watermarks()
        time.sleep(0.005)
    release.set()  # now the held late record comes, behind the join's watermark
    result = client.wait(30)
    assert result.status == "FINISHED", result.cause
    assert Counter(tuple(r) for r in sink.records) == interval_reference(left[:100], right, 0, 5)
    if to_side_output:
        assert late_sink.records == [{"k": 1, "ts": 15, "v": -1}]
        assert result.event_time.late_records_dropped == 0
    else:
        assert result.event_time.late_records_dropped == 1


def test_get_side_output_is_refused_where_a_join_sends_nothing_aside() -> None:
    """A window join (apply or project) and an interval join's project without late tags
    never send to a side output: get_side_output on them is refused, not an empty stream."""
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(1000).with_timestamp_assigner("ts")
    env = pe.StreamEnvironment(parallelism=1)
    rows = pa.table({"user": [1, 2], "ts": [1000, 2000], "v": [1, 2]})
    a = env.from_collection(rows, watermark_strategy=strategy)
    b = env.from_collection(rows, watermark_strategy=strategy)
    tag = pe.OutputTag("late")
    windowed = a.join(b).where("user").equal_to("user").window(pe.windows.tumbling(5000))
    for joined in (windowed.apply(lambda x, y: (x, y)), windowed.project()):
        with pytest.raises(ValueError, match="sends nothing to a side output"):
            joined.get_side_output(tag)
    interval = a.key_by("user").interval_join(b.key_by("user")).between(0, 10)
    with pytest.raises(ValueError, match="sends nothing to a side output"):
        interval.project().get_side_output(tag)
    kept = a.key_by("user").interval_join(b.key_by("user")).between(0, 10).side_output_left_late_data(tag)
    kept.project().get_side_output(tag)  # late rows go there: allowed


@pytest.mark.parametrize("arrow", [False, True], ids=["python", "arrow"])
def test_a_record_without_its_timestamp_fails_the_job_naming_the_join(arrow: bool) -> None:
    """A map between the source and the join that drops the timestamp column: the join
    meets records it cannot place in time, and the failure names the join."""
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(1000).with_timestamp_assigner("ts")
    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    rows_a, rows_b = [{"user": 1, "ts": 1000, "v": 1}], [{"user": 1, "ts": 1000, "v": 2}]
    if arrow:
        rows_a, rows_b = pa.Table.from_pylist(rows_a), pa.Table.from_pylist(rows_b)
    a = env.from_collection(rows_a, watermark_strategy=strategy)
    b = env.from_collection(rows_b, watermark_strategy=strategy)
    if arrow:
        a = a.map_batches(lambda batch: batch.drop_columns(["ts"]))
    else:
        a = a.map(lambda r: {"user": r["user"], "v": r["v"]})
    joined = a.key_by("user").interval_join(b.key_by("user")).between(-10, 10)
    (joined.project() if arrow else joined.process(Pairs())).name("the-join").sink_to(pe.sinks.CollectSink())
    with pytest.raises(pe.JobFailedError) as info:
        env.execute("join-without-timestamps")
    cause = str(info.value.__cause__)
    assert "'the-join'" in cause and "'ts'" in cause, cause
