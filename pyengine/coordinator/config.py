"""Checkpointing settings, validated where they are made: a bad value fails at
``StreamEnvironment(...)`` with the setting's name, not minutes into a job."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CheckpointConfig", "MODES"]

MODES = ("exactly_once", "at_least_once")


def _int(name: str, value: object, minimum: int) -> None:
    if type(value) is bool or not isinstance(value, int):
        raise TypeError(f"CheckpointConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"CheckpointConfig.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Flink's checkpoint settings, under Flink's names in snake case.

    ``interval_ms``: how often the coordinator starts a checkpoint; ``timeout_ms``:
    when a pending checkpoint expires; ``min_pause_ms``: the least time from the
    end of one checkpoint to the start of the next; ``max_concurrent``: pending
    checkpoints at once (savepoints do not count); ``tolerable_failures``: failed
    checkpoints in a row before the job fails over; ``retained``: completed
    checkpoints kept. ``unaligned`` needs ``mode="exactly_once"``;
    ``aligned_timeout_ms`` > 0 starts aligned and switches to unaligned after it."""

    interval_ms: int = 500
    mode: str = "exactly_once"
    unaligned: bool = False
    aligned_timeout_ms: int = 0
    timeout_ms: int = 600_000
    min_pause_ms: int = 0
    max_concurrent: int = 1
    tolerable_failures: int = 0
    retained: int = 1

    def __post_init__(self) -> None:
        _int("interval_ms", self.interval_ms, 1)
        if self.mode not in MODES:
            raise ValueError(f"CheckpointConfig.mode must be 'exactly_once' or 'at_least_once', got {self.mode!r}")
        if not isinstance(self.unaligned, bool):
            raise TypeError(f"CheckpointConfig.unaligned must be a bool, got {self.unaligned!r}")
        if self.unaligned and self.mode != "exactly_once":
            raise ValueError("CheckpointConfig.unaligned=True needs mode='exactly_once' (at-least-once never aligns)")
        _int("aligned_timeout_ms", self.aligned_timeout_ms, 0)
        if self.aligned_timeout_ms > 0 and not self.unaligned:
            raise ValueError("CheckpointConfig.aligned_timeout_ms > 0 needs unaligned=True")
        _int("timeout_ms", self.timeout_ms, 1)
        _int("min_pause_ms", self.min_pause_ms, 0)
        _int("max_concurrent", self.max_concurrent, 1)
        _int("tolerable_failures", self.tolerable_failures, 0)
        _int("retained", self.retained, 1)

    @property
    def exactly_once(self) -> bool:
        return self.mode == "exactly_once"
