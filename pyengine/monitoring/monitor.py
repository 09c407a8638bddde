"""``JobMonitor``: one running job as the monitoring server sees it.

A runner makes one with ``start_monitor(runner, env.monitoring)`` when a job
starts and stops it when the job ends. The monitor reads the runner through a
few attributes every runner has (``job_id``, ``name``, ``env``, ``graph``,
``coordinator``, ``restarts``, ``all_running()``) and the subtasks' counters
either pulled (``runner.task_metrics()``, the embedded runner: its tasks are
threads of this process) or pushed (``report_task_metrics``, the Spark runner's
driver, from its tasks' polls). A sampling thread turns the counters into rates
once per ``Monitoring.sample_interval_s``; requests only read what it left, so a
request never touches a task and a task never waits for a request.

What it costs the job: the embedded runner's tasks are threads of this process,
so every bit of Python the monitor runs holds the GIL they need. Hence a sample
is O(subtasks) (a few counters each, nothing per record), and each answer is
built at most once per version of what it shows (``body``): a new sample, a
checkpoint event, a change of state. Three clients reading every second (an open
dashboard, Prometheus, a CLI) cost one build, not three. The monitor meters its
own threads (``cpu_seconds``): the sampler, the request handlers and the
server's accept loop, which is what the 2% budget of issue #15 is measured on."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, TextIO, Tuple

from ..coordinator.stats import CheckpointStatsTracker
from .config import Monitoring
from .metrics import JobSample, MetricsHistory, clean_counters
from .rest import (
    VertexInfo,
    backpressure_level,
    checkpoint_statistics,
    checkpointing_statistics,
    find_checkpoint,
    task_checkpoint_details,
)
from .rest import checkpoint_config as rest_checkpoint_config

__all__ = ["JSON_TYPE", "JobMonitor", "start_monitor", "vertices_of"]

log = logging.getLogger(__name__)

JSON_TYPE = "application/json; charset=utf-8"
# Answers kept per version (paths: a dashboard asks for a handful, a scan of
# made-up paths only empties the cache, never grows it past this).
MAX_CACHED_BODIES = 64

Body = Tuple[int, bytes, str]  # status, payload, content type

_SHIP_STRATEGY = {"forward": "FORWARD", "hash": "HASH", "rebalance": "REBALANCE", "broadcast": "BROADCAST"}


def vertices_of(graph: Any, env: Any) -> List[VertexInfo]:
    """The job graph's vertices as the REST API shows them."""
    out = []
    for v in graph.vertices:
        uids = v.uids()
        names = [s.name for s in v.steps]
        out.append(
            VertexInfo(
                id=str(v.name),
                name=" -> ".join(names),
                parallelism=int(env.parallelism),
                max_parallelism=int(env.max_parallelism),
                exchange=str(v.exchange),
                operators=tuple(zip(uids, names, strict=True)),
            )
        )
    return out


def start_monitor(job: Any, config: Optional[Monitoring], out: Optional[TextIO] = None) -> Optional[JobMonitor]:
    """Starts ``job``'s monitoring server, or returns None when ``config`` is None.
    A server that cannot listen leaves the job running: the monitor says why (on
    ``out``, stderr by default) and its ``url`` is None."""
    if config is None:
        return None
    if not isinstance(config, Monitoring):
        raise TypeError(f"monitoring must be a pyengine.Monitoring or None, got {config!r}")
    monitor = JobMonitor(job, config, out=out)
    monitor.start()
    return monitor


