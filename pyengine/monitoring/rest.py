"""The JSON of Flink's REST API, built from a job's ``CheckpointStatsTracker``.

Paths and field names are Flink's (``/jobs/:jobid/checkpoints`` and below, as in
Flink's ``CheckpointingStatistics``, ``CheckpointStatistics``,
``TaskCheckpointStatisticsWithSubtaskDetails``, ``CheckpointConfigInfo``,
``JobDetailsInfo`` and ``JobVertexBackPressureInfo``), so Flink's tooling and a
Flink user's habits carry over. Where Flink names a vertex by a 32-hex id,
pyengine uses its vertex names (``v0``, ``v1``, ...). Durations are whole
milliseconds and sizes bytes, as in Flink.

Everything here reads the tracker without its coordinator's lock: the coordinator
must never wait for a monitoring request, so each checkpoint's mutable parts
(its subtask map) are copied first, in one step the GIL makes atomic."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "PERCENTILES",
    "VertexInfo",
    "backpressure_level",
    "checkpoint_config",
    "checkpoint_statistics",
    "checkpointing_statistics",
    "find_checkpoint",
    "stats_summary",
    "subtask_key",
    "task_checkpoint_details",
]

# Flink's StatsSummaryDto: min/max/avg (whole numbers) and these quantiles.
PERCENTILES = (("p50", 0.50), ("p90", 0.90), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999))

# The tracker's summary keys, as Flink's summary names them.
_SUMMARY_KEYS = (
    ("end_to_end_duration", "end_to_end_duration_ms"),
    ("checkpointed_size", "checkpointed_size"),
    ("state_size", "full_size"),
    ("processed_data", "processed_data"),
    ("persisted_data", "persisted_data"),
)


@dataclass(frozen=True)
class VertexInfo:
    """One vertex of the job graph as the REST API shows it: its id (``v0``...), a
    Flink-style name of its chained operators, its parallelism and how records reach it."""

    id: str
    name: str
    parallelism: int
    max_parallelism: int
    exchange: str = "forward"
    operators: Tuple[Tuple[str, str], ...] = field(default=())  # (uid, name)


def subtask_key(key: str) -> Tuple[str, int]:
    """``"v1#3"`` (how the coordinator names an acknowledging subtask) as ``("v1", 3)``."""
    vertex, _, index = key.rpartition("#")
    try:
        return vertex, int(index)
    except ValueError:
        return key, -1


def _ms(value: Any) -> int:
    return round(float(value or 0))


def _percentile(ordered: Sequence[float], p: float) -> float:
    """The tracker's own rule (nearest rank), so both agree on every value."""
    return float(ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))])


def stats_summary(values: Iterable[float]) -> Dict[str, Any]:
    """Flink's ``StatsSummaryDto`` of ``values`` (all zeros when there are none)."""
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return {"min": 0, "max": 0, "avg": 0, **{name: 0.0 for name, _ in PERCENTILES}}
    return {
        "min": _ms(ordered[0]),
        "max": _ms(ordered[-1]),
        "avg": _ms(sum(ordered) / len(ordered)),
        **{name: _percentile(ordered, p) for name, p in PERCENTILES},
    }


def _from_tracker(entry: Any) -> Optional[Dict[str, Any]]:
    """A tracker summary entry as a ``StatsSummaryDto``, if it has every quantile."""
    if not isinstance(entry, dict) or any(name not in entry for name, _ in PERCENTILES):
        return None
    return {
        "min": _ms(entry["min"]),
        "max": _ms(entry["max"]),
        "avg": _ms(entry["avg"]),
        **{name: float(entry[name]) for name, _ in PERCENTILES},
    }


def _latest_ack(subtasks: Dict[str, Any]) -> int:
    return max((int(s.ack_timestamp) for s in subtasks.values()), default=0)


def checkpoint_type(stats: Any, unaligned_by_config: bool = False) -> str:
    """Flink's ``RestAPICheckpointType``: SAVEPOINT, UNALIGNED_CHECKPOINT or CHECKPOINT;
    unaligned when any subtask took it unaligned (before any has acknowledged, as configured)."""
    if stats.type == "savepoint":
        return "SAVEPOINT"
    subtasks = dict(stats.subtasks)
    if subtasks:
        return "UNALIGNED_CHECKPOINT" if any(s.unaligned for s in subtasks.values()) else "CHECKPOINT"
    return "UNALIGNED_CHECKPOINT" if unaligned_by_config else "CHECKPOINT"


