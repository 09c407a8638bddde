"""Job graphs beyond one line (issue #20, phase 1, embedded runner): fan-out and
several sinks, side outputs (``ctx.output``, late window records), ``union``,
``connect`` with ``CoProcessFunction`` and ``KeyedCoProcessFunction``; results
against brute-force answers computed from the whole inputs."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyengine as pe
from pyengine.api import JobGraph

LEFT = [{"k": i % 7, "v": i} for i in range(400)]
RIGHT = [{"k": i % 5, "v": 10_000 + i} for i in range(250)]
ODD = pe.OutputTag("odd")


def env(**kwargs: Any) -> pe.StreamEnvironment:
    settings: Dict[str, Any] = dict(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10),
        buffer_size=16,
        buffer_timeout_ms=1,
        monitoring=None,
    )
    settings.update(kwargs)
    return pe.StreamEnvironment(**settings)


class Split(pe.ProcessFunction):
    """Even values on, odd ones to the side output."""

    def process_element(self, value: Any, ctx: pe.ProcessContext) -> Any:
        if value["v"] % 2:
            ctx.output(ODD, value["v"])
        else:
            yield value["v"]


# -- fan-out and several sinks ---------------------------------------------------------------------


def test_a_stream_continued_twice_feeds_both_branches_and_every_sink_gets_its_records() -> None:
    e = env()
    s = e.from_collection(LEFT)
    evens, tens, counts = pe.sinks.CollectSink(), pe.sinks.CollectSink(), pe.sinks.CollectSink()
    s.filter(lambda r: r["v"] % 2 == 0).map(lambda r: r["v"]).sink_to(evens)
    s.map(lambda r: r["v"] * 10).sink_to(tens)
    s.key_by("k").aggregate(pe.agg.count(), emit="final").sink_to(counts)
    result = e.execute("fan-out")
    assert result.status == "FINISHED"
    assert sorted(evens.records) == [r["v"] for r in LEFT if r["v"] % 2 == 0]
    assert sorted(tens.records) == sorted(r["v"] * 10 for r in LEFT)
    assert {r["k"]: r["count"] for r in counts.records} == dict(Counter(r["k"] for r in LEFT))


def test_one_stream_into_two_sinks_and_the_same_sink_twice_is_refused() -> None:
    e = env()
    s = e.from_collection([1, 2, 3])
    a, b = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    s.sink_to(a)
    s.sink_to(b)
    e.execute("two-sinks")
    assert sorted(a.records) == sorted(b.records) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"already ends another stream.*union the streams first"):
        s.map(lambda x: x).sink_to(a)


def test_continuing_a_sink_is_refused_naming_the_way_out() -> None:
    e = env()
    done = e.from_collection([1]).sink_to(pe.sinks.CollectSink())
    with pytest.raises(ValueError, match=r"map\(\): this stream is the end of a sink_to\(\).*continued more than once"):
        done.map(lambda x: x)


def test_a_line_builds_the_vertices_it_always_had() -> None:
    """Vertex names and uids of a one-line job are what they were (checkpoints of
    earlier versions restore): v0 the source's chain, a vertex per exchange."""
    e = env()
    e.from_collection(LEFT).map(lambda r: r).key_by("k").process(Count()).rebalance().map(lambda r: r).sink_to(
        pe.sinks.CollectSink()
    )
    graph = e._graph()
    assert [(v.name, v.uids()) for v in graph.vertices] == [
        ("v0", ["collection", "1-map"]),
        ("v1", ["3-process"]),
        ("v2", ["5-map", "6-sink"]),
    ]
    assert [v.exchange for v in graph.vertices] == ["forward", "hash", "rebalance"]
    assert graph.nonlinear_features() == []


def test_branches_get_unique_default_uids_and_explicit_repeats_are_refused() -> None:
    e = env()
    s = e.from_collection(LEFT)
    t = e.from_collection(RIGHT)
    s.map(lambda r: r).sink_to(pe.sinks.CollectSink())
    s.map(lambda r: r).sink_to(pe.sinks.CollectSink())
    t.map(lambda r: r).sink_to(pe.sinks.CollectSink())
    uids = [u for v in e._graph().vertices for u in v.uids()]
    assert len(uids) == len(set(uids))
    assert "collection" in uids and "collection-2" in uids
    s.map(lambda r: r).uid("same").sink_to(pe.sinks.CollectSink())
    s.map(lambda r: r).uid("same").sink_to(pe.sinks.CollectSink())
    with pytest.raises(ValueError, match=r"uids must be unique.*'same'"):
        e._graph()


