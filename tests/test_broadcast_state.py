"""The broadcast state pattern (issue #20): ``rules.broadcast(descriptor)`` connected
to a keyed or a plain stream, ``pe.KeyedBroadcastProcessFunction`` /
``pe.BroadcastProcessFunction``; results against brute-force answers that do not
depend on how the two inputs interleave; broadcast state checkpointed, restored on
every subtask (a savepoint at parallelism 2 resumed at 3), both backends, aligned
and unaligned; and the misuses refused."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Dict, List, Tuple

import pytest

import pyengine as pe
from pyengine.api import BroadcastStream

RULES = pe.MapStateDescriptor("rules")
PENDING = pe.ListStateDescriptor("pending")
SEEN = pe.ValueStateDescriptor("seen", 0)
N_RULES = 9
RULE_RECORDS = [{"rule": j, "factor": 10 * j + 1} for j in range(N_RULES)]
DATA = [{"k": i % 13, "v": i, "rule": (i * 7) % N_RULES} for i in range(1200)]
FACTOR = {r["rule"]: r["factor"] for r in RULE_RECORDS}


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


class Enrich(pe.KeyedBroadcastProcessFunction):
    """Multiplies each record by its rule's factor (broadcast state). A record whose
    rule has not arrived yet waits in keyed list state; a rule arriving releases the
    records waiting for it through ``apply_to_keyed_state``. Each key also counts its
    records, reported by an event-time timer at the end of input. The output is the
    same however the inputs interleave, and only if every subtask has every rule."""

    def open(self, ctx: pe.KeyedBroadcastReadOnlyContext) -> None:
        self.pending = ctx.get_list_state(PENDING)
        self.seen = ctx.get_state(SEEN)

    def process_element(self, value: Any, ctx: pe.KeyedBroadcastReadOnlyContext) -> Any:
        self.seen.update(self.seen.value() + 1)
        ctx.timer_service().register_event_time_timer(10**12)
        factor = ctx.get_broadcast_state(RULES).get(value["rule"])
        if factor is None:
            self.pending.add(value)
            return None
        return [("out", ctx.current_key, value["v"], value["v"] * factor)]

    def process_broadcast_element(self, value: Any, ctx: pe.KeyedBroadcastContext) -> Any:
        ctx.get_broadcast_state(RULES).put(value["rule"], value["factor"])
        out: List[Any] = []

        def release(key: Any, pending: Any) -> None:
            waiting = pending.get()
            ready = [r for r in waiting if r["rule"] == value["rule"]]
            if ready:
                out.extend(("out", key, r["v"], r["v"] * value["factor"]) for r in ready)
                pending.update([r for r in waiting if r["rule"] != value["rule"]])

        ctx.apply_to_keyed_state(PENDING, release)
        return out

    def on_timer(self, timestamp: int, ctx: pe.KeyedBroadcastReadOnlyContext) -> Any:
        yield ("seen", ctx.current_key, self.seen.value(), len(ctx.get_broadcast_state(RULES)))


def expected(data: List[Dict[str, Any]] = DATA) -> Counter:
    out = Counter(("out", r["k"], r["v"], r["v"] * FACTOR[r["rule"]]) for r in data)
    out.update(("seen", k, n, N_RULES) for k, n in Counter(r["k"] for r in data).items())
    return out


@pytest.mark.parametrize("backend", ["heap", "incremental"])
@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
def test_keyed_broadcast_enriches_every_record_once_with_every_rule(backend: str, unaligned: bool) -> None:
    e = env(state_backend=backend, checkpointing=pe.CheckpointConfig(interval_ms=5, unaligned=unaligned))
    sink = pe.sinks.CollectSink()
    rules = e.from_collection(RULE_RECORDS, name="rules").broadcast(RULES)
    e.from_collection(DATA, name="data").key_by("k").connect(rules).process(Enrich()).uid("enrich").sink_to(sink)
    result = e.execute("keyed-broadcast")
    assert result.status == "FINISHED"
    assert Counter(sink.records) == expected()
    assert result.checkpoints.counts["completed"] >= 1


class Route(pe.BroadcastProcessFunction):
    """Not keyed: each record is tagged with the number of rules its subtask holds
    at the end (the rules are counted by each subtask's broadcast side); a record
    whose rule is known goes on, the others to a side output."""

    def process_element(self, value: Any, ctx: pe.ReadOnlyBroadcastContext) -> Any:
        rules = ctx.get_broadcast_state(RULES)
        if value["rule"] in rules:
            yield ("known", value["v"])
        else:
            ctx.output(UNKNOWN, value["v"])

    def process_broadcast_element(self, value: Any, ctx: pe.BroadcastContext) -> Any:
        ctx.get_broadcast_state(RULES).put(value["rule"], value["factor"])
        yield ("rule", ctx.subtask, value["rule"])


UNKNOWN = pe.OutputTag("unknown")


def test_every_subtask_gets_every_broadcast_record_and_a_plain_stream_reads_the_state() -> None:
    e = env(parallelism=3)
    main, side = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    rules = e.from_collection(RULE_RECORDS, name="rules").broadcast(RULES)
    routed = e.from_collection([{"v": i, "rule": 100 + i % 3} for i in range(60)], name="data").connect(rules)
    out = routed.process(Route())
    out.sink_to(main)
    out.get_side_output(UNKNOWN).sink_to(side)
    e.execute("broadcast-plain")
    rule_events = sorted(r for r in main.records if r[0] == "rule")
    assert rule_events == sorted(("rule", s, j) for s in range(3) for j in range(N_RULES)), "each subtask, each rule"
    assert sorted(side.records) == list(range(60)), "rules 100..102 never arrive: every record goes aside"


class Writes(pe.KeyedBroadcastProcessFunction):
    def __init__(self, what: str) -> None:
        self.what = what

    def open(self, ctx: Any) -> None:
        self.seen = ctx.get_state(SEEN)

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.seen.update(self.seen.value() + 1)
        if self.what == "put":
            ctx.get_broadcast_state(RULES).put("x", 1)
        if self.what == "unknown":
            ctx.get_broadcast_state(pe.MapStateDescriptor("other"))
        return None

    def process_broadcast_element(self, value: Any, ctx: Any) -> Any:
        if self.what == "keyed":
            ctx.get_state(SEEN)
        if self.what == "timer":
            ctx.timer_service()
        if self.what == "stray":  # keyed state from open(), outside apply_to_keyed_state
            self.seen.value()
        return None


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("put", r"broadcast state 'rules' is read-only here \(put called outside process_broadcast_element\)"),
        ("unknown", r"'other'.* is not a broadcast state of this stream \(known: 'rules'\)"),
        ("keyed", r"ctx.get_state in process_broadcast_element: a broadcast record belongs to no key.*apply_to_keyed"),
        ("timer", r"ctx.timer_service\(\) in process_broadcast_element"),
        ("stray", r"keyed state used in process_broadcast_element .*'seen'.*apply_to_keyed_state"),
    ],
)
def test_misuse_inside_the_functions_fails_the_job_at_once_naming_the_way_out(what: str, message: str) -> None:
    e = env(restart_attempts=3)
    rules = e.from_collection(RULE_RECORDS).broadcast(RULES)
    e.from_collection(DATA[:20]).key_by("k").connect(rules).process(Writes(what)).sink_to(pe.sinks.CollectSink())
    with pytest.raises(pe.JobFailedError, match=message) as info:
        e.execute("misuse")
    assert info.value.result.restarts == 0, "a program error is not retried"


def test_building_misuses_are_refused_and_plain_broadcast_still_works() -> None:
    e = env()
    s = e.from_collection([1, 2, 3])
    with pytest.raises(TypeError, match=r"broadcast\(\.\.\.\) takes pe.MapStateDescriptor"):
        s.broadcast(pe.ValueStateDescriptor("v"))  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="two descriptors are named 'rules'"):
        s.broadcast(RULES, pe.MapStateDescriptor("rules"))
    bs = s.broadcast(RULES)
    assert isinstance(bs, BroadcastStream) and isinstance(bs, pe.BroadcastStream)
    other = e.from_collection([{"k": 1}])
    with pytest.raises(TypeError, match=r"takes a pe.BroadcastProcessFunction.*key the stream first"):
        other.connect(bs).process(Enrich())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"takes a pe.KeyedBroadcastProcessFunction.*has no keyed state"):
        other.key_by("k").connect(bs).process(Route())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a broadcast stream \(other.broadcast\(pe.MapStateDescriptor"):
        other.key_by("k").connect(other)  # type: ignore[call-overload]
    # the exchange without descriptors: every subtask gets every record, as before
    sink = pe.sinks.CollectSink()
    e2 = env(parallelism=3)
    e2.from_collection([1, 2, 3]).broadcast().map(lambda x: x * 10).sink_to(sink)
    e2.execute("plain-broadcast")
    assert sorted(sink.records) == sorted([10, 20, 30] * 3)


# -- a savepoint at parallelism 2, resumed at 3 ----------------------------------------------------


class Count2(pe.KeyedCoProcessFunction):
    """A keyed two-input operator ahead of the broadcast one: passes both inputs'
    records on, counting them per key (keyed state of a connect, rescaled too)."""

    def open(self, ctx: pe.KeyedContext) -> None:
        self.n = ctx.get_state(pe.ValueStateDescriptor("n", 0))

    def process_element1(self, value: Any, ctx: pe.KeyedContext) -> Any:
        self.n.update(self.n.value() + 1)
        return [value]

    def process_element2(self, value: Any, ctx: pe.KeyedContext) -> Any:
        self.n.update(self.n.value() + 1)
        return [value]


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_savepoint_at_2_with_broadcast_and_keyed_state_resumed_at_3_is_exact(tmp_path: Any, backend: str) -> None:
    """Every rule is read and in broadcast state before the savepoint and never read
    again: after the resume at 3, the new third subtask enriches its keys' records
    only if it got a copy of the broadcast state (Flink: each new subtask does).
    Keyed state (pending records, counts, timers, the connect's counts) moves by key
    group; the output is the uninterrupted run's."""
    from test_windows_lateness import Held

    left, right = DATA[0::2], DATA[1::2]
    uninterrupted = pe.sinks.CollectSink()
    sink = pe.sinks.CollectSink()  # one for both runs: the resumed run commits what the savepoint covers

    def job(parallelism: int, release: threading.Event, out: Any, storage: str) -> pe.StreamEnvironment:
        e = env(
            parallelism=parallelism,
            state_backend=backend,
            checkpoint_storage=str(tmp_path / storage),
        )
        rules = e.from_source(Held(RULE_RECORDS, len(RULE_RECORDS), release), name="rules").uid("rules")
        a = e.from_source(Held(left, 150, release), name="left").uid("left")
        b = e.from_source(Held(right, 100, release), name="right").uid("right")
        merged = a.key_by("k").connect(b.key_by("k")).process(Count2()).uid("count2")
        merged.key_by("k").connect(rules.broadcast(RULES)).process(Enrich()).uid("enrich").sink_to(out)
        return e

    released = threading.Event()
    released.set()
    job(2, released, uninterrupted, "plain").execute("bsp-plain")
    assert Counter(uninterrupted.records) == expected()

    client = job(2, threading.Event(), sink, "ckpt2").execute_async("bsp")
    deadline = time.monotonic() + 30
    while (client.checkpoints is None or client.checkpoints.counts["completed"] < 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    savepoint = client.stop_with_savepoint(str(tmp_path / "savepoint"))
    client.wait(30)
    enriched = [r for r in sink.records if r[0] == "out"]
    assert 0 < len(enriched) < len(DATA), "the savepoint was taken mid-job"
    job(3, released, sink, "ckpt3").execute("bsp", restore_from=savepoint)
    assert Counter(sink.records) == Counter(uninterrupted.records)


def test_apply_to_keyed_state_visits_each_key_of_the_subtask_once_with_its_state() -> None:
    """The rule is read only once every data record was processed: each of the two
    operator subtasks gets it and visits its own keys, so together they visit every
    key once, each with that key's state."""
    seen: List[Tuple[int, Any, int]] = []
    processed = Counter()
    all_in = threading.Event()

    class Visit(pe.KeyedBroadcastProcessFunction):
        def open(self, ctx: Any) -> None:
            self.n = ctx.get_state(SEEN)

        def process_element(self, value: Any, ctx: Any) -> Any:
            self.n.update(self.n.value() + 1)
            processed["n"] += 1  # one subtask thread at a time holds the GIL here
            if processed["n"] == 100:
                all_in.set()
            return None

        def process_broadcast_element(self, value: Any, ctx: Any) -> Any:
            ctx.apply_to_keyed_state(SEEN, lambda key, state: seen.append((ctx.subtask, key, state.value())))
            return None

    from pyengine.connectors.base import Source

    class Rule(Source):
        def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
            if position >= 1 or subtask > 0:
                return None
            return [{"rule": 0}] if all_in.is_set() else []

    e = env(parallelism=2)
    rules = e.from_source(Rule()).broadcast(RULES)
    data = e.from_collection([{"k": i % 10} for i in range(100)])
    data.key_by("k").connect(rules).process(Visit()).sink_to(pe.sinks.CollectSink())
    e.execute("visit")
    assert sorted(k for _, k, _ in seen) == list(range(10)), "every key once over both subtasks"
    assert {k: n for _, k, n in seen} == {k: 10 for k in range(10)}
    assert {s for s, _, _ in seen} == {0, 1}
