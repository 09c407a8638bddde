"""Helpers for testing code built on pyengine; shipped as public API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from .io.events import CheckpointBarrier, CheckpointFailureReason, CheckpointMetrics

__all__ = ["ManualClock", "RecordingListener"]


@dataclass
class RecordingListener:
    """A gate listener that remembers every call, in order.

    ``log`` holds one tuple per call: ``("trigger", checkpoint_id)``,
    ``("abort", checkpoint_id, reason)``, ``("input", checkpoint_id, channel,
    buffer)`` or ``("finish", checkpoint_id)``; the other attributes give the
    same calls by kind.
    """

    log: List[Tuple[Any, ...]] = field(default_factory=list)
    triggered: List[Tuple[CheckpointBarrier, CheckpointMetrics]] = field(default_factory=list)
    aborted: List[Tuple[int, CheckpointFailureReason]] = field(default_factory=list)
    in_flight: Dict[int, List[Tuple[int, Any]]] = field(default_factory=dict)
    finished: List[int] = field(default_factory=list)

    def trigger_checkpoint_on_barrier(self, barrier: CheckpointBarrier, metrics: CheckpointMetrics) -> None:
        self.triggered.append((barrier, metrics))
        self.log.append(("trigger", barrier.checkpoint_id))

    def abort_checkpoint_on_barrier(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        self.aborted.append((checkpoint_id, reason))
        self.log.append(("abort", checkpoint_id, reason))

    def add_input_data(self, checkpoint_id: int, channel: int, buffer: Any) -> None:
        self.in_flight.setdefault(checkpoint_id, []).append((channel, buffer))
        self.log.append(("input", checkpoint_id, channel, buffer))

    def finish_input(self, checkpoint_id: int) -> None:
        self.finished.append(checkpoint_id)
        self.log.append(("finish", checkpoint_id))

    @property
    def triggered_ids(self) -> List[int]:
        return [barrier.checkpoint_id for barrier, _ in self.triggered]

    @property
    def aborted_ids(self) -> List[int]:
        return [checkpoint_id for checkpoint_id, _ in self.aborted]


class ManualClock:
    """A clock in nanoseconds that only moves when told to, for the gate's
    ``clock`` argument: alignment times and timeouts become exact."""

    def __init__(self, start_ns: int = 1_700_000_000_000_000_000) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, ns: int) -> None:
        self.now_ns += ns

    @property
    def now_ms(self) -> int:
        return self.now_ns // 1_000_000