def _duration(stats: Any, subtasks: Dict[str, Any]) -> int:
    if stats.status == "IN_PROGRESS":  # as Flink: up to the latest acknowledgement so far
        latest = _latest_ack(subtasks)
        return max(0, latest - int(stats.trigger_timestamp)) if latest else 0
    return _ms(stats.end_to_end_duration_ms)


def _task_statistics(stats: Any, vertex: VertexInfo, subtasks: Dict[str, Any]) -> Dict[str, Any]:
    """Flink's ``TaskCheckpointStatistics``: one vertex's part of one checkpoint."""
    mine = [s for k, s in subtasks.items() if subtask_key(k)[0] == vertex.id]
    latest = max((int(s.ack_timestamp) for s in mine), default=0)
    return {
        "id": int(stats.id),
        "status": stats.status,
        "latest_ack_timestamp": latest,
        "checkpointed_size": sum(int(s.checkpointed_size) for s in mine),
        "state_size": sum(int(s.full_size) for s in mine),
        "end_to_end_duration": max(0, latest - int(stats.trigger_timestamp)) if latest else 0,
        "alignment_buffered": 0,  # as in Flink since 1.11: alignment no longer buffers
        "processed_data": sum(int(s.processed_data) for s in mine),
        "persisted_data": sum(int(s.persisted_data) for s in mine),
        "num_subtasks": vertex.parallelism,
        "num_acknowledged_subtasks": len(mine),
    }


def checkpoint_statistics(
    stats: Any,
    vertices: Sequence[VertexInfo],
    *,
    unaligned_by_config: bool = False,
    retained_ids: Optional[Iterable[int]] = None,
    include_tasks: bool = True,
) -> Dict[str, Any]:
    """Flink's ``CheckpointStatistics`` (completed, failed or in progress) of one
    ``CheckpointStats``, with ``tasks`` per vertex."""
    subtasks = dict(stats.subtasks)
    status = stats.status
    out: Dict[str, Any] = {
        "className": {"COMPLETED": "completed", "FAILED": "failed"}.get(status, "in_progress"),
        "id": int(stats.id),
        "status": status,
        "is_savepoint": stats.type == "savepoint",
        "trigger_timestamp": int(stats.trigger_timestamp),
        "latest_ack_timestamp": _latest_ack(subtasks),
        "checkpointed_size": sum(int(s.checkpointed_size) for s in subtasks.values()),
        "state_size": sum(int(s.full_size) for s in subtasks.values()),
        "end_to_end_duration": _duration(stats, subtasks),
        "alignment_buffered": 0,
        "processed_data": sum(int(s.processed_data) for s in subtasks.values()),
        "persisted_data": sum(int(s.persisted_data) for s in subtasks.values()),
        "num_subtasks": int(stats.num_subtasks),
        "num_acknowledged_subtasks": len(subtasks),
        "checkpoint_type": checkpoint_type(stats, unaligned_by_config),
        "tasks": {v.id: _task_statistics(stats, v, subtasks) for v in vertices} if include_tasks else {},
    }
    if stats.type == "savepoint":
        out["savepointFormat"] = "CANONICAL"
    if status == "COMPLETED":
        out["external_path"] = stats.external_path
        retained = None if retained_ids is None else set(retained_ids)
        out["discarded"] = bool(retained is not None and stats.type != "savepoint" and stats.id not in retained)
    elif status == "FAILED":
        out["failure_timestamp"] = int(stats.trigger_timestamp) + _ms(stats.end_to_end_duration_ms)
        out["failure_message"] = stats.failure_message
    return out


_RECORDED: weakref.WeakKeyDictionary[Any, Tuple[Hashable, Dict[str, Any]]] = weakref.WeakKeyDictionary()
_RECORDED_LOCK = threading.Lock()


