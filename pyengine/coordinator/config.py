"""Checkpointing settings, validated where they are made: a bad value fails at
``StreamEnvironment(...)`` with the setting's name, not minutes into a job."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from ..errors import suggest_keywords

__all__ = ["CheckpointConfig", "DEFAULT_MAX_RECOVERY_S", "MODES"]

MODES = ("exactly_once", "at_least_once")
DEFAULT_MAX_RECOVERY_S = 30.0  # the goal of interval_ms="auto" when none is given


def _int(name: str, value: object, minimum: int) -> None:
    if type(value) is bool or not isinstance(value, int):
        raise TypeError(f"CheckpointConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"CheckpointConfig.{name} must be >= {minimum}, got {value}")


@suggest_keywords  # an unknown keyword says "did you mean"
@dataclass(frozen=True)
class CheckpointConfig:
    """Flink's checkpoint settings, under Flink's names in snake case.

    ``interval_ms``: how often the coordinator starts a checkpoint; ``timeout_ms``:
    when a pending checkpoint expires; ``min_pause_ms``: the least time from the
    end of one checkpoint to the start of the next; ``max_concurrent``: pending
    checkpoints at once (savepoints do not count); ``tolerable_failures``: failed
    checkpoints in a row before the job fails over; ``retained``: completed
    checkpoints kept. ``unaligned`` needs ``mode="exactly_once"``;
    ``aligned_timeout_ms`` > 0 starts aligned and switches to unaligned after it.

    ``interval_ms="auto"`` chooses the interval, and keeps adjusting it, from a
    recovery-time goal: ``max_recovery_s`` (default ``DEFAULT_MAX_RECOVERY_S``, 30 s)
    bounds the estimated restore time plus the replay of what one interval brings in,
    with the longest interval that does (the least checkpointing), never shorter than
    twice the checkpoints' measured duration (see ``pyengine.coordinator.interval``
    for the rule and why). ``max_recovery_s`` is refused with a fixed interval.

    ``interval_during_backlog_ms`` (Flink's ``execution.checkpointing.interval-during-
    backlog``): the interval while any source reports that it is processing a backlog
    (catching up), usually longer, since a job catching up gains more from throughput
    than from frequent commits; 0 takes no periodic checkpoints during a backlog;
    None (the default) keeps the regular interval."""

    interval_ms: Union[int, str] = 500
    mode: str = "exactly_once"
    unaligned: bool = False
    aligned_timeout_ms: int = 0
    timeout_ms: int = 600_000
    min_pause_ms: int = 0
    max_concurrent: int = 1
    tolerable_failures: int = 0
    retained: int = 1
    max_recovery_s: Optional[float] = None
    interval_during_backlog_ms: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.interval_ms, str):
            if self.interval_ms != "auto":
                raise ValueError(
                    f"CheckpointConfig.interval_ms must be an int >= 1 or 'auto', got {self.interval_ms!r}"
                )
        else:
            _int("interval_ms", self.interval_ms, 1)
        if self.max_recovery_s is not None:
            goal = self.max_recovery_s
            if type(goal) is bool or not isinstance(goal, (int, float)):
                raise TypeError(f"CheckpointConfig.max_recovery_s must be a number of seconds, got {goal!r}")
            if not math.isfinite(goal) or goal <= 0:
                raise ValueError(f"CheckpointConfig.max_recovery_s must be a positive number of seconds, got {goal}")
            if self.interval_ms != "auto":
                raise ValueError(
                    "CheckpointConfig.max_recovery_s is the goal of interval_ms='auto'; with a fixed "
                    f"interval_ms={self.interval_ms} it would be ignored: set interval_ms='auto' or drop it"
                )
        if self.interval_during_backlog_ms is not None:
            _int("interval_during_backlog_ms", self.interval_during_backlog_ms, 0)
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

    @property
    def auto_interval(self) -> bool:
        """The interval follows ``max_recovery_s`` (``interval_ms="auto"``)."""
        return self.interval_ms == "auto"

    @property
    def recovery_goal_s(self) -> float:
        """The goal of ``interval_ms="auto"``: ``max_recovery_s`` or the default."""
        return float(self.max_recovery_s) if self.max_recovery_s is not None else DEFAULT_MAX_RECOVERY_S