# -- side outputs --------------------------------------------------------------------------------


def test_side_output_of_a_process_function_and_its_main_output_go_their_ways() -> None:
    e = env()
    main = e.from_collection(LEFT).rebalance().process(Split())
    evens, odds = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    main.sink_to(evens)
    main.get_side_output(ODD).map(lambda v: -v).sink_to(odds)
    e.execute("side")
    assert sorted(evens.records) == [r["v"] for r in LEFT if r["v"] % 2 == 0]
    assert sorted(odds.records) == sorted(-r["v"] for r in LEFT if r["v"] % 2)


class Tally(pe.KeyedProcessFunction):
    """Counts per key; every 10th record of a key also goes to the side output."""

    def open(self, ctx: pe.KeyedContext) -> None:
        self.n = ctx.get_state(pe.ValueStateDescriptor("n", 0))

    def process_element(self, value: Any, ctx: pe.KeyedContext) -> Any:
        n = self.n.value() + 1
        self.n.update(n)
        if n % 10 == 0:
            ctx.output(pe.OutputTag("tenth"), (ctx.current_key, n))
        yield (ctx.current_key, n)


def test_side_output_of_a_keyed_process_function_and_an_unread_tag_is_dropped() -> None:
    e = env()
    tallied = e.from_collection(LEFT).key_by("k").process(Tally())
    main, tenth = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    tallied.sink_to(main)
    tallied.get_side_output(pe.OutputTag("tenth")).sink_to(tenth)
    tallied.get_side_output(pe.OutputTag("nobody-writes-this")).sink_to(pe.sinks.CollectSink())
    e.execute("keyed-side")
    per_key = Counter(r["k"] for r in LEFT)
    assert Counter(main.records) == Counter((k, n) for k, c in per_key.items() for n in range(1, c + 1))
    assert sorted(tenth.records) == sorted((k, n) for k, c in per_key.items() for n in range(10, c + 1, 10))


def test_get_side_output_and_output_tag_refuse_what_they_cannot_take() -> None:
    e = env()
    s = e.from_collection([1])
    with pytest.raises(TypeError, match=r"pe\.OutputTag"):
        s.map(lambda x: x).get_side_output("odd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not on a source"):
        s.get_side_output(ODD)
    # a step that never sends to a side output: refused, not read as an empty stream
    for step, call in [
        (s.map(lambda x: x), "map"),
        (s.filter(bool), "filter"),
        (s.flat_map(lambda x: [x]), "flat_map"),
        (s.process(Split()).map(lambda x: x), "map"),
        (e.from_collection([{"k": 1}]).key_by("k").aggregate(pe.agg.count()), "aggregate"),
    ]:
        with pytest.raises(ValueError, match=rf"the last step here, {call}\(\), sends nothing to a side output"):
            step.get_side_output(ODD)
    s.process(Split()).get_side_output(ODD)  # a process function may: accepted
    with pytest.raises(ValueError, match="non-empty name"):
        pe.OutputTag("")
    assert pe.OutputTag("a", int) == pe.OutputTag("a") and len({pe.OutputTag("a"), pe.OutputTag("a")}) == 1


