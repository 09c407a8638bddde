"""Exactly-once aligned (Flink's CheckpointBarrierAligner)."""

from __future__ import annotations

import pytest
from conftest import barrier, cancel, eop, feed

from pyengine.io import CheckpointFailureReason, CorruptStreamError

B, C = barrier, cancel
R = CheckpointFailureReason


def test_blocked_channel_data_waits_and_follows_in_order(make_gate, listener, clock) -> None:
    gate = make_gate(3)
    out = feed(gate, [(0, "a0"), (1, B(1)), (1, "b1"), (1, "b2"), (0, "a1"), (2, "c0")])
    assert out == [(0, "a0"), (1, B(1)), (0, "a1"), (2, "c0")]
    assert gate.blocked_channels == [1]
    out = feed(gate, [(2, B(1)), (2, "c1")])
    assert out == [(2, B(1))]
    assert gate.blocked_channels == [1, 2]
    assert listener.triggered == []
    clock.advance(7_000)
    out = feed(gate, [(0, B(1))])
    assert out == [(0, B(1)), (1, "b1"), (2, "c1"), (1, "b2")]
    assert gate.blocked_channels == []
    assert listener.triggered_ids == [1]
    metrics = listener.triggered[0][1]
    assert metrics.alignment_duration_ns == 7_000 == gate.last_alignment_duration_ns
    assert not metrics.unaligned
    assert gate.latest_checkpoint_id == 1


def test_single_channel_never_blocks(make_gate, listener) -> None:
    gate = make_gate(1)
    out = feed(gate, [(0, "a"), (0, B(1)), (0, "b"), (0, B(2)), (0, B(3)), (0, "c"), (0, B(2))])
    assert [x for _, x in out] == ["a", B(1), "b", B(2), B(3), "c", B(2)]
    assert listener.triggered_ids == [1, 2, 3]
    assert gate.last_alignment_duration_ns == 0


def test_single_channel_abort_checkpoint(make_gate, listener) -> None:
    gate = make_gate(1)
    feed(gate, [(0, "a"), (0, B(1)), (0, "b"), (0, B(2)), (0, "c"), (0, C(4)), (0, B(5)), (0, "d"), (0, C(6))])
    assert [e[:2] for e in listener.log] == [("trigger", 1), ("trigger", 2), ("abort", 4), ("trigger", 5), ("abort", 6)]
    assert gate.latest_checkpoint_id == 6
    assert gate.last_alignment_duration_ns == 0


def test_multi_channel_abort_checkpoint(make_gate, listener) -> None:
    # Flink's testMultiChannelAbortCheckpoint sequence.
    gate = make_gate(3)
    feed(
        gate,
        [
            (0, "0"),
            (2, "1"),
            (0, "2"),
            (1, B(1)),
            (2, B(1)),
            (0, "5"),
            (0, B(1)),
            (0, "7"),
            (2, "8"),
            (0, B(2)),
            (2, B(2)),
            (1, "11"),
            (1, C(2)),
            (2, "13"),
            (1, "14"),
            (1, B(3)),
            (2, B(3)),
            (0, B(3)),
            (0, "18"),
            (1, "19"),
            (1, C(4)),
            (2, B(4)),
            (2, "22"),
            (0, B(4)),
            (0, "24"),
            (1, "25"),
            (2, "26"),
            (2, B(5)),
            (1, B(5)),
            (0, B(5)),
            (0, "30"),
            (1, "31"),
            (1, C(6)),
            (2, C(6)),
            (0, B(6)),
            (0, "35"),
        ],
    )
    assert [e[:2] for e in listener.log] == [
        ("trigger", 1),
        ("abort", 2),
        ("trigger", 3),
        ("abort", 4),
        ("trigger", 5),
        ("abort", 6),
    ]
    assert {r for _, r in listener.aborted} == {R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER}
    assert gate.blocked_channels == []
    assert gate.last_alignment_duration_ns == 0  # the last one was cancelled


