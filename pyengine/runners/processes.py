"""The process-parallel embedded runner: subtasks in worker processes on this machine.

Skeleton (issue #19): selected with ``StreamEnvironment(executor="processes")`` or
``execute(runner="processes")``."""

from __future__ import annotations

from typing import Any

__all__ = ["ProcessRunner"]


class ProcessRunner:
    """Runs a job's subtasks in worker processes."""

    supports_graphs = True
    supports_event_time = True

    def job(self, graph: Any, env: Any, name: str, restore_from: Any, resume: str) -> Any:
        raise NotImplementedError("the process-parallel runner is not built yet")