def _recorded_summary(tracker: Any) -> Dict[str, Any]:
    """The tracker's all-time summary, worked out again only when a checkpoint
    completed since the last time. It sorts every completed checkpoint's values (a
    day of checkpoints every second is 86,400 of each), with the GIL held: done on
    every request, it would take a long-running job's time as its history grows.
    The key is read from what ``report_completed`` sets last, so a summary read
    while a completion is half recorded is not kept under the new count."""
    key = (
        dict(tracker.counts).get("completed", 0),
        id(getattr(tracker, "latest_completed", None)),
        id(getattr(tracker, "latest_savepoint", None)),
    )
    try:
        with _RECORDED_LOCK:
            kept = _RECORDED.get(tracker)
    except TypeError:  # a tracker that takes no weak reference: not kept
        kept = None
    if kept is not None and kept[0] == key:
        return kept[1]
    try:
        recorded = dict(tracker.summary())
    except RuntimeError:  # a list grew under sorted(): the history's values serve
        return {}
    try:
        with _RECORDED_LOCK:
            _RECORDED[tracker] = (key, recorded)
    except TypeError:
        pass
    return recorded


def _summary(tracker: Any, completed: List[Any]) -> Dict[str, Any]:
    """Flink's summary over every completed checkpoint: from the tracker's own
    (all-time) summary where it has every quantile, else from the completed
    checkpoints still in the history."""
    recorded = _recorded_summary(tracker)
    out: Dict[str, Any] = {}
    for flink_key, tracker_key in _SUMMARY_KEYS:
        dto = _from_tracker(recorded.get(tracker_key))
        if dto is None:
            dto = stats_summary(getattr(s, tracker_key) for s in completed)
        out[flink_key] = dto
    out["alignment_buffered"] = stats_summary([0 for _ in completed])
    return out


def checkpointing_statistics(
    tracker: Any,
    vertices: Sequence[VertexInfo],
    *,
    unaligned_by_config: bool = False,
    retained_ids: Optional[Iterable[int]] = None,
) -> Dict[str, Any]:
    """Flink's ``CheckpointingStatistics``: ``/jobs/:jobid/checkpoints``."""
    counts = dict(tracker.counts)
    history = list(tracker.history)
    retained = None if retained_ids is None else set(retained_ids)

    def one(stats: Any) -> Optional[Dict[str, Any]]:
        if stats is None:
            return None
        return checkpoint_statistics(stats, vertices, unaligned_by_config=unaligned_by_config, retained_ids=retained)

    restored = tracker.latest_restored
    return {
        "counts": {
            "restored": int(counts.get("restored", 0)),
            "total": int(counts.get("triggered", 0)),
            "in_progress": int(counts.get("in_progress", 0)),
            "completed": int(counts.get("completed", 0)),
            "failed": int(counts.get("failed", 0)),
        },
        "summary": _summary(tracker, [s for s in history if s.status == "COMPLETED"]),
        "latest": {
            "completed": one(tracker.latest_completed),
            "savepoint": one(tracker.latest_savepoint),
            "failed": one(tracker.latest_failed),
            "restored": None
            if restored is None
            else {
                "id": int(restored["id"]),
                "restore_timestamp": int(restored["restore_timestamp"]),
                "is_savepoint": bool(restored["is_savepoint"]),
                "external_path": restored["external_path"],
            },
        },
        "history": [one(s) for s in history],
    }


def find_checkpoint(tracker: Any, checkpoint_id: int) -> Any:
    """A checkpoint's statistics by id: in the history, or one of the latest ones
    (which outlive the history); None when the tracker no longer has it."""
    for stats in list(tracker.history):
        if stats.id == checkpoint_id:
            return stats
    for stats in (tracker.latest_completed, tracker.latest_savepoint, tracker.latest_failed):
        if stats is not None and stats.id == checkpoint_id:
            return stats
    return None


def _subtask_row(stats: Any, index: int, sub: Any) -> Dict[str, Any]:
    if sub is None:
        return {"index": index, "status": "pending_or_failed"}
    return {
        "index": index,
        "status": "completed",
        "ack_timestamp": int(sub.ack_timestamp),
        "end_to_end_duration": max(0, int(sub.ack_timestamp) - int(stats.trigger_timestamp)),
        "checkpointed_size": int(sub.checkpointed_size),
        "state_size": int(sub.full_size),
        "checkpoint": {"sync": _ms(sub.sync_duration_ms), "async": _ms(sub.async_duration_ms)},
        "alignment": {
            "buffered": 0,
            "processed": int(sub.processed_data),
            "persisted": int(sub.persisted_data),
            "duration": _ms(sub.alignment_duration_ms),
        },
        "start_delay": _ms(sub.start_delay_ms),
        "unaligned_checkpoint": bool(sub.unaligned),
        "aborted": False,
    }


