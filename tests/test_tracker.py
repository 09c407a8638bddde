"""At-least-once (Flink's CheckpointBarrierTracker), with the sequences of
Flink's own tracker tests: nothing is ever blocked, so the gate hands back
exactly the pushed sequence minus cancellation markers."""

from __future__ import annotations

import pytest
from conftest import barrier, cancel, eop, feed

from pyengine.io import CheckpointFailureReason, CorruptStreamError

B, C = barrier, cancel
R = CheckpointFailureReason


def buf(ch: int, i: int) -> tuple:
    return (ch, f"b{ch}.{i}")


def seq(*items):
    """Tuples (ch, id) are barriers, ('c', ch, id) cancellations, (ch, 'eop'),
    ('b', ch) numbered buffers."""
    counter = iter(range(10_000))
    out = []
    for it in items:
        if it[0] == "b":
            out.append(buf(it[1], next(counter)))
        elif it[0] == "c":
            out.append((it[1], C(it[2])))
        elif it[1] == "eop":
            out.append((it[0], eop()))
        else:
            out.append((it[1], B(it[0])))
    return out


def run(make_gate, n, sequence):
    gate = make_gate(n, mode="at_least_once")
    out = feed(gate, sequence)
    expected = [(ch, item) for ch, item in sequence if type(item).__name__ != "CancelCheckpointMarker"]
    assert out == expected
    return gate


def test_single_channel_with_skipped_barriers(make_gate, listener) -> None:
    s = seq(
        ("b", 0),
        (1, 0),
        ("b", 0),
        ("b", 0),
        (3, 0),
        ("b", 0),
        (4, 0),
        (6, 0),
        ("b", 0),
        (7, 0),
        ("b", 0),
        (10, 0),
        ("b", 0),
    )
    run(make_gate, 1, s)
    assert listener.triggered_ids == [1, 3, 4, 6, 7, 10]


def test_multi_channel_with_barriers(make_gate, listener) -> None:
    s = seq(
        ("b", 0),
        ("b", 2),
        ("b", 0),
        (1, 1),
        (1, 2),
        ("b", 2),
        ("b", 1),
        (1, 0),
        ("b", 0),
        ("b", 0),
        ("b", 1),
        ("b", 1),
        ("b", 2),
        (2, 0),
        (2, 1),
        (2, 2),
        ("b", 2),
        ("b", 2),
        (3, 2),
        ("b", 2),
        ("b", 2),
        (3, 0),
        (3, 1),
        (4, 1),
        (4, 2),
        (4, 0),
        ("b", 0),
    )
    gate = run(make_gate, 3, s)
    assert listener.triggered_ids == [1, 2, 3, 4]
    assert gate.latest_checkpoint_id == 4
    assert gate.blocked_channels == []


def test_multi_channel_skipping_checkpoints(make_gate, listener) -> None:
    s = seq(
        ("b", 0),
        ("b", 2),
        ("b", 0),
        (1, 1),
        (1, 2),
        ("b", 2),
        ("b", 1),
        (1, 0),
        ("b", 0),
        ("b", 0),
        ("b", 1),
        ("b", 1),
        ("b", 2),
        (2, 0),
        (2, 1),
        (2, 2),
        ("b", 2),
        ("b", 2),
        (3, 2),
        ("b", 2),
        ("b", 2),
        (4, 0),
        ("b", 0),
        ("b", 1),
        ("b", 2),
        (4, 1),
        ("b", 1),
        (4, 2),
        ("b", 0),
    )
    run(make_gate, 3, s)
    assert listener.triggered_ids == [1, 2, 4]
    assert listener.aborted == []  # subsumed pending checkpoints are dropped silently


