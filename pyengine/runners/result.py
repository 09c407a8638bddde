"""What ``execute`` returns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..coordinator import CheckpointStatsTracker
from ..runtime.statistics import EventTimeStatistics

__all__ = ["JobResult"]


@dataclass
class JobResult:
    """The end of a job: FINISHED or FAILED (with ``cause``), how many restarts it
    took, the records of a ``CollectSink``, and the checkpoint statistics
    (``checkpoints``: objects; ``checkpoints_json()``: Flink's REST shape).
    ``monitoring_url``: where its monitoring server answered while it ran (None
    when monitoring was off or could not listen). In Jupyter it shows itself as a
    checkpoint summary (``_repr_html_``)."""

    name: str
    job_id: str
    status: str
    cause: Optional[BaseException]
    restarts: int
    records: List[Any]
    checkpoints: CheckpointStatsTracker
    checkpoint_dir: str
    latest_checkpoint: Optional[str]
    duration_s: float
    _temp: Any = field(default=None, repr=False)
    monitoring_url: Optional[str] = None
    # Event time at the end (a job that uses it): each subtask's watermarks and the
    # late records dropped (``pyengine.runtime.statistics.EventTimeStatistics``).
    event_time: Optional[EventTimeStatistics] = None

    @property
    def succeeded(self) -> bool:
        return self.status == "FINISHED"

    def checkpoints_json(self) -> Dict[str, Any]:
        return self.checkpoints.to_json()

    def _repr_html_(self) -> str:
        from ..monitoring.console import checkpoint_summary_html

        return checkpoint_summary_html(
            self.checkpoints,
            name=self.name,
            status=self.status,
            restarts=self.restarts,
            url=self.monitoring_url,
            duration_s=self.duration_s,
        )

    def dumps(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "job_id": self.job_id,
                "status": self.status,
                "cause": None if self.cause is None else str(self.cause),
                "restarts": self.restarts,
                "duration_s": self.duration_s,
                "checkpoint_dir": self.checkpoint_dir,
                "latest_checkpoint": self.latest_checkpoint,
                "monitoring_url": self.monitoring_url,
                "event_time": None if self.event_time is None else self.event_time.to_json(),
                "checkpoints": self.checkpoints_json(),
            },
            indent=2,
            default=str,
        )
