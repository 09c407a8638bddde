"""``/metrics``: Prometheus exposition through ``prometheus_client``, under the
names Flink's Prometheus reporter gives the same metrics, so a Flink dashboard or
alert rule reads a pyengine job unchanged:

- ``flink_jobmanager_job_<name>`` (labels ``job_id``, ``job_name``) for the job's
  checkpoints: ``lastCheckpointDuration`` (ms), ``lastCheckpointSize`` (bytes
  written by the latest completed checkpoint), ``lastCheckpointFullSize`` (its full
  state), ``lastCompletedCheckpointId``, ``lastCheckpointCompletedTimestamp`` (ms
  since the epoch, FLINK-36344), ``lastCheckpointRestoreTimestamp``,
  ``lastCheckpointProcessedData``, ``lastCheckpointPersistedData``,
  ``numberOfCompletedCheckpoints``, ``numberOfFailedCheckpoints``,
  ``numberOfInProgressCheckpoints``, ``totalNumberOfCheckpoints``, ``numRestarts``
  and ``timeSinceLastCompletedCheckpoint`` (ms; the metric FLINK-34579 proposed,
  -1 before the first). Like Flink, values that do not exist yet are -1.
- ``flink_taskmanager_job_task_<name>`` (plus ``task_id``, ``task_name``,
  ``subtask_index``, ``task_attempt_num``) per subtask: ``numRecordsIn``,
  ``numRecordsOut``, ``numRecordsInPerSecond``, ``numRecordsOutPerSecond``,
  ``busyTimeMsPerSecond``, ``backPressuredTimeMsPerSecond``,
  ``idleTimeMsPerSecond``, ``accumulatedBusyTime``, ``accumulatedBackPressuredTime``,
  ``accumulatedIdleTime``, ``checkpointAlignmentTime`` and
  ``checkpointStartDelayNanos`` (ns, of the latest completed checkpoint),
  ``checkpointedStateSize`` (the subtask's state in it, bytes), and, for jobs with
  event time, ``currentInputWatermark``, ``currentOutputWatermark`` and
  ``watermarkLag`` (ms behind wall time).
- ``flink_taskmanager_job_task_operator_<name>`` (plus ``operator_id``,
  ``operator_name``) per operator and subtask: ``stateEntries`` (keyed state
  entries, stateful operators) and ``numLateRecordsDropped`` (records a window
  dropped as too late, checkpointed with it: a restore neither loses nor repeats
  the count; for keyed operators, and any other once it has dropped one).

Every value is read when Prometheus scrapes, from the monitor's latest sample and
the coordinator's statistics; nothing is registered in the process-wide registry,
so several jobs in one process never collide."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Tuple

from .rest import subtask_key

if TYPE_CHECKING:
    from .monitor import JobMonitor

__all__ = ["CONTENT_TYPE", "JobCollector", "exposition"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

JOB = "flink_jobmanager_job_"
TASK = "flink_taskmanager_job_task_"
OPERATOR = "flink_taskmanager_job_task_operator_"


class JobCollector:
    """A ``prometheus_client`` collector of one job (see the module's docstring)."""

    def __init__(self, monitor: JobMonitor) -> None:
        self.monitor = monitor

    def describe(self) -> List[Any]:
        return []  # unchecked collector: its metrics are known only when collected

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        m = self.monitor
        job_labels = ["job_id", "job_name"]
        job_values = [m.job_id, m.name]

        def job_gauge(name: str, doc: str, value: float) -> Any:
            family = GaugeMetricFamily(JOB + name, doc, labels=job_labels)
            family.add_metric(job_values, value)
            return family

        tracker = m.tracker()
        counts = dict(tracker.counts)
        latest = tracker.latest_completed
        restored = tracker.latest_restored
        now_ms = time.time() * 1000
        completed_at = (
            float(latest.trigger_timestamp) + float(latest.end_to_end_duration_ms) if latest is not None else -1.0
        )
        yield job_gauge("totalNumberOfCheckpoints", "Checkpoints triggered.", counts.get("triggered", 0))
        yield job_gauge("numberOfCompletedCheckpoints", "Completed checkpoints.", counts.get("completed", 0))
        yield job_gauge("numberOfFailedCheckpoints", "Failed checkpoints.", counts.get("failed", 0))
        yield job_gauge("numberOfInProgressCheckpoints", "Checkpoints in progress.", counts.get("in_progress", 0))
        subtasks = dict(latest.subtasks) if latest is not None else {}
        yield job_gauge(
            "lastCheckpointDuration",
            "End-to-end duration of the latest completed checkpoint (ms).",
            float(latest.end_to_end_duration_ms) if latest is not None else -1,
        )
        yield job_gauge(
            "lastCheckpointSize",
            "Bytes the latest completed checkpoint wrote (its incremental size).",
            sum(int(s.checkpointed_size) for s in subtasks.values()) if latest is not None else -1,
        )
        yield job_gauge(
            "lastCheckpointFullSize",
            "Full state size of the latest completed checkpoint (bytes).",
            sum(int(s.full_size) for s in subtasks.values()) if latest is not None else -1,
        )
        yield job_gauge(
            "lastCheckpointProcessedData",
            "Bytes processed during alignment by the latest completed checkpoint.",
            sum(int(s.processed_data) for s in subtasks.values()) if latest is not None else -1,
        )
        yield job_gauge(
            "lastCheckpointPersistedData",
            "In-flight bytes persisted by the latest completed checkpoint (unaligned).",
            sum(int(s.persisted_data) for s in subtasks.values()) if latest is not None else -1,
        )
        yield job_gauge(
            "lastCompletedCheckpointId", "Id of the latest completed checkpoint.", latest.id if latest else -1
        )
        yield job_gauge(
            "lastCheckpointCompletedTimestamp",
            "When the latest checkpoint completed (ms since the epoch).",
            completed_at,
        )
        yield job_gauge(
            "timeSinceLastCompletedCheckpoint",
            "Milliseconds since the latest checkpoint completed (-1 before the first).",
            max(0.0, now_ms - completed_at) if latest is not None else -1,
        )
        yield job_gauge(
            "lastCheckpointRestoreTimestamp",
            "When the job last restored a checkpoint (ms since the epoch).",
            float(restored["restore_timestamp"]) if restored else -1,
        )
        yield job_gauge("numRestarts", "Restarts of the job so far.", m.restarts)

        sample = m.latest()
        vertex_names = {v.id: v.name for v in m.vertices()}
        task_labels = [*job_labels, "task_id", "task_name", "subtask_index", "task_attempt_num"]
        families: Dict[str, Any] = {}

        def task_gauge(name: str, doc: str) -> Any:
            if name not in families:
                families[name] = GaugeMetricFamily(TASK + name, doc, labels=task_labels)
            return families[name]

        per_subtask: Dict[Tuple[str, int], Any] = {subtask_key(k): s for k, s in subtasks.items()}
        operator_family = GaugeMetricFamily(
            OPERATOR + "stateEntries",
            "Keyed state entries of a stateful operator's subtask.",
            labels=[*task_labels, "operator_id", "operator_name"],
        )
        late_family = GaugeMetricFamily(
            OPERATOR + "numLateRecordsDropped",
            "Records the operator's subtask dropped as too late (behind the watermark).",
            labels=[*task_labels, "operator_id", "operator_name"],
        )
        for (vid, index), s in sorted(sample.subtasks.items()):
            labels = [*job_values, vid, vertex_names.get(vid, vid), str(index), str(s.attempt)]
            task_gauge("numRecordsIn", "Records this subtask took in.").add_metric(labels, s.records_in)
            task_gauge("numRecordsOut", "Records this subtask sent on.").add_metric(labels, s.records_out)
            task_gauge("numRecordsInPerSecond", "Records in per second.").add_metric(labels, s.records_in_per_s)
            task_gauge("numRecordsOutPerSecond", "Records out per second.").add_metric(labels, s.records_out_per_s)
            task_gauge("busyTimeMsPerSecond", "Busy time (ms per second).").add_metric(labels, s.busy_ms_per_s)
            task_gauge("backPressuredTimeMsPerSecond", "Backpressured time (ms per second).").add_metric(
                labels, s.backpressured_ms_per_s
            )
            task_gauge("idleTimeMsPerSecond", "Idle time (ms per second).").add_metric(labels, s.idle_ms_per_s)
            task_gauge("accumulatedBusyTime", "Busy time so far (ms).").add_metric(labels, s.accumulated_busy_ms)
            task_gauge("accumulatedBackPressuredTime", "Backpressured time so far (ms).").add_metric(
                labels, s.accumulated_backpressured_ms
            )
            task_gauge("accumulatedIdleTime", "Idle time so far (ms).").add_metric(labels, s.accumulated_idle_ms)
            ack = per_subtask.get((vid, index))
            if ack is not None:
                task_gauge(
                    "checkpointAlignmentTime", "Alignment time of the latest completed checkpoint (ns)."
                ).add_metric(labels, float(ack.alignment_duration_ms) * 1e6)
                task_gauge(
                    "checkpointStartDelayNanos", "Start delay of the latest completed checkpoint (ns)."
                ).add_metric(labels, float(ack.start_delay_ms) * 1e6)
                task_gauge(
                    "checkpointedStateSize", "This subtask's state in the latest completed checkpoint (bytes)."
                ).add_metric(labels, int(ack.full_size))
            if s.buffer_size is not None:
                task_gauge(
                    "debloatedBufferSize", "Adaptive buffers: records per output buffer now (smallest channel)."
                ).add_metric(labels, s.buffer_size)
            if s.buffers_in_flight is not None:
                task_gauge(
                    "debloatedBuffersInFlight", "Adaptive buffers: buffers queued per output channel at most now."
                ).add_metric(labels, s.buffers_in_flight)
            if s.input_watermark is not None:
                task_gauge("currentInputWatermark", "The subtask's input watermark (ms since the epoch).").add_metric(
                    labels, s.input_watermark
                )
            if s.watermark is not None:
                task_gauge("currentOutputWatermark", "The subtask's watermark (ms since the epoch).").add_metric(
                    labels, s.watermark
                )
                task_gauge("watermarkLag", "How far the watermark is behind wall time (ms).").add_metric(
                    labels, max(0.0, now_ms - s.watermark)
                )
            for op in s.operators:
                if isinstance(op.get("state_rows"), int):
                    operator_family.add_metric([*labels, op["uid"], op["name"]], op["state_rows"])
                # as Flink registers it on window operators only: keyed (stateful) operators,
                # or any other that did drop records, rather than a zero for every map and sink
                late = op.get("late_records_dropped")
                if isinstance(late, int) and (late > 0 or isinstance(op.get("state_rows"), int)):
                    late_family.add_metric([*labels, op["uid"], op["name"]], late)
        yield from families.values()
        yield operator_family
        yield late_family


def exposition(monitor: JobMonitor) -> Tuple[bytes, str]:
    """The job's metrics in Prometheus' text format, and its content type."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(monitor))  # type: ignore[arg-type]
    return generate_latest(registry), CONTENT_TYPE
