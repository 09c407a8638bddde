"""Unaligned checkpoints across a broadcast exchange: the in-flight output of a
broadcast exchange is persisted per channel and replayed to that channel alone
(through the partitioner it reached every channel again: duplicates), and a restore
at another parallelism gives a new subtask the broadcast input in flight of the same
old subtask its broadcast state comes from."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, List

import pytest
from test_graphs_exactly_once import Chaos

import pyengine as pe


class Slow(pe.ProcessFunction):
    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos

    def __deepcopy__(self, memo: Any) -> Slow:
        return Slow(self.chaos)

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.chaos.hit("user")
        time.sleep(0.0003)
        yield {"v": value, "s": ctx.subtask}


def test_in_flight_output_of_a_broadcast_exchange_is_replayed_once_per_channel(tmp_path: Any) -> None:
    """A slow consumer behind a broadcast exchange keeps buffers waiting on both
    channels when unaligned barriers overtake them; after the failure each subtask
    gets each record exactly once (it got some twice before)."""
    chaos = Chaos("user", 1500)
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=True),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=8,
        buffer_timeout_ms=1,
        channel_capacity=2,
        restart_attempts=2,
        monitoring=None,
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"))
    env.from_generator(lambda i: i, count=1500).broadcast().process(Slow(chaos)).sink_to(sink)
    result = env.execute("broadcast-unaligned")
    assert chaos.fired and result.restarts == 1
    got = Counter((r["v"], r["s"]) for r in sink.read_committed())
    assert got == Counter({(v, s): 1 for v in range(1500) for s in range(2)})


RULES = pe.MapStateDescriptor("rules")
N_RULES = 60
RULE_RECORDS = [{"rule": j, "factor": j + 1} for j in range(N_RULES)]
DATA = [{"k": i % 17, "v": i, "rule": i % N_RULES} for i in range(900)]


class SlowEnrich(pe.KeyedBroadcastProcessFunction):
    """Records times their rule's factor, parked until the rule arrives; both sides
    slow, so both inputs have data in flight at every unaligned checkpoint."""

    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos

    def __deepcopy__(self, memo: Any) -> SlowEnrich:
        return SlowEnrich(self.chaos)

    def open(self, ctx: Any) -> None:
        self.pending = ctx.get_list_state(pe.ListStateDescriptor("pending"))

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.chaos.hit("user")
        time.sleep(0.0005)
        factor = ctx.get_broadcast_state(RULES).get(value["rule"])
        if factor is None:
            self.pending.add(value)
            return None
        return [(value["v"], value["v"] * factor)]

    def process_broadcast_element(self, value: Any, ctx: Any) -> Any:
        time.sleep(0.005)
        ctx.get_broadcast_state(RULES).put(value["rule"], value["factor"])
        out: List[Any] = []

        def release(key: Any, pending: Any) -> None:
            waiting = pending.get()
            ready = [r for r in waiting if r["rule"] == value["rule"]]
            if ready:
                out.extend((r["v"], r["v"] * value["factor"]) for r in ready)
                pending.update([r for r in waiting if r["rule"] != value["rule"]])

        ctx.apply_to_keyed_state(pe.ListStateDescriptor("pending"), release)
        return out


@pytest.mark.parametrize("new_parallelism", [3, 1, 2])
def test_an_unaligned_checkpoint_with_broadcast_state_restores_only_at_its_parallelism(
    tmp_path: Any, new_parallelism: int
) -> None:
    """The job fails (no restarts) with rules and records in flight. Restored from its
    last unaligned checkpoint at the same parallelism, every record is enriched exactly
    once. At another parallelism the restore is refused, with the way out: unaligned,
    each subtask checkpointed at its own point of the rules, so a key moved to another
    subtask would meet a broadcast state that had seen more or fewer rules (a review
    measured 3-9 of 1,500 records lost that way, with slow rules)."""
    sink = pe.sinks.CollectSink()

    def job(parallelism: int, chaos: Chaos) -> pe.StreamEnvironment:
        env = pe.StreamEnvironment(
            parallelism=parallelism,
            checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=True),
            checkpoint_storage=str(tmp_path / "ckpt"),
            buffer_size=4,
            buffer_timeout_ms=1,
            channel_capacity=2,
            restart_attempts=0,
            monitoring=None,
        )
        rules = env.from_generator(lambda i: RULE_RECORDS[i], count=N_RULES, name="rules").uid("rules")
        data = env.from_generator(lambda i: DATA[i], count=len(DATA), name="data").uid("data")
        enriched = data.key_by("k").connect(rules.broadcast(RULES)).process(SlowEnrich(chaos)).uid("enrich")
        enriched.sink_to(sink)
        return env

    with pytest.raises(pe.JobFailedError):
        job(2, Chaos("user", 600)).execute("bu")
    if new_parallelism != 2:
        with pytest.raises(ValueError, match=r"unaligned checkpoint taken at parallelism 2.*take a savepoint"):
            job(new_parallelism, Chaos("none", 1)).execute("bu", restore_from=str(tmp_path / "ckpt"))
        return
    result = job(new_parallelism, Chaos("none", 1)).execute("bu", restore_from=str(tmp_path / "ckpt"))
    assert result.status == "FINISHED"
    factor = {r["rule"]: r["factor"] for r in RULE_RECORDS}
    assert Counter(sink.records) == Counter((r["v"], r["v"] * factor[r["rule"]]) for r in DATA)


LIMITS = pe.MapStateDescriptor("limits")


class Limits(pe.KeyedBroadcastProcessFunction):
    """Keeps the rule record itself in broadcast state and bumps it in place."""

    def process_element(self, value: Any, ctx: Any) -> Any:
        yield ctx.get_broadcast_state(LIMITS).get("temp")["limit"]

    def process_broadcast_element(self, rule: Any, ctx: Any) -> Any:
        state = ctx.get_broadcast_state(LIMITS)
        if rule["op"] == "set":
            state.put("temp", rule)
        else:
            state.get("temp")["limit"] += 1


def test_each_subtask_gets_its_own_copy_of_broadcast_records() -> None:
    """A broadcast record kept in broadcast state and changed in place changes only
    this subtask's copy (as each Flink subtask deserializes its own): with the same
    objects in every channel, each bump counted once per subtask (16 at p=2, not 13)."""
    env = pe.StreamEnvironment(parallelism=2, monitoring=None)
    sink = pe.sinks.CollectSink()
    rules = env.from_collection([{"op": "set", "limit": 10}, {"op": "bump"}, {"op": "bump"}, {"op": "bump"}])

    def late(x: Any) -> Any:
        time.sleep(0.3)  # after every rule
        return x

    data = env.from_collection([{"k": i} for i in range(4)]).map(late)
    data.key_by("k").connect(rules.broadcast(LIMITS)).process(Limits()).sink_to(sink)
    env.execute("own-copies")
    assert sorted(sink.records) == [13, 13, 13, 13]