@pytest.mark.parametrize("by_function", [False, True], ids=["vectorised", "per-record"])
def test_late_window_records_go_to_the_side_output_instead_of_being_dropped(by_function: bool) -> None:
    """As test_windows_lateness's steps, with ``side_output_late_data``: the one record
    too late for its window goes to the side output and nothing is counted dropped."""
    import test_windows_lateness as lateness

    late = pe.OutputTag("late")
    e = pe.StreamEnvironment(parallelism=1, auto_watermark_interval_ms=1, monitoring=None)
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    main, side = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    keyed = e.from_source(lateness.Steps(lateness.LATE_STEPS), watermark_strategy=strategy).key_by(
        (lambda r: r["k"]) if by_function else "k"
    )
    windowed = (
        keyed.window(pe.windows.tumbling(100))
        .allowed_lateness(50)
        .side_output_late_data(late)
        .aggregate(pe.agg.count(), pe.agg.max("ts"))
    )
    windowed.sink_to(main)
    windowed.get_side_output(late).sink_to(side)
    client = e.execute_async("late-side")
    lateness.Steps.client = client
    try:
        result = client.wait(60)
    finally:
        lateness.Steps.client = None
    key = "key" if by_function else "k"
    rows = [(r[key], r["window_start"], r["window_end"], r["count"], r["max_ts"]) for r in main.records]
    assert rows == [(1, 0, 100, 2, 20), (1, 0, 100, 3, 60), (1, 100, 200, 2, 160)]
    assert side.records == [{"k": 1, "ts": 70}]
    assert result.event_time is not None and result.event_time.late_records_dropped == 0


def test_side_output_late_data_refuses_processing_time_and_other_tags() -> None:
    keyed = env().from_collection([{"k": 1}]).key_by("k")
    with pytest.raises(ValueError, match="event-time windows only"):
        keyed.window(pe.windows.tumbling(10, time="processing")).side_output_late_data(pe.OutputTag("late"))
    with pytest.raises(TypeError, match=r"pe\.OutputTag"):
        keyed.window(pe.windows.tumbling(10, time="processing")).side_output_late_data("late")  # type: ignore[arg-type]


# -- union -----------------------------------------------------------------------------------------


class Count(pe.KeyedProcessFunction):
    def open(self, ctx: pe.KeyedContext) -> None:
        self.n = ctx.get_state(pe.ValueStateDescriptor("n", 0))

    def process_element(self, value: Any, ctx: pe.KeyedContext) -> Any:
        n = self.n.value() + 1
        self.n.update(n)
        yield {"k": ctx.current_key, "n": n}


def expected_counts(records: List[Dict[str, Any]]) -> Counter:
    per_key = Counter(r["k"] for r in records)
    return Counter({(k, n): 1 for k, c in per_key.items() for n in range(1, c + 1)})


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
def test_union_of_three_streams_then_keyed_state_counts_every_record_once(unaligned: bool) -> None:
    e = env(checkpointing=pe.CheckpointConfig(interval_ms=5, unaligned=unaligned), channel_capacity=2)
    a = e.from_collection(LEFT)
    b = e.from_collection(RIGHT)
    c = e.from_generator(lambda i: {"k": i % 3, "v": -i}, count=300)
    sink = pe.sinks.CollectSink()
    a.union(b.map(lambda r: r), c).key_by("k").process(Count()).sink_to(sink)
    result = e.execute("union")
    everything = LEFT + RIGHT + [{"k": i % 3, "v": -i} for i in range(300)]
    assert Counter((r["k"], r["n"]) for r in sink.records) == expected_counts(everything)
    assert result.checkpoints.counts["completed"] >= 1


def test_union_keeps_the_schema_and_timestamps_its_inputs_share() -> None:
    import pyarrow as pa

    e = env()
    table = pa.table({"k": [1, 2], "ts": [1, 2]})
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    a = e.from_collection(table, watermark_strategy=strategy)
    b = e.from_collection(table, watermark_strategy=strategy)
    both = a.union(b)
    assert both._schema is not None and both._schema.equals(table.schema)
    assert both._timestamps == a._timestamps
    both.key_by("k").window(pe.windows.tumbling(10)).aggregate(pe.agg.count())  # event time is known
    with pytest.raises(ValueError, match="at least one other stream"):
        a.union()
    with pytest.raises(TypeError, match="union the streams before key_by"):
        a.union(b.key_by("k"))  # type: ignore[arg-type]


# -- connect ---------------------------------------------------------------------------------------


class Tag(pe.CoProcessFunction):
    def process_element1(self, value: Any, ctx: pe.ProcessContext) -> Any:
        yield ("L", value["v"])

    def process_element2(self, value: Any, ctx: pe.ProcessContext) -> Any:
        if value["v"] % 3 == 0:
            ctx.output(ODD, value["v"])
        yield ("R", value["v"])


