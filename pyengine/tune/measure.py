"""One measured run of a job at one ``Setting``: what ``pyengine tune`` compares, and what
the ``pyengine_benchmark`` fixture records in a benchmark's saved JSON.

A job is a function that builds its pipeline on the environment it is given
(``def build(env): env.from_source(...)...sink_to(...)``): the settings belong to the
environment, so the same function runs at every point of a search. The run is
instrumented from outside, without changing the job: the sources' ``read`` is counted
(records and their time), and the sink's ``stage``/``commit`` are timed.

What is measured, and how:

- **throughput**: records read by the sources per second. A run stopped early (``seconds``)
  takes its rate over the second half of the run, after the channels have filled: reading
  runs ahead of processing only by the in-flight data, and a run that counted the filling
  would favour large buffers and channels for data they only hold.
- **end-to-end latency**: with ``latency_field`` (a column or key holding the time, in
  seconds since the epoch, its record was created, as ``bench/test_bench_latency.py``
  does), the time from creation to the output's being committed (a transactional sink)
  or staged (any other), measured per output batch. Without it, the commit latency is
  derived: a record read at ``t`` is committed when the first checkpoint triggered after
  ``t`` completes (its barrier follows the record), so ``completed - t``, over the reads.
- **checkpoints**: the coordinator's statistics: end-to-end duration, start delay and
  alignment p50/p99, checkpointed size, in-flight data persisted (unaligned).
- **recovery**: restore (measured when asked: the job restored from the run's latest
  checkpoint, from the start of the run to its first output, or first read) plus the
  replay of what one interval and one checkpoint's duration bring in (what a failure just
  before a checkpoint completes loses), at the measured throughput.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .settings import Setting

__all__ = ["JobBuilder", "Measurement", "measure"]

JobBuilder = Callable[[Any], Any]
"""``build(env)``: adds the job's sources, operators and sink to ``env``."""


@dataclass
class Measurement:
    """The figures of one run (see the module's docstring for how each is measured).
    Latencies and durations in ms, sizes in bytes, times in s; NaN where the run gave
    nothing to measure (no checkpoint completed, no output)."""

    setting: Setting
    records: int
    seconds: float
    throughput: float
    latency_p50_ms: float = math.nan
    latency_p99_ms: float = math.nan
    latency_measured: bool = False  # False: derived from checkpoint completions
    checkpoints: int = 0
    checkpoint_p50_ms: float = math.nan
    checkpoint_p99_ms: float = math.nan
    start_delay_p50_ms: float = math.nan
    start_delay_p99_ms: float = math.nan
    alignment_p50_ms: float = math.nan
    alignment_p99_ms: float = math.nan
    checkpoint_size: float = math.nan
    persisted_p50: float = math.nan
    persisted_max: float = math.nan
    restore_s: float = math.nan
    restore_measured: bool = False
    # the checkpoint interval the run used: the setting's, or with interval_ms="auto" the
    # median of what the coordinator chose for its periodic checkpoints
    interval_ms: float = math.nan
    replay_s: float = math.nan
    status: str = ""
    notes: List[str] = field(default_factory=list)
    # each completed checkpoint's end-to-end duration, oldest first, as far back as the
    # statistics' history goes: what a benchmark row per checkpoint times (p50/p99 above
    # summarise every one; not in ``to_json``, which they summarise)
    checkpoint_durations_ms: List[float] = field(default_factory=list, repr=False)

    @property
    def recovery_s(self) -> float:
        """Restore plus the replay of one interval (NaN until restore is known)."""
        return self.restore_s + self.replay_s

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        out["setting"] = self.setting.to_json()
        out["recovery_s"] = self.recovery_s
        del out["checkpoint_durations_ms"]
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


