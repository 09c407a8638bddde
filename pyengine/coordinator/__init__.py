"""The checkpoint coordinator: when checkpoints start, when they complete, and
what happens when they fail. Flink's names and rules."""

from __future__ import annotations

from .config import CheckpointConfig
from .coordinator import (
    AckResult,
    CheckpointCoordinator,
    CheckpointException,
    ExecutionAttempt,
    IllegalCheckpointStateError,
    JobGateway,
    PendingCheckpoint,
    TaskStateSnapshot,
)
from .stats import CheckpointStats, CheckpointStatsTracker, SubtaskCheckpointStats, SubtaskMetrics
from .timers import ManualTimerService, ThreadTimerService, TimerService

__all__ = [
    "AckResult",
    "CheckpointConfig",
    "CheckpointCoordinator",
    "CheckpointException",
    "CheckpointStats",
    "CheckpointStatsTracker",
    "ExecutionAttempt",
    "IllegalCheckpointStateError",
    "JobGateway",
    "ManualTimerService",
    "PendingCheckpoint",
    "SubtaskCheckpointStats",
    "SubtaskMetrics",
    "TaskStateSnapshot",
    "ThreadTimerService",
    "TimerService",
]
