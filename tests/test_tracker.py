"""At-least-once (Flink's CheckpointBarrierTracker), with the sequences of
Flink's own tracker tests: nothing is ever blocked, so the gate hands back
exactly the pushed sequence minus cancellation markers.

Sequences are written compactly: ``b0`` a buffer on channel 0, ``3@1`` the
barrier of checkpoint 3 on channel 1, ``x4@1`` its cancellation marker, ``e2``
end of partition on channel 2.
"""

from __future__ import annotations

import pytest
from conftest import barrier, cancel, eop, feed

from pyengine.io import CancelCheckpointMarker, CheckpointFailureReason, CorruptStreamError

B, C = barrier, cancel
R = CheckpointFailureReason


def seq(text: str) -> list:
    out = []
    for serial, token in enumerate(text.split()):
        if token[0] == "b":
            out.append((int(token[1:]), f"buffer {serial}"))
        elif token[0] == "e":
            out.append((int(token[1:]), eop()))
        elif token[0] == "x":
            cid, ch = token[1:].split("@")
            out.append((int(ch), C(int(cid))))
        else:
            cid, ch = token.split("@")
            out.append((int(ch), B(int(cid))))
    return out


def run(make_gate, n, sequence):
    gate = make_gate(n, mode="at_least_once")
    out = feed(gate, sequence)
    assert out == [(ch, item) for ch, item in sequence if type(item) is not CancelCheckpointMarker]
    return gate


# The opening of several of Flink's multi-channel tracker tests: checkpoints 1 and 2 complete.
FIRST_TWO = "b0 b2 b0 1@1 1@2 b2 b1 1@0  b0 b0 b1 b1 b2 2@0 2@1 2@2"


def test_single_channel_with_skipped_barriers(make_gate, listener) -> None:
    run(make_gate, 1, seq("b0 1@0 b0 b0 3@0 b0 4@0 6@0 b0 7@0 b0 10@0 b0"))
    assert listener.triggered_ids == [1, 3, 4, 6, 7, 10]


def test_multi_channel_with_barriers(make_gate, listener) -> None:
    gate = run(make_gate, 3, seq(FIRST_TWO + " b2 b2 3@2 b2 b2 3@0 3@1  4@1 4@2 4@0 b0"))
    assert listener.triggered_ids == [1, 2, 3, 4]
    assert gate.latest_checkpoint_id == 4
    assert gate.blocked_channels == []


def test_multi_channel_skipping_checkpoints(make_gate, listener) -> None:
    run(make_gate, 3, seq(FIRST_TWO + " b2 b2 3@2 b2 b2  4@0 b0 b1 b2 4@1 b1 4@2 b0"))
    assert listener.triggered_ids == [1, 2, 4]
    assert listener.aborted == []  # subsumed pending checkpoints are dropped silently


def test_complete_checkpoints_on_late_barriers(make_gate, listener) -> None:
    run(
        make_gate,
        3,
        seq(
            "b1 b1 b0 b2 2@1 2@0 2@2  b1 b0 3@1 3@2  b1 b0 4@2 4@1 b1 b2  3@0  b0 4@0"
            "  b1 b2 5@1 b0 5@0 b1 5@2  b1 6@1 b0 6@0"
            "  b1 7@1 b0 7@2 b2 8@2 b0 8@1 b1 9@1  7@0 b0 9@2 b2 10@2  8@0 b1 b2 9@0"
            "  b1 b0 b2  10@0 10@1"
        ),
    )
    assert listener.triggered_ids == [2, 3, 4, 5, 7, 8, 9, 10]


def test_single_channel_abort_checkpoint(make_gate, listener) -> None:
    run(make_gate, 1, seq("b0 1@0 b0 2@0 x4@0 5@0 b0 x6@0 b0"))
    assert [e[:2] for e in listener.log] == [("trigger", 1), ("trigger", 2), ("abort", 4), ("trigger", 5), ("abort", 6)]
    assert {r for _, r in listener.aborted} == {R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER}


def test_multi_channel_abort_checkpoint(make_gate, listener) -> None:
    run(
        make_gate,
        3,
        seq(
            "b0 b2 b0 1@1 1@2 b2 b1 1@0  b0 b2 2@0 2@2 b0 b2 x2@1  b2 b1 3@1 3@2 3@0"
            "  b0 b1 x4@1 4@2 b0 4@0  b0 b1 b2 5@2 5@1 5@0  b0 b1 x6@1 x6@2 6@0 b0"
        ),
    )
    assert [e[:2] for e in listener.log] == [
        ("trigger", 1), ("abort", 2), ("trigger", 3), ("abort", 4), ("trigger", 5), ("abort", 6)
    ]  # fmt: skip


def test_interleaved_cancellations_abort_each_checkpoint_once(make_gate, listener) -> None:
    run(make_gate, 3, seq("1@0 x2@0 x1@1 x2@1 x1@2 x2@2 b0"))
    assert [e[:2] for e in listener.log] == [("abort", 1), ("abort", 2)]


def test_end_of_partition_aborts_pending_and_later_checkpoints_need_open_channels_only(make_gate, listener) -> None:
    gate = run(make_gate, 3, seq("1@0 1@1 2@0 e0 b1 3@1 3@2"))
    assert listener.aborted == [
        (1, R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM), (2, R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM)
    ]  # fmt: skip
    assert listener.triggered_ids == [3]
    assert gate.latest_checkpoint_id == 3


def test_old_barriers_are_ignored(make_gate, listener) -> None:
    run(make_gate, 2, seq("2@0 2@1 1@0 1@1 3@1"))
    assert listener.triggered_ids == [2]


def test_at_most_fifty_pending_checkpoints_are_tracked(make_gate, listener) -> None:
    gate = make_gate(2, mode="at_least_once")
    for cid in range(1, 52):  # 51 pending on channel 0: checkpoint 1 falls out of the table
        gate.push(0, B(cid))
        feed(gate, [])
        gate.poll_next()
    gate.push(1, B(1))
    gate.push(1, B(2))
    while gate.poll_next():
        pass
    assert listener.triggered_ids == [2]


def test_repeated_barrier_on_one_channel_is_a_corrupt_stream(make_gate, listener) -> None:
    gate = make_gate(2, mode="at_least_once")
    gate.push(0, B(1))
    gate.push(0, B(1))
    with pytest.raises(CorruptStreamError, match="corrupt: repeated barrier for checkpoint 1 on channel 0"):
        gate.poll_next()
    assert listener.triggered == []  # a repeated barrier must never complete a checkpoint early


def test_a_pending_checkpoint_counts_each_channel_once(make_gate, listener) -> None:
    gate = make_gate(2, mode="at_least_once")
    out = feed(gate, [(0, B(1)), (0, B(2))])
    assert out == [(0, B(1)), (0, B(2))]
    gate.push(0, B(1))  # not adjacent to the first B(1), so only the pending table can tell
    with pytest.raises(CorruptStreamError, match="checkpoint 1 on channel 0"):
        gate.poll_next()
    assert listener.triggered == []


def test_metrics_report_start_delay(make_gate, listener, clock) -> None:
    gate = make_gate(2, mode="at_least_once")
    ts = clock.now_ms - 250
    feed(gate, [(0, B(1, ts)), (1, B(1, ts))])
    metrics = listener.triggered[0][1]
    assert metrics.checkpoint_start_delay_ns == 250_000_000
    assert metrics.alignment_duration_ns == 0 and not metrics.unaligned
    assert gate.last_checkpoint_start_delay_ns == 250_000_000
