"""Aligned checkpoints with a timeout (Flink 1.12's AlternatingController): the barrier
the gate triggers with says how the checkpoint is taken at this task, because the
task reads ``options.unaligned`` to decide whether to wait for its in-flight data
(``finish_input``). The coordinator's barriers of such a checkpoint say unaligned;
one whose barriers all arrive in time is taken aligned, and its trigger said
unaligned too: the task waited for a ``finish_input`` that never came, the
checkpoint never completed and neither did the job (a hang at the final checkpoint)."""

from __future__ import annotations

import random
import time
from typing import Any, Dict, List

import pytest
from conftest import barrier, drain

import pyengine as pe
from pyengine.io import CheckpointType
from pyengine.testing import RecordingListener

B = barrier


def _assert_task_contract(listener: RecordingListener) -> None:
    """What StreamTask relies on: a trigger whose barrier says unaligned gets its
    finish_input (or an abort), one that says aligned gets neither in-flight data
    nor finish_input; and the barrier agrees with the metrics."""
    unaligned = {b.checkpoint_id for b, m in listener.triggered if b.options.unaligned}
    aligned = {b.checkpoint_id for b, m in listener.triggered if not b.options.unaligned}
    for b, m in listener.triggered:
        assert b.options.unaligned == m.unaligned, (b, m)
    assert set(listener.finished) <= unaligned
    assert not aligned & set(listener.in_flight)
    assert unaligned <= set(listener.finished) | set(listener.aborted_ids), (
        unaligned,
        listener.finished,
        listener.aborted_ids,
    )


@pytest.mark.parametrize("pushed_unaligned", [True, False])
def test_checkpoint_aligned_in_time_triggers_an_aligned_barrier(make_gate, listener, clock, pushed_unaligned) -> None:
    gate = make_gate(2, unaligned=True, aligned_timeout_ms=10)
    first, second = B(1, unaligned=pushed_unaligned), B(1, unaligned=pushed_unaligned)
    gate.push_many(0, [first, "a-after"])
    gate.push_many(1, ["b0", second])
    assert gate.poll_next() == (0, first)  # the caller still gets the barrier it pushed
    clock.advance(9_999_999)
    assert drain(gate) == [(1, "b0"), (1, second), (0, "a-after")]
    assert listener.triggered_ids == [1]
    taken, metrics = listener.triggered[0]
    assert not metrics.unaligned
    assert not taken.options.unaligned  # the task must not wait for in-flight data
    assert (taken.checkpoint_id, taken.timestamp, taken.checkpoint_type) == (1, 1, CheckpointType.CHECKPOINT)
    assert listener.finished == [] and listener.in_flight == {}
    _assert_task_contract(listener)


@pytest.mark.parametrize("pushed_unaligned", [True, False])
def test_switch_at_the_timeout_triggers_unaligned_then_finishes_the_channel_state(
    make_gate, listener, clock, pushed_unaligned
) -> None:
    gate = make_gate(3, unaligned=True, aligned_timeout_ms=10)
    gate.push_many(0, [B(1, unaligned=pushed_unaligned), "a-after"])
    gate.push_many(1, ["b0"])
    assert drain(gate) == [(0, B(1, unaligned=pushed_unaligned)), (1, "b0")]
    assert gate.blocked_channels == [0]
    clock.advance(10_000_000)
    gate.push_many(1, ["b1", "b2"])
    gate.push_many(2, ["c0"])
    # Timed out: triggered unaligned, channel 0 released; what channels 1 and 2 deliver
    # before their barriers is in-flight data of the checkpoint.
    assert sorted(x for _, x in drain(gate)) == ["a-after", "b1", "b2", "c0"]
    taken, metrics = listener.triggered[0]
    assert metrics.unaligned and taken.options.unaligned
    assert sorted(listener.in_flight[1]) == [(1, "b1"), (1, "b2"), (2, "c0")]
    assert listener.finished == []
    gate.push_many(2, ["c1", B(1, unaligned=pushed_unaligned), "c-after"])
    assert gate.poll_next() == (2, B(1, unaligned=pushed_unaligned))  # overtakes c1
    assert listener.finished == []  # channel 1's barrier is still out
    gate.push_many(1, ["b3", B(1, unaligned=pushed_unaligned)])
    assert gate.poll_next() == (1, B(1, unaligned=pushed_unaligned))
    assert listener.finished == [1]
    assert sorted(listener.in_flight[1]) == [(1, "b1"), (1, "b2"), (1, "b3"), (2, "c0"), (2, "c1")]
    assert sorted(x for _, x in drain(gate)) == ["b3", "c-after", "c1"]
    _assert_task_contract(listener)


