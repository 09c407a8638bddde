"""Per-subtask counters, read as snapshots, and the samples rates are made of.

A ``StreamTask`` keeps a few plain counters (records in and out, counted per
buffer; nanoseconds spent idle and backpressured, counted around the waits that
already exist), so the record path pays one addition per buffer and nothing per
record. Everything else happens here, off the task's thread: ``task_counters``
reads them (the embedded runner's tasks directly; a Spark task's poll thread reads
its own and sends them to the driver), and ``MetricsHistory`` samples them about
once a second into rates, busy/backpressured/idle time per second, and a bounded
history for the dashboard and ``/jobs/:id/recent-progress``."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Tuple

__all__ = ["JobSample", "MetricsHistory", "SubtaskSample", "job_watermark", "task_counters"]

TaskKey = Tuple[str, int]  # (vertex, subtask)

# What a counters dict may carry, and of which type: reports from Spark tasks are
# JSON from another process, so the driver keeps only these, as these types.
_INT_FIELDS = ("subtask", "attempt", "records_in", "records_out", "idle_ns", "backpressured_ns", "uptime_ns")
_OPTIONAL_INT_FIELDS = ("state_rows", "watermark", "input_watermark", "late_records_dropped")
# present only for a subtask whose output has adaptive buffers (buffer_debloat=True)
_DEBLOAT_FIELDS = ("buffer_size", "buffers_in_flight")
_MAX_OPERATORS = 64


def _state_rows(op: Any) -> Optional[int]:
    """Entries in an operator's keyed state, if it has any: O(key groups), read from
    another thread, so a resize under the read makes it try once more, then give up."""
    backend = getattr(op, "backend", None)
    count = getattr(backend, "num_entries", None)
    if count is None:
        return None
    for _ in range(2):
        try:
            return int(count())
        except (RuntimeError, KeyError, ValueError, TypeError):
            continue
    return None


def _watermark(task: Any, name: str = "output_watermark") -> Optional[int]:
    """The task's output (or input) watermark (event time, ms), None while it has
    none: before the first one (Long.MIN_VALUE, as in Flink) and after the last (MAX)."""
    value = getattr(task, name, None)
    if type(value) is not int or not -(2**62) < value < 2**62:
        return None
    return value


def _late(op: Any) -> Optional[int]:
    """Records an operator dropped as too late (Flink's ``numLateRecordsDropped``);
    None for an object that does not count them."""
    value = getattr(op, "late_records_dropped", None)
    return value if type(value) is int else None


def task_counters(task: Any, now_ns: Optional[int] = None) -> Dict[str, Any]:
    """A snapshot of one ``StreamTask``'s counters as plain JSON-able values (what a
    Spark task sends to the driver, and what the embedded runner hands over)."""
    attempt = task.attempt
    now = time.perf_counter_ns() if now_ns is None else now_ns
    started = getattr(task, "started_ns", 0) or 0
    operators = []
    rows_total: Optional[int] = None
    late_total: Optional[int] = None
    for op in getattr(task, "chain", [])[:_MAX_OPERATORS]:
        rows = _state_rows(op)
        late = _late(op)
        operators.append(
            {
                "uid": str(getattr(op, "uid", "")),
                "name": str(getattr(op, "name", "")),
                "state_rows": rows,
                "late_records_dropped": late,
            }
        )
        if rows is not None:
            rows_total = (rows_total or 0) + rows
        if late is not None:
            late_total = (late_total or 0) + late
    # a source's input watermark is what its chain generated (as ``time_metrics`` says)
    has_gate = getattr(task, "gate", None) is not None
    finished = task.finished.is_set() if hasattr(task, "finished") else False
    running = task.running.is_set() if hasattr(task, "running") else False
    ended_ns = getattr(task, "ended_ns", 0) or 0
    # adaptive buffers (StreamEnvironment(buffer_debloat=True)): the output's current
    # limits, the smallest over its channels; None for a sink or with debloating off
    debloat = task.debloat_metrics() if hasattr(task, "debloat_metrics") else None
    counters: Dict[str, Any] = {
        "vertex": str(attempt.vertex),
        "subtask": int(attempt.subtask),
        "attempt": int(attempt.attempt),
        "status": "FINISHED" if finished else "RUNNING" if running else "INITIALIZING",
        "records_in": int(getattr(task, "records_in", 0)),
        "records_out": int(getattr(task, "records_out", 0)),
        "idle_ns": int(getattr(task, "idle_ns", 0)),
        "backpressured_ns": int(getattr(task, "backpressured_ns", 0)),
        "uptime_ns": max(0, (ended_ns or now) - started) if started else 0,
        "state_rows": rows_total,
        "watermark": _watermark(task),
        "input_watermark": _watermark(task, "input_watermark" if has_gate else "output_watermark"),
        # idle: the subtask told downstream its output is idle (every split or input
        # idle), so, as in Flink, its watermark holds nothing back
        "idle": bool(getattr(task, "output_idle", False)),
        "late_records_dropped": late_total,
        "operators": operators,
    }
    if debloat is not None:
        counters["buffer_size"] = int(debloat["buffer_size"])
        counters["buffers_in_flight"] = int(debloat["buffers_in_flight"])
    return counters


def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and type(value) is not bool else None


def clean_counters(data: Any) -> Optional[Dict[str, Any]]:
    """A counters dict from another process, kept only as far as it is well formed:
    known fields of the right types, bounded strings and lists, nothing else."""
    if not isinstance(data, dict):
        return None
    try:
        out: Dict[str, Any] = {"vertex": str(data["vertex"])[:200]}
        for name in _INT_FIELDS:
            value = data[name] if name in ("subtask", "attempt") else data.get(name, 0)
            if type(value) is bool or not isinstance(value, int):
                return None
            out[name] = value
        for name in _OPTIONAL_INT_FIELDS:
            value = data.get(name)
            out[name] = _int_or_none(value)
        for name in _DEBLOAT_FIELDS:
            value = _int_or_none(data.get(name))
            if value is not None:
                out[name] = value
        out["idle"] = data.get("idle") is True
        status = data.get("status", "RUNNING")
        out["status"] = status if status in ("INITIALIZING", "RUNNING", "FINISHED") else "RUNNING"
        operators = data.get("operators", [])
        out["operators"] = [
            {
                "uid": str(o.get("uid", ""))[:200],
                "name": str(o.get("name", ""))[:200],
                "state_rows": _int_or_none(o.get("state_rows")),
                "late_records_dropped": _int_or_none(o.get("late_records_dropped")),
            }
            for o in (operators if isinstance(operators, list) else [])[:_MAX_OPERATORS]
            if isinstance(o, dict)
        ]
    except (KeyError, TypeError, AttributeError):
        return None
    return out


@dataclass
class SubtaskSample:
    """One subtask at one sample: its counters (for the whole job, across restarts:
    an attempt's counters start at zero, so earlier attempts' totals are carried)
    and its rates since the sample before."""

    vertex: str
    subtask: int
    attempt: int
    status: str
    records_in: int
    records_out: int
    records_in_per_s: float = 0.0
    records_out_per_s: float = 0.0
    busy_ms_per_s: float = 0.0
    backpressured_ms_per_s: float = 0.0
    idle_ms_per_s: float = 0.0
    accumulated_busy_ms: float = 0.0
    accumulated_backpressured_ms: float = 0.0
    accumulated_idle_ms: float = 0.0
    state_rows: Optional[int] = None
    watermark: Optional[int] = None  # output watermark
    input_watermark: Optional[int] = None
    idle: bool = False
    # records dropped as too late, over the chain's operators: checkpointed with
    # them, so the latest attempt's count is the run's (never carried across restarts)
    late_records_dropped: Optional[int] = None
    # adaptive buffers: records per buffer and buffers queued per output channel now
    # (the smallest over the subtask's channels); None for a sink or with debloating off
    buffer_size: Optional[int] = None
    buffers_in_flight: Optional[int] = None
    operators: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def backpressure_ratio(self) -> float:
        return min(1.0, max(0.0, self.backpressured_ms_per_s / 1000.0))


@dataclass
class JobSample:
    """The whole job at one sample (wall clock ``timestamp_ms``)."""

    timestamp_ms: int
    duration_ms: float
    subtasks: Dict[TaskKey, SubtaskSample]
    # per vertex: rows that came in / went out during the interval
    vertex_in: Dict[str, int] = field(default_factory=dict)
    vertex_out: Dict[str, int] = field(default_factory=dict)


def _late_by_uid(counters: Optional[Dict[str, Any]]) -> Dict[str, int]:
    if counters is None:
        return {}
    return {
        str(o.get("uid")): int(o["late_records_dropped"])
        for o in counters.get("operators", [])
        if isinstance(o.get("late_records_dropped"), int)
    }


def _late_delta(op: Dict[str, Any], before: Dict[str, int]) -> Optional[int]:
    late = op.get("late_records_dropped")
    if not isinstance(late, int):
        return None
    return max(0, late - before.get(str(op.get("uid")), 0))


def job_watermark(sample: JobSample, last_vertex: str) -> Optional[int]:
    """The job's event time, as Flink's rules make it: the watermark that reached the
    last vertex (the sink's input watermark), the minimum over its subtasks that are
    running and not idle. An idle subtask (every split or input idle) holds nothing
    back, as the valve leaves an idle channel out; a finished one has passed the end
    of input. When every running subtask is idle, the largest of their watermarks
    (the valve flushes the largest when all its inputs turn idle). None while an
    active subtask has no watermark yet, or the job has no event time."""
    subs = [s for (vid, _), s in sample.subtasks.items() if vid == last_vertex and s.status != "FINISHED"]
    active = [s.input_watermark for s in subs if not s.idle]
    if active:
        return None if any(w is None for w in active) else min(w for w in active if w is not None)
    idle = [s.input_watermark for s in subs if s.input_watermark is not None]
    return max(idle) if idle else None


class MetricsHistory:
    """Turns counter snapshots into samples. ``add(counters)`` is called by the
    monitor's sampling thread with every subtask's counters; the latest sample and
    a bounded history (``maxlen``) are read by the server."""

    def __init__(self, maxlen: int = 300) -> None:
        self._lock = threading.Lock()
        self._last: Dict[TaskKey, Dict[str, Any]] = {}
        self._carried: Dict[TaskKey, Dict[str, int]] = {}
        self._last_ns: Optional[int] = None
        self.samples: Deque[JobSample] = deque(maxlen=maxlen)
        self.latest: Optional[JobSample] = None
        self.count = 0  # samples taken so far: the version of ``latest``

    def _total(self, key: TaskKey, counters: Dict[str, Any], name: str) -> int:
        return self._carried.get(key, {}).get(name, 0) + int(counters.get(name, 0))

    def add(
        self, counters: Iterable[Dict[str, Any]], now_ns: Optional[int] = None, wall_ms: Optional[int] = None
    ) -> JobSample:
        now = time.monotonic_ns() if now_ns is None else now_ns
        wall = int(time.time() * 1000) if wall_ms is None else wall_ms
        with self._lock:
            elapsed_s = (now - self._last_ns) / 1e9 if self._last_ns is not None else 0.0
            subtasks: Dict[TaskKey, SubtaskSample] = {}
            vertex_in: Dict[str, int] = {}
            vertex_out: Dict[str, int] = {}
            for c in counters:
                key = (str(c["vertex"]), int(c["subtask"]))
                before = self._last.get(key)
                if before is not None and before["attempt"] != c["attempt"]:  # a restart: new counters from 0
                    carried = self._carried.setdefault(key, {})
                    for name in ("records_in", "records_out", "idle_ns", "backpressured_ns", "uptime_ns"):
                        carried[name] = carried.get(name, 0) + int(before.get(name, 0))
                    before = None
                d_in = int(c["records_in"]) - (int(before["records_in"]) if before else 0)
                d_out = int(c["records_out"]) - (int(before["records_out"]) if before else 0)
                d_up = int(c["uptime_ns"]) - (int(before["uptime_ns"]) if before else 0)
                d_idle = int(c["idle_ns"]) - (int(before["idle_ns"]) if before else 0)
                d_bp = int(c["backpressured_ns"]) - (int(before["backpressured_ns"]) if before else 0)
                # late drops are checkpointed with the operator: a restarted attempt starts from
                # the restored count, so the interval's drops are measured against the last
                # count seen of the key, whichever attempt it came from (never below 0)
                late_before = _late_by_uid(self._last.get(key))
                sample = SubtaskSample(
                    vertex=key[0],
                    subtask=key[1],
                    attempt=int(c["attempt"]),
                    status=str(c.get("status", "RUNNING")),
                    records_in=self._total(key, c, "records_in"),
                    records_out=self._total(key, c, "records_out"),
                    state_rows=c.get("state_rows"),
                    watermark=c.get("watermark"),
                    input_watermark=c.get("input_watermark"),
                    idle=bool(c.get("idle", False)),
                    late_records_dropped=c.get("late_records_dropped"),
                    buffer_size=c.get("buffer_size"),
                    buffers_in_flight=c.get("buffers_in_flight"),
                    operators=[{**o, "late_in_interval": _late_delta(o, late_before)} for o in c.get("operators", [])],
                )
                up = self._total(key, c, "uptime_ns")
                idle = self._total(key, c, "idle_ns")
                bp = self._total(key, c, "backpressured_ns")
                sample.accumulated_idle_ms = idle / 1e6
                sample.accumulated_backpressured_ms = bp / 1e6
                sample.accumulated_busy_ms = max(0, up - idle - bp) / 1e6
                if elapsed_s > 0:
                    sample.records_in_per_s = max(0, d_in) / elapsed_s
                    sample.records_out_per_s = max(0, d_out) / elapsed_s
                if d_up > 0:
                    idle_share = min(1.0, max(0.0, d_idle / d_up))
                    bp_share = min(1.0 - idle_share, max(0.0, d_bp / d_up))
                    sample.idle_ms_per_s = 1000 * idle_share
                    sample.backpressured_ms_per_s = 1000 * bp_share
                    sample.busy_ms_per_s = 1000 * (1.0 - idle_share - bp_share)
                vertex_in[key[0]] = vertex_in.get(key[0], 0) + max(0, d_in)
                vertex_out[key[0]] = vertex_out.get(key[0], 0) + max(0, d_out)
                subtasks[key] = sample
                self._last[key] = dict(c)
            job = JobSample(wall, elapsed_s * 1000, subtasks, vertex_in, vertex_out)
            self._last_ns = now
            self.samples.append(job)
            self.latest = job
            self.count += 1
            return job

    def history(self) -> List[JobSample]:
        with self._lock:
            return list(self.samples)
