"""Event-time statistics of a job's tasks (Flink's watermark and late-record metrics),
as the embedded and Spark runners report them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

__all__ = ["EventTimeStatistics", "event_time_statistics"]


@dataclass(frozen=True)
class EventTimeStatistics:
    """Event time across a job's subtasks (Flink's metrics): per vertex, each
    subtask's current input watermark (``currentInputWatermark``: what its valve put
    out, or for a source what it generated) and output watermark, and the records
    dropped as too late (``numLateRecordsDropped``, over every window operator;
    checkpointed, so a restore neither loses nor repeats the count)."""

    watermarks: Dict[str, List[int]]
    output_watermarks: Dict[str, List[int]]
    late_records_dropped: int

    def to_json(self) -> Dict[str, Any]:
        return {
            "currentInputWatermark": self.watermarks,
            "currentOutputWatermark": self.output_watermarks,
            "numLateRecordsDropped": self.late_records_dropped,
        }


def event_time_statistics(tasks: Sequence[Any]) -> EventTimeStatistics:
    """The statistics of these tasks (one attempt's), by vertex and subtask."""
    inputs: Dict[str, List[int]] = {}
    outputs: Dict[str, List[int]] = {}
    late = 0
    for task in sorted(tasks, key=lambda t: (t.attempt.vertex, t.attempt.subtask)):
        m = task.time_metrics()
        inputs.setdefault(task.attempt.vertex, []).append(m["currentInputWatermark"])
        outputs.setdefault(task.attempt.vertex, []).append(m["currentOutputWatermark"])
        late += m["numLateRecordsDropped"]
    return EventTimeStatistics(inputs, outputs, late)