def test_connect_calls_each_side_s_method_and_its_side_output_works() -> None:
    e = env()
    tagged = e.from_collection(LEFT).connect(e.from_collection(RIGHT)).process(Tag())
    main, side = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    tagged.sink_to(main)
    tagged.get_side_output(ODD).sink_to(side)
    e.execute("connect")
    assert Counter(main.records) == Counter([("L", r["v"]) for r in LEFT] + [("R", r["v"]) for r in RIGHT])
    assert sorted(side.records) == [r["v"] for r in RIGHT if r["v"] % 3 == 0]


class Enrich(pe.KeyedCoProcessFunction):
    """Keeps the latest right value per key; left records are emitted with the right
    values seen so far for their key; at the end of input (the event-time timer at the
    maximum watermark) each key reports both counts."""

    def open(self, ctx: pe.KeyedContext) -> None:
        self.left = ctx.get_state(pe.ValueStateDescriptor("left", 0))
        self.right = ctx.get_state(pe.ValueStateDescriptor("right", 0))

    def process_element1(self, value: Any, ctx: pe.KeyedContext) -> Any:
        self.left.update(self.left.value() + 1)
        ctx.timer_service().register_event_time_timer(1_000_000)
        return None

    def process_element2(self, value: Any, ctx: pe.KeyedContext) -> Any:
        self.right.update(self.right.value() + 1)
        ctx.timer_service().register_event_time_timer(1_000_000)
        return None

    def on_timer(self, timestamp: int, ctx: pe.KeyedContext) -> Any:
        yield (ctx.current_key, self.left.value(), self.right.value())


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_keyed_connect_shares_state_and_timers_across_both_inputs(backend: str) -> None:
    e = env(state_backend=backend)
    sink = pe.sinks.CollectSink()
    e.from_collection(LEFT).key_by("k").connect(e.from_collection(RIGHT).key_by("k")).process(Enrich()).sink_to(sink)
    e.execute("keyed-connect")
    lefts, rights = Counter(r["k"] for r in LEFT), Counter(r["k"] for r in RIGHT)
    assert sorted(sink.records) == sorted((k, lefts[k], rights[k]) for k in set(lefts) | set(rights))


def test_connected_streams_key_by_keys_both_and_mismatches_are_refused() -> None:
    e = env()
    a, b = e.from_collection(LEFT), e.from_collection(RIGHT)
    sink = pe.sinks.CollectSink()
    a.connect(b).key_by("k", lambda r: r["k"]).process(Enrich()).sink_to(sink)
    e.execute("key-by-both")
    assert len(sink.records) == 7
    e = env()
    a, b = e.from_collection(LEFT), e.from_collection(RIGHT)
    with pytest.raises(TypeError, match=r"KeyedCoProcessFunction.*connect streams that are not keyed"):
        a.key_by("k").connect(b.key_by("k")).process(Tag())
    with pytest.raises(TypeError, match=r"CoProcessFunction.*key both"):
        a.connect(b).process(Enrich())
    with pytest.raises(TypeError, match=r"or a broadcast stream \(other.broadcast"):
        a.key_by("k").connect(b)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="key both"):
        a.connect(b.key_by("k"))  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="needs a keyed stream"):
        a.process(Count())  # type: ignore[arg-type]


def test_a_connect_of_three_edges_uses_one_gate_over_all_of_them() -> None:
    """A union into a connect's first input and a stream into its second: one vertex,
    three edges, inputs 0, 0 and 1 (its task's gate has their channels in that order)."""
    e = env()
    a, b, c = e.from_collection(LEFT), e.from_collection(LEFT), e.from_collection(RIGHT)
    a.union(b).key_by("k").connect(c.key_by("k")).process(Enrich()).sink_to(pe.sinks.CollectSink())
    graph: JobGraph = e._graph()
    co = [v for v in graph.vertices if len(v.inputs) > 1]
    assert len(co) == 1
    assert [(edge.source, edge.input, edge.exchange) for edge in co[0].inputs] == [
        (0, 0, "hash"),
        (1, 0, "hash"),
        (2, 1, "hash"),
    ]
    assert "connect" in graph.nonlinear_features() and "several sources" in graph.nonlinear_features()