class _Probe:
    """Counts what the sources read and times what the sink stages and commits."""

    def __init__(self, latency_field: Optional[str]) -> None:
        self.latency_field = latency_field
        self.lock = threading.Lock()
        self.total = 0
        self.reads: List[Tuple[float, int]] = []  # (wall time, records read so far)
        self.first_output: Optional[float] = None
        self.started = 0.0  # when the run was started
        self.staged: Dict[Tuple[int, int], List[np.ndarray]] = {}
        self.latencies: List[np.ndarray] = []

    def wrap_source(self, source: Any) -> None:
        read = source.read

        def counted(subtask: int, parallelism: int, position: int, n: int) -> Any:
            got = read(subtask, parallelism, position, n)
            if got is not None:
                count = got.num_rows if hasattr(got, "num_rows") else len(got)
                if count:
                    with self.lock:
                        self.total += count
                        self.reads.append((time.time(), self.total))
            return got

        source.read = counted  # on this instance only: the job's class is untouched

    def wrap_sink(self, sink: Any) -> None:
        stage, commit = sink.stage, sink.commit
        transactional = bool(getattr(sink, "transactional", False))

        def staged(subtask: int, checkpoint_id: int, records: Any) -> None:
            now = time.time()
            if self.first_output is None:
                self.first_output = now
            if self.latency_field is not None:
                created = _created(records, self.latency_field)
                if not transactional:
                    self.latencies.append(now - created)
                elif len(created):
                    with self.lock:
                        self.staged.setdefault((subtask, checkpoint_id), []).append(created)
            stage(subtask, checkpoint_id, records)

        def committed(subtask: int, checkpoint_id: int) -> None:
            commit(subtask, checkpoint_id)
            if self.latency_field is not None:
                now = time.time()
                with self.lock:
                    keys = [k for k in self.staged if k[0] == subtask and k[1] <= checkpoint_id]
                    for key in keys:
                        self.latencies.append(now - np.concatenate(self.staged.pop(key)))

        sink.stage, sink.commit = staged, committed

    def rate(self, early_stop: bool, finished_at: float) -> Tuple[int, float, float]:
        """(records, seconds, records/s) of the run (see the module's docstring)."""
        reads = list(self.reads)
        if not reads:
            return 0, 0.0, 0.0
        first, last = reads[0][0], reads[-1][0]
        if not early_stop:
            seconds = max(finished_at - first, 1e-9)
            return self.total, seconds, self.total / seconds
        middle = first + (last - first) / 2
        times = np.array([t for t, _ in reads])
        counts = np.array([c for _, c in reads])
        i = int(np.searchsorted(times, middle))
        if i >= len(reads) - 1 or last - times[i] <= 0:
            seconds = max(last - first, 1e-9)
            return self.total, seconds, self.total / seconds
        return self.total, last - first, float((counts[-1] - counts[i]) / (last - times[i]))

    def derived_latencies(self, timeline: List[Tuple[int, int, int]]) -> Tuple[np.ndarray, np.ndarray]:
        """Commit latency of every read, from the checkpoints' trigger and completion: one
        latency per read and the records it read (its weight). Not one entry per record:
        ten million records made an 80 MB array and two partitions of it, 0.3-0.4 s
        after every run, which the benchmarks timed as the job's."""
        if not timeline or not self.reads:
            return np.array([]), np.array([], dtype=np.int64)
        triggers = np.array([t / 1000 for _, t, _ in timeline])
        completions = np.array([c / 1000 for _, _, c in timeline])
        times = np.array([t for t, _ in self.reads])
        counts = np.diff(np.array([0] + [c for _, c in self.reads]))
        k = np.searchsorted(triggers, times, side="left")
        covered = k < len(triggers)
        if not covered.any():
            return np.array([]), np.array([], dtype=np.int64)
        return completions[k[covered]] - times[covered], counts[covered]


def _created(records: Any, name: str) -> np.ndarray:
    """The creation times (s since the epoch) of one staged output, Arrow or records."""
    if hasattr(records, "column") and hasattr(records, "schema"):
        if records.schema.get_field_index(name) < 0:
            raise KeyError(f"latency_field {name!r} is not a column of the sink's input ({records.schema.names})")
        column = records.column(name)
        import pyarrow as pa

        if pa.types.is_timestamp(column.type):
            return column.cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
    values = [r[name] if isinstance(r, dict) else getattr(r, name) for r in records]
    return np.asarray(values, dtype=np.float64)


