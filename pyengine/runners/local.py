"""The embedded runner: every subtask a thread of this process.

Channels are native input gates with the configured capacity (backpressure is
a full gate); failover restarts the whole job from the latest completed
checkpoint, as Flink's full-restart strategy, up to ``restart_attempts``."""

from __future__ import annotations

import gc
import logging
import shutil
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..connectors.base import RunInfo
from ..connectors.console import CollectSink
from ..coordinator import (
    CheckpointCoordinator,
    CheckpointException,
    ExecutionAttempt,
    ThreadTimerService,
)
from ..errors import OutputInUseError, is_non_retryable
from ..io import CheckpointedInputGate, CheckpointFailureReason, CheckpointOptions
from ..runtime.base import OperatorContext
from ..runtime.outputs import Output, Outputs
from ..runtime.statistics import event_time_statistics
from ..runtime.task import StreamTask
from ..storage import checkpoint_storage
from ..storage.filesystem import CheckpointStorage
from ..storage.jobs import JobLease, describe_jobs, list_jobs
from ..storage.metadata import CheckpointMetadata, OperatorState, load_metadata
from .result import JobResult

__all__ = ["LocalRunner", "out_edges", "recover_sinks", "refuse_graph", "resolve_restore_path", "sinks_of"]

log = logging.getLogger(__name__)


def resolve_restore_path(path: str, job_name: Optional[str] = None) -> Tuple[CheckpointMetadata, str]:
    """What ``restore_from=path`` restores: a checkpoint directory, a savepoint
    directory or ``_metadata`` file; a job's directory (its latest readable
    checkpoint, falling back past a damaged one with a warning); or a checkpoint
    storage root holding exactly one job, or several of which ``job_name`` picks
    exactly one. Anything else is refused with what was found there."""
    from ..storage.jobs import describe_jobs, list_jobs, read_job

    try:
        return load_metadata(path), path
    except (OSError, ValueError) as first:
        job = read_job(path)
        if job is None:
            jobs = list_jobs(path)
            if not jobs:
                raise ValueError(
                    f"restore_from={path!r} is not a checkpoint, a savepoint, a job's checkpoint directory or a "
                    f"checkpoint storage root: {first}"
                ) from None
            named = [j for j in jobs if j.job_name == job_name]
            others = [j for j in jobs if j.job_name and j.job_name != job_name]
            if len(jobs) > 1 or (job_name is not None and others):
                if len(named) != 1:
                    which = "none is" if not named else f"{len(named)} are"
                    raise ValueError(
                        f"restore_from={path!r} is a checkpoint storage root holding {len(jobs)} job(s), and {which} "
                        f"named {job_name!r}; pass one job's directory (or one of its chk-<n> directories) to "
                        "restore it under this name:\n" + describe_jobs(jobs)
                    ) from None
                jobs = named
            job = jobs[0]
        errors = []
        for checkpoint_id in reversed(job.checkpoints):
            directory = f"{job.uri}/chk-{checkpoint_id}"
            try:
                return load_metadata(directory), directory
            except (OSError, ValueError) as exc:
                log.warning("skipping %s, it cannot be restored: %s", directory, exc)
                errors.append(str(exc))
        detail = "; ".join(errors) if errors else "it has no completed checkpoint"
        raise ValueError(f"restore_from={path!r}: job directory {job.uri} cannot be restored: {detail}") from None


def covered_by(metadata: Optional[CheckpointMetadata]) -> Tuple[Tuple[str, int], ...]:
    """The run lineage a restored checkpoint covers, for ``Sink.recover`` (``()``: a
    fresh start). Metadata from before lineages were recorded covers its own run."""
    if metadata is None:
        return ()
    if metadata.runs:
        return tuple((r, c) for r, c in metadata.runs)
    return ((metadata.job_id, metadata.checkpoint_id),)


RESUME_MODES = ("auto", "never")


def sinks_identity(sinks: Sequence[Any]) -> str:
    """Where a job's sinks write (``sink_identity`` of each, joined): one sink's is its own."""
    return " + ".join(i for i in (sink_identity(s) for s in sinks) if i)


def sink_identity(sink: Any) -> str:
    """Where a sink's output goes, as a job directory records it: a resumed run must
    write there too (else it is another pipeline that happens to share the name)."""
    import os

    where = getattr(sink, "path", None) or getattr(sink, "table_uri", None)
    if isinstance(where, str) and where:
        if "://" not in where:
            where = os.path.abspath(where)
        return f"{type(sink).__name__} {where}"
    return ""


GIL_SWITCH_INTERVAL_S = 0.001


