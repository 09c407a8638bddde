"""Exactly-once unaligned (Flink's CheckpointBarrierUnaligner), the alternating
handler (savepoints stay aligned) and aligned checkpoints with a timeout."""

from __future__ import annotations

import threading
import time

from conftest import barrier, cancel, drain, eop, feed

from pyengine.io import CheckpointedInputGate, CheckpointFailureReason, CheckpointType
from pyengine.testing import RecordingListener

B, C = barrier, cancel
R = CheckpointFailureReason


def savepoint(cid: int):
    return B(cid, checkpoint_type=CheckpointType.SAVEPOINT)


def test_barrier_overtakes_queued_buffers_which_become_in_flight_data(make_gate, listener) -> None:
    gate = make_gate(2, unaligned=True)
    gate.push_many(0, ["a0", "a1", "a2"])
    gate.push_many(1, ["b0"])
    assert gate.poll_next() == (0, "a0")
    gate.push(0, B(1))
    gate.push(0, "a3")
    # The barrier takes effect at the next poll, ahead of a1, a2.
    assert gate.poll_next() == (0, B(1))
    assert listener.log == [("trigger", 1), ("input", 1, 0, "a1"), ("input", 1, 0, "a2")]
    assert listener.triggered[0][1].unaligned
    assert gate.blocked_channels == []
    # Overtaken buffers are still processed, in order; channel 1's data is in flight
    # until its barrier arrives.
    assert drain(gate) == [(1, "b0"), (0, "a1"), (0, "a2"), (0, "a3")]
    assert listener.in_flight[1] == [(0, "a1"), (0, "a2"), (1, "b0")]
    gate.push_many(1, ["b1", B(1), "b2"])
    assert gate.poll_next() == (1, B(1))
    assert listener.in_flight[1][-1] == (1, "b1")
    assert listener.finished == [1]
    assert drain(gate) == [(1, "b1"), (1, "b2")]
    assert listener.log.count(("input", 1, 1, "b1")) == 1


def test_barrier_overtakes_a_full_channel(make_gate, listener) -> None:
    gate = make_gate(2, unaligned=True, capacity=4)
    assert gate.push_many(0, range(10)) == 4
    assert gate.push(0, B(1))  # backpressure does not hold up the barrier
    assert gate.poll_next() == (0, B(1))
    assert listener.in_flight[1] == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_poll_priority_takes_an_overtaking_barrier_and_never_data(make_gate, listener) -> None:
    """What a task whose own output is full calls: it must still join the checkpoint."""
    gate = make_gate(2, unaligned=True, capacity=4)
    gate.push_many(0, ["a0", "a1"])
    assert gate.poll_priority() is None  # only data: nothing taken
    assert gate.queued(0) == 2
    gate.push(0, B(1))
    assert gate.poll_priority() == (0, B(1))
    assert listener.log == [("trigger", 1), ("input", 1, 0, "a0"), ("input", 1, 0, "a1")]
    assert gate.poll_priority() is None
    assert drain(gate) == [(0, "a0"), (0, "a1")]


def test_poll_priority_leaves_an_aligned_barrier_in_order(make_gate, listener) -> None:
    gate = make_gate(2, unaligned=False)
    gate.push_many(0, ["a0", B(1)])
    assert gate.poll_priority() is None
    assert listener.log == []
    assert gate.poll_next() == (0, "a0")


def test_poll_priority_switches_to_unaligned_at_the_aligned_timeout(make_gate, listener, clock) -> None:
    gate = make_gate(2, unaligned=True, aligned_timeout_ms=10)
    gate.push_many(0, [B(1)])
    gate.push_many(1, ["b0", B(1)])
    assert gate.poll_next() == (0, B(1))  # aligning: channel 0 blocked
    clock.advance(10_000_000)
    assert gate.poll_priority() == (1, B(1))
    assert listener.finished == [1] and listener.in_flight[1] == [(1, "b0")]


def test_end_of_partition_and_cancellation_abort(make_gate, listener) -> None:
    gate = make_gate(3, unaligned=True)
    feed(gate, [(0, B(1)), (1, eop())])
    assert listener.aborted == [(1, R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM)]
    feed(gate, [(0, B(2)), (2, "x"), (2, C(2)), (2, "y")])
    assert listener.aborted[-1] == (2, R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER)
    assert listener.in_flight[2] == [(2, "x")]  # y came after the abort
    feed(gate, [(2, B(2))])  # late barrier of the cancelled checkpoint
    assert listener.triggered_ids == [1, 2]
    assert listener.finished == []


def test_newer_barrier_subsumes_and_cancellation_of_a_newer_checkpoint(make_gate, listener) -> None:
    gate = make_gate(2, unaligned=True)
    feed(gate, [(0, B(1)), (0, B(2))])
    assert listener.log == [("trigger", 1), ("abort", 1, R.CHECKPOINT_DECLINED_SUBSUMED), ("trigger", 2)]
    feed(gate, [(1, C(3))])
    assert listener.log[-2:] == [
        ("abort", 2, R.CHECKPOINT_DECLINED_SUBSUMED),
        ("abort", 3, R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER),
    ]
    assert gate.latest_checkpoint_id == 3