def _interval_used(setting: Setting, tracker: Any) -> float:
    if setting.interval_ms != "auto":
        return float(setting.interval_ms)
    used = [s.interval_ms for s in tracker.history if s.status == "COMPLETED" and getattr(s, "interval_ms", None)]
    return float(np.median(used)) if used else float(setting.nominal_interval_ms)


def _percentiles(values: np.ndarray, weights: Optional[np.ndarray] = None) -> Tuple[float, float]:
    """p50 and p99 of ``values``, each counted ``weights`` times (default once): the
    same figures as ``np.percentile`` of the values repeated, without repeating them."""
    if weights is None:
        if not len(values):
            return math.nan, math.nan
        return float(np.percentile(values, 50)), float(np.percentile(values, 99))
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if not len(values):
        return math.nan, math.nan
    order = np.argsort(values, kind="stable")
    ordered, ends = values[order], np.cumsum(weights[order])
    n = int(ends[-1])

    def at(rank: int) -> float:  # the rank-th (0-based) of the values repeated, in order
        return float(ordered[int(np.searchsorted(ends, rank, side="right"))])

    def percentile(q: float) -> float:  # numpy's default ("linear") interpolation
        position = q / 100 * (n - 1)
        low = math.floor(position)
        below, above = at(low), at(min(low + 1, n - 1))
        return below + (above - below) * (position - low)

    return percentile(50), percentile(99)


def _instrument(env: Any, probe: _Probe, outputs: Optional[str] = None, undo: Optional[List[Any]] = None) -> None:
    for source in env._sources:
        probe.wrap_source(source)
    sinks = [s._sink for s in env._streams if s._sink is not None]
    if not sinks:
        raise ValueError("tune: the job has no sink; the build function must end its pipeline with .sink_to(...)")
    if outputs is not None:
        _redirect_outputs(sinks, outputs, undo if undo is not None else [])
    for sink in sinks:
        probe.wrap_sink(sink)


def _redirect_outputs(sinks: List[Any], directory: str, undo: List[Any]) -> None:
    """Points the job's file and Delta sinks at ``directory`` (the trial's own, deleted
    after it): a trial is a measurement, not a run of the job, so it must not leave
    output where the job's runs write. Each trial writes as the job would (same sink,
    format and commits), into a directory of its own, so no trial finds another's
    output (the second trial into the job's own directory refused it, a FileSink's
    ``mode="error"``). What it changes goes into ``undo`` as (sink, attribute, value),
    for ``measure`` to put back: a sink made outside the build function is the job's own
    object, and must write where the job says once the trial is over."""
    from ..connectors.filesink import FileSink

    for i, sink in enumerate(sinks):
        changes: Dict[str, Any]
        if isinstance(sink, FileSink):
            changes = {"path": os.path.join(directory, f"sink-{i}")}
        elif type(sink).__name__ == "DeltaSink" and hasattr(sink, "table_uri"):
            changes = {"table_uri": os.path.join(directory, f"sink-{i}"), "storage_options": None}
        else:
            continue
        for attribute, value in changes.items():
            undo.append((sink, attribute, getattr(sink, attribute)))
            setattr(sink, attribute, value)


def _undo(undo: List[Any]) -> None:
    for sink, attribute, value in reversed(undo):
        setattr(sink, attribute, value)
    undo.clear()


def _environment(setting: Setting, parallelism: int, storage: Optional[str], checkpointing: bool) -> Any:
    from ..api import StreamEnvironment
    from ..coordinator.config import CheckpointConfig

    return StreamEnvironment(
        parallelism=parallelism,
        checkpointing=CheckpointConfig(**setting.checkpoint_kwargs()) if checkpointing else None,
        checkpoint_storage=storage if checkpointing else None,
        monitoring=None,  # a server per trial would be measured with the job
        **setting.environment_kwargs(),
    )