def test_complete_checkpoints_on_late_barriers(make_gate, listener) -> None:
    s = seq(
        ("b", 1),
        ("b", 1),
        ("b", 0),
        ("b", 2),
        (2, 1),
        (2, 0),
        (2, 2),
        ("b", 1),
        ("b", 0),
        (3, 1),
        (3, 2),
        ("b", 1),
        ("b", 0),
        (4, 2),
        (4, 1),
        ("b", 1),
        ("b", 2),
        (3, 0),
        ("b", 0),
        (4, 0),
        ("b", 1),
        ("b", 2),
        (5, 1),
        ("b", 0),
        (5, 0),
        ("b", 1),
        (5, 2),
        ("b", 1),
        (6, 1),
        ("b", 0),
        (6, 0),
        ("b", 1),
        (7, 1),
        ("b", 0),
        (7, 2),
        ("b", 2),
        (8, 2),
        ("b", 0),
        (8, 1),
        ("b", 1),
        (9, 1),
        (7, 0),
        ("b", 0),
        (9, 2),
        ("b", 2),
        (10, 2),
        (8, 0),
        ("b", 1),
        ("b", 2),
        (9, 0),
        ("b", 1),
        ("b", 0),
        ("b", 2),
        (10, 0),
        (10, 1),
    )
    run(make_gate, 3, s)
    assert listener.triggered_ids == [2, 3, 4, 5, 7, 8, 9, 10]


def test_single_channel_abort_checkpoint(make_gate, listener) -> None:
    s = seq(("b", 0), (1, 0), ("b", 0), (2, 0), ("c", 0, 4), (5, 0), ("b", 0), ("c", 0, 6), ("b", 0))
    run(make_gate, 1, s)
    assert [e[:2] for e in listener.log] == [("trigger", 1), ("trigger", 2), ("abort", 4), ("trigger", 5), ("abort", 6)]
    assert {r for _, r in listener.aborted} == {R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER}


def test_multi_channel_abort_checkpoint(make_gate, listener) -> None:
    s = seq(
        ("b", 0),
        ("b", 2),
        ("b", 0),
        (1, 1),
        (1, 2),
        ("b", 2),
        ("b", 1),
        (1, 0),
        ("b", 0),
        ("b", 2),
        (2, 0),
        (2, 2),
        ("b", 0),
        ("b", 2),
        ("c", 1, 2),
        ("b", 2),
        ("b", 1),
        (3, 1),
        (3, 2),
        (3, 0),
        ("b", 0),
        ("b", 1),
        ("c", 1, 4),
        (4, 2),
        ("b", 0),
        (4, 0),
        ("b", 0),
        ("b", 1),
        ("b", 2),
        (5, 2),
        (5, 1),
        (5, 0),
        ("b", 0),
        ("b", 1),
        ("c", 1, 6),
        ("c", 2, 6),
        (6, 0),
        ("b", 0),
    )
    run(make_gate, 3, s)
    assert [e[:2] for e in listener.log] == [
        ("trigger", 1),
        ("abort", 2),
        ("trigger", 3),
        ("abort", 4),
        ("trigger", 5),
        ("abort", 6),
    ]


def test_interleaved_cancellations_abort_each_checkpoint_once(make_gate, listener) -> None:
    s = seq((1, 0), ("c", 0, 2), ("c", 1, 1), ("c", 1, 2), ("c", 2, 1), ("c", 2, 2), ("b", 0))
    run(make_gate, 3, s)
    assert [e[:2] for e in listener.log] == [("abort", 1), ("abort", 2)]


def test_end_of_partition_aborts_pending_and_later_checkpoints_need_open_channels_only(make_gate, listener) -> None:
    s = seq((1, 0), (1, 1), (2, 0), (0, "eop"), ("b", 1), (3, 1), (3, 2))
    gate = run(make_gate, 3, s)
    assert listener.aborted == [
        (1, R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM),
        (2, R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM),
    ]
    assert listener.triggered_ids == [3]
    assert gate.latest_checkpoint_id == 3


def test_old_barriers_are_ignored(make_gate, listener) -> None:
    s = seq((2, 0), (2, 1), (1, 0), (1, 1), (3, 1))
    run(make_gate, 2, s)
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