class _FrozenHeap:
    """What the process held when its first job started, out of the cyclic garbage
    collector's sight until its last job ends (``gc.freeze`` / ``gc.unfreeze``).

    Why: a per-record job allocates objects that outlive a buffer (its outputs, in
    flight), so the collector promotes them, and every ~25% growth of the oldest
    generation it walks all of it: the user's and the libraries' objects too (a list
    of 100,000 input records is 100,000 references to visit). Measured on a function
    yielding a pyspark Row per record, 100,000 records at p=2: 2-4 full collections of
    40-85 ms each per run, 30% of its time; frozen, 5 ms each. The worker processes
    freeze the same way (``processes._worker_main``). Only what existed before the job
    is frozen; garbage it makes is collected as before. Counted, so concurrent jobs
    unfreeze once, at the end of the last; a process that froze its heap itself
    (``gc.get_freeze_count()`` at the first job's start) is left as it is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs = 0
        self._frozen = False

    def enter(self) -> None:
        with self._lock:
            if self._jobs == 0 and gc.get_freeze_count() == 0:
                gc.freeze()
                self._frozen = True
            self._jobs += 1

    def exit(self) -> None:
        with self._lock:
            self._jobs -= 1
            if self._jobs == 0 and self._frozen:
                self._frozen = False
                gc.unfreeze()


FROZEN_HEAP = _FrozenHeap()


def build_task(
    *,
    env: Any,
    vertex: Any,
    v_index: int,
    subtask: int,
    attempt: ExecutionAttempt,
    job_name: str,
    local_recovery_dir: Optional[str],
    output: Optional[Union[Output, Outputs]],
    storage: Any,
    executor: Any,
    coordinator: Any,
    restored: Dict[str, OperatorState],
    on_failure: Callable[[BaseException], None],
    on_drained: Callable[[ExecutionAttempt], None],
) -> StreamTask:
    """One subtask of ``vertex``: its chain, context and input gate (every vertex but
    a source's has one: ONE gate over the channels of all its input edges, ``p``
    channels per edge in the order of ``vertex.inputs``, so one barrier handler
    aligns a checkpoint across a union's or a connect's inputs, as Flink 1.12's);
    both runners build tasks here, the embedded one with local outputs, the Spark one
    with remote."""
    p = env.parallelism
    checkpointing = env.checkpointing
    gate_factory: Optional[Callable[[Any], Any]] = None
    edges: List[Any] = list(getattr(vertex, "inputs", None) or [])
    if not hasattr(vertex, "inputs") and v_index > 0:  # a vertex without edges: of a line, fed by the one before
        edges = [None]
    if edges:
        channels = p * len(edges)

        def gate_factory(listener: Any) -> Any:
            return CheckpointedInputGate(
                channels,
                listener,
                mode=checkpointing.mode if checkpointing else "exactly_once",
                unaligned=bool(checkpointing and checkpointing.unaligned),
                aligned_timeout_ms=checkpointing.aligned_timeout_ms if checkpointing else 0,
                capacity=max(1, env.channel_capacity),
            )

    ctx = OperatorContext(
        job_name=job_name,
        subtask=subtask,
        parallelism=p,
        max_parallelism=env.max_parallelism,
        state_backend=env.state_backend,
        local_recovery_dir=local_recovery_dir,
        attempt=attempt.attempt,
    )
    return StreamTask(
        attempt=attempt,
        chain=vertex.create_chain(checkpointing is not None),
        ctx=ctx,
        gate_factory=gate_factory,
        output=output,
        storage=storage,
        executor=executor,
        coordinator=coordinator,
        restored=restored,
        buffer_size=env.buffer_size,
        buffer_timeout_ms=env.buffer_timeout_ms,
        read_bytes=env.batch_bytes,
        on_failure=on_failure,
        on_drained=on_drained,
        channel_state_uid=f"__channel_state__{vertex.name}",
        input_key_selector=vertex.key_selector if vertex.exchange == "hash" else None,
        input_edges=[(e.input, e.key_selector if e.exchange == "hash" else None) for e in edges if e is not None],
        channels_per_edge=p,
        input_exchanges=[e.exchange for e in edges if e is not None],
    )


class LocalRunner:
    """Runs a job graph (``pyengine.api.JobGraph``) in this process."""

    def __init__(
        self, graph: Any, env: Any, name: str, restore_from: Optional[str] = None, resume: str = "auto"
    ) -> None:
        self.graph = graph
        self.env = env
        self.name = name
        self.job_id = uuid.uuid4().hex  # this run's id
        self.restore_from = restore_from
        self.resume = resume
        self.lease: Optional[JobLease] = None
        self.run_info: Optional[RunInfo] = None
        self._own_directory = False  # this run made its job directory (not resumed)
        self._attempted = False  # an attempt started: the run has left its mark
        self._tasks: List[StreamTask] = []
        self._failure: Optional[BaseException] = None
        self._failure_lock = threading.Lock()
        self._wake = threading.Event()
        self._drained: set = set()  # tasks done with all their input (bounded input)
        self.coordinator: Optional[CheckpointCoordinator] = None
        self.restarts = 0  # so far, for progress reports while the job runs
        self._temp: Optional[tempfile.TemporaryDirectory] = None
        self._stop_with_savepoint = threading.Event()
        self._stop_savepoint: Optional[CheckpointMetadata] = None  # what stop_with_savepoint took
        self._cancel = threading.Event()
        self.monitor: Any = None  # pyengine.monitoring.JobMonitor, while the job runs

    # -- the JobGateway ----------------------------------------------------------------------

    def tasks_to_trigger(self) -> Sequence[ExecutionAttempt]:
        return [t.attempt for t in self._tasks if t.gate is None]

    def tasks_to_ack(self) -> Sequence[ExecutionAttempt]:
        return [t.attempt for t in self._tasks]

    def all_running(self) -> bool:
        if self._failure is not None or not self._tasks:
            return False
        return all(t.running.is_set() and not t.end_requested.is_set() for t in self._tasks)

    def records_read(self) -> int:
        """Records the source tasks of this attempt read so far (the coordinator's
        replay rate for ``interval_ms="auto"``; optional in a JobGateway)."""
        return sum(t.records_in for t in list(self._tasks) if t.gate is None)

    def is_processing_backlog(self) -> bool:
        """Whether a source reports a backlog (``Source.is_processing_backlog``): the
        coordinator then checkpoints every ``interval_during_backlog_ms``."""
        for source in getattr(self.graph, "sources", ()):
            ask = getattr(source, "is_processing_backlog", None)
            if ask is not None and ask():
                return True
        return False

    def operator_parallelism(self) -> Dict[str, Tuple[int, int]]:
        p, max_p = self.env.parallelism, self.env.max_parallelism
        return {uid: (p, max_p) for uid in self.graph.state_uids()}

    def _task(self, attempt: ExecutionAttempt) -> Optional[StreamTask]:
        for t in self._tasks:
            if t.attempt == attempt:
                return t
        return None

    def trigger(self, task: ExecutionAttempt, checkpoint_id: int, timestamp: int, options: CheckpointOptions) -> None:
        t = self._task(task)
        if t is not None:
            t.trigger_checkpoint(checkpoint_id, timestamp, options)

    def notify_complete(self, task: ExecutionAttempt, checkpoint_id: int) -> None:
        t = self._task(task)
        if t is not None:
            t.notify_checkpoint_complete(checkpoint_id)

    def notify_aborted(self, task: ExecutionAttempt, checkpoint_id: int) -> None:
        t = self._task(task)
        if t is not None:
            t.notify_checkpoint_aborted(checkpoint_id)

    def fail_job(self, cause: BaseException) -> None:
        with self._failure_lock:
            if self._failure is None:
                self._failure = cause
        self._wake.set()

    def _task_drained(self, attempt: ExecutionAttempt) -> None:
        self._drained.add(attempt)
        self._wake.set()

    # -- running -----------------------------------------------------------------------------

    def _storage_uri(self) -> str:
        if self.env.checkpoint_storage:
            return str(self.env.checkpoint_storage)
        self._temp = tempfile.TemporaryDirectory(prefix="pyengine-checkpoints-")
        return self._temp.name

    def _build(self, attempt_number: int, restored: Dict[str, OperatorState], executor: Any, storage: Any) -> None:
        env, graph = self.env, self.graph
        p = env.parallelism
        tasks_by_vertex: Dict[int, List[StreamTask]] = {}
        # Vertices come in topological order (a vertex's inputs before it): built in
        # reverse, each vertex's consumers' gates exist when its outputs are made.
        for v_index in reversed(range(len(graph.vertices))):
            vertex = graph.vertices[v_index]
            edges_out = out_edges(graph, v_index)
            row: List[StreamTask] = []
            for s in range(p):
                outs = [
                    (
                        edge.tag,
                        Output(
                            [t.gate for t in tasks_by_vertex[c]],  # type: ignore[misc]
                            s,
                            edge.exchange,
                            edge.key_selector,
                            env.max_parallelism,
                            env.buffer_size,
                            threading.Event(),  # replaced by the task's own below
                            gate_channel=k * p + s,  # after the channels of the consumer's earlier edges
                            debloat_target_ms=env.buffer_debloat_target_ms if env.buffer_debloat else None,
                            target=_step_name(graph.vertices[c]),
                            grow="buffer_size" in env.engine_chosen,  # an explicit size is a ceiling
                        ),
                    )
                    for c, k, edge in edges_out
                ]
                output: Optional[Union[Output, Outputs]] = None
                if len(outs) == 1 and outs[0][0] is None:
                    output = outs[0][1]
                elif outs:
                    output = Outputs(outs)
                task = build_task(
                    env=env,
                    vertex=vertex,
                    v_index=v_index,
                    subtask=s,
                    attempt=ExecutionAttempt(vertex.name, s, attempt_number),
                    job_name=self.name,
                    local_recovery_dir=env._local_dir(vertex.name, s),
                    output=output,
                    storage=storage,
                    executor=executor,
                    coordinator=self.coordinator,
                    restored=restored,
                    on_failure=self.fail_job,
                    on_drained=self._task_drained,
                )
                if output is not None:
                    output.cancelled = task.cancelled
                row.append(task)
            tasks_by_vertex[v_index] = row
        self._tasks = [t for v_index in range(len(graph.vertices)) for t in tasks_by_vertex[v_index]]

    def _check_restore(self, metadata: CheckpointMetadata, path: str) -> None:
        known = set(self.graph.state_uids())
        unknown = sorted(set(metadata.operators) - known)
        if unknown:
            how = (
                f"this run resumes the unfinished job {self.name!r} (resume='auto'); to start it fresh instead, "
                "execute(..., resume='never')"
                if self.restore_from is None
                else "give the operators the uids they had (.uid(...)), or restore another checkpoint"
            )
            raise ValueError(
                f"cannot restore from {path}: it has state for operators {unknown} that this job does not have "
                f"(operators are matched by uid; this job's: {sorted(known)}); {how}"
            )
        self._check_broadcast_rescale(metadata, path)

    def _check_broadcast_rescale(self, metadata: CheckpointMetadata, path: str) -> None:
        """Refuses an unaligned checkpoint of broadcast state at another parallelism.

        Unaligned, each subtask snapshots at its own point of the broadcast input (what
        it had not reached is its in-flight data). At the same parallelism every subtask
        gets its own state and in-flight data back: exact. At another, a key's keyed state
        moves by key group to a subtask whose broadcast copy (and in-flight broadcast
        input) comes from another old subtask, one that had seen more or fewer broadcast
        records: updates made through ``apply_to_keyed_state`` would be missed or repeated
        for that key. Flink 1.11-1.12 refuse every rescale of an unaligned checkpoint;
        here only this case is refused. A checkpoint holds an operator's in-flight data
        (``__channel_state__<vertex>``) only when it was taken unaligned."""
        p = self.env.parallelism
        for vertex in self.graph.vertices:
            for step, uid in zip(vertex.steps, vertex.uids(), strict=True):
                state = metadata.operators.get(uid) if getattr(step, "broadcast_state", False) else None
                if state is None or state.parallelism in (0, p):
                    continue
                if f"__channel_state__{vertex.name}" not in metadata.operators:
                    continue  # aligned: every subtask's copy is the same
                raise ValueError(
                    f"cannot restore from {path} at parallelism {p}: it is an unaligned checkpoint taken at "
                    f"parallelism {state.parallelism}, and operator {uid!r} keeps broadcast state, which its "
                    "subtasks checkpointed at different points of the broadcast input (keyed state moved to another "
                    f"subtask would miss or repeat broadcast updates). Restore it at parallelism {state.parallelism}, "
                    f"then take a savepoint (savepoints are aligned) and restore that at {p}; or run the job with "
                    "aligned checkpoints"
                )

    def run(self) -> JobResult:
        # All subtasks are threads of this process and take turns on the GIL. A thread
        # waking from a wait (for data, for room) waits for the GIL up to the switch
        # interval, 5 ms by default, and a barrier crossing a few tasks pays it at each:
        # measured, 20-30 ms of a 30 ms unaligned checkpoint under backpressure, against
        # ~1 ms at 1 ms. Throughput did not change measurably, so jobs run at 1 ms.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, GIL_SWITCH_INTERVAL_S))
        self.start_monitoring()
        FROZEN_HEAP.enter()  # after what may raise before the try: exit() is in its finally
        status = "FAILED"
        try:
            result = self._run()
            status = result.status
            return result
        finally:
            sys.setswitchinterval(interval)
            FROZEN_HEAP.exit()
            if self.monitor is not None:
                self.monitor.stop(status)
            if self._attempted and self.env.checkpointing is not None:
                from ..monitoring.history import save_run_statistics

                save_run_statistics(self, status)  # for `pyengine checkpoints stats`
            self._release_state()

    def _release_state(self) -> None:
        """Drops the subtasks' keyed state once the run is over, as Flink disposes a
        task's backend. The runner and its tasks are held in reference cycles, which
        only the cyclic collector frees; and while a later job in this process runs,
        the heap it froze at its start (``_FrozenHeap``) includes this run's leftovers,
        so without this their state would stay in memory until that job ends."""
        for task in self._tasks:
            thread = getattr(task, "thread", None)
            if thread is not None and thread.ident is not None and thread is not threading.current_thread():
                thread.join(timeout=5)  # a task closes its operators after it says it finished
                if thread.is_alive():
                    continue  # a close() still running may read its state: left to the collector
            for op in getattr(task, "chain", ()):
                dispose = getattr(getattr(op, "backend", None), "dispose", None)
                if dispose is not None:
                    dispose()

    def start_monitoring(self) -> Optional[str]:
        """Starts the job's monitoring server (``env.monitoring``), once; returns its
        URL (None when off, or when it could not listen: the job runs all the same)."""
        if self.monitor is None:
            from ..monitoring import start_monitor

            self.monitor = start_monitor(self, getattr(self.env, "monitoring", None))
        return None if self.monitor is None else self.monitor.url

    def task_metrics(self) -> List[Dict[str, Any]]:
        """Each live subtask's counters, for the monitor's sampling thread."""
        from ..monitoring.metrics import task_counters

        return [task_counters(t) for t in list(self._tasks)]

    # -- the run's identity: where it writes, what it restores, who else is there ---------

    def _auto_resume(self) -> bool:
        """``resume="auto"`` applies where a resumed run can deliver its output exactly:
        durable checkpoint storage the user named, checkpoints on, and a sink whose
        earlier output survives the process (a ``CollectSink``'s does not)."""
        env = self.env
        return (
            self.resume == "auto"
            and self.restore_from is None
            and bool(env.checkpoint_storage)
            and env.checkpointing is not None
            and not any(isinstance(sink, CollectSink) for sink in sinks_of(self.graph))
        )

    def _find_resumable(self, uri: str) -> Any:
        """The latest run of the job with this name in this storage, when it did not
        finish (Spark's rule for a reused ``checkpointLocation``); a live one is refused."""
        jobs = [j for j in list_jobs(uri) if j.job_name == self.name]
        if not jobs:
            return None
        job = jobs[-1]
        run = job.last_run
        if job.state == "RUNNING" and run is not None:
            raise OutputInUseError(
                f"job {self.name!r} is already running in checkpoint storage {uri} (run {run.run_id}, host "
                f"{run.host}, pid {run.pid}); two runs must not share one job's checkpoints. Wait for it, stop it, "
                f"or start a separate fresh run with execute({self.name!r}, resume='never').\n" + describe_jobs(jobs)
            )
        if job.finished:
            return None
        output = sinks_identity(sinks_of(self.graph))
        if job.output and output and job.output != output:
            raise OutputInUseError(
                f"job {self.name!r} has an unfinished run in {job.uri} that wrote to {job.output}, but this run "
                f"writes to {output}: it is another pipeline under the same name, or the output moved. Name the "
                f"job differently, start fresh with execute({self.name!r}, resume='never'), or write to "
                f"{job.output} to resume it"
            )
        return job

    def _open_run(self) -> Tuple[CheckpointStorage, Optional[CheckpointMetadata], Optional[str], Any]:
        """Decides this run's job directory and restore point and takes the directory's
        lease. A fresh run, or one restored from an explicit path, gets a directory of
        its own (the restored checkpoint is left as it is, as in Flink's NO_CLAIM
        restore); a resumed run continues in the directory of the run it resumes (the
        last item returned: that directory's ``JobDirectory``)."""
        uri = self._storage_uri()
        restored: Optional[CheckpointMetadata] = None
        path: Optional[str] = None
        dir_id, lineage_id = self.job_id, self.job_id
        resumed = None
        if self.restore_from is not None:
            restored, path = resolve_restore_path(self.restore_from, self.name)
            self._check_restore(restored, path)
            lineage_id = covered_by(restored)[0][0]
        elif self._auto_resume():
            resumed = self._find_resumable(uri)
            if resumed is not None:
                dir_id, lineage_id = resumed.dir_id, resumed.lineage_id
        storage = checkpoint_storage(uri, dir_id)
        storage.probe()
        self.lease = JobLease(
            storage.uri_of(storage.root), self.name, lineage_id, self.job_id, sinks_identity(sinks_of(self.graph))
        )
        self.lease.acquire(restored_from=path)
        self.run_info = RunInfo(self.name, self.job_id, lineage_id, covered_by(restored))
        return storage, restored, path, resumed

    def _resume(self, storage: CheckpointStorage, resumed: Any) -> Optional[CheckpointMetadata]:
        """Adopts what the resumed run left in its directory (its completed checkpoints
        within retention; the rest is deleted) and returns the checkpoint to restore."""
        assert self.coordinator is not None
        restored = self.coordinator.recover()  # new ids continue past every chk-<n> found
        path = storage.uri_of(storage.checkpoint_dir(restored.checkpoint_id)) if restored else None
        last = resumed.last_run.run_id if resumed.last_run else resumed.dir_id
        log.warning(
            "job %r: resuming run %s from %s (resume='auto'; pass resume='never' to start fresh)",
            self.name,
            last,
            path or "its start: it completed no checkpoint",
        )
        if restored is not None:
            self._check_restore(restored, path or "")
            self.run_info = RunInfo(self.name, self.job_id, covered_by(restored)[0][0], covered_by(restored))
            self.lease.note_restored_from(path)  # type: ignore[union-attr]
        return restored

    def _close_run(self, status: str) -> None:
        if status == "FINISHED":  # no checkpoint of a finished job is resumed: its inputs' copies go
            for source in getattr(self.graph, "sources", []):
                cleanup = getattr(source, "cleanup", None)
                if cleanup is not None:
                    cleanup()
        try:
            _each_sink(self.graph, lambda sink: sink.end_run(status))
        finally:
            if self.lease is not None:
                if self._attempted or not self._own_directory:
                    self.lease.release(status)
                else:  # refused before it ran (a sink's output in use, say): leave no trace
                    self.lease.release(status)
                    fs, root = self.lease.fs, self.lease.root
                    try:
                        fs.delete_dir(root)
                    except OSError:
                        pass
            local_root = getattr(self.env, "_local_root", None)
            if local_root is not None:  # local copies serve restarts within this run only
                shutil.rmtree(local_root, ignore_errors=True)
                self.env._local_root = None

    def _start_run(self, timers: Any) -> Tuple[CheckpointStorage, Optional[CheckpointMetadata]]:
        """Opens the run, makes its coordinator, adopts a resumed directory, and tells
        the sink who is writing; both runners start a run here."""
        storage, restored, path, resumed = self._open_run()
        self._own_directory = resumed is None
        env = self.env
        self.coordinator = CheckpointCoordinator(
            self.job_id, env.checkpointing or _NO_CHECKPOINTS, storage, self, timers
        )
        if resumed is not None:
            restored = self._resume(storage, resumed)
            path = self.lease.record.restored_from if self.lease else None
        self.coordinator.job_name = self.name
        self.coordinator.lineage = list(covered_by(restored))
        if restored is not None:
            self.coordinator.note_restored_from(restored, path or "")
        assert self.run_info is not None
        run_info = self.run_info
        _each_sink(self.graph, lambda sink: sink.begin_run(run_info))
        for source in getattr(self.graph, "sources", []):
            prepare = getattr(source, "prepare", None)
            if prepare is not None:  # sources that need the driver first (a DataFrame's copy)
                prepare(storage.uri_of(storage.root))
        return storage, restored

    def _run(self) -> JobResult:
        env = self.env
        started = time.monotonic()
        timers = ThreadTimerService()
        status, cause = "FAILED", None
        restarts = 0
        executor = None
        storage = None
        try:
            storage, restored_meta = self._start_run(timers)
            executor = ThreadPoolExecutor(
                max_workers=2 * env.parallelism * len(self.graph.vertices), thread_name_prefix="pyengine-async"
            )
            while True:
                self._failure = None
                self._drained = set()
                self._wake.clear()
                restored = dict(restored_meta.operators) if restored_meta is not None else {}
                covered = covered_by(restored_meta)
                recover_sinks(self.graph, covered)
                self._attempted = True
                self._build(restarts, restored, executor, storage)
                for t in self._tasks:
                    t.start()
                outcome = self._supervise()
                if outcome == "finished":
                    status = "FINISHED"
                    break
                for t in self._tasks:
                    t.cancel()
                for t in self._tasks:
                    t.thread.join(timeout=30)
                # Whatever was triggered meanwhile waits for acks of tasks that are gone.
                self.coordinator.abort_pending_checkpoints(CheckpointFailureReason.JOB_FAILOVER_REGION)  # type: ignore[union-attr]
                if outcome == "stopped":
                    # The tasks may have been cancelled before the savepoint's commit reached
                    # them: the sink commits what the savepoint covers here, and nothing after.
                    stopped = covered_by(self._stop_savepoint)
                    recover_sinks(self.graph, stopped)
                    status = "FINISHED"
                    break
                if outcome == "cancelled":
                    status = "CANCELED"
                    break
                cause = self._failure
                if not self._restart(restarts):
                    break
                restarts += 1
                restored_meta = self.coordinator.restore_latest() or restored_meta  # type: ignore[union-attr]
        finally:
            if self.coordinator is not None:
                self.coordinator.shutdown()
            timers.shutdown()
            if executor is not None:
                executor.shutdown(wait=True)
            if self.lease is not None:
                self._close_run("STOPPED" if self._stop_with_savepoint.is_set() else status)
        records = list(getattr(self.graph.sink, "records", []))
        return self._result(status, cause, restarts, records, storage, started)

    def _restart(self, restarts: int) -> bool:
        """After a failed attempt: False when ``restart_attempts`` are spent or the
        failure is one no restart can fix (a ``NonRetryableError``), else log the
        restart and wait the restart delay (both runners fail over the same way)."""
        if restarts >= self.env.restart_attempts or is_non_retryable(self._failure):
            return False
        self.restarts = restarts + 1
        log.warning(
            "job %s failed (%s); restart %d of %d", self.name, self._failure, self.restarts, self.env.restart_attempts
        )
        time.sleep(self.env.restart_delay_ms / 1000)
        return True

    def _result(
        self,
        status: str,
        cause: Optional[BaseException],
        restarts: int,
        records: List[Any],
        storage: Any,
        started: float,
    ) -> JobResult:
        assert self.coordinator is not None
        latest = self.coordinator.store.latest()
        # The result alone keeps a temporary checkpoint directory: the runner is in
        # reference cycles (its tasks point back at it), so while it held the directory
        # too, the directory stayed on disk after the result was dropped, until a
        # collection of the cycles, which then deleted it in the middle of whatever ran.
        temp, self._temp = self._temp, None
        return JobResult(
            name=self.name,
            job_id=self.job_id,
            status=status,
            cause=cause if status == "FAILED" else None,
            restarts=restarts,
            records=records,
            checkpoints=self.coordinator.stats,
            checkpoint_dir=storage.uri_of(storage.root),
            latest_checkpoint=storage.uri_of(storage.checkpoint_dir(latest.checkpoint_id)) if latest else None,
            duration_s=time.monotonic() - started,
            _temp=temp,
            event_time=event_time_statistics(self._tasks) if getattr(self.graph, "event_time", False) else None,
            monitoring_url=None if self.monitor is None else self.monitor.url,
        )

    def _supervise(self) -> str:
        """Waits for the end of this attempt: "finished", "failed", "stopped" or "cancelled"."""
        coordinator = self.coordinator
        assert coordinator is not None
        while not all(t.running.is_set() or t.finished.is_set() for t in self._tasks):
            if self._failure is not None:
                return "failed"
            time.sleep(0.001)
        checkpointing = self.env.checkpointing is not None
        if checkpointing:
            coordinator.start_checkpoint_scheduler()
        sources = [t for t in self._tasks if t.gate is None]
        ending = False
        while True:
            self._wake.wait(timeout=0.05)
            self._wake.clear()
            if self._failure is not None:
                coordinator.stop_checkpoint_scheduler()
                return "failed"
            if self._stop_with_savepoint.is_set():
                coordinator.stop_checkpoint_scheduler(abort_pending=False)
                return "stopped"
            if self._cancel.is_set():
                coordinator.stop_checkpoint_scheduler()
                return "cancelled"
            # The final checkpoint waits until every task has processed all its input, so
            # no record is left in flight behind its barrier, aligned or not (FLIP-147).
            if not ending and len(self._drained) == len(self._tasks):
                ending = True
                if checkpointing and not self._final_checkpoint():
                    coordinator.stop_checkpoint_scheduler()
                    return "failed"
                coordinator.stop_checkpoint_scheduler(abort_pending=False)
                for t in sources:
                    t.end_requested.set()
            if all(t.finished.is_set() for t in self._tasks):
                return "failed" if self._failure is not None else "finished"

    def _final_checkpoint(self) -> bool:
        """At the end of bounded input: one more checkpoint, so sinks commit what
        the last records produced before the job ends.

        The periodic scheduler stops first, so the final checkpoint is the job's last:
        a periodic one that started after it (a tick between its completion and the
        scheduler's stop) completed once the tasks had ended, and its notification,
        reaching no running task, committed nothing - a completed checkpoint without
        its commit (a DeltaSink's table one version short of the job's checkpoints).
        Checkpoints already pending go on: they complete before it, or it subsumes them."""
        coordinator = self.coordinator
        assert coordinator is not None
        coordinator.stop_checkpoint_scheduler(abort_pending=False)
        while self._failure is None:
            future = coordinator.trigger_checkpoint(aligned=True)  # see trigger_checkpoint
            # The coordinator expires the checkpoint at its timeout; a task failing meanwhile
            # (say, a sink's commit of the previous checkpoint) must end the wait at once.
            while not future.done() and self._failure is None:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
            if self._failure is not None:
                return False
            try:
                future.result()
                return True
            except CheckpointException as exc:
                log.info("final checkpoint did not complete (%s); retrying", exc)
                time.sleep(0.01)
        return False

    # -- savepoints (from a JobClient) -------------------------------------------------------

    def trigger_savepoint(self, directory: str, timeout_s: float = 600) -> str:
        return self._savepoint(directory, timeout_s)[0]

    def _savepoint(self, directory: str, timeout_s: float, stop: bool = False) -> Tuple[str, CheckpointMetadata]:
        coordinator = self.coordinator
        if coordinator is None:
            raise RuntimeError("the job is not running")
        future = coordinator.trigger_savepoint(directory, stop=stop)
        if stop:
            # The job stops when the savepoint completes, even after this call timed out:
            # its sources emit nothing past it any more (and go on if it fails instead).
            future.add_done_callback(self._stop_at)
        metadata = future.result(timeout=timeout_s)
        stats = coordinator.stats.latest_savepoint
        if stats is not None and stats.id == metadata.checkpoint_id and stats.external_path:
            return stats.external_path, metadata
        return directory, metadata

    def cancel(self) -> None:
        """Ends the job now, without a savepoint (Flink's cancel): its tasks stop, what
        the last completed checkpoint covers stays committed, and the run is recorded
        CANCELED, so running the job again resumes from that checkpoint."""
        self._cancel.set()
        self._wake.set()

    def stop_with_savepoint(self, directory: str, timeout_s: float = 600) -> str:
        """A savepoint after which nothing is output (its sources emit nothing past its
        barrier, as Flink's synchronous savepoint), then the job ends FINISHED, its
        sinks having committed exactly what the savepoint covers."""
        return self._savepoint(directory, timeout_s, stop=True)[0]

    def _stop_at(self, future: Future[CheckpointMetadata]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the savepoint failed: the tasks were told, and the job goes on
        self._stop_savepoint = future.result()
        self._stop_with_savepoint.set()
        self._wake.set()


def refuse_graph(graph: Any, runner: str) -> None:
    """Raises for a runner that runs one-line jobs only (no ``supports_graphs``) when
    ``graph`` is more than one line, naming what makes it a graph and the way out."""
    features = graph.nonlinear_features() if hasattr(graph, "nonlinear_features") else []
    if features:
        raise ValueError(
            f"this job is a graph, not one line ({', '.join(features)}), which {runner} does not run: run it "
            "embedded (execute(..., runner='embedded')) or on Spark (runner='spark'), which run any graph"
        )


def sinks_of(graph: Any) -> List[Any]:
    """A job graph's sinks (a graph made before several sinks: its one sink)."""
    sinks = getattr(graph, "sinks", None)
    return list(sinks) if sinks is not None else [graph.sink]


def _each_sink(graph: Any, call: Callable[[Any], None]) -> None:
    """``call(sink)`` for every sink of the job, each even when one before it
    raised; then the first error goes on."""
    error: Optional[BaseException] = None
    for sink in sinks_of(graph):
        try:
            call(sink)
        except BaseException as exc:
            if error is None:
                error = exc
    if error is not None:
        raise error


def recover_sinks(graph: Any, covered: Tuple[Tuple[str, int], ...]) -> None:
    """``Sink.recover(covered)`` for every sink of the job."""
    _each_sink(graph, lambda sink: sink.recover(covered))


def _step_name(vertex: Any) -> str:
    """What a vertex is called in errors: its first step's name (``.name(...)``, or the
    operator's own), the name the user knows it by; the vertex's otherwise."""
    steps = getattr(vertex, "steps", None)
    return str(steps[0].name) if steps else str(vertex.name)


def out_edges(graph: Any, v_index: int) -> List[Tuple[int, int, Any]]:
    """(consumer vertex, the edge's position among its inputs, edge) for every edge
    leaving vertex ``v_index``; a graph without edges is a line."""
    consumers = getattr(graph, "consumers", None)
    if consumers is not None:
        return list(consumers(v_index))
    if v_index + 1 >= len(graph.vertices):
        return []
    nxt = graph.vertices[v_index + 1]
    from types import SimpleNamespace

    return [(v_index + 1, 0, SimpleNamespace(tag=None, exchange=nxt.exchange, key_selector=nxt.key_selector))]


class _NoCheckpoints:
    """Coordinator settings for a job without checkpointing (it never triggers)."""

    interval_ms = 10**9
    mode = "exactly_once"
    unaligned = False
    aligned_timeout_ms = 0
    timeout_ms = 600_000
    min_pause_ms = 0
    max_concurrent = 1
    tolerable_failures = 0
    retained = 1


_NO_CHECKPOINTS: Any = _NoCheckpoints()