def test_newer_barrier_subsumes_the_alignment(make_gate, listener) -> None:
    # Flink's testIgnoreCancelBarrierIfCheckpointSubsumed.
    gate = make_gate(3)
    out = feed(
        gate, [(2, "0"), (1, B(3)), (0, B(3)), (2, "3"), (2, B(5)), (1, "5"), (0, "6"), (0, C(3)), (0, "8"), (1, "9")]
    )
    assert listener.aborted == [(3, R.CHECKPOINT_DECLINED_SUBSUMED)]
    assert gate.blocked_channels == [2]
    assert [x for _, x in out if isinstance(x, str)] == ["0", "3", "5", "6", "8", "9"]
    out = feed(gate, [(0, B(5)), (1, B(5)), (2, "late")])
    assert listener.triggered_ids == [5]
    assert out[-1] == (2, "late")


def test_cancelled_checkpoint_ignores_its_late_barriers(make_gate, listener) -> None:
    # Flink's testAbortOnCanceledBarriers.
    gate = make_gate(3)
    feed(
        gate,
        [
            (1, "0"),
            (1, B(1)),
            (2, "2"),
            (0, "3"),
            (0, C(1)),
            (1, "5"),
            (1, B(2)),
            (2, "7"),
            (0, "8"),
            (2, B(1)),
            (0, "10"),
            (2, "11"),
        ],
    )
    assert listener.aborted == [(1, R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER)]
    assert gate.blocked_channels == [1]
    feed(gate, [(0, B(2)), (2, B(2))])
    assert listener.triggered_ids == [2]


def test_closed_channels_count_as_aligned(make_gate, listener) -> None:
    # Flink's testStartAlignmentWithClosedChannels.
    gate = make_gate(4)
    out = feed(
        gate,
        [
            (2, eop()),
            (1, eop()),
            (0, "0"),
            (0, "1"),
            (3, "2"),
            (3, B(2)),
            (0, B(2)),
            (0, B(3)),
            (3, B(3)),
            (0, "3"),
            (0, "4"),
            (3, "5"),
            (0, eop()),
            (3, "6"),
            (3, B(4)),
        ],
    )
    assert listener.triggered_ids == [2, 3, 4]
    assert gate.latest_checkpoint_id == 4
    assert out[:2] == [(2, eop()), (1, eop())]
    feed(gate, [(3, "7"), (3, eop())])
    assert gate.is_finished


def test_end_of_partition_aborts_the_alignment(make_gate, listener) -> None:
    # Flink's testEndOfStreamWhileCheckpoint.
    gate = make_gate(3)
    out = feed(gate, [(0, B(1)), (1, B(1)), (2, B(1)), (0, "3"), (0, "4"), (2, "5"), (2, B(2)), (0, B(2)), (1, "8")])
    assert gate.blocked_channels == [0, 2]
    out = feed(gate, [(0, "blocked"), (1, eop())])
    assert listener.aborted == [(2, R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM)]
    assert gate.blocked_channels == []
    assert out == [(1, eop()), (0, "blocked")]
    feed(gate, [(2, eop()), (0, "11"), (0, eop())])
    assert listener.triggered_ids == [1]
    assert gate.is_finished


def test_repeated_barrier_on_a_channel_is_a_corrupt_stream(make_gate, listener) -> None:
    gate = make_gate(3)
    assert feed(gate, [(0, "a")]) == [(0, "a")]
    # The repeat sits behind the blocked channel, so it is caught when pushed;
    # the consumer fails, and keeps failing: nothing after a corrupt event is trusted.
    assert gate.push(0, B(1))
    assert gate.push(0, B(1))
    for _ in range(2):
        with pytest.raises(CorruptStreamError, match="corrupt: repeated barrier for checkpoint 1 on channel 0"):
            gate.poll_next()
    with pytest.raises(CorruptStreamError):
        gate.poll_batch(5)
    with pytest.raises(CorruptStreamError):
        gate.next(timeout=0)
    assert listener.log == []


def test_different_checkpoints_on_one_channel_are_not_repeats(make_gate, listener) -> None:
    gate = make_gate(2)
    feed(gate, [(0, B(1)), (1, B(1)), (0, B(2)), (0, B(1)), (1, B(2))])
    assert listener.triggered_ids == [1, 2]


def test_start_delay_is_measured_from_the_barrier_timestamp(make_gate, listener, clock) -> None:
    gate = make_gate(2)
    feed(gate, [(0, B(1, clock.now_ms - 40))])
    assert gate.last_checkpoint_start_delay_ns == 40_000_000
    feed(gate, [(1, B(1, clock.now_ms - 40))])
    assert listener.triggered[0][1].checkpoint_start_delay_ns == 40_000_000
