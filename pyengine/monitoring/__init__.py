"""Watching a running job: Flink's checkpoint REST API (paths and field names),
Prometheus ``/metrics`` under Flink's metric names, Spark's
``StreamingQueryProgress`` at ``/jobs/:id/progress``, and a dashboard at ``/``.

Every job serves it from its own process (the driver under Spark), on loopback by
default: ``StreamEnvironment(..., monitoring=pe.Monitoring(host, port, token))``,
``monitoring=None`` turns it off. Its address is printed when the job starts and
is ``JobClient.monitoring_url`` / ``JobResult.monitoring_url``."""

from __future__ import annotations

from .config import Monitoring, is_loopback
from .metrics import MetricsHistory, task_counters
from .monitor import JobMonitor, start_monitor

__all__ = ["JobMonitor", "MetricsHistory", "Monitoring", "is_loopback", "start_monitor", "task_counters"]
