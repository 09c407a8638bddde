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
def test_an_unaligned_checkpoint_with_broadcast_in_flight_restores_at_another_parallelism(
    tmp_path: Any, new_parallelism: int
) -> None:
    """The job fails (no restarts) with rules and records in flight; restored from its
    last unaligned checkpoint at another parallelism, every record is enriched exactly
    once: each new subtask's broadcast state and broadcast input in flight come from
    the same old subtask, so no rule is missing or applied twice."""
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
    result = job(new_parallelism, Chaos("none", 1)).execute("bu", restore_from=str(tmp_path / "ckpt"))
    assert result.status == "FINISHED"
    factor = {r["rule"]: r["factor"] for r in RULE_RECORDS}
    assert Counter(sink.records) == Counter((r["v"], r["v"] * factor[r["rule"]]) for r in DATA)
