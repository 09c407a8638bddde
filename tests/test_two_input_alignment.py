"""Two-input barrier handling as Flink tests it (AlignedCheckpointsTest,
UnalignedCheckpointsTest and CheckpointBarrierTrackerTest over several gates), for
all three handlers of the one gate a two-input task builds: exactly-once aligned,
exactly-once unaligned, and at-least-once (the tracker). Channels 0-1 are input
1's, 2-3 input 2's (``p`` channels per input edge, as ``build_task`` lays them out).
``make_gate`` runs every case on the native and the reference implementation.

The cases: the barrier first on one input; a cancellation marker on one input; one
input ending (end of partition) while a checkpoint is pending; a newer barrier on
one input subsuming the pending checkpoint. Each says what Flink 1.12 does, and
the next checkpoint is shown to work over both inputs (or the one still open)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
from conftest import barrier, cancel, eop, feed

from pyengine.io import CheckpointFailureReason

R = CheckpointFailureReason
MODES = ["aligned", "unaligned", "at_least_once"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def two_inputs(make_gate: Any, mode: str) -> Any:
    options: Dict[str, Any] = (
        {"mode": "at_least_once"} if mode == "at_least_once" else {"unaligned": mode == "unaligned"}
    )
    return make_gate(4, **options)


def data(out: List[Any]) -> List[Any]:
    return [(ch, item) for ch, item in out if isinstance(item, str)]


def test_barrier_first_on_one_input(make_gate: Any, listener: Any, mode: str) -> None:
    """Aligned: input 1 is blocked from its barriers until input 2's arrive, input 2
    flows meanwhile, one trigger. Unaligned: the first barrier triggers at once,
    nothing is blocked, input 2's records ahead of its barriers are the checkpoint's
    in-flight data. At-least-once: nothing is blocked, the trigger comes with the
    last channel's barrier."""
    gate = two_inputs(make_gate, mode)
    before = feed(gate, [(0, "a0"), (2, "b0"), (0, barrier(1)), (1, barrier(1)), (0, "a-after"), (3, "b-before")])
    after = feed(gate, [(2, barrier(1)), (3, barrier(1))])
    if mode == "aligned":
        assert data(before) == [(0, "a0"), (2, "b0"), (3, "b-before")], "input 1 waits, input 2 flows"
        assert data(after) == [(0, "a-after")], "input 1 released once both inputs are aligned"
        assert listener.log == [("trigger", 1)]
    elif mode == "unaligned":
        assert data(before) == [(0, "a0"), (2, "b0"), (0, "a-after"), (3, "b-before")], "nothing waits"
        assert listener.log == [("trigger", 1), ("input", 1, 3, "b-before"), ("finish", 1)]
    else:
        assert data(before) == [(0, "a0"), (2, "b0"), (0, "a-after"), (3, "b-before")], "nothing waits"
        assert listener.log == [("trigger", 1)]
    assert gate.blocked_channels == []


def test_cancellation_marker_on_one_input(make_gate: Any, listener: Any, mode: str) -> None:
    """A cancellation marker of the pending checkpoint on input 2 aborts it
    (CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER) in every mode, releases input 1
    (aligned), stops recording in-flight data (unaligned); the checkpoint's late
    barriers and markers are ignored; the next checkpoint completes over both."""
    gate = two_inputs(make_gate, mode)
    out = feed(gate, [(0, barrier(1)), (1, barrier(1)), (1, "a-after"), (2, "b"), (2, cancel(1)), (3, "b-after")])
    assert (1, "a-after") in data(out), "input 1 is not held by a cancelled checkpoint"
    assert listener.aborted == [(1, R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER)]
    feed(gate, [(3, cancel(1)), (2, barrier(1)), (3, barrier(1))])  # the rest of checkpoint 1, late
    assert listener.aborted_ids == [1] and listener.triggered_ids == ([1] if mode == "unaligned" else [])
    feed(gate, [(c, barrier(2)) for c in (2, 3, 0, 1)])
    assert listener.triggered_ids[-1] == 2 and listener.aborted_ids == [1]
    if mode == "unaligned":
        assert listener.in_flight[1] == [(2, "b")], "recorded until the cancellation, not after"
        assert listener.finished == [2]
    assert gate.blocked_channels == []


def test_one_input_ending_while_the_checkpoint_is_pending(make_gate: Any, listener: Any, mode: str) -> None:
    """Input 2 ends (end of partition on its channels) while checkpoint 1 waits for
    its barriers: Flink 1.12 declines it (CHECKPOINT_DECLINED_INPUT_END_OF_STREAM) in
    every handler and releases input 1; checkpoint 2 then needs input 1's barriers
    only (ended channels count as aligned)."""
    gate = two_inputs(make_gate, mode)
    out = feed(gate, [(0, barrier(1)), (1, barrier(1)), (0, "a-after"), (2, eop())])
    assert (0, "a-after") in data(out)
    assert listener.aborted == [(1, R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM)]
    feed(gate, [(3, eop()), (0, barrier(2)), (1, barrier(2))])
    assert listener.triggered_ids[-1] == 2 and listener.aborted_ids == [1]
    if mode == "unaligned":
        assert listener.finished == [2]
    assert gate.blocked_channels == []


def test_newer_barrier_on_one_input_subsumes_the_pending_checkpoint(make_gate: Any, listener: Any, mode: str) -> None:
    """Barrier 2 on input 2 while checkpoint 1 waits for input 2: exactly-once
    (aligned or not) aborts 1 (CHECKPOINT_DECLINED_SUBSUMED) and goes on with 2; the
    tracker keeps both pending and, when 2 completes, drops 1 without a word (Flink's
    CheckpointBarrierTracker). Either way only checkpoint 2 is taken after it."""
    gate = two_inputs(make_gate, mode)
    feed(gate, [(0, barrier(1)), (1, barrier(1)), (2, barrier(2))])
    feed(gate, [(3, barrier(2)), (0, barrier(2)), (1, barrier(2))])
    if mode == "aligned":
        assert listener.log == [("abort", 1, R.CHECKPOINT_DECLINED_SUBSUMED), ("trigger", 2)]
    elif mode == "unaligned":
        assert listener.log == [
            ("trigger", 1),
            ("abort", 1, R.CHECKPOINT_DECLINED_SUBSUMED),
            ("trigger", 2),
            ("finish", 2),
        ]
    else:
        assert listener.log == [("trigger", 2)]
    assert gate.latest_checkpoint_id == 2
    feed(gate, [(3, barrier(1))])  # a barrier of the subsumed checkpoint, late: ignored
    assert listener.triggered_ids[-1] == 2 and gate.blocked_channels == []
