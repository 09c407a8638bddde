"""Mistakes a new user makes with functions and windows, found by a new-user trial:
each either works as the user meant or fails at once (no restarts) with a message
that says what to write instead; none is silently wrong."""

from __future__ import annotations

import traceback
from typing import Any, List

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.errors import OutputTypeError, is_non_retryable

STRATEGY = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
RECORDS = [{"user": i % 3, "ts": i * 10} for i in range(20)]


def _failed(env: pe.StreamEnvironment) -> Any:
    with pytest.raises(pe.JobFailedError) as err:
        env.execute("mistake")
    result = err.value.result
    assert result.status == "FAILED" and result.restarts == 0 and is_non_retryable(result.cause)
    return result.cause


# -- a function that returns one record instead of yielding it -----------------------------------


class ReturnsADict(pe.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        return {"user": value["user"]}


class TimerReturnsADict(pe.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        ctx.timer_service().register_event_time_timer(value["ts"] + 5)
        return None

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        return {"fired": timestamp}


class ReturnsAString(pe.ProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        return "user"


@pytest.mark.parametrize(
    ("build", "call"),
    [
        (lambda s: s.key_by("user").process(ReturnsADict()), "process_element"),
        (lambda s: s.key_by("user").process(TimerReturnsADict()), "on_timer"),
        (lambda s: s.process(ReturnsAString()), "process_element"),
        (lambda s: s.flat_map(lambda r: {"user": r["user"]}), "flat_map"),
        (
            lambda s: s.key_by("user").window(pe.windows.tumbling(50)).process(lambda k, w, es: {"user": k}),
            "window function",
        ),
    ],
    ids=["process-element", "on-timer", "a-string", "flat-map", "window-process"],
)
def test_a_function_returning_one_record_fails_at_once_and_says_to_yield_it(build: Any, call: str) -> None:
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    build(env.from_collection(RECORDS, watermark_strategy=STRATEGY)).sink_to(pe.sinks.CollectSink())
    cause = _failed(env)
    assert isinstance(cause, OutputTypeError), cause
    message = str(cause)
    assert call in message and "yield" in message and "one by one" in message


def test_a_function_yielding_or_returning_a_list_of_dicts_emits_them() -> None:
    class Yields(pe.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            yield {"user": value["user"]}

    class ReturnsAList(pe.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            return [{"user": value["user"]}]

    for fn in (Yields(), ReturnsAList()):
        env = pe.StreamEnvironment(parallelism=1)
        env.from_collection(RECORDS).key_by("user").process(fn).sink_to(pe.sinks.CollectSink())
        assert sorted(r["user"] for r in env.execute("ok").records) == sorted(r["user"] for r in RECORDS)


# -- records in no window (a sliding window whose slide is longer than its size) -----------------

GAPPED = [{"k": 1, "ts": 200}, {"k": 1, "ts": 700}, {"k": 2, "ts": 720}, {"k": 1, "ts": 1100}, {"k": 1, "ts": 2600}]


@pytest.mark.parametrize("how", ["aggregate", "process"])
@pytest.mark.parametrize("parallelism", [1, 2])
def test_records_between_sliding_windows_are_in_none_and_not_counted_late(how: str, parallelism: int) -> None:
    """sliding(500, 1000): windows [0, 500), [1000, 1500), [2000, 2500)...; 700, 720 and
    2600 fall in none (a batch may hold only such records) and are not late either."""
    env = pe.StreamEnvironment(parallelism=parallelism)
    keyed = env.from_collection(GAPPED, watermark_strategy=STRATEGY).key_by("k").window(pe.windows.sliding(500, 1000))
    if how == "aggregate":
        stream = keyed.aggregate(pe.agg.count())
    else:
        stream = keyed.process(lambda k, w, es: [{"k": k, "window_start": w.start, "count": len(es)}])
    stream.sink_to(pe.sinks.CollectSink())
    result = env.execute("gapped")
    assert sorted((r["k"], r["window_start"], r["count"]) for r in result.records) == [(1, 0, 1), (1, 1000, 1)]
    assert result.event_time is not None and result.event_time.late_records_dropped == 0


def test_a_batch_of_records_all_in_no_window_is_no_error() -> None:
    env = pe.StreamEnvironment(parallelism=1)
    only_gaps: List[Any] = [{"k": 1, "ts": 700}]
    stream = env.from_collection(only_gaps, watermark_strategy=STRATEGY).key_by("k")
    stream.window(pe.windows.sliding(500, 1000)).aggregate(pe.agg.count()).sink_to(pe.sinks.CollectSink())
    result = env.execute("only-gaps")
    assert result.status == "FINISHED" and result.records == []


# -- a key column with a window bound's name ------------------------------------------------------


@pytest.mark.parametrize("column", ["window_start", "window_end"])
def test_a_key_column_named_as_a_window_bound_is_refused_when_built(column: str) -> None:
    env = pe.StreamEnvironment()
    keyed = env.from_collection([{column: 7, "ts": 1}], watermark_strategy=STRATEGY).key_by(column)
    with pytest.raises(ValueError, match=f"key column '{column}'.*rename"):
        keyed.window(pe.windows.tumbling(10)).aggregate(pe.agg.count())


# -- a function's class where an instance goes; keyed state outside a key ------------------------


def test_a_function_class_instead_of_an_instance_is_refused_when_built() -> None:
    class Collect(pe.windows.ProcessWindowFunction):
        def process(self, key: Any, context: Any, elements: List[Any]) -> Any:
            yield key

    env = pe.StreamEnvironment()
    stream = env.from_collection(RECORDS, watermark_strategy=STRATEGY)
    with pytest.raises(TypeError, match=r"pass ReturnsADict\(\), not the class"):
        stream.key_by("user").process(ReturnsADict)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass ReturnsAString\(\), not the class"):
        stream.process(ReturnsAString)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass Collect\(\), not the class"):
        stream.key_by("user").window(pe.windows.tumbling(50)).process(Collect)


class TimerInOpen(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        ctx.timer_service().register_event_time_timer(100)

    def process_element(self, value: Any, ctx: Any) -> Any:
        return ()


def test_a_timer_registered_in_open_fails_at_once_and_says_where_timers_go() -> None:
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    env.from_collection(RECORDS, watermark_strategy=STRATEGY).key_by("user").process(TimerInOpen()).sink_to(
        pe.sinks.CollectSink()
    )
    cause = _failed(env)
    assert "no current key" in str(cause) and "process_element or on_timer" in str(cause)


# -- found by a new-user trial of per-record state (issue #19) ---------------------------------


def test_an_arrow_type_as_a_value_states_default_is_refused_with_the_way_out() -> None:
    """PyFlink's ``ValueStateDescriptor(name, type)``: here the second argument is the
    default, and ``value()`` returned the Arrow type itself, so ``is None`` checks
    silently failed."""
    import pyarrow as pa

    from pyengine.state import ValueStateDescriptor

    with pytest.raises(TypeError, match=r"second argument is the default.*type=pa\.int64\(\)"):
        ValueStateDescriptor("n", pa.int64())
    with pytest.raises(TypeError, match=r"type=the type"):
        ValueStateDescriptor("t", pa.timestamp("ms"))
    # named as code that exists: pa.float64() prints as "double", pa.bool_() as "bool"
    with pytest.raises(TypeError, match=r"type=pa\.float64\(\)"):
        ValueStateDescriptor("f", pa.float64())
    with pytest.raises(TypeError, match=r"type=pa\.bool_\(\)"):
        ValueStateDescriptor("b", pa.bool_())
    assert ValueStateDescriptor("n", type=pa.int64()).default is None


def test_a_default_that_does_not_fit_the_declared_type_is_refused_at_get_state() -> None:
    import pyarrow as pa

    from pyengine.state import StateDescriptorError, ValueStateDescriptor, create_keyed_backend

    backend = create_keyed_backend("heap")
    with pytest.raises(StateDescriptorError, match=r"value state 'n' default: 'zero' is not an int64 value"):
        backend.get_state(ValueStateDescriptor("n", "zero", pa.int64()))
    backend.set_current_key(1)
    assert backend.get_state(ValueStateDescriptor("f", 0, pa.float64())).value() == 0  # an int is a float64 value


@pytest.mark.parametrize("declared", [False, True])
def test_a_list_state_view_emitted_downstream_is_written_to_parquet_as_the_list_it_shows(
    tmp_path: Any, declared: bool
) -> None:
    """The docs say ``get()`` for values going downstream; a view sent anyway was
    refused by the parquet sink with advice to declare a schema (pyarrow takes
    lists, not other sequences), where the jsonl sink wrote it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pyengine.state import ListStateDescriptor

    seen = ListStateDescriptor[int]("seen", pa.int64())

    class Seen(pe.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.seen = ctx.get_list_state(seen)

        def process_element(self, value: Any, ctx: Any) -> Any:
            self.seen.add(value["x"])
            yield {"k": value["k"], "seen": self.seen.view()}

    schema = pa.schema([("k", pa.int64()), ("seen", pa.list_(pa.int64()))]) if declared else None
    env = pe.StreamEnvironment(parallelism=1)
    records = [{"k": i % 2, "x": i} for i in range(6)]
    out = tmp_path / "out"
    sink = pe.sinks.FileSink(str(out), format="parquet", schema=schema)
    env.from_collection(records).key_by("k").process(Seen()).sink_to(sink)
    assert env.execute("views").status == "FINISHED"
    rows = pq.read_table(str(out)).to_pylist()
    assert sorted((r["k"], r["seen"]) for r in rows) == sorted(
        (k, [x for x in range(n + 1) if x % 2 == k]) for n, k in ((x, x % 2) for x in range(6))
    )


def test_a_list_state_view_nested_in_a_record_is_written_to_parquet_as_lists(tmp_path: Any) -> None:
    """The review: a view inside a struct field or a list was still refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pyengine.state import ListStateDescriptor

    seen = ListStateDescriptor[int]("seen", pa.int64())

    class Nested(pe.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.seen = ctx.get_list_state(seen)

        def process_element(self, value: Any, ctx: Any) -> Any:
            self.seen.add(value["x"])
            view = self.seen.view()
            yield {"k": value["k"], "s": {"seen": view}, "twice": [view, view]}

    env = pe.StreamEnvironment(parallelism=1)
    out = tmp_path / "out"
    env.from_collection([{"k": 0, "x": i} for i in range(3)]).key_by("k").process(Nested()).sink_to(
        pe.sinks.FileSink(str(out), format="parquet")
    )
    assert env.execute("nested-views").status == "FINISHED"
    rows = sorted(pq.read_table(str(out)).to_pylist(), key=lambda r: len(r["s"]["seen"]))
    assert [r["s"]["seen"] for r in rows] == [[0], [0, 1], [0, 1, 2]]
    assert rows[2]["twice"] == [[0, 1, 2], [0, 1, 2]]


def test_a_pause_between_checkpoints_is_no_back_to_back(caplog: Any) -> None:
    """The review: with ``min_pause_ms`` the warning said "each starts as the previous
    one ends" and advised the setting already given."""
    import logging

    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=2, min_pause_ms=100), monitoring=None
    )
    env.from_generator(lambda i: {"k": i % 50_000, "v": i}, 1_200_000).key_by("k").process(_Counter()).sink_to(
        pe.sinks.DiscardSink()
    )
    with caplog.at_level(logging.WARNING, logger="pyengine.coordinator.coordinator"):
        result = env.execute("paused")
    assert result.status == "FINISHED" and result.checkpoints.counts["completed"] >= 3
    assert not [r for r in caplog.records if "checkpoints in a row" in r.getMessage()]


def test_a_default_not_of_its_type_fails_the_job_at_once() -> None:
    import pyarrow as pa

    from pyengine.state import ValueStateDescriptor

    class Wrong(pe.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.n = ctx.get_state(ValueStateDescriptor("n", "zero", pa.int64()))

        def process_element(self, value: Any, ctx: Any) -> Any:
            return ()

    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3, monitoring=None)
    env.from_collection([{"k": 1}]).key_by("k").process(Wrong()).sink_to(pe.sinks.DiscardSink())
    result = env.execute_async("wrong-default").wait(60, raise_failure=False)
    assert result.status == "FAILED" and result.restarts == 0
    assert "'zero' is not an int64 value" in str(result.cause)


def test_checkpoints_far_longer_than_their_interval_are_said_once(caplog: Any) -> None:
    """``interval_ms=2`` meant as 2 s: checkpoints ran back to back, the job spent its
    time checkpointing, and nothing said so."""
    import logging

    env = pe.StreamEnvironment(parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=2), monitoring=None)
    env.from_generator(lambda i: {"k": i % 50_000, "v": i}, 1_200_000).key_by("k").process(_Counter()).sink_to(
        pe.sinks.DiscardSink()
    )
    with caplog.at_level(logging.WARNING, logger="pyengine.coordinator.coordinator"):
        result = env.execute("back-to-back")
    assert result.status == "FINISHED"
    said = [r.getMessage() for r in caplog.records if "checkpoints in a row took more than twice" in r.getMessage()]
    # 50,000 keys' state takes more than 4 ms to checkpoint on any machine, many times over the run
    assert result.checkpoints.summary()["end_to_end_duration_ms"]["p50"] > 4
    # more than the 3 in a row that make it say so: said once, not at each later one (the
    # input is long enough for that however fast the job runs: buffers grow by default)
    assert result.checkpoints.counts["completed"] > 3
    assert len(said) == 1, said
    assert "interval of 2 ms" in said[0] and "in milliseconds" in said[0]


class _Counter(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        from pyengine.state import ValueStateDescriptor

        self.n = ctx.get_state(ValueStateDescriptor("n", 0))

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.n.update(self.n.value() + 1)
        return ()


@pytest.mark.parametrize("name", ["window", "aggregate", "interval_join", "transform_with_state"])
def test_a_keyed_streams_method_on_a_stream_not_keyed_says_to_key_it(name: str) -> None:
    stream = pe.StreamEnvironment().from_collection([{"k": 1}])
    with pytest.raises(AttributeError, match=rf"{name}\(\) is a keyed stream's: .*key_by\(key\)\.{name}\("):
        getattr(stream, name)
    with pytest.raises(AttributeError, match="has no attribute 'windw'"):
        stream.windw  # noqa: B018  # a misspelt name stays Python's error


def test_a_misspelt_process_element_is_refused_while_the_job_is_built() -> None:
    """A function whose class leaves process_element to the base class failed the
    running job with an empty NotImplementedError after every restart (a new-user
    trial); it is refused at .process(), naming the method and the near miss."""
    import pyengine as pe

    class Typo(pe.KeyedProcessFunction):
        def process_elements(self, value: Any, ctx: Any) -> Any:
            yield value

    env = pe.StreamEnvironment()
    keyed = env.from_collection([1, 2]).key_by(lambda r: r)
    with pytest.raises(TypeError, match=r"Typo does not define process_element.*'process_elements': rename it"):
        keyed.process(Typo())

    class Half(pe.KeyedCoProcessFunction):
        def process_element1(self, value: Any, ctx: Any) -> Any:
            yield value

    other = env.from_collection([3]).key_by(lambda r: r)
    with pytest.raises(TypeError, match="Half does not define process_element2"):
        keyed.connect(other).process(Half())

    class Assigned(pe.KeyedProcessFunction):  # defined on the instance: fine
        def __init__(self) -> None:
            self.process_element = lambda value, ctx: [value]

    sink = pe.sinks.CollectSink()
    keyed.process(Assigned()).sink_to(sink)
    assert sorted(env.execute("assigned").records) == [1, 2]


class WrongType(pe.KeyedProcessFunction):
    def __init__(self, mistake: str) -> None:
        self.mistake = mistake

    def open(self, ctx: Any) -> None:
        self.amounts = ctx.get_list_state(pe.state.ListStateDescriptor("amounts", pa.float64()))
        if self.mistake == "two kinds":
            ctx.get_state(pe.state.ValueStateDescriptor("amounts"))

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.amounts.add("12.5" if self.mistake == "type" else 12.5)
        return ()


@pytest.mark.parametrize("mistake", ["type", "two kinds"])
def test_a_value_of_the_wrong_type_or_a_name_of_two_states_fails_at_once(mistake: str) -> None:
    """The replay after a restart writes the same value (asks for the same name) again,
    so these fail the job at once instead of after every restart (a new-user trial)."""
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    env.from_collection(RECORDS).key_by("user").process(WrongType(mistake)).sink_to(pe.sinks.CollectSink())
    cause = _failed(env)
    if mistake == "type":
        assert isinstance(cause, pe.state.StateTypeError) and "'12.5' is not a double value" in str(cause)
    else:
        assert isinstance(cause.__cause__ or cause, pe.state.StateNameConflictError)  # raised in open()
        assert "already registered" in str(cause)


class ReturnsAnInt(pe.KeyedProcessFunction):
    def __init__(self, where: str) -> None:
        self.where = where

    def process_element(self, value: Any, ctx: Any) -> Any:
        ctx.timer_service().register_event_time_timer(value["ts"] + 5)
        return 1 if self.where == "process_element" else ()

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        return timestamp


@pytest.mark.parametrize("where", ["process_element", "on_timer"])
def test_a_function_that_returns_an_int_fails_at_once_and_says_to_yield(where: str) -> None:
    """``return 5`` failed with "'int' object is not iterable" after every restart (a
    new-user trial): now at once, naming the call and the fix."""
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    env.from_collection(RECORDS, watermark_strategy=STRATEGY).key_by("user").process(ReturnsAnInt(where)).sink_to(
        pe.sinks.CollectSink()
    )
    cause = _failed(env)
    assert isinstance(cause, OutputTypeError)
    assert f"{where} returned" in str(cause) and "(an int), which is not records: yield each record" in str(cause)


@pytest.mark.parametrize("arrow", [False, True])
def test_a_fractional_float_timestamp_is_refused_and_a_whole_one_read(arrow: bool) -> None:
    """999.9 was truncated to 999 and epoch seconds from time.time() were read as
    milliseconds of January 1970, silently (a new-user trial); a whole float is still
    whole milliseconds."""
    for ts, ok in ((999.0, True), (1_700_000_000.5, False)):
        env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
        records: Any = [{"k": 1, "ts": 5.0}, {"k": 1, "ts": ts}]
        if arrow:
            records = pa.table({"k": [1, 1], "ts": [5.0, ts]})
        strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
        sink = pe.sinks.CollectSink()
        windows = (
            env.from_collection(records, watermark_strategy=strategy).key_by("k").window(pe.windows.tumbling(1000))
        )
        windows.aggregate(pe.agg.count()).sink_to(sink)
        if ok:
            assert env.execute("whole").records == [{"k": 1, "window_start": 0, "window_end": 1000, "count": 2}]
            continue
        cause = _failed(env)
        assert "whole milliseconds, got the float 1700000000.5" in str(cause) and "* 1000" in str(cause)


class FloatTimer(pe.KeyedProcessFunction):
    """Sets a timer at seconds as a float: in process_element, or only in on_timer."""

    def __init__(self, in_on_timer: bool) -> None:
        self.in_on_timer = in_on_timer

    def process_element(self, value: Any, ctx: Any) -> Any:
        due = value["ts"] + 5
        ctx.timer_service().register_event_time_timer(due if self.in_on_timer else due / 1000)
        return ()

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        ctx.timer_service().register_event_time_timer(timestamp / 1000)
        return ()


@pytest.mark.parametrize("in_on_timer", [False, True])
def test_a_timer_at_a_float_names_the_operator(in_on_timer: bool) -> None:
    """The refusal said what was wrong but not where: a job with several functions
    left the user to guess which one (a new-user trial). It names the operator."""
    from pyengine.state.timers import InvalidTimerTypeError

    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    stream = env.from_collection(RECORDS, watermark_strategy=STRATEGY).key_by("user")
    stream.process(FloatTimer(in_on_timer)).name("expiry").uid("expiry-state").sink_to(pe.sinks.DiscardSink())
    cause = _failed(env)
    assert isinstance(cause, InvalidTimerTypeError)
    assert "operator 'expiry' (uid 'expiry-state', subtask 0)" in str(cause)
    assert "int milliseconds, got float" in str(cause)
    assert ("on_timer" in str(cause)) == in_on_timer
    # the traceback still reaches the function's own line
    frames = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert ("on_timer" if in_on_timer else "process_element") in frames, frames


def test_a_pyflink_reduce_function_object_is_taken_as_its_reduce() -> None:
    """PyFlink's ReducingStateDescriptor takes a ReduceFunction object; here it was
    refused with "reduce_function must be callable" (a new-user trial)."""

    class Sum:
        def reduce(self, a: Any, b: Any) -> Any:
            return a + b

    descriptor = pe.state.ReducingStateDescriptor("total", Sum())
    backend = pe.state.create_keyed_backend("heap")
    backend.set_current_key("k")
    total = backend.get_state(descriptor)
    total.add(2)
    total.add(3)
    assert total.get() == 5
    with pytest.raises(TypeError, match=r"a function of two values \(or an object with a reduce\(a, b\) method\)"):
        pe.state.ReducingStateDescriptor("total", 5)


class ProcessReturnsAnInt(pe.ProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        return 1


def test_a_process_function_or_flat_map_that_returns_an_int_fails_at_once() -> None:
    """As for keyed functions (a review of the fix found the other operators still
    retried it)."""
    for build in (
        lambda s: s.process(ProcessReturnsAnInt()),
        lambda s: s.flat_map(lambda r: 1),
    ):
        env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
        build(env.from_collection(RECORDS)).sink_to(pe.sinks.CollectSink())
        cause = _failed(env)
        assert isinstance(cause, OutputTypeError) and "(an int), which is not records" in str(cause)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: pe.state.ValueStateDescriptor("v", None, t),
        lambda t: pe.state.ListStateDescriptor("l", pa.struct([("name", t)])),
        lambda t: pe.state.MapStateDescriptor("m", t, pa.int64()),
    ],
)
def test_a_dictionary_arrow_type_is_refused_for_state(make: Any) -> None:
    """Inside a state file's union pyarrow wrote a dictionary type it could not read
    back ("Message metadata too long"): a checkpoint that would never restore (a
    review finding). Refused where the descriptor is made, with the type to use."""
    with pytest.raises(pe.state.StateDescriptorError, match=r"holds a dictionary type.*pa\.string\(\)"):
        make(pa.dictionary(pa.int32(), pa.string()))


def test_a_savepoint_of_a_job_that_failed_says_why_it_is_not_running(tmp_path: Any) -> None:
    """A trial: ``stop_with_savepoint`` on a job that had failed said only "job ... is
    not running"; the cause came out of ``wait()`` alone."""

    class Broken(pe.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            raise pe.state.StateTypeError("the state does not fit")

    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    env.from_generator(lambda i: {"k": i % 3}, rate_per_s=1_000).key_by("k").process(Broken()).sink_to(
        pe.sinks.DiscardSink()
    )
    client = env.execute_async("broken")
    with pytest.raises(pe.errors.JobFailedError):
        client.wait()
    with pytest.raises(RuntimeError, match=r"is not running: it FAILED: .*the state does not fit"):
        client.stop_with_savepoint(str(tmp_path / "sp"), timeout_s=5)