def test_savepoints_stay_aligned_in_an_unaligned_gate(make_gate, listener) -> None:
    gate = make_gate(2, unaligned=True)
    gate.push_many(0, ["a0", savepoint(1), "a1"])
    assert drain(gate) == [(0, "a0"), (0, savepoint(1))]
    assert gate.blocked_channels == [0]
    assert listener.triggered == []
    gate.push_many(1, ["b0", savepoint(1)])
    assert drain(gate) == [(1, "b0"), (1, savepoint(1)), (0, "a1")]
    assert listener.triggered_ids == [1]
    assert not listener.triggered[0][1].unaligned
    assert listener.in_flight == {}
    # ... and the next checkpoint is unaligned again.
    gate.push_many(1, ["b1", B(2)])
    assert gate.poll_next() == (1, B(2))
    assert listener.triggered[-1][1].unaligned


def test_unaligned_checkpoint_subsumes_an_aligning_savepoint(make_gate, listener) -> None:
    gate = make_gate(2, unaligned=True)
    feed(gate, [(0, savepoint(1))])
    gate.push_many(0, ["blocked", B(2)])
    assert gate.poll_next() == (0, B(2))
    assert listener.log[:2] == [("abort", 1, R.CHECKPOINT_DECLINED_SUBSUMED), ("trigger", 2)]
    assert listener.in_flight[2] == [(0, "blocked")]


def test_channel_state_writer_attribute_is_used(impl) -> None:
    class Task:
        def __init__(self) -> None:
            self.channel_state_writer = RecordingListener()

        def trigger_checkpoint_on_barrier(self, barrier, metrics) -> None: ...

        def abort_checkpoint_on_barrier(self, checkpoint_id, reason) -> None: ...

    task = Task()
    gate = CheckpointedInputGate(1, task, unaligned=True, implementation=impl)
    gate.push_many(0, ["x", B(1)])
    drain(gate)
    assert task.channel_state_writer.in_flight == {1: [(0, "x")]}
    assert task.channel_state_writer.finished == [1]


def test_aligned_timeout_switches_to_unaligned(make_gate, listener, clock) -> None:
    gate = make_gate(3, unaligned=True, aligned_timeout_ms=10)
    gate.push_many(0, [B(1), "a-after"])
    gate.push_many(1, ["b-before"])
    assert drain(gate) == [(0, B(1)), (1, "b-before")]
    assert gate.blocked_channels == [0]  # starts aligned
    gate.push_many(2, ["c0", "c1", B(1), "c-after"])  # queued behind data, not overtaking yet
    assert gate.poll_next() == (2, "c0")
    assert listener.triggered == []
    clock.advance(10_000_000)
    # Timed out: trigger unaligned, release channel 0, and let channel 2's barrier overtake c1.
    assert gate.poll_next() == (2, B(1))
    _, metrics = listener.triggered[0]
    assert metrics.unaligned and metrics.alignment_duration_ns == 10_000_000
    assert gate.blocked_channels == []
    assert listener.in_flight[1] == [(2, "c1")]
    gate.push_many(1, ["b1", B(1)])  # pushed after the switch: overtakes at once
    assert gate.poll_next() == (1, B(1))
    assert listener.in_flight[1] == [(2, "c1"), (1, "b1")]
    assert listener.finished == [1]
    assert sorted(x for _, x in drain(gate)) == ["a-after", "b1", "c-after", "c1"]


def test_aligned_timeout_not_reached_stays_aligned(make_gate, listener, clock) -> None:
    gate = make_gate(2, unaligned=True, aligned_timeout_ms=10)
    feed(gate, [(0, B(1))])
    clock.advance(9_999_999)
    feed(gate, [(1, B(1))])
    assert listener.triggered_ids == [1]
    assert not listener.triggered[0][1].unaligned
    assert listener.in_flight == {}


def test_blocking_next_wakes_up_at_the_alignment_deadline(impl) -> None:
    listener = RecordingListener()
    gate = CheckpointedInputGate(2, listener, unaligned=True, aligned_timeout_ms=30, implementation=impl)
    first = B(1, int(time.time() * 1000))
    gate.push_many(0, [first, "after"])
    assert gate.next(timeout=1) == (0, first)
    start = time.monotonic()
    # Channel 0 is blocked and channel 1 silent: only the timeout can release "after".
    assert gate.next(timeout=2) == (0, "after")
    assert 0.01 < time.monotonic() - start < 1.5
    assert listener.triggered[0][1].unaligned


def test_in_flight_data_from_a_producer_thread(impl) -> None:
    listener = RecordingListener()
    gate = CheckpointedInputGate(4, listener, unaligned=True, capacity=16, implementation=impl)
    n = 500
    # Every barrier is in before any channel ends: an end of partition consumed
    # while the checkpoint is still collecting barriers would (rightly) abort it.
    all_barriers_pushed = threading.Barrier(4)

    def produce(ch: int) -> None:
        for i in range(n):
            gate.put(ch, (ch, i))
            if i == n // 2:
                gate.put(ch, B(1))
        all_barriers_pushed.wait()
        gate.put(ch, eop())

    threads = [threading.Thread(target=produce, args=(ch,)) for ch in range(4)]
    for t in threads:
        t.start()
    seen: dict[int, list] = {ch: [] for ch in range(4)}
    while (r := gate.next(timeout=10)) is not None:
        if isinstance(r[1], tuple):
            seen[r[0]].append(r[1][1])
    for t in threads:
        t.join()
    assert all(seen[ch] == list(range(n)) for ch in range(4))
    assert listener.triggered_ids == [1] and listener.finished == [1]
    # In-flight data is exactly what was pushed before each channel's barrier but
    # not yet processed when the checkpoint triggered: a contiguous run ending at n//2.
    for ch in range(4):
        items = [buf[1] for c, buf in listener.in_flight[1] if c == ch]
        assert items == list(range(n // 2 + 1 - len(items), n // 2 + 1))