def test_a_runner_that_runs_lines_only_refuses_a_graph_naming_what_makes_it_one() -> None:
    e = env()
    s = e.from_collection([1])
    s.sink_to(pe.sinks.CollectSink())
    s.map(lambda x: x).sink_to(pe.sinks.CollectSink())

    class LinesOnly:  # a runner without supports_graphs
        supports_event_time = True

        def job(self, *args: Any) -> Any:
            raise AssertionError("a graph must be refused before it reaches the runner")

    with pytest.raises(ValueError, match=r"several sinks.*fan-out.*run it embedded"):
        e.execute("graph-elsewhere", runner=LinesOnly())


# -- event time across inputs ----------------------------------------------------------------------


def test_event_time_windows_over_a_union_count_every_record_of_both_inputs() -> None:
    """Each source's watermarks are its own; the union's is the least of them, so no
    record of the slower input is late and every window holds all its records."""
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    fast = [{"k": i % 3, "ts": i * 5} for i in range(600)]
    slow = [{"k": i % 3, "ts": i * 15} for i in range(200)]
    e = env(auto_watermark_interval_ms=1)
    sink = pe.sinks.CollectSink()
    a = e.from_collection(fast, watermark_strategy=strategy)
    b = e.from_collection(slow, watermark_strategy=strategy)
    a.union(b).key_by("k").window(pe.windows.tumbling(100)).aggregate(pe.agg.count()).sink_to(sink)
    result = e.execute("event-time-union")
    expected = Counter()
    for r in fast + slow:
        expected[(r["k"], r["ts"] // 100 * 100)] += 1
    assert {(r["k"], r["window_start"]): r["count"] for r in sink.records} == dict(expected)
    assert result.event_time is not None and result.event_time.late_records_dropped == 0


class Stamps(pe.KeyedCoProcessFunction):
    """Each input's ``ctx.timestamp()`` comes from that input's own timestamps."""

    def process_element1(self, value: Any, ctx: pe.KeyedContext) -> Any:
        yield ("a", ctx.timestamp(), value["ts"])

    def process_element2(self, value: Any, ctx: pe.KeyedContext) -> Any:
        yield ("b", ctx.timestamp(), value["when"])


def test_connect_reads_each_input_s_timestamps_with_its_own_assigner() -> None:
    e = env()
    a = e.from_collection(
        [{"k": i, "ts": 1000 + i} for i in range(20)],
        watermark_strategy=pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts"),
    )
    b = e.from_collection(
        [{"k": i, "when": 5000 + i} for i in range(20)],
        watermark_strategy=pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("when"),
    )
    sink = pe.sinks.CollectSink()
    a.key_by("k").connect(b.key_by("k")).process(Stamps()).sink_to(sink)
    e.execute("stamps")
    assert len(sink.records) == 40
    assert all(stamp == expected for _, stamp, expected in sink.records)


def test_at_least_once_checkpoints_across_a_connect_complete_and_lose_nothing() -> None:
    e = env(checkpointing=pe.CheckpointConfig(interval_ms=5, mode="at_least_once"), channel_capacity=2)
    sink = pe.sinks.CollectSink()
    e.from_collection(LEFT).key_by("k").connect(e.from_collection(RIGHT).key_by("k")).process(Enrich()).sink_to(sink)
    result = e.execute("at-least-once")
    lefts, rights = Counter(r["k"] for r in LEFT), Counter(r["k"] for r in RIGHT)
    assert sorted(sink.records) == sorted((k, lefts[k], rights[k]) for k in set(lefts) | set(rights))
    assert result.checkpoints.counts["completed"] >= 1


# -- random graphs' inputs against brute force ---------------------------------------------------


class Join(pe.KeyedCoProcessFunction):
    """Emits every (left, right) pair of a key once, whichever side came first: the
    pairs a brute-force join of the whole inputs gives."""

    def open(self, ctx: pe.KeyedContext) -> None:
        self.lefts = ctx.get_state(pe.ListStateDescriptor("lefts"))
        self.rights = ctx.get_state(pe.ListStateDescriptor("rights"))

    def process_element1(self, value: Any, ctx: pe.KeyedContext) -> Any:
        self.lefts.add(value["v"])
        return [(value["v"], r) for r in self.rights.get()]

    def process_element2(self, value: Any, ctx: pe.KeyedContext) -> Any:
        self.rights.add(value["v"])
        return [(left, value["v"]) for left in self.lefts.get()]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    left=st.lists(st.integers(0, 5), max_size=60),
    right=st.lists(st.integers(0, 5), max_size=60),
    extra=st.lists(st.integers(0, 5), max_size=30),
    parallelism=st.integers(1, 3),
    backend=st.sampled_from(["heap", "incremental"]),
    unaligned=st.booleans(),
)
def test_a_union_into_a_keyed_connect_joins_as_brute_force_does(
    left: List[int], right: List[int], extra: List[int], parallelism: int, backend: str, unaligned: bool
) -> None:
    lefts = [{"k": k, "v": f"l{i}"} for i, k in enumerate(left)] + [{"k": k, "v": f"x{i}"} for i, k in enumerate(extra)]
    rights = [{"k": k, "v": f"r{i}"} for i, k in enumerate(right)]
    e = env(
        parallelism=parallelism,
        state_backend=backend,
        checkpointing=pe.CheckpointConfig(interval_ms=5, unaligned=unaligned),
        buffer_size=4,
    )
    a = e.from_collection(lefts[: len(left)])
    x = e.from_collection(lefts[len(left) :])
    b = e.from_collection(rights)
    joined, keys = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    pairs = a.union(x).key_by("k").connect(b.key_by("k")).process(Join())
    pairs.sink_to(joined)
    b.map(lambda r: r["k"]).sink_to(keys)  # the same source feeds a second sink too
    e.execute("random-join")
    expected = Counter((lt["v"], rt["v"]) for lt in lefts for rt in rights if lt["k"] == rt["k"])
    assert Counter(joined.records) == expected
    assert sorted(keys.records) == sorted(right)


def test_review_misuses_are_refused_naming_the_way_out() -> None:
    """uid() on a side output would rename its producer's state; a wrong tag in
    ctx.output is refused even while no side output is read; keyed state in a
    non-keyed function is refused at once (not an AttributeError, not retried); two
    branches named alike are told to take uids."""
    e = env()
    main = e.from_collection(LEFT).rebalance().process(Split()).uid("splitter")
    with pytest.raises(ValueError, match="side output has none of its own"):
        main.get_side_output(ODD).uid("odd-records")
    assert main._last_op("check").uid == "splitter"

    class WrongTag(pe.ProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            ctx.output("odd", value)  # a string, not a pe.OutputTag
            yield value

    e = env(restart_attempts=3)
    e.from_collection([1, 2]).process(WrongTag()).sink_to(pe.sinks.DiscardSink())
    with pytest.raises(pe.JobFailedError) as failed:
        e.execute("wrong-tag")
    assert "pe.OutputTag" in str(failed.value.cause) and "operator" in str(failed.value.cause)
    assert failed.value.result.restarts == 0, "a restart cannot make a string a tag"

    class KeyedInOpen(pe.ProcessFunction):
        def open(self, ctx: Any) -> None:
            self.n = ctx.get_state(pe.ValueStateDescriptor("n", 0))

        def process_element(self, value: Any, ctx: Any) -> Any:
            yield value

    e = pe.StreamEnvironment(monitoring=None, restart_attempts=3)
    e.from_collection([1, 2]).process(KeyedInOpen()).sink_to(pe.sinks.DiscardSink())
    with pytest.raises(pe.JobFailedError) as failed:
        e.execute("keyed-state-unkeyed")
    assert failed.value.result.restarts == 0
    assert "needs a keyed stream" in str(failed.value.cause) and "KeyedProcessFunction" in str(failed.value.cause)

    e = env()
    s = e.from_collection([1])
    s.map(lambda x: x).name("parse").sink_to(pe.sinks.DiscardSink())
    s.map(lambda x: x).name("parse").sink_to(pe.sinks.DiscardSink())
    with pytest.raises(ValueError, match=r"takes its \.name\(\.\.\.\) as its state's uid"):
        e.execute("same-names")


def test_a_side_output_nobody_reads_is_dropped_and_said_once(caplog: Any) -> None:
    """A misspelt tag's name (the job reads "unknown-user", the function writes
    "unknown_user") lost every record it took without a word (a new user's trial): the
    records are still dropped, as Flink drops them, but a warning names the operator
    and the tag, once."""

    class Route(pe.ProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            if value % 2:
                ctx.output(pe.OutputTag("unknown_user"), value)
            else:
                yield value

    e = env(parallelism=1)
    routed = e.from_collection(list(range(10))).process(Route()).name("route")
    main, aside = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    routed.sink_to(main)
    routed.get_side_output(pe.OutputTag("unknown-user")).sink_to(aside)
    with caplog.at_level("WARNING", logger="pyengine.runtime.operators"):
        e.execute("misspelt-tag")
    assert sorted(main.records) == [0, 2, 4, 6, 8] and aside.records == []
    warnings = [r.getMessage() for r in caplog.records if "no stream of the job reads" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'unknown_user'" in warnings[0] and "'route'" in warnings[0]


def test_a_failing_key_selector_is_named_with_the_step_and_the_record() -> None:
    """A key_by lambda raising on one record failed the job with a bare "KeyError:
    'user_id'"; an unhashable key was retried as if a restart could fix it."""
    records = [{"user_id": 1}, {"user_id": 2}, {"user": 3}]
    e = env(parallelism=2, restart_attempts=1)
    e.from_collection(records).key_by(lambda r: r["user_id"]).process(Count()).name("count").sink_to(
        pe.sinks.DiscardSink()
    )
    with pytest.raises(pe.JobFailedError) as failed:
        e.execute("bad-key")
    message = str(failed.value)  # the where; ``cause`` stays the user's own exception
    assert "key_by into 'count'" in message and "KeyError" in message and "{'user': 3}" in message, message
    assert isinstance(failed.value.cause, KeyError)

    e = env(parallelism=2, restart_attempts=3)
    e.from_collection(records).key_by(lambda r: [r.get("user_id")]).process(Count()).name("count").sink_to(
        pe.sinks.DiscardSink()
    )
    with pytest.raises(pe.JobFailedError) as failed:
        e.execute("list-key")
    assert failed.value.result.restarts == 0, "the same key comes again after a restart"
    assert "has no stable hash" in str(failed.value) and "key_by into 'count'" in str(failed.value)


def test_a_keyed_connect_whose_inputs_key_by_different_types_warns(caplog: Any) -> None:
    """Orders keyed by an int user id and users by the id as a string ("1", as read from
    JSON) never met: the job ran on and sent every order down its "no such user" path,
    without a word (a new user's trial). A warning now names the two types."""

    class Enrich(pe.KeyedCoProcessFunction):
        def open(self, ctx: Any) -> None:
            self.name = ctx.get_state(pe.ValueStateDescriptor("name"))

        def process_element1(self, value: Any, ctx: Any) -> Any:
            yield (value["order"], self.name.value())

        def process_element2(self, value: Any, ctx: Any) -> Any:
            self.name.update(value["name"])

    def run(user_key: Any) -> List[str]:
        e = env(parallelism=1)
        orders = e.from_collection([{"order": "o1", "user": 1}])
        users = e.from_collection([{"id": 1, "name": "ann"}])
        orders.key_by(lambda r: r["user"]).connect(users.key_by(user_key)).process(Enrich()).name("enrich").sink_to(
            pe.sinks.DiscardSink()
        )
        caplog.clear()
        with caplog.at_level("WARNING", logger="pyengine.runtime.operators"):
            e.execute("enrich")
        return [r.getMessage() for r in caplog.records if "never meet" in r.getMessage()]

    warnings = run(lambda r: str(r["id"]))
    assert len(warnings) == 1 and "int" in warnings[0] and "str" in warnings[0] and "'enrich'" in warnings[0]
    assert run(lambda r: r["id"]) == []
    assert run(lambda r: float(r["id"])) == [], "1 and 1.0 are one key (the same key group and equal)"
