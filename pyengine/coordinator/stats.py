"""Checkpoint statistics, shaped as Flink's REST API shapes them
(``/jobs/:id/checkpoints``): counts, a summary, the latest checkpoints and a
bounded history with per-subtask detail."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

__all__ = ["CheckpointStats", "CheckpointStatsTracker", "SubtaskCheckpointStats", "SubtaskMetrics"]


@dataclass
class SubtaskMetrics:
    """What a subtask reports with its acknowledgement."""

    sync_duration_ms: float = 0.0
    async_duration_ms: float = 0.0
    alignment_duration_ms: float = 0.0
    start_delay_ms: float = 0.0
    unaligned: bool = False
    processed_data: int = 0  # bytes processed during alignment
    persisted_data: int = 0  # bytes of in-flight data persisted (unaligned)
    checkpointed_size: int = 0
    full_size: int = 0


@dataclass
class SubtaskCheckpointStats(SubtaskMetrics):
    subtask: str = ""
    ack_timestamp: int = 0


@dataclass
class CheckpointStats:
    id: int
    status: str  # IN_PROGRESS, COMPLETED, FAILED
    type: str  # checkpoint, savepoint
    trigger_timestamp: int
    num_subtasks: int
    latest_ack_timestamp: int = 0
    end_to_end_duration_ms: int = 0
    checkpointed_size: int = 0
    full_size: int = 0
    processed_data: int = 0
    persisted_data: int = 0
    alignment_duration_ms: float = 0.0
    external_path: Optional[str] = None
    failure_message: Optional[str] = None
    interval_ms: Optional[int] = None  # the periodic interval in use when it was triggered
    subtasks: Dict[str, SubtaskCheckpointStats] = field(default_factory=dict)

    @property
    def num_acknowledged(self) -> int:
        return len(self.subtasks)

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        out["num_acknowledged_subtasks"] = self.num_acknowledged
        return out


def _summary(values: List[float]) -> Dict[str, float]:
    if not values:
        return {"min": 0, "avg": 0, "max": 0, "p50": 0, "p90": 0, "p95": 0, "p99": 0, "p999": 0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]

    return {
        "min": ordered[0],
        "avg": sum(ordered) / len(ordered),
        "max": ordered[-1],
        "p50": pct(0.50),
        "p90": pct(0.90),
        "p95": pct(0.95),
        "p99": pct(0.99),
        "p999": pct(0.999),
    }


class CheckpointStatsTracker:
    """Statistics of one job across restarts. ``history_size`` bounds the history,
    as Flink's ``web.checkpoints.history``; the summary covers every completed one."""

    def __init__(self, history_size: int = 10) -> None:
        self.counts = {"triggered": 0, "in_progress": 0, "completed": 0, "failed": 0, "restored": 0}
        self._history: Deque[CheckpointStats] = deque(maxlen=history_size)
        self._live: Dict[int, CheckpointStats] = {}
        self._durations: List[float] = []
        self._checkpointed: List[float] = []
        self._full: List[float] = []
        self._alignment: List[float] = []
        self._processed: List[float] = []
        self._persisted: List[float] = []
        self._start_delay: List[float] = []
        self._live_start_delay: Dict[int, float] = {}
        # (id, trigger, completed) of every completed checkpoint, in ms since the epoch:
        # ``pyengine tune`` reads when output was committed from it (the history is bounded)
        self.timeline: List[Tuple[int, int, int]] = []
        self.latest_completed: Optional[CheckpointStats] = None
        self.latest_savepoint: Optional[CheckpointStats] = None
        self.latest_failed: Optional[CheckpointStats] = None
        self.latest_restored: Optional[Dict[str, Any]] = None
        # The periodic interval in use and, with interval_ms="auto", why (the coordinator
        # keeps it current): mode, interval_ms (None: none during a backlog),
        # base_interval_ms, backlog, interval_during_backlog_ms, max_recovery_s, estimate.
        self.interval: Dict[str, Any] = {}
        # (when, interval_ms) at every change of the interval in use
        self.interval_changes: List[Tuple[int, Optional[int]]] = []

    def report_interval(self, info: Dict[str, Any], now: int = 0) -> None:
        if not self.interval_changes or self.interval_changes[-1][1] != info.get("interval_ms"):
            self.interval_changes.append((now, info.get("interval_ms")))
            del self.interval_changes[:-1000]
        self.interval = info

    def report_pending(
        self, checkpoint_id: int, timestamp: int, type_: str, num_subtasks: int, interval_ms: Optional[int] = None
    ) -> CheckpointStats:
        stats = CheckpointStats(checkpoint_id, "IN_PROGRESS", type_, timestamp, num_subtasks, interval_ms=interval_ms)
        self._live[checkpoint_id] = stats
        self._history.appendleft(stats)
        self.counts["triggered"] += 1
        self.counts["in_progress"] += 1
        return stats

    def report_ack(self, checkpoint_id: int, subtask: str, metrics: SubtaskMetrics, now: int) -> None:
        stats = self._live.get(checkpoint_id)
        if stats is None:
            return
        sub = SubtaskCheckpointStats(**asdict(metrics), subtask=subtask, ack_timestamp=now)
        stats.subtasks[subtask] = sub
        stats.latest_ack_timestamp = max(stats.latest_ack_timestamp, now)
        stats.checkpointed_size += metrics.checkpointed_size
        stats.full_size += metrics.full_size
        stats.processed_data += metrics.processed_data
        stats.persisted_data += metrics.persisted_data
        stats.alignment_duration_ms = max(stats.alignment_duration_ms, metrics.alignment_duration_ms)
        # a checkpoint waits for its slowest subtask: its start delay is the largest one
        delay = self._live_start_delay.get(checkpoint_id, 0.0)
        self._live_start_delay[checkpoint_id] = max(delay, metrics.start_delay_ms)

    def report_completed(self, checkpoint_id: int, now: int, external_path: str) -> None:
        stats = self._live.pop(checkpoint_id, None)
        start_delay = self._live_start_delay.pop(checkpoint_id, 0.0)
        if stats is None:
            return
        stats.status = "COMPLETED"
        stats.external_path = external_path
        stats.end_to_end_duration_ms = max(0, now - stats.trigger_timestamp)
        self.counts["in_progress"] -= 1
        self.counts["completed"] += 1
        self._durations.append(stats.end_to_end_duration_ms)
        self._checkpointed.append(stats.checkpointed_size)
        self._full.append(stats.full_size)
        self._alignment.append(stats.alignment_duration_ms)
        self._processed.append(stats.processed_data)
        self._persisted.append(stats.persisted_data)
        self._start_delay.append(start_delay)
        self.timeline.append((checkpoint_id, stats.trigger_timestamp, now))
        if stats.type == "checkpoint":
            self.latest_completed = stats
        else:
            self.latest_savepoint = stats

    def report_failed(self, checkpoint_id: int, now: int, message: str) -> None:
        stats = self._live.pop(checkpoint_id, None)
        self._live_start_delay.pop(checkpoint_id, None)
        if stats is None:
            return
        stats.status = "FAILED"
        stats.failure_message = message
        stats.end_to_end_duration_ms = max(0, now - stats.trigger_timestamp)
        self.counts["in_progress"] -= 1
        self.counts["failed"] += 1
        self.latest_failed = stats

    def report_restored(self, checkpoint_id: int, now: int, external_path: str, is_savepoint: bool) -> None:
        self.counts["restored"] += 1
        self.latest_restored = {
            "id": checkpoint_id,
            "restore_timestamp": now,
            "is_savepoint": is_savepoint,
            "external_path": external_path,
        }

    @property
    def history(self) -> List[CheckpointStats]:
        """Newest first."""
        return list(self._history)

    def summary(self) -> Dict[str, Dict[str, float]]:
        return {
            "end_to_end_duration_ms": _summary(self._durations),
            "checkpointed_size": _summary(self._checkpointed),
            "full_size": _summary(self._full),
            "alignment_duration_ms": _summary(self._alignment),
            "processed_data": _summary(self._processed),
            "persisted_data": _summary(self._persisted),
            "start_delay_ms": _summary(self._start_delay),
        }

    def to_json(self) -> Dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "interval": dict(self.interval),
            "summary": self.summary(),
            "latest": {
                "completed": self.latest_completed.to_json() if self.latest_completed else None,
                "savepoint": self.latest_savepoint.to_json() if self.latest_savepoint else None,
                "failed": self.latest_failed.to_json() if self.latest_failed else None,
                "restored": self.latest_restored,
            },
            "history": [s.to_json() for s in self._history],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, default=str)
