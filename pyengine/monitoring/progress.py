"""``/jobs/:id/progress``: the job's last interval shaped as Spark's
``StreamingQueryProgress``, because PySpark users already read ``lastProgress``.

A pyengine job has no micro-batches; the nearest thing, as in Spark's continuous
processing, is the checkpoint epoch: ``batchId`` is the latest completed
checkpoint, and one "trigger" is one sampling interval of the monitor. So:

- ``numInputRows`` / ``inputRowsPerSecond``: rows the sources read in the interval;
- ``processedRowsPerSecond``: rows that reached the last vertex (the sink) per second;
- ``durationMs``: ``triggerExecution`` is the interval; ``walCommit`` the latest
  completed checkpoint's end-to-end duration (it commits state and source
  positions), with its parts (``checkpointStartDelay``, ``checkpointAlignment``,
  ``checkpointSync``, ``checkpointAsync``: the slowest subtask's);
- ``eventTime.watermark``: the job's event time, as Flink's rules make it: the
  watermark that reached the last vertex, the minimum over its running subtasks
  that are not idle (``metrics.job_watermark``), so an idle split's old watermark
  does not hold it back (it holds back no window either);
- ``stateOperators``: per stateful operator, its keyed state entries
  (``numRowsTotal``), the rows that reached it in the interval
  (``numRowsUpdated``), the records it dropped as too late in the interval
  (``numRowsDroppedByWatermark``, per trigger as in Spark; the job's total so far,
  Flink's ``numLateRecordsDropped``, is in its ``customMetrics``), and its state's
  size in the latest completed checkpoint (``memoryUsedBytes``, as the state is
  held in memory by both backends)."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .metrics import job_watermark
from .rest import subtask_key

if TYPE_CHECKING:
    from .metrics import JobSample
    from .monitor import JobMonitor

__all__ = ["iso_time", "streaming_query_progress"]


def iso_time(ms: int) -> str:
    """Spark's timestamp format: ``2024-01-31T12:00:00.000Z``."""
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _rate(rows: int, duration_ms: float) -> float:
    return rows * 1000.0 / duration_ms if duration_ms > 0 else 0.0


def _latest_parts(stats: Any) -> Dict[str, int]:
    subtasks = list(dict(stats.subtasks).values()) if stats is not None else []

    def slowest(name: str) -> int:
        return round(max((float(getattr(s, name)) for s in subtasks), default=0.0))

    return {
        "checkpointStartDelay": slowest("start_delay_ms"),
        "checkpointAlignment": slowest("alignment_duration_ms"),
        "checkpointSync": slowest("sync_duration_ms"),
        "checkpointAsync": slowest("async_duration_ms"),
    }


def streaming_query_progress(monitor: JobMonitor, sample: JobSample) -> Dict[str, Any]:
    """One ``StreamingQueryProgress`` (see the module's docstring for what each field means here)."""
    vertices = monitor.vertices()
    tracker = monitor.tracker()
    latest = tracker.latest_completed
    first, last = (vertices[0], vertices[-1]) if vertices else (None, None)
    duration = sample.duration_ms
    read = sample.vertex_in.get(first.id, 0) if first is not None else 0
    reached = sample.vertex_in.get(last.id, 0) if last is not None else 0
    input_rate = _rate(read, duration)

    sizes: Dict[str, int] = {}
    if latest is not None:
        for key, sub in dict(latest.subtasks).items():
            vid = subtask_key(key)[0]
            sizes[vid] = sizes.get(vid, 0) + int(sub.full_size)

    state_operators: List[Dict[str, Any]] = []
    for v in vertices:
        subs = [s for (vid, _), s in sample.subtasks.items() if vid == v.id]
        stateful = []
        for uid, name in v.operators:
            ops = [o for s in subs for o in s.operators if o.get("uid") == uid]
            rows = [o["state_rows"] for o in ops if isinstance(o.get("state_rows"), int)]
            if rows:
                late = sum(int(o.get("late_records_dropped") or 0) for o in ops)
                late_now = sum(int(o.get("late_in_interval") or 0) for o in ops)
                stateful.append((uid, name, sum(rows), late, late_now))
        for uid, name, total, late, late_now in stateful:
            state_operators.append(
                {
                    "operatorName": name,
                    "numRowsTotal": total,
                    "numRowsUpdated": sample.vertex_in.get(v.id, 0),
                    "allUpdatesTimeMs": -1,
                    "numRowsRemoved": -1,
                    "allRemovalsTimeMs": -1,
                    "commitTimeMs": -1,
                    "memoryUsedBytes": sizes.get(v.id, 0) if len(stateful) == 1 else -1,
                    "numRowsDroppedByWatermark": late_now,
                    "numShufflePartitions": v.parallelism,
                    "numStateStoreInstances": v.parallelism,
                    "customMetrics": {
                        "operatorUid": uid,
                        "vertex": v.id,
                        "maxParallelism": v.max_parallelism,
                        "numLateRecordsDropped": late,
                    },
                }
            )

    watermark = job_watermark(sample, last.id) if last is not None else None
    event_time: Dict[str, str] = {}
    if watermark is not None:
        event_time["watermark"] = iso_time(watermark)

    duration_ms: Dict[str, int] = {"triggerExecution": round(duration)}
    if latest is not None:
        duration_ms["walCommit"] = round(float(latest.end_to_end_duration_ms))
        duration_ms.update(_latest_parts(latest))

    sink_name = type(getattr(monitor.job.graph, "sink", None)).__name__
    run_info = getattr(monitor.job, "run_info", None)
    lineage = getattr(run_info, "lineage_id", None)
    source: Optional[Dict[str, Any]] = None
    if first is not None:
        source = {
            "description": first.operators[0][1] if first.operators else first.name,
            "startOffset": None,
            "endOffset": None,
            "latestOffset": None,
            "numInputRows": read,
            "inputRowsPerSecond": input_rate,
            "processedRowsPerSecond": input_rate,
            "metrics": {},
        }
    return {
        "id": str(lineage or monitor.job_id),
        "runId": monitor.job_id,
        "name": monitor.name,
        "timestamp": iso_time(sample.timestamp_ms),
        "batchId": int(latest.id) if latest is not None else -1,
        "batchDuration": round(duration),
        "numInputRows": read,
        "inputRowsPerSecond": input_rate,
        "processedRowsPerSecond": _rate(reached, duration),
        "durationMs": duration_ms,
        "eventTime": event_time,
        "stateOperators": state_operators,
        "sources": [source] if source is not None else [],
        "sink": {"description": sink_name, "numOutputRows": reached, "metrics": {}},
        "observedMetrics": {},
        # pyengine's own, beside Spark's: the job's state and restarts so far, and the
        # checkpoint interval in use (with interval_ms="auto", the one the goal chose)
        "status": monitor.state(),
        "restarts": monitor.restarts,
        "checkpointIntervalMs": (getattr(tracker, "interval", None) or {}).get("interval_ms"),
    }