class JobMonitor:
    """The monitoring of one job: its server, its sampling thread and what they read."""

    def __init__(self, job: Any, config: Monitoring, out: Optional[TextIO] = None) -> None:
        self.job = job
        self.config = config
        self.out = out
        self.history = MetricsHistory(config.history)
        self.url: Optional[str] = None
        self.error: Optional[str] = None  # why there is no server, when there is none
        self.start_ms = int(time.time() * 1000)
        self.end_ms = -1
        self._final: Optional[str] = None
        self._reported: Dict[Tuple[str, int], Dict[str, Any]] = {}
        self._reported_lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler: Optional[threading.Thread] = None
        self._server: Any = None
        self._empty = CheckpointStatsTracker()
        self.on_sample: List[Callable[[JobMonitor, JobSample], None]] = []
        self._line: Any = None  # the live progress line, on a terminal
        self._cpu_ns = 0  # CPU time the monitor's own threads spent (see ``cpu_seconds``)
        self._cpu_lock = threading.Lock()
        self._bodies: Dict[str, Tuple[Hashable, Body]] = {}
        self._bodies_lock = threading.Lock()
        self._vertices: Optional[Tuple[Any, List[VertexInfo]]] = None

    # -- life --------------------------------------------------------------------------------

    def start(self) -> Optional[str]:
        started = time.thread_time_ns()
        try:
            return self._start()
        finally:
            self.charge(time.thread_time_ns() - started)  # the job's start pays it: part of the cost

    def _start(self) -> Optional[str]:
        from .server import MonitoringServer

        try:
            self._server = MonitoringServer(
                self,
                self.config.host,
                self.config.port,
                self.config.token,
                request_timeout_s=self.config.request_timeout_s,
            )
        except OSError as exc:
            hint = "; Monitoring(port=0) picks a free port" if self.config.port != 0 else ""
            self.error = (
                f"the monitoring server of job {self.name!r} could not listen on "
                f"{self.config.host}:{self.config.port} ({exc.strerror or exc}); the job runs without it{hint}"
            )
            # said once, on ``out`` (stderr): a warning through logging as well would print it a
            # second time (Python's last-resort handler writes warnings to stderr, unprefixed)
            log.debug("%s", self.error)
            self._say(f"pyengine: {self.error}")
        else:
            self.url = self._server.url
            if self.config.announce:
                self._say(f"pyengine: job {self.name!r} monitoring at {self.url}")
        if self.config.progress and self.out is None:
            self._start_line()
        self._sampler = threading.Thread(target=self._sample_loop, name="pyengine-monitor-sampler", daemon=True)
        self._sampler.start()
        return self.url

    def _start_line(self) -> None:
        from .console import ProgressLine

        if not ProgressLine.wanted():
            return
        try:
            self._line = ProgressLine(self)
        except ImportError:  # rich is optional for the line: the job runs the same without it
            self._line = None

    def stop(self, status: str = "FINISHED") -> None:
        """The job ended with ``status``: a last sample, then the server closes."""
        if self._final is not None:
            return
        self._final = status
        self.end_ms = int(time.time() * 1000)
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(5)
        try:
            self.sample()
        except Exception:  # a last sample is a nicety; stopping must not fail the job
            log.debug("last monitoring sample failed", exc_info=True)
        if self._line is not None:
            self._line.close()
        if self._server is not None:
            self._server.close()

    def _say(self, line: str) -> None:
        stream = self.out if self.out is not None else sys.stderr
        try:
            print(line, file=stream, flush=True)
        except (OSError, ValueError):
            pass

    # -- counters ----------------------------------------------------------------------------

    def report_task_metrics(self, counters: Any) -> bool:
        """Counters a subtask sent (under Spark, through the driver's control plane):
        kept when well formed, the newest per subtask; False when refused."""
        clean = clean_counters(counters)
        if clean is None:
            return False
        key = (clean["vertex"], clean["subtask"])
        with self._reported_lock:
            before = self._reported.get(key)
            if before is None or before["attempt"] <= clean["attempt"]:
                self._reported[key] = clean
        return True

    def report_task_counters(self, attempt: Any, counters: Any) -> bool:
        """Counters that came with a Spark task's poll: filed under the attempt the
        control plane authenticated, never under what the body claims."""
        if isinstance(counters, dict):
            counters = {**counters, "vertex": attempt.vertex, "subtask": attempt.subtask, "attempt": attempt.attempt}
        return self.report_task_metrics(counters)

    def _counters(self) -> List[Dict[str, Any]]:
        pull = getattr(self.job, "task_metrics", None)
        pulled = list(pull()) if callable(pull) else []
        with self._reported_lock:
            pushed = list(self._reported.values())
        return pulled + pushed

    def sample(self) -> JobSample:
        started = time.thread_time_ns()
        try:
            return self._sample()
        finally:
            self.charge(time.thread_time_ns() - started)

    def _sample(self) -> JobSample:
        job_sample = self.history.add(self._counters())
        for listener in list(self.on_sample):
            try:
                listener(self, job_sample)
            except Exception:
                log.debug("a monitoring listener failed", exc_info=True)
        return job_sample

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.config.sample_interval_s):
            try:
                self.sample()
            except Exception:  # never let the monitor's thread end the job or itself
                log.debug("monitoring sample failed", exc_info=True)

    def latest(self) -> JobSample:
        return self.history.latest if self.history.latest is not None else self.sample()

    # -- what it costs ---------------------------------------------------------------------

    def charge(self, cpu_ns: int) -> None:
        """Adds CPU time one of the monitor's threads spent on its work."""
        with self._cpu_lock:
            self._cpu_ns += max(0, int(cpu_ns))

    @property
    def cpu_seconds(self) -> float:
        """CPU time the monitoring spent so far: sampling, answering requests, and
        the server's accept loop (each thread's own CPU clock, so another process's
        load does not count). Under the embedded runner this is GIL time the tasks
        could not have, the upper bound of what monitoring takes from the job."""
        with self._cpu_lock:
            return self._cpu_ns / 1e9

    # -- answers, built once per version -------------------------------------------------------

    def version(self) -> Hashable:
        """What every answer depends on, cheaply: the latest sample, the checkpoint
        statistics (counts, and the acks of the ten latest, so an in-progress
        checkpoint's progress shows), the job's state and restarts. Answers built
        under one version are served as they are until it changes: at most one
        sampling interval old, as Flink's REST caches its metrics and checkpoint
        statistics for a refresh interval (``metrics.fetcher.update-interval``,
        ``rest.cache.checkpoint-statistics.timeout``)."""
        tracker = self.tracker()
        restored = tracker.latest_restored
        return (
            self.history.count,
            tuple(tracker.counts.values()),
            tuple((s.id, s.status, len(s.subtasks)) for s in tracker.history),
            None if restored is None else restored.get("restore_timestamp"),
            self.state(),
            self.restarts,
        )

    def body(self, key: str, build: Callable[[], Body]) -> Body:
        """``build()``'s answer for ``key``, built once per ``version()``."""
        version = self.version()
        with self._bodies_lock:
            kept = self._bodies.get(key)
        if kept is not None and kept[0] == version:
            return kept[1]
        answer = build()
        with self._bodies_lock:
            if len(self._bodies) >= MAX_CACHED_BODIES:
                self._bodies.clear()
            self._bodies[key] = (version, answer)
        return answer

    @staticmethod
    def encode(status: int, body: Any) -> Body:
        """A route's answer as bytes: JSON, or bytes with their content type as they are."""
        if isinstance(body, tuple):
            payload, kind = body
            return status, bytes(payload), str(kind)
        return status, json.dumps(body, default=str, separators=(",", ":")).encode(), JSON_TYPE

    # -- the job -----------------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def name(self) -> str:
        return str(self.job.name)

    @property
    def restarts(self) -> int:
        return int(getattr(self.job, "restarts", 0) or 0)

    def state(self) -> str:
        """Flink's job states: INITIALIZING, RUNNING, RESTARTING, then FINISHED or FAILED."""
        if self._final is not None:
            return self._final
        try:
            running = bool(self.job.all_running())
        except Exception:
            running = False
        if running:
            return "RUNNING"
        return "RESTARTING" if self.restarts > 0 else "INITIALIZING"

    def tracker(self) -> Any:
        coordinator = getattr(self.job, "coordinator", None)
        return self._empty if coordinator is None else coordinator.stats

    def checkpoint_config(self) -> Any:
        return getattr(self.job.env, "checkpointing", None)

    def retained_ids(self) -> Optional[List[int]]:
        coordinator = getattr(self.job, "coordinator", None)
        store = getattr(coordinator, "store", None)
        if store is None:
            return None
        return [m.checkpoint_id for m in store.checkpoints]

    def vertices(self) -> List[VertexInfo]:
        """The job graph's vertices, worked out once per graph (a job's graph does not
        change while it runs; answers ask for it several times each)."""
        graph = self.job.graph
        kept = self._vertices
        if kept is None or kept[0] is not graph:
            kept = (graph, vertices_of(graph, self.job.env))
            self._vertices = kept
        return list(kept[1])

    def vertex(self, vertex_id: str) -> Optional[VertexInfo]:
        for v in self.vertices():
            if v.id == vertex_id:
                return v
        return None

    def storage_uri(self) -> str:
        coordinator = getattr(self.job, "coordinator", None)
        storage = getattr(coordinator, "storage", None)
        if storage is not None:
            try:
                return str(storage.uri_of(storage.root))
            except Exception:
                pass
        return str(getattr(self.job.env, "checkpoint_storage", None) or "temporary directory")

    # -- REST bodies -------------------------------------------------------------------------

    def jobs_overview(self) -> Dict[str, Any]:
        return {"jobs": [{"id": self.job_id, "status": self.state()}]}

    def checkpoints(self) -> Dict[str, Any]:
        config = self.checkpoint_config()
        return checkpointing_statistics(
            self.tracker(),
            self.vertices(),
            unaligned_by_config=bool(config is not None and config.unaligned),
            retained_ids=self.retained_ids(),
        )

    def checkpoint_details(self, checkpoint_id: int) -> Optional[Dict[str, Any]]:
        stats = find_checkpoint(self.tracker(), checkpoint_id)
        if stats is None:
            return None
        config = self.checkpoint_config()
        return checkpoint_statistics(
            stats,
            self.vertices(),
            unaligned_by_config=bool(config is not None and config.unaligned),
            retained_ids=self.retained_ids(),
        )

    def subtask_details(self, checkpoint_id: int, vertex_id: str) -> Optional[Dict[str, Any]]:
        stats = find_checkpoint(self.tracker(), checkpoint_id)
        vertex = self.vertex(vertex_id)
        if stats is None or vertex is None:
            return None
        return task_checkpoint_details(stats, vertex)

    def config_info(self) -> Optional[Dict[str, Any]]:
        config = self.checkpoint_config()
        if config is None:
            return None
        return rest_checkpoint_config(
            config,
            state_backend=str(self.job.env.state_backend),
            checkpoint_storage=self.storage_uri(),
            interval=getattr(self.tracker(), "interval", None) or None,
        )

    def job_details(self) -> Dict[str, Any]:
        """Flink's ``JobDetailsInfo`` (``/jobs/:jobid``): the job, its vertices with
        their I/O metrics, and the plan (how the vertices connect)."""
        now = int(time.time() * 1000)
        state = self.state()
        sample = self.latest()
        vertices: List[Dict[str, Any]] = []
        nodes: List[Dict[str, Any]] = []
        previous: Optional[VertexInfo] = None
        for v in self.vertices():
            subs = [s for (vid, _), s in sample.subtasks.items() if vid == v.id]
            finished = sum(1 for s in subs if s.status == "FINISHED")
            running = sum(1 for s in subs if s.status == "RUNNING")
            if state in ("FINISHED", "FAILED"):
                vstatus = state
            else:
                vstatus = "RUNNING" if running == v.parallelism else "FINISHED" if finished == v.parallelism else state
            vertices.append(
                {
                    "id": v.id,
                    "name": v.name,
                    "maxParallelism": v.max_parallelism,
                    "parallelism": v.parallelism,
                    "status": vstatus,
                    "start-time": self.start_ms,
                    "end-time": self.end_ms,
                    "duration": (self.end_ms if self.end_ms > 0 else now) - self.start_ms,
                    "tasks": {"RUNNING": running, "FINISHED": finished},
                    "metrics": {
                        "read-bytes": 0,
                        "read-bytes-complete": False,
                        "write-bytes": 0,
                        "write-bytes-complete": False,
                        "read-records": sum(s.records_in for s in subs),
                        "read-records-complete": True,
                        "write-records": sum(s.records_out for s in subs),
                        "write-records-complete": True,
                        "accumulated-backpressured-time": int(sum(s.accumulated_backpressured_ms for s in subs)),
                        "accumulated-idle-time": int(sum(s.accumulated_idle_ms for s in subs)),
                        "accumulated-busy-time": float(sum(s.accumulated_busy_ms for s in subs)),
                    },
                }
            )
            node: Dict[str, Any] = {
                "id": v.id,
                "parallelism": v.parallelism,
                "operator": "",
                "operator_strategy": "",
                "description": v.name,
                "optimizer_properties": {},
            }
            if previous is not None:
                node["inputs"] = [
                    {
                        "num": 0,
                        "id": previous.id,
                        "ship_strategy": _SHIP_STRATEGY.get(v.exchange, v.exchange.upper()),
                        "exchange": "pipelined_bounded",
                    }
                ]
            nodes.append(node)
            previous = v
        timestamps = {"INITIALIZING": self.start_ms, "CREATED": self.start_ms}
        if self.end_ms > 0:
            timestamps[state] = self.end_ms
        counts: Dict[str, int] = {}
        for vertex in vertices:
            vertex_status = str(vertex["status"])
            counts[vertex_status] = counts.get(vertex_status, 0) + 1
        return {
            "jid": self.job_id,
            "name": self.name,
            "isStoppable": False,
            "state": state,
            "job-type": "STREAMING",
            "start-time": self.start_ms,
            "end-time": self.end_ms,
            "duration": (self.end_ms if self.end_ms > 0 else now) - self.start_ms,
            "maxParallelism": int(self.job.env.max_parallelism),
            "now": now,
            "timestamps": timestamps,
            "vertices": vertices,
            "status-counts": counts,
            "plan": {"jid": self.job_id, "name": self.name, "type": "STREAMING", "nodes": nodes},
            # pyengine's own: restarts so far (Flink's numRestarts metric)
            "restarts": self.restarts,
        }

    def backpressure(self, vertex_id: str) -> Optional[Dict[str, Any]]:
        """Flink's ``JobVertexBackPressureInfo``, measured (as Flink since 1.13) from the
        time each subtask spent waiting for room downstream in the last interval."""
        vertex = self.vertex(vertex_id)
        if vertex is None:
            return None
        sample = self.latest()
        subtasks: List[Dict[str, Any]] = []
        worst = 0.0
        for i in range(vertex.parallelism):
            s = sample.subtasks.get((vertex.id, i))
            ratio = s.backpressure_ratio if s is not None else 0.0
            worst = max(worst, ratio)
            subtasks.append(
                {
                    "subtask": i,
                    "attempt-number": s.attempt if s is not None else 0,
                    "backpressure-level": backpressure_level(ratio),
                    "ratio": round(ratio, 4),
                    "idleRatio": round((s.idle_ms_per_s if s else 0.0) / 1000, 4),
                    "busyRatio": round((s.busy_ms_per_s if s else 0.0) / 1000, 4),
                    # pyengine's own: the adaptive buffers' current limits on its output
                    # (None for a sink, or with buffer_debloat=False)
                    "debloatedBufferSize": s.buffer_size if s is not None else None,
                    "debloatedBuffersInFlight": s.buffers_in_flight if s is not None else None,
                    "other-concurrent-attempts": [],
                }
            )
        return {
            "status": "ok",
            "backpressure-level": backpressure_level(worst),
            "end-timestamp": sample.timestamp_ms,
            "subtasks": subtasks,
        }

    def progress(self) -> Dict[str, Any]:
        from .progress import streaming_query_progress

        return streaming_query_progress(self, self.latest())

    def recent_progress(self) -> List[Dict[str, Any]]:
        from .progress import streaming_query_progress

        return [streaming_query_progress(self, s) for s in self.history.history()]

    def metrics_text(self) -> Tuple[bytes, str]:
        from .prometheus import exposition

        return exposition(self)
