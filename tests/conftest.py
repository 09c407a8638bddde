from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Tuple

import pytest

from pyengine.io import CancelCheckpointMarker, CheckpointBarrier, CheckpointedInputGate, EndOfPartition
from pyengine.testing import ManualClock, RecordingListener


@pytest.fixture(params=["native", "reference"])
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def listener() -> RecordingListener:
    return RecordingListener()


@pytest.fixture
def make_gate(impl: str, listener: RecordingListener, clock: ManualClock) -> Callable[..., Any]:
    def make(num_channels: int, **kwargs: Any) -> Any:
        kwargs.setdefault("clock", clock)
        return CheckpointedInputGate(num_channels, listener, implementation=impl, **kwargs)

    return make


def barrier(checkpoint_id: int, timestamp: int = 1, **options: Any) -> CheckpointBarrier:
    from pyengine.io import CheckpointOptions

    return CheckpointBarrier(checkpoint_id, timestamp, CheckpointOptions(**options))


def cancel(checkpoint_id: int) -> CancelCheckpointMarker:
    return CancelCheckpointMarker(checkpoint_id)


def eop() -> EndOfPartition:
    return EndOfPartition()


def drain(gate: Any) -> List[Tuple[int, Any]]:
    out = []
    while (r := gate.poll_next()) is not None:
        out.append(r)
    return out


def feed(
    gate: Any, sequence: Iterable[Tuple[int, Any]], after: Optional[Callable[[], None]] = None
) -> List[Tuple[int, Any]]:
    """Push one event at a time and poll everything available after each push,
    the way Flink's mock input gate hands a fixed sequence to the handler."""
    out: List[Tuple[int, Any]] = []
    for channel, item in sequence:
        assert gate.push(channel, item)
        out.extend(drain(gate))
        if after is not None:
            after()
    return out
