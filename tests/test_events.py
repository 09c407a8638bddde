from __future__ import annotations

import dataclasses

import pytest

from pyengine.io import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointFailureReason,
    CheckpointOptions,
    CheckpointType,
    EndOfPartition,
)


def test_barrier_equality_hash_and_repr() -> None:
    a = CheckpointBarrier(3, 1000)
    assert a == CheckpointBarrier(3, 1000, CheckpointOptions())
    assert a != CheckpointBarrier(4, 1000)
    assert a != CheckpointBarrier(3, 1000, CheckpointOptions(unaligned=True))
    assert hash(a) == hash(CheckpointBarrier(3, 1000))
    assert repr(a) == "CheckpointBarrier(3, timestamp=1000)"
    sp = CheckpointBarrier(5, 7, CheckpointOptions(CheckpointType.SAVEPOINT))
    assert repr(sp) == "CheckpointBarrier(5, timestamp=7, CheckpointOptions(CheckpointType.SAVEPOINT))"
    assert a.id == 3 and a.is_checkpoint and not sp.is_checkpoint
    assert sp.checkpoint_type is CheckpointType.SAVEPOINT


def test_events_are_immutable() -> None:
    for event in (CheckpointBarrier(1, 1), CancelCheckpointMarker(1), CheckpointOptions()):
        field = dataclasses.fields(event)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(event, field, 2)


def test_end_of_partition_and_cancel_marker_values() -> None:
    assert EndOfPartition() == EndOfPartition()
    assert repr(EndOfPartition()) == "EndOfPartition()"
    assert CancelCheckpointMarker(2) == CancelCheckpointMarker(2) != CancelCheckpointMarker(3)
    assert repr(CancelCheckpointMarker(2)) == "CancelCheckpointMarker(2)"


@pytest.mark.parametrize("make", [lambda i: CheckpointBarrier(i, 0), CancelCheckpointMarker])
def test_negative_checkpoint_id_is_refused_with_the_value(make) -> None:
    with pytest.raises(ValueError, match="-5"):
        make(-5)
    with pytest.raises(TypeError, match="checkpoint_id"):
        make("1")
    with pytest.raises(TypeError):
        make(True)


def test_bad_barrier_fields() -> None:
    with pytest.raises(ValueError, match="timestamp"):
        CheckpointBarrier(1, -1)
    with pytest.raises(TypeError, match="options"):
        CheckpointBarrier(1, 1, "unaligned")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="savepoint cannot be unaligned"):
        CheckpointOptions(CheckpointType.SAVEPOINT, unaligned=True)
    with pytest.raises(TypeError, match="checkpoint_type"):
        CheckpointOptions("checkpoint")  # type: ignore[arg-type]


def test_event_classes_are_final() -> None:
    for cls in (CheckpointBarrier, CancelCheckpointMarker, EndOfPartition, CheckpointOptions):
        with pytest.raises(TypeError, match="final"):
            type("Sub", (cls,), {})


def test_failure_reasons_have_flinks_names() -> None:
    for name in (
        "CHECKPOINT_DECLINED_SUBSUMED",
        "CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER",
        "CHECKPOINT_DECLINED_INPUT_END_OF_STREAM",
        "CHECKPOINT_DECLINED_ALIGNMENT_LIMIT_EXCEEDED",
    ):
        assert CheckpointFailureReason[name].message