def _run(
    build: JobBuilder,
    env: Any,
    probe: _Probe,
    name: str,
    seconds: Optional[float],
    restore_from: Optional[str] = None,
    stop_at_output: bool = False,
    outputs: Optional[str] = None,
    undo: Optional[List[Any]] = None,
) -> Tuple[Any, float, float]:
    """(result, wall time of the run, the moment it ended or was stopped); the job's
    file sinks write under ``outputs`` (``_redirect_outputs``, recorded in ``undo``)."""
    build(env)
    if getattr(env, "executor", "threads") != "threads":
        # The trials' probes (a counter on each source and sink, with a lock) stay in this
        # process; in worker processes they would have to be pickled, and would count there.
        raise ValueError(
            f"pyengine tune (and JobBenchmark) measure a job on threads; build(env) set executor="
            f"{env.executor!r}. Tune it on threads (leave executor alone in build) and time the two executors "
            "yourself (env.execute, start to end); channel_capacity and buffer_size left to the engine (auto) "
            "are chosen per executor"
        )
    _instrument(env, probe, outputs, undo)
    start = probe.started = time.time()
    if seconds is None and not stop_at_output:
        result = (
            env.execute(name, resume="never") if restore_from is None else env.execute(name, restore_from=restore_from)
        )
        end = time.time()
        return result, end - start, end
    if restore_from is None:
        client = env.execute_async(name, resume="never")
    else:
        client = env.execute_async(name, restore_from=restore_from)
    # the budget counts from the first record read, not from the job's start (which
    # restores state, and the first time imports); a job that reads nothing in a
    # minute is stopped all the same
    deadline = start + 60.0
    began = False
    while not client.done():
        if stop_at_output and probe.first_output is not None:
            break
        if seconds is not None and not began and probe.reads:
            began = True
            deadline = probe.reads[0][0] + seconds
        if time.time() >= deadline:
            break
        time.sleep(0.005)
    end = time.time()
    if not client.done():
        client.cancel()
    result = client.wait(120, raise_failure=False)
    return result, end - start, end


# Said of the job, not of a setting: ``recommend`` repeats them once in the result's messages.
BOUNDED_NOTE = (
    "the job is bounded: it ended within the trial's time, so each trial ran all of its input, and a "
    "checkpoint interval as long as a run shows only the final checkpoint; tune an unbounded version of "
    "the job (from_generator, a monitored read_files) for figures of the interval"
)
NO_RECOVERY_NOTE = (
    "recovery not measured: the job restored from its latest checkpoint produced nothing (a bounded "
    "job restored from the end of its input has nothing left to read)"
)