def task_checkpoint_details(stats: Any, vertex: VertexInfo) -> Dict[str, Any]:
    """Flink's ``TaskCheckpointStatisticsWithSubtaskDetails``:
    ``/jobs/:jobid/checkpoints/details/:checkpointid/subtasks/:vertexid``."""
    subtasks = dict(stats.subtasks)
    by_index = {subtask_key(k)[1]: s for k, s in subtasks.items() if subtask_key(k)[0] == vertex.id}
    acked = [by_index[i] for i in sorted(by_index)]
    trigger = int(stats.trigger_timestamp)
    out = _task_statistics(stats, vertex, subtasks)
    out["summary"] = {
        "checkpointed_size": stats_summary(s.checkpointed_size for s in acked),
        "state_size": stats_summary(s.full_size for s in acked),
        "end_to_end_duration": stats_summary(max(0, int(s.ack_timestamp) - trigger) for s in acked),
        "checkpoint_duration": {
            "sync": stats_summary(s.sync_duration_ms for s in acked),
            "async": stats_summary(s.async_duration_ms for s in acked),
        },
        "alignment": {
            "buffered": stats_summary(0 for _ in acked),
            "processed": stats_summary(s.processed_data for s in acked),
            "persisted": stats_summary(s.persisted_data for s in acked),
            "duration": stats_summary(s.alignment_duration_ms for s in acked),
        },
        "start_delay": stats_summary(s.start_delay_ms for s in acked),
    }
    out["subtasks"] = [_subtask_row(stats, i, by_index.get(i)) for i in range(vertex.parallelism)]
    return out


def checkpoint_config(
    config: Any, *, state_backend: str, checkpoint_storage: str, interval: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """Flink's ``CheckpointConfigInfo``: ``/jobs/:jobid/checkpoints/config``.

    ``interval``: the coordinator's interval in use (``CheckpointStatsTracker.interval``);
    with ``interval_ms="auto"`` the configured value is not a number, and ``interval``
    is the one chosen now (0 while a backlog takes no checkpoints), as Flink reports the
    backlog interval in force."""
    current = (interval or {}).get("interval_ms", config.interval_ms) if interval else config.interval_ms
    out = _checkpoint_config(config, state_backend=state_backend, checkpoint_storage=checkpoint_storage)
    out["interval"] = int(current) if isinstance(current, int) else 0
    if interval:
        # pyengine's own: "fixed" or "auto", the goal, the backlog state and the estimate
        out["interval_info"] = dict(interval)
    return out


def _checkpoint_config(config: Any, *, state_backend: str, checkpoint_storage: str) -> Dict[str, Any]:
    return {
        "mode": "exactly_once" if config.mode == "exactly_once" else "at_least_once",
        "interval": config.interval_ms if isinstance(config.interval_ms, int) else 0,
        "timeout": int(config.timeout_ms),
        "min_pause": int(config.min_pause_ms),
        "max_concurrent": int(config.max_concurrent),
        "externalization": {"enabled": True, "delete_on_cancellation": False},
        "state_backend": state_backend,
        "checkpoint_storage": checkpoint_storage,
        "unaligned_checkpoints": bool(config.unaligned),
        "tolerable_failed_checkpoints": int(config.tolerable_failures),
        "aligned_checkpoint_timeout": int(config.aligned_timeout_ms),
        "checkpoints_after_tasks_finish": True,
        "state_changelog_enabled": False,
        # pyengine's own: completed checkpoints kept (Flink's state.checkpoints.num-retained)
        "retained_checkpoints": int(config.retained),
    }


def backpressure_level(ratio: float) -> str:
    """Flink's levels: ok up to 10% of the time backpressured, low up to 50%, else high."""
    if ratio <= 0.10:
        return "ok"
    if ratio <= 0.50:
        return "low"
    return "high"
