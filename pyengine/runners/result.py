"""What ``execute`` returns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..coordinator import CheckpointStatsTracker

__all__ = ["JobResult"]


@dataclass
class JobResult:
    """The end of a job: FINISHED or FAILED (with ``cause``), how many restarts it
    took, the records of a ``CollectSink``, and the checkpoint statistics
    (``checkpoints``: objects; ``checkpoints_json()``: Flink's REST shape)."""

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

    @property
    def succeeded(self) -> bool:
        return self.status == "FINISHED"

    def checkpoints_json(self) -> Dict[str, Any]:
        return self.checkpoints.to_json()

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
                "checkpoints": self.checkpoints_json(),
            },
            indent=2,
            default=str,
        )