def measure(
    build: JobBuilder,
    setting: Setting = Setting(),  # noqa: B008 - frozen
    *,
    parallelism: int = 2,
    seconds: Optional[float] = None,
    checkpointing: bool = True,
    latency_field: Optional[str] = None,
    input_rate_per_s: Optional[float] = None,
    measure_restore: bool = False,
    name: str = "pyengine-tune",
) -> Measurement:
    """Runs ``build``'s job once at ``setting`` and measures it.

    ``seconds``: stop the run that long after its first record (an unbounded job needs
    it; a short run is how a search stays short); None runs a bounded job to its end.
    ``input_rate_per_s``: the rate the job's input arrives at in production, for the
    replay part of recovery (default: the measured throughput, a job that runs at
    capacity). ``measure_restore``: restore the job from the run's latest checkpoint and
    time it (one more short run)."""
    root = tempfile.mkdtemp(prefix="pyengine-tune-")
    undo: List[Any] = []
    quiet = _QuietBackToBack(name)
    coordinator_log = logging.getLogger("pyengine.coordinator.coordinator")
    coordinator_log.addFilter(quiet)
    try:
        storage = os.path.join(root, "ckpt")
        probe = _Probe(latency_field)
        env = _environment(setting, parallelism, storage, checkpointing)
        result, _, ended = _run(build, env, probe, name, seconds, outputs=os.path.join(root, "output"), undo=undo)
        if result.status == "FAILED":
            raise RuntimeError(f"tune: the job failed at {setting.label}: {result.cause}") from result.cause
        records, elapsed, rate = probe.rate(seconds is not None and result.status != "FINISHED", ended)
        m = Measurement(setting, records, elapsed, rate, status=result.status)
        if seconds is not None and result.status == "FINISHED":
            m.notes.append(BOUNDED_NOTE)
        summary = result.checkpoints.summary()
        m.checkpoints = int(result.checkpoints.counts["completed"])
        m.interval_ms = _interval_used(setting, result.checkpoints)
        if m.checkpoints:
            duration = summary["end_to_end_duration_ms"]
            m.checkpoint_p50_ms, m.checkpoint_p99_ms = float(duration["p50"]), float(duration["p99"])
            delay = summary.get("start_delay_ms", {})
            m.start_delay_p50_ms, m.start_delay_p99_ms = float(delay.get("p50", 0)), float(delay.get("p99", 0))
            alignment = summary["alignment_duration_ms"]
            m.alignment_p50_ms, m.alignment_p99_ms = float(alignment["p50"]), float(alignment["p99"])
            m.checkpoint_durations_ms = [
                float(c.end_to_end_duration_ms) for c in reversed(result.checkpoints.history) if c.status == "COMPLETED"
            ]
            m.checkpoint_size = float(summary["full_size"]["max"])
            m.persisted_p50 = float(summary["persisted_data"]["p50"])
            m.persisted_max = float(summary["persisted_data"]["max"])
        if latency_field is not None and probe.latencies:
            m.latency_p50_ms, m.latency_p99_ms = (v * 1e3 for v in _percentiles(np.concatenate(probe.latencies)))
            m.latency_measured = True
        elif checkpointing:
            timeline = list(getattr(result.checkpoints, "timeline", []))
            m.latency_p50_ms, m.latency_p99_ms = (v * 1e3 for v in _percentiles(*probe.derived_latencies(timeline)))
            if latency_field is not None:
                m.notes.append("no output carried the latency field: latency derived from checkpoint completions")
        if checkpointing and rate > 0:
            arriving = input_rate_per_s if input_rate_per_s is not None else rate
            lost = m.interval_ms / 1000 + (m.checkpoint_p50_ms / 1000 if m.checkpoints else 0.0)
            m.replay_s = lost * arriving / rate
            if input_rate_per_s is not None and input_rate_per_s >= rate:
                m.notes.append(f"input rate {input_rate_per_s:,.0f}/s is at or above the measured {rate:,.0f}/s")
        if measure_restore and result.latest_checkpoint:
            _undo(undo)
            m.restore_s = _restore(build, setting, parallelism, storage, name, result.latest_checkpoint, undo)
            m.restore_measured = not math.isnan(m.restore_s)
            if not m.restore_measured:
                m.notes.append(NO_RECOVERY_NOTE)
        return m
    finally:
        _undo(undo)
        coordinator_log.removeFilter(quiet)
        shutil.rmtree(root, ignore_errors=True)


class _QuietBackToBack(logging.Filter):
    """Leaves out the coordinator's warning that checkpoints run back to back for the
    trial's job (named ``job``): a trial tries such intervals on purpose, and
    ``recommend`` says it of the recommendation. Other jobs of the process still get it."""

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job

    def filter(self, record: logging.LogRecord) -> bool:
        from ..coordinator.coordinator import BACK_TO_BACK_WARNING

        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg is BACK_TO_BACK_WARNING and args[:1] == (self.job,))


def _restore(
    build: JobBuilder, setting: Setting, parallelism: int, storage: str, name: str, path: str, undo: List[Any]
) -> float:
    """Seconds from starting the job restored from ``path`` to its first output (or
    first read, for a job whose output is sparse): what a restart costs before it
    makes progress."""
    probe = _Probe(None)
    env = _environment(setting, parallelism, storage, True)
    outputs = os.path.join(os.path.dirname(storage), "restored-output")
    _result, _, _ = _run(
        build, env, probe, name, None, restore_from=path, stop_at_output=True, outputs=outputs, undo=undo
    )
    first = probe.first_output if probe.first_output is not None else (probe.reads[0][0] if probe.reads else None)
    if first is None:
        return math.nan
    return max(0.0, first - probe.started)