def test_next_checkpoint_after_a_switch_can_complete_aligned(make_gate, listener, clock) -> None:
    gate = make_gate(2, unaligned=True, aligned_timeout_ms=10)
    gate.push(0, B(1, unaligned=True))
    drain(gate)
    clock.advance(10_000_000)
    gate.push_many(1, ["x", B(1, unaligned=True)])
    drain(gate)
    gate.push_many(0, [B(2, unaligned=True)])
    gate.push_many(1, [B(2, unaligned=True)])
    drain(gate)
    assert [(b.checkpoint_id, b.options.unaligned, m.unaligned) for b, m in listener.triggered] == [
        (1, True, True),
        (2, False, False),
    ]
    assert listener.finished == [1] and listener.in_flight == {1: [(1, "x")]}
    _assert_task_contract(listener)


@pytest.mark.parametrize("seed", range(30))
def test_random_sequences_keep_the_task_contract(make_gate, listener, clock, seed) -> None:
    """Barriers as the coordinator sends them (unaligned=True), data, and time passing
    around the timeout, polled as a task does; in the end every barrier is in."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    gate = make_gate(n, unaligned=True, aligned_timeout_ms=5, capacity=8)
    sent: Dict[int, int] = {ch: 0 for ch in range(n)}  # last checkpoint id pushed per channel
    last = 0
    for step in range(rng.randint(20, 120)):
        r = rng.random()
        ch = rng.randrange(n)
        if r < 0.45:
            gate.push(ch, f"d{step}")
        elif r < 0.6:
            if gate.push(ch, B(sent[ch] + 1, unaligned=True)):
                sent[ch] += 1
                last = max(last, sent[ch])
        elif r < 0.75:
            clock.advance(rng.randint(0, 6_000_000))
        elif r < 0.85:
            gate.poll_priority()
        else:
            gate.poll_batch(rng.randint(1, 5))
    for ch in range(n):
        for cid in range(sent[ch] + 1, last + 1):
            while not gate.push(ch, B(cid, unaligned=True)):
                clock.advance(6_000_000)  # a blocked channel makes room once alignment times out
                gate.poll_next()
    drain(gate)
    _assert_task_contract(listener)


@pytest.mark.parametrize("aligned_timeout_ms", [2, 50])
def test_job_with_an_aligned_timeout_finishes_exactly(tmp_path, aligned_timeout_ms: int) -> None:
    """The hang's job: a slow consumer behind a rebalance. With 50 ms nearly every
    checkpoint aligns in time, with 2 ms many switch; either way every checkpoint
    completes or fails, and execute() returns with each record once."""
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=True, aligned_timeout_ms=aligned_timeout_ms),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=8,
        buffer_timeout_ms=1,
        channel_capacity=2,
        monitoring=None,
    )
    sink = pe.sinks.CollectSink()

    def slow(r: Any) -> Any:
        time.sleep(0.0005)
        return r

    records: List[Dict[str, int]] = [{"i": i, "k": i % 5} for i in range(800)]
    env.from_collection(records).rebalance().map(slow).sink_to(sink)
    client = env.execute_async("aligned-timeout")
    try:
        result = client.wait(timeout_s=60)
    finally:
        if not client.done():
            client.cancel()
    assert result.status == "FINISHED", result.cause
    assert sorted(r["i"] for r in result.records) == list(range(800))
    counts = result.checkpoints.counts
    assert counts["completed"] >= 1 and counts["in_progress"] == 0, counts
