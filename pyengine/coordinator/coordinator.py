"""The checkpoint coordinator: Flink's ``CheckpointCoordinator`` rules, in one class.

It decides when a checkpoint starts (periodic scheduler, manual triggers,
``max_concurrent``, ``min_pause``), collects acknowledgements into a
``PendingCheckpoint``, completes it (``_metadata``, the completed store,
subsumption, notifications), or aborts it (decline, expiry, failover) and
deletes what it wrote. It talks to tasks only through a ``JobGateway`` whose
calls must not block (they post to task mailboxes), so it may call them while
holding its lock; and it never reads a clock itself (``TimerService``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import posixpath
import random
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from ..io.events import CheckpointFailureReason, CheckpointOptions, CheckpointType
from ..storage.filesystem import CheckpointStorage, CheckpointStorageLocation, checkpoint_storage, resolve
from ..storage.handles import KeyGroupsStateHandle, StateHandle, StreamStateHandle
from ..storage.metadata import CheckpointMetadata, OperatorState, SubtaskState
from ..storage.store import CompletedCheckpointStore, discard_unreferenced, owns_path, shared_files, stream_paths_of
from .config import CheckpointConfig
from .interval import Estimate, RecoveryGoalPolicy
from .stats import CheckpointStatsTracker, SubtaskMetrics
from .timers import Cancellable, TimerService

__all__ = [
    "AckResult",
    "CheckpointCoordinator",
    "CheckpointException",
    "ExecutionAttempt",
    "IllegalCheckpointStateError",
    "JobGateway",
    "PendingCheckpoint",
    "TaskStateSnapshot",
]

log = logging.getLogger(__name__)

# Said once a job's checkpoints run back to back (``_warn_if_back_to_back``); a tuning
# trial, which tries such intervals on purpose, leaves it out (``pyengine.tune.measure``).
BACK_TO_BACK_WARNING = (
    "job %r: %d checkpoints in a row took more than twice the checkpoint interval of %d ms (the "
    "last %.0f ms): each starts as the previous one ends, and the job keeps checkpointing. "
    "CheckpointConfig(interval_ms=...) is in milliseconds; give an interval longer than the "
    "checkpoints, min_pause_ms=... for time between them, or interval_ms='auto'"
)

# Failures that say nothing about the job's health: they never count against
# tolerable_failures (as Flink's CheckpointFailureManager ignores them).
_NOT_COUNTED = {
    CheckpointFailureReason.CHECKPOINT_SUBSUMED,
    CheckpointFailureReason.NOT_ALL_REQUIRED_TASKS_RUNNING,
    CheckpointFailureReason.CHECKPOINT_COORDINATOR_SUSPEND,
    CheckpointFailureReason.CHECKPOINT_COORDINATOR_SHUTDOWN,
    CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN,
    CheckpointFailureReason.TOO_MANY_CHECKPOINT_REQUESTS,
    CheckpointFailureReason.MINIMUM_TIME_BETWEEN_CHECKPOINTS,
    CheckpointFailureReason.JOB_FAILOVER_REGION,
    # A task's decline for these reasons follows from something else (a task not yet
    # running or finishing, an alignment limit, a cancellation barrier that another
    # task's counted failure sent), so it is not a failure of its own.
    CheckpointFailureReason.CHECKPOINT_DECLINED_TASK_NOT_READY,
    CheckpointFailureReason.CHECKPOINT_DECLINED_TASK_CLOSING,
    CheckpointFailureReason.CHECKPOINT_DECLINED_ALIGNMENT_LIMIT_EXCEEDED,
    CheckpointFailureReason.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER,
    CheckpointFailureReason.CHECKPOINT_DECLINED_SUBSUMED,
    CheckpointFailureReason.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM,
}
MAX_QUEUED_REQUESTS = 1000
BACKLOG_POLL_MS = 200  # how often a backlog without checkpoints is asked whether it is over
RECENT_EXPIRED = 16  # as Flink's NUM_GHOST_CHECKPOINT_IDS


class IllegalCheckpointStateError(RuntimeError):
    """The coordinator was asked to do what its rules never allow (Flink's
    ``IllegalStateException``): a bug in the caller, not a failed checkpoint."""


class CheckpointException(Exception):
    """A checkpoint that did not complete, and why (a ``CheckpointFailureReason``)."""

    def __init__(self, reason: CheckpointFailureReason, detail: str = "") -> None:
        super().__init__(reason.message + (f" {detail}" if detail else ""))
        self.reason = reason


@dataclass(frozen=True)
class ExecutionAttempt:
    """One run of one subtask: a restart makes a new attempt, whose acks are the
    only ones the coordinator accepts for checkpoints it triggered after it."""

    vertex: str
    subtask: int
    attempt: int = 0

    @property
    def task(self) -> Tuple[str, int]:
        return (self.vertex, self.subtask)

    def __str__(self) -> str:
        return f"{self.vertex}#{self.subtask}"


@dataclass
class TaskStateSnapshot:
    """What a subtask acknowledges with: its state handles per operator uid."""

    operators: Dict[str, SubtaskState] = field(default_factory=dict)

    def handles(self) -> List[StateHandle]:
        return [h for s in self.operators.values() for h in s.handles()]


class JobGateway(Protocol):
    """What the coordinator needs from a runner. No method may block."""

    def tasks_to_trigger(self) -> Sequence[ExecutionAttempt]: ...

    def tasks_to_ack(self) -> Sequence[ExecutionAttempt]: ...

    def all_running(self) -> bool: ...

    def operator_parallelism(self) -> Dict[str, Tuple[int, int]]: ...

    def trigger(
        self, task: ExecutionAttempt, checkpoint_id: int, timestamp: int, options: CheckpointOptions
    ) -> None: ...

    def notify_complete(self, task: ExecutionAttempt, checkpoint_id: int) -> None: ...

    def notify_aborted(self, task: ExecutionAttempt, checkpoint_id: int) -> None: ...

    def fail_job(self, cause: BaseException) -> None: ...

    # Optional, looked up with getattr (a gateway without them works, with less to go on):
    # ``records_read() -> int``: records the sources read in this attempt, for the replay
    # rate of ``interval_ms="auto"``; ``is_processing_backlog() -> bool``: a source is
    # catching up (``interval_during_backlog_ms``), asked at every scheduler tick.


class AckResult(enum.Enum):
    SUCCESS = "success"
    DUPLICATE = "duplicate"
    UNKNOWN = "unknown"  # not a task this checkpoint waits for (for example an old attempt)
    DISCARDED = "discarded"  # the checkpoint is already gone


class PendingCheckpoint:
    """A triggered checkpoint waiting for its acknowledgements."""

    def __init__(
        self,
        checkpoint_id: int,
        timestamp: int,
        checkpoint_type: CheckpointType,
        tasks: Sequence[ExecutionAttempt],
        location: CheckpointStorageLocation,
        storage: CheckpointStorage,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self.timestamp = timestamp
        self.checkpoint_type = checkpoint_type
        self.location = location
        self.storage = storage
        self.not_yet_acknowledged: Set[ExecutionAttempt] = set(tasks)
        self.acknowledged: Dict[ExecutionAttempt, TaskStateSnapshot] = {}
        self.future: concurrent.futures.Future[CheckpointMetadata] = concurrent.futures.Future()
        self.disposed = False
        self.timeout: Optional[Cancellable] = None

    @property
    def is_savepoint(self) -> bool:
        return self.checkpoint_type.is_savepoint

    @property
    def fully_acknowledged(self) -> bool:
        return not self.not_yet_acknowledged and not self.disposed

    def acknowledge_task(self, task: ExecutionAttempt, state: TaskStateSnapshot) -> AckResult:
        if self.disposed:
            return AckResult.DISCARDED
        if task in self.not_yet_acknowledged:
            self.not_yet_acknowledged.discard(task)
            self.acknowledged[task] = state
            return AckResult.SUCCESS
        if task in self.acknowledged:
            return AckResult.DUPLICATE
        return AckResult.UNKNOWN

    def handles(self) -> List[StateHandle]:
        return [h for s in self.acknowledged.values() for h in s.handles()]

    def __repr__(self) -> str:
        return f"PendingCheckpoint({self.checkpoint_id}, waiting for {len(self.not_yet_acknowledged)})"


@dataclass
class _Request:
    checkpoint_type: CheckpointType
    periodic: bool
    target: Optional[str]
    future: concurrent.futures.Future[CheckpointMetadata]
    aligned: bool = False  # an aligned checkpoint even when the job's are unaligned


class CheckpointCoordinator:
    """Triggers, tracks, completes and aborts the checkpoints of one job.

    Restarts keep the same coordinator (ids keep increasing, statistics carry
    over); ``restore_latest`` tells it which checkpoint the new attempt starts from,
    and ``recover`` adopts what a dead run left in the same job directory.

    State files are deleted only through the completed store's registry, which
    counts the references of retained *and* pending checkpoints (acknowledgements
    register theirs as they arrive), and only inside this job's own directory; a
    checkpoint whose state refers to a file already deleted is aborted, never
    completed (see ``pyengine.storage.store``)."""

    def __init__(
        self,
        job_id: str,
        config: CheckpointConfig,
        storage: CheckpointStorage,
        gateway: JobGateway,
        timers: TimerService,
        *,
        rng: Optional[random.Random] = None,
        history_size: int = 10,
    ) -> None:
        self.job_id = job_id
        self.config = config
        self.storage = storage
        self.gateway = gateway
        self.timers = timers
        self.store = CompletedCheckpointStore(storage, config.retained)
        self.stats = CheckpointStatsTracker(history_size)
        self._rng = rng or random.Random()
        self._lock = threading.RLock()
        self._next_id = 1
        self._pending: Dict[int, PendingCheckpoint] = {}
        self._queue: Deque[_Request] = deque()
        self._recent: Deque[int] = deque(maxlen=RECENT_EXPIRED)
        self._scheduler: Optional[Cancellable] = None
        # The periodic timer's generation: a tick that fired while another thread held
        # the lock and replaced the timer (_reschedule: cancelling a timer that already
        # fired does nothing) is stale and returns, instead of scheduling a second one.
        self._tick_generation = 0
        self._pause_timer: Optional[Cancellable] = None
        self._periodic = False
        self._executing = False  # _execute_queued is running (a failed start re-enters it)
        self._last_completion_ms: Optional[int] = None
        self._consecutive_failures = 0
        self._shutdown = False
        # Set by the runner: what completed checkpoints record of the run (see CheckpointMetadata).
        self.job_name = ""
        self.lineage: List[Tuple[str, int]] = []
        # the interval: fixed, or chosen from the recovery goal (interval_ms="auto")
        self._policy: Optional[RecoveryGoalPolicy] = None
        self.estimate: Optional[Estimate] = None
        if getattr(config, "interval_ms", None) == "auto":
            self._policy = RecoveryGoalPolicy(config.recovery_goal_s)
            self.estimate = self._policy.decide()
        self._backlog_sources: Set[str] = set()
        self._backlog = False
        self._last_tick_ms: Optional[int] = None
        self._restore_mark: Optional[Tuple[int, int]] = None  # (when a restore began, its state size)
        self._catching_up = False  # restored, and no checkpoint completed since
        self._first_checkpoint = True  # none completed since the scheduler (re)started
        self._longer_than_interval = 0  # completed checkpoints in a row over twice the interval (-1: said)
        self._rate_mark: Optional[Tuple[int, int]] = None  # (when, records read) at the last sample
        self._publish_interval()

    # -- scheduler ---------------------------------------------------------------------------

    @property
    def interval_ms(self) -> Optional[int]:
        """The interval in use now: the fixed one, the one the recovery goal chose, or
        the backlog interval while a source reports a backlog (None: no periodic
        checkpoints during it)."""
        with self._lock:
            return self._current_interval()

    def _current_interval(self) -> Optional[int]:
        backlog_ms = getattr(self.config, "interval_during_backlog_ms", None)
        if self._backlog and backlog_ms is not None:
            return backlog_ms or None
        if self.estimate is not None:
            return self.estimate.interval_ms
        return int(self.config.interval_ms)

    def _publish_interval(self) -> None:
        """What the statistics show of the interval (``CheckpointStatsTracker.interval``)."""
        backlog_ms = getattr(self.config, "interval_during_backlog_ms", None)
        self.stats.report_interval(
            {
                "mode": "auto" if self._policy is not None else "fixed",
                "interval_ms": self._current_interval(),
                "base_interval_ms": self.estimate.interval_ms if self.estimate else int(self.config.interval_ms),
                "backlog": self._backlog,
                "interval_during_backlog_ms": backlog_ms,
                "max_recovery_s": self._policy.max_recovery_s if self._policy else None,
                "estimate": self.estimate.to_json() if self.estimate else None,
            },
            self.timers.now_ms(),
        )

    def set_processing_backlog(self, source: str, backlog: bool) -> None:
        """A source says it is (or no longer is) catching up on a backlog, as Flink's
        ``SplitEnumeratorContext.setIsProcessingBacklog``: the job is processing a backlog
        while any source says so, and checkpoints every ``interval_during_backlog_ms``
        meanwhile. The next checkpoint is rescheduled at once."""
        with self._lock:
            if backlog:
                self._backlog_sources.add(source)
            else:
                self._backlog_sources.discard(source)
            self._update_backlog()

    def _update_backlog(self) -> None:
        asked = getattr(self.gateway, "is_processing_backlog", None)
        backlog = bool(self._backlog_sources)
        if not backlog and asked is not None:
            try:
                backlog = bool(asked())
            except Exception:  # a gateway's failure must not stop the scheduler
                log.exception("is_processing_backlog failed")
        if backlog != self._backlog:
            self._backlog = backlog
            self._sample_rate()  # the rate so far belongs to the period that ends
            self._publish_interval()
            self._reschedule()

    def start_checkpoint_scheduler(self) -> None:
        """Starts periodic checkpoints after a random initial delay in
        [min_pause, interval], so jobs started together do not checkpoint together.

        After a restore (``restore_latest``, ``note_restored_from``) it is what ends
        the restore: the runner starts it once every task runs with its state, so the
        time since is the restore's duration, which ``interval_ms="auto"`` uses."""
        with self._lock:
            if self._shutdown:
                raise RuntimeError("the checkpoint coordinator is shut down")
            self.stop_checkpoint_scheduler(abort_pending=False)
            self._periodic = True
            now = self.timers.now_ms()
            if self._restore_mark is not None:
                began, size = self._restore_mark
                self._restore_mark = None
                if self._policy is not None:
                    self._policy.observe_restore((now - began) / 1000, size)
                    self.estimate = self._policy.decide()
                self._catching_up = True
            self._rate_mark = None
            self._first_checkpoint = True
            self._sample_rate()
            self._update_backlog()
            self._publish_interval()
            interval = self._current_interval()
            self._last_tick_ms = now
            if interval is None:
                self._scheduler = self._schedule_tick(BACKLOG_POLL_MS)
                return
            low = min(self.config.min_pause_ms, interval)
            delay = self._rng.uniform(low, interval + 1)
            self._scheduler = self._schedule_tick(delay)

    def _reschedule(self) -> None:
        """The interval changed: the next periodic checkpoint is due one new interval
        after the last one (at once if that is past)."""
        if not self._periodic or self._scheduler is None or self._last_tick_ms is None:
            return
        interval = self._current_interval()
        self._scheduler.cancel()
        if interval is None:
            self._scheduler = self._schedule_tick(BACKLOG_POLL_MS)
            return
        due = self._last_tick_ms + interval - self.timers.now_ms()
        self._scheduler = self._schedule_tick(max(0, due))

    def stop_checkpoint_scheduler(self, abort_pending: bool = True) -> None:
        """Stops periodic checkpoints. Queued periodic requests fail with
        PERIODIC_SCHEDULER_SHUTDOWN (none may start later, when a pending checkpoint
        ends); with ``abort_pending``, as Flink's, the other queued requests and every
        pending checkpoint fail with CHECKPOINT_COORDINATOR_SUSPEND."""
        with self._lock:
            self._periodic = False
            if self._scheduler is not None:
                self._scheduler.cancel()
                self._scheduler = None
            self._tick_generation += 1  # a tick already fired and waiting for the lock does nothing
            self._fail_queued(lambda r: r.periodic, CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN)
            if abort_pending:
                self._fail_queued(lambda r: True, CheckpointFailureReason.CHECKPOINT_COORDINATOR_SUSPEND)
                self.abort_pending_checkpoints(CheckpointFailureReason.CHECKPOINT_COORDINATOR_SUSPEND)

    def _fail_queued(self, which: Callable[[_Request], bool], reason: CheckpointFailureReason) -> None:
        failed = [r for r in self._queue if which(r)]
        if failed:
            self._queue = deque(r for r in self._queue if not which(r))
            for request in failed:
                request.future.set_exception(CheckpointException(reason))

    @property
    def is_periodic_checkpointing_started(self) -> bool:
        return self._periodic

    def job_status_changed(self, running: bool) -> None:
        """The job went to RUNNING (start the scheduler) or left it (stop it)."""
        if running:
            self.start_checkpoint_scheduler()
        else:
            self.stop_checkpoint_scheduler()

    def _schedule_tick(self, delay_ms: float) -> Cancellable:
        """The next periodic tick, of a new generation (the lock is held)."""
        self._tick_generation += 1
        generation = self._tick_generation
        return self.timers.schedule(delay_ms, lambda: self._on_scheduler_tick(generation))

    def _on_scheduler_tick(self, generation: Optional[int] = None) -> None:
        with self._lock:
            if not self._periodic or (generation is not None and generation != self._tick_generation):
                return  # stopped, or replaced while this tick waited for the lock
            self._scheduler = None  # the tick is spent: _update_backlog must not reschedule it
            self._update_backlog()
            interval = self._current_interval()
            if interval is None:  # a backlog without checkpoints: ask again soon
                self._scheduler = self._schedule_tick(BACKLOG_POLL_MS)
                return
            self._last_tick_ms = self.timers.now_ms()
            self._scheduler = self._schedule_tick(interval)
            try:
                self._request(CheckpointType.CHECKPOINT, periodic=True, target=None)
            except Exception:  # the timer thread must survive anything: the next tick tries again
                log.exception("periodic checkpoint request failed")

    # -- triggering ----------------------------------------------------------------------------

    def trigger_checkpoint(
        self, periodic: bool = False, *, aligned: bool = False
    ) -> concurrent.futures.Future[CheckpointMetadata]:
        """Requests a checkpoint; the future gives its metadata or a CheckpointException.

        ``aligned=True`` takes it aligned even in an unaligned job: the runner's final
        checkpoint at the end of bounded input, whose barrier must come after every
        record (a record it overtook would reach the sink after the last commit)."""
        with self._lock:
            return self._request(CheckpointType.CHECKPOINT, periodic=periodic, target=None, aligned=aligned)

    def trigger_savepoint(
        self, target_dir: str, *, stop: bool = False
    ) -> concurrent.futures.Future[CheckpointMetadata]:
        """A savepoint into ``target_dir``: never subsumed, never held back by
        ``min_pause``, and in an aligned job never counted against ``max_concurrent``.
        In an unaligned job it waits until no checkpoint is running and holds new ones
        back while it runs, as in Flink: a savepoint is aligned, and an unaligned
        barrier overtaking its barrier would cancel it at the gate. Its state is copied
        into ``target_dir``, so it lives on whatever happens to the job's directory.

        ``stop``: the savepoint of a stop (Flink's synchronous savepoint): the sources
        emit nothing after its barrier and the tasks fire no processing-time timer
        after their snapshot, so nothing is output past it; if it fails, they go on."""
        if not isinstance(target_dir, str) or not target_dir:
            raise ValueError(f"a savepoint needs a target directory, got {target_dir!r}")
        kind = CheckpointType.SYNC_SAVEPOINT if stop else CheckpointType.SAVEPOINT
        with self._lock:
            return self._request(kind, periodic=False, target=target_dir)

    def _request(
        self, checkpoint_type: CheckpointType, *, periodic: bool, target: Optional[str], aligned: bool = False
    ) -> concurrent.futures.Future[CheckpointMetadata]:
        future: concurrent.futures.Future[CheckpointMetadata] = concurrent.futures.Future()
        if self._shutdown:
            future.set_exception(CheckpointException(CheckpointFailureReason.CHECKPOINT_COORDINATOR_SHUTDOWN))
            return future
        if periodic and not self._periodic:
            future.set_exception(CheckpointException(CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN))
            return future
        if periodic and any(r.periodic for r in self._queue):
            # One queued periodic request is enough: the next tick would only pile up.
            future.set_exception(CheckpointException(CheckpointFailureReason.TOO_MANY_CHECKPOINT_REQUESTS))
            return future
        if len(self._queue) >= MAX_QUEUED_REQUESTS:
            future.set_exception(CheckpointException(CheckpointFailureReason.TOO_MANY_CHECKPOINT_REQUESTS))
            return future
        request = _Request(checkpoint_type, periodic, target, future, aligned)
        if checkpoint_type.is_savepoint:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)
        self._execute_queued()
        return future

    def _execute_queued(self) -> None:
        """Starts queued requests that the rules allow now; arranges a retry when
        only the minimum pause holds them back. Not re-entrant: a start that fails
        ends in _abort, which calls this again; the running loop goes on instead."""
        if self._executing:
            return
        self._executing = True
        try:
            while self._queue:
                request = self._queue[0]
                if request.checkpoint_type.is_savepoint:
                    if self.config.unaligned and self._pending:
                        return  # it runs alone: retried when the pending ones end
                else:
                    if self._num_pending_checkpoints() >= self.config.max_concurrent:
                        return  # retried when a pending checkpoint ends
                    if self.config.unaligned and any(p.is_savepoint for p in self._pending.values()):
                        return  # nothing runs beside an unaligned job's savepoint
                    wait = self._pause_left_ms()
                    if wait > 0:
                        if self._pause_timer is None:
                            self._pause_timer = self.timers.schedule(wait, self._on_pause_over)
                        return
                self._queue.popleft()
                self._start(request)
        finally:
            self._executing = False

    def _on_pause_over(self) -> None:
        with self._lock:
            self._pause_timer = None
            try:
                self._execute_queued()
            except Exception:  # the timer thread must survive anything
                log.exception("starting a queued checkpoint failed")

    def _pause_left_ms(self) -> float:
        if self._last_completion_ms is None or self.config.min_pause_ms == 0:
            return 0
        return self._last_completion_ms + self.config.min_pause_ms - self.timers.now_ms()

    def _num_pending_checkpoints(self) -> int:
        return sum(1 for p in self._pending.values() if not p.is_savepoint)

    def _stopped_reason(self, request: _Request) -> Optional[CheckpointFailureReason]:
        """Why ``request`` may no longer start, if it may not: the coordinator shut down,
        or (a periodic request) the periodic scheduler stopped."""
        if self._shutdown:
            return CheckpointFailureReason.CHECKPOINT_COORDINATOR_SHUTDOWN
        if request.periodic and not self._periodic:
            return CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN
        return None

    def _start(self, request: _Request) -> None:
        stopped = self._stopped_reason(request)
        if stopped is not None:
            request.future.set_exception(CheckpointException(stopped))
            return
        if not self.gateway.all_running():
            request.future.set_exception(CheckpointException(CheckpointFailureReason.NOT_ALL_REQUIRED_TASKS_RUNNING))
            return
        checkpoint_id = self._next_id
        self._next_id += 1
        now = self.timers.now_ms()
        savepoint = request.checkpoint_type.is_savepoint
        try:
            storage = self.storage
            if request.target is not None:
                storage = checkpoint_storage(request.target, f"savepoint-{self.job_id[:8]}-{checkpoint_id}")
            location = storage.location(checkpoint_id)
        except Exception as exc:
            # A storage failure fails this request only: the caller may be the timer
            # thread (which must live on) or a task whose acknowledgement started it.
            cause = CheckpointException(CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE, f"{exc!r}")
            log.warning("could not create the location of checkpoint %s: %s", checkpoint_id, exc)
            self.stats.report_pending(checkpoint_id, now, "savepoint" if savepoint else "checkpoint", 0)
            self.stats.report_failed(checkpoint_id, now, str(cause))
            request.future.set_exception(cause)
            self._count_failure(cause, savepoint)
            return
        # Re-checked now that the location exists (Flink's createPendingCheckpoint checks
        # again after the id and the location): a gateway or storage call above may have
        # shut the coordinator down or stopped the periodic scheduler, and a request still
        # running then must not start a checkpoint nobody will end.
        stopped = self._stopped_reason(request)
        if stopped is not None:
            self._dispose_location(location, storage, checkpoint_id)
            request.future.set_exception(CheckpointException(stopped))
            return
        pending = PendingCheckpoint(
            checkpoint_id, now, request.checkpoint_type, self.gateway.tasks_to_ack(), location, storage
        )
        pending.future = request.future
        self._pending[checkpoint_id] = pending
        self.stats.report_pending(
            checkpoint_id,
            now,
            "savepoint" if pending.is_savepoint else "checkpoint",
            len(pending.not_yet_acknowledged),
            interval_ms=self._current_interval() if request.periodic else None,
        )
        pending.timeout = self.timers.schedule(self.config.timeout_ms, lambda: self._expire(checkpoint_id))
        # savepoints are always aligned, and so is a checkpoint requested aligned
        unaligned = self.config.unaligned and not pending.is_savepoint and not request.aligned
        options = CheckpointOptions(request.checkpoint_type, unaligned=unaligned)
        try:
            for task in self.gateway.tasks_to_trigger():
                self.gateway.trigger(task, checkpoint_id, now, options)
        except Exception as exc:
            self._abort(pending, CheckpointException(CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE, f"{exc!r}"))

    def _expire(self, checkpoint_id: int) -> None:
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is not None:
                self._abort(pending, CheckpointException(CheckpointFailureReason.CHECKPOINT_EXPIRED))

    # -- messages from tasks -----------------------------------------------------------------

    def receive_acknowledge_message(
        self,
        checkpoint_id: int,
        task: ExecutionAttempt,
        state: Optional[TaskStateSnapshot] = None,
        metrics: Optional[SubtaskMetrics] = None,
    ) -> AckResult:
        """An acknowledgement; completes the checkpoint when it is the last one.
        Its files are registered as in use by the pending checkpoint at once, so no
        discarding deletes them before it completes or fails. State that cannot be
        used (unknown task, gone checkpoint) is deleted - only what this job's
        storage owns (see ``_discard``)."""
        state = state or TaskStateSnapshot()
        with self._lock:
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                if checkpoint_id in self._recent:
                    log.info("late acknowledgement of checkpoint %s from %s: discarding its state", checkpoint_id, task)
                else:
                    log.warning("acknowledgement of unknown checkpoint %s from %s: discarding", checkpoint_id, task)
                self._discard(state.handles(), checkpoint_id)
                self._remove_aborted_location(checkpoint_id)
                return AckResult.DISCARDED
            result = pending.acknowledge_task(task, state)
            if result is AckResult.SUCCESS:
                paths = stream_paths_of(state.handles())
                self.store.registry.register_pending(checkpoint_id, paths)
                self.stats.report_ack(checkpoint_id, str(task), metrics or SubtaskMetrics(), self.timers.now_ms())
                gone = self._deleted(paths)
                if gone is not None:
                    self._abort(pending, self._unrestorable(task, gone))
                elif pending.fully_acknowledged:
                    self.complete_pending_checkpoint(pending)
            elif result in (AckResult.UNKNOWN, AckResult.DISCARDED):
                self._discard(state.handles(), checkpoint_id)
            return result

    def receive_decline_message(
        self,
        checkpoint_id: int,
        task: ExecutionAttempt,
        cause: Optional[BaseException] = None,
        state: Optional[TaskStateSnapshot] = None,
    ) -> None:
        """A task could not take the checkpoint: it fails."""
        with self._lock:
            if state is not None:
                self._discard(state.handles(), checkpoint_id)
            pending = self._pending.get(checkpoint_id)
            if pending is None:
                self._remove_aborted_location(checkpoint_id)
                return
            reason = CheckpointFailureReason.CHECKPOINT_DECLINED
            if isinstance(cause, CheckpointException):
                reason = cause.reason
            if pending.is_savepoint and reason is CheckpointFailureReason.CHECKPOINT_SUBSUMED:
                # Only the coordinator subsumes, and never a savepoint: a task (a remote one
                # names its reason) saying so means a newer barrier overtook the savepoint's.
                reason = CheckpointFailureReason.CHECKPOINT_DECLINED_SUBSUMED
            detail = f"declined by {task}" + (f": {cause}" if cause is not None else "")
            self._abort(pending, CheckpointException(reason, detail))

    def _remove_aborted_location(self, checkpoint_id: int) -> None:
        """A task that took its snapshot after the checkpoint was aborted made its
        ``chk-<n>`` directory anew: it goes again (only for a checkpoint this
        coordinator aborted, never a pending or retained one)."""
        if checkpoint_id in self._recent and checkpoint_id not in self._pending:
            if not any(m.checkpoint_id == checkpoint_id for m in self.store.checkpoints):
                self.storage.delete_dir(self.storage.checkpoint_dir(checkpoint_id))

    def _deleted(self, paths: List[str]) -> Optional[str]:
        """The first of ``paths`` that was already deleted, if any."""
        registry = self.store.registry
        return next((p for p in paths if registry.was_deleted(p)), None)

    @staticmethod
    def _unrestorable(task: object, path: str) -> CheckpointException:
        return CheckpointException(
            CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE,
            f"the state of {task} uses {path}, which was already deleted: completed, this checkpoint "
            "could not be restored",
        )

    # -- completion and abortion -------------------------------------------------------------

    def complete_pending_checkpoint(self, pending: PendingCheckpoint) -> None:
        """All acks are in: ``_metadata`` makes it exist; then subsume, retain, notify.

        Refused with a CheckpointException (FINALIZE_CHECKPOINT_FAILURE), changing
        nothing, for a checkpoint that is not pending here or still waits for an
        acknowledgement: it would complete without that task's state."""
        with self._lock:
            checkpoint_id = pending.checkpoint_id
            if self._pending.get(checkpoint_id) is not pending or pending.disposed:
                raise CheckpointException(
                    CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE, f"checkpoint {checkpoint_id} is not pending"
                )
            if pending.not_yet_acknowledged:
                waiting = ", ".join(sorted(str(t) for t in pending.not_yet_acknowledged))
                raise CheckpointException(
                    CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE,
                    f"checkpoint {checkpoint_id} still waits for the acknowledgements of {waiting}",
                )
            gone = self._deleted(stream_paths_of(pending.handles()))
            if gone is not None:
                self._abort(pending, self._unrestorable("a task", gone))
                return
            metadata = self._metadata_of(pending)
            try:
                if pending.is_savepoint:
                    metadata = self._self_contained(metadata, pending.location)
                    pending.storage.write_metadata(checkpoint_id, metadata.to_json())
                else:
                    self.store.complete(metadata)
                path = pending.storage.uri_of(pending.storage.checkpoint_dir(checkpoint_id))
            except Exception as exc:  # a storage failure fails this checkpoint, not the coordinator
                self._abort(pending, CheckpointException(CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE, str(exc)))
                return
            self._pending.pop(checkpoint_id, None)
            pending.disposed = True
            if pending.timeout is not None:
                pending.timeout.cancel()
            if pending.is_savepoint:
                self._release_savepoint_sources(pending)
            self.store.registry.release_pending(checkpoint_id)  # what it keeps is registered as retained
            now = self.timers.now_ms()
            self.stats.report_completed(checkpoint_id, now, path)
            if not pending.is_savepoint:
                self._last_completion_ms = now
                self._consecutive_failures = 0
                self._on_completed()
                older_ones = [p for p in self._pending.values() if p.checkpoint_id < checkpoint_id]
                for older in [p for p in older_ones if not p.is_savepoint]:
                    self._abort(older, CheckpointException(CheckpointFailureReason.CHECKPOINT_SUBSUMED))
            for task in self.gateway.tasks_to_ack():
                self.gateway.notify_complete(task, checkpoint_id)
            pending.future.set_result(metadata)
            self._execute_queued()

    BACK_TO_BACK = 3  # completed checkpoints in a row over twice the interval before it is said

    def _warn_if_back_to_back(self, duration_ms: float) -> None:
        """Says once, as a warning, that checkpoints take more than twice their interval:
        each then starts as the last ends, and the job spends its time checkpointing,
        which nothing else shows (an interval given in seconds where milliseconds go, 2
        for 2 s, ran 16 checkpoints back to back without a word). Twice, not once: a
        checkpoint a little longer than its interval only spaces them a little more."""
        interval = self._current_interval()
        if interval is None or self._policy is not None or self._longer_than_interval < 0:
            return
        if getattr(self.config, "min_pause_ms", 0) or getattr(self.config, "max_concurrent", 1) > 1:
            return  # a pause between checkpoints, or overlapping ones: the user chose how they follow
        if duration_ms <= 2 * interval:
            self._longer_than_interval = 0
            return
        self._longer_than_interval += 1
        if self._longer_than_interval >= self.BACK_TO_BACK:
            self._longer_than_interval = -1  # said
            log.warning(
                BACK_TO_BACK_WARNING,
                self.job_name,
                self.BACK_TO_BACK,
                interval,
                duration_ms,
            )

    def _on_completed(self) -> None:
        """A checkpoint completed: what it measured goes to the interval's policy, and
        the next checkpoint is rescheduled when the interval changed."""
        self._sample_rate()
        self._catching_up = False
        self._update_backlog()
        stats = self.stats.latest_completed
        if stats is not None:
            self._warn_if_back_to_back(stats.end_to_end_duration_ms)
        if self._policy is None or stats is None:
            return
        slowest = max((s.async_duration_ms + s.sync_duration_ms for s in stats.subtasks.values()), default=0.0)
        first, self._first_checkpoint = self._first_checkpoint, False
        self._policy.observe_checkpoint(stats.end_to_end_duration_ms, stats.full_size, slowest, first=first)
        before = self._current_interval()
        self.estimate = self._policy.decide()
        self._publish_interval()
        if self._current_interval() != before:
            self._reschedule()

    def _sample_rate(self) -> None:
        """The sources' read rate since the last sample, if the gateway counts records:
        a catch-up rate while the job catches up (after a restore, during a backlog),
        else the input rate."""
        counted = getattr(self.gateway, "records_read", None)
        if counted is None or self._policy is None:
            return
        try:
            records = int(counted())
        except Exception:
            log.exception("records_read failed")
            return
        now = self.timers.now_ms()
        mark, self._rate_mark = self._rate_mark, (now, records)
        if mark is None or records < mark[1] or now - mark[0] < 50:
            if mark is not None and records >= mark[1]:
                self._rate_mark = mark  # too short to measure: keep the older mark
            return
        rate = (records - mark[1]) / ((now - mark[0]) / 1000)
        if self._catching_up or self._backlog:
            self._policy.observe_catchup_rate(rate)
        else:
            self._policy.observe_input_rate(rate)

    def _self_contained(self, metadata: CheckpointMetadata, location: CheckpointStorageLocation) -> CheckpointMetadata:
        """The savepoint's metadata with every state file it uses copied into its own
        directory: tasks write a savepoint's state where they write checkpoints (the
        job's ``chk-<n>/`` and ``shared/``), which retention and recovery clean up."""
        root = location.storage.uri_of(location.storage.root) + "/"
        copies: Dict[str, StreamStateHandle] = {}

        def moved(stream: StateHandle) -> StateHandle:
            if not isinstance(stream, StreamStateHandle) or stream.path.startswith(root):
                return stream
            if stream.path not in copies:
                src_fs, src_path, _ = resolve(stream.path)
                name = posixpath.basename(src_path)
                while any(c.path.endswith("/" + name) for c in copies.values()):
                    name = "_" + name
                target = f"{location.directory}/{name}"
                with src_fs.open_input_stream(src_path) as src, location.storage.fs.open_output_stream(target) as out:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                copies[stream.path] = StreamStateHandle(location.storage.uri_of(target), stream.size, stream.checksum)
            return copies[stream.path]

        def relocated(handle: StateHandle) -> StateHandle:
            if isinstance(handle, KeyGroupsStateHandle):
                return dataclasses.replace(handle, stream=moved(handle.stream), shared=())
            return moved(handle)

        operators = {
            uid: OperatorState(
                op.parallelism,
                op.max_parallelism,
                {
                    i: SubtaskState([relocated(h) for h in sub.keyed], [relocated(h) for h in sub.operator])
                    for i, sub in op.subtasks.items()
                },
            )
            for uid, op in metadata.operators.items()
        }
        return dataclasses.replace(metadata, operators=operators, shared=[])

    def _release_savepoint_sources(self, pending: PendingCheckpoint) -> None:
        """After a savepoint completed (self-contained): the files its tasks wrote into
        the job's ``shared/`` are held until a newer checkpoint completes (tasks build
        their next deltas on the savepoint's chain, as on a checkpoint's); its
        ``chk-<n>/`` in the job's directory is no longer needed."""
        original = self._metadata_of(pending)
        own = [p for p in shared_files(original) if owns_path(self.storage, p)]
        self.store.anchor(pending.checkpoint_id, own)
        if pending.storage is not self.storage:
            self.storage.delete_dir(self.storage.checkpoint_dir(pending.checkpoint_id))

    def _metadata_of(self, pending: PendingCheckpoint) -> CheckpointMetadata:
        parallelism = self.gateway.operator_parallelism()
        operators: Dict[str, OperatorState] = {}
        for task, snapshot in pending.acknowledged.items():
            for uid, sub in snapshot.operators.items():
                p, max_p = parallelism.get(uid, (0, 0))
                op = operators.setdefault(uid, OperatorState(parallelism=p, max_parallelism=max_p))
                op.subtasks[task.subtask] = sub
        return CheckpointMetadata(
            job_id=self.job_id,
            checkpoint_id=pending.checkpoint_id,
            timestamp=pending.timestamp,
            type="savepoint" if pending.is_savepoint else "checkpoint",
            operators=operators,
            job_name=self.job_name,
            runs=[*self.lineage, (self.job_id, pending.checkpoint_id)],
        )

    def _abort(self, pending: PendingCheckpoint, cause: CheckpointException) -> None:
        """Ends a pending checkpoint as failed: deletes what its tasks acknowledged and
        its location, notifies the tasks, fails its future. A savepoint aborted as
        CHECKPOINT_SUBSUMED is refused (``IllegalCheckpointStateError``), changing nothing:
        savepoints are never subsumed, so the caller has a bug (Flink's
        ``PendingCheckpoint.abort`` says the same)."""
        checkpoint_id = pending.checkpoint_id
        if pending.is_savepoint and cause.reason is CheckpointFailureReason.CHECKPOINT_SUBSUMED:
            raise IllegalCheckpointStateError(
                f"savepoint {checkpoint_id} cannot be aborted as {cause.reason.name}: savepoints are never "
                "subsumed. Subsume checkpoints only (abort_pending_checkpoints(CHECKPOINT_SUBSUMED) leaves "
                "savepoints pending), or abort the savepoint with the reason it failed for"
            )
        if self._pending.pop(checkpoint_id, None) is None:
            return
        pending.disposed = True
        if pending.timeout is not None:
            pending.timeout.cancel()
        self._recent.append(checkpoint_id)
        self.store.registry.release_pending(checkpoint_id)
        self._discard(pending.handles(), checkpoint_id)
        self._dispose_location(pending.location, pending.storage, checkpoint_id)
        self.stats.report_failed(checkpoint_id, self.timers.now_ms(), str(cause))
        for task in self.gateway.tasks_to_ack():
            self.gateway.notify_aborted(task, checkpoint_id)
        pending.future.set_exception(cause)
        self._count_failure(cause, pending.is_savepoint)
        if not self._shutdown:
            self._execute_queued()

    def _dispose_location(
        self, location: CheckpointStorageLocation, storage: CheckpointStorage, checkpoint_id: int
    ) -> None:
        """Deletes what a checkpoint that will not complete wrote where it was going:
        its ``chk-<n>``; for a savepoint also the job directory's ``chk-<n>`` (its tasks
        write there) and the ``savepoint-<run>-<n>`` directory made for it in the target,
        so a failed savepoint leaves nothing that looks like one - that directory only
        once it holds no file, so nothing else written there is ever deleted."""
        try:
            location.dispose()
            if storage is not self.storage:
                self.storage.delete_dir(self.storage.checkpoint_dir(checkpoint_id))
                if not storage.list_files():
                    storage.delete_dir(storage.root)
        except OSError as exc:
            log.warning("could not delete the location of failed checkpoint %s: %s", checkpoint_id, exc)

    def _count_failure(self, cause: CheckpointException, savepoint: bool) -> None:
        """Counts a failed checkpoint against ``tolerable_failures``; past it, the job fails."""
        if cause.reason in _NOT_COUNTED or savepoint:
            return
        self._consecutive_failures += 1
        if self._consecutive_failures > self.config.tolerable_failures:
            self._consecutive_failures = 0
            self.gateway.fail_job(
                CheckpointException(
                    cause.reason,
                    f"exceeded tolerable_failures={self.config.tolerable_failures}: {cause}",
                )
            )

    def abort_pending_checkpoints(self, reason: CheckpointFailureReason) -> None:
        """Aborts every pending checkpoint, for example on failover; with
        CHECKPOINT_SUBSUMED, the savepoints stay (a savepoint is never subsumed)."""
        with self._lock:
            for pending in list(self._pending.values()):
                if reason is CheckpointFailureReason.CHECKPOINT_SUBSUMED and pending.is_savepoint:
                    continue
                self._abort(pending, CheckpointException(reason))

    def _discard(self, handles: List[StateHandle], checkpoint_id: Optional[int]) -> None:
        """Deletes the files of state no checkpoint will use: only files of this job's
        ``shared/`` that nothing uses, and files directly in ``chk-<checkpoint_id>/``
        unless that checkpoint is retained - never anything else an acknowledgement
        names (a forged one could name any path)."""
        if checkpoint_id is not None and any(m.checkpoint_id == checkpoint_id for m in self.store.checkpoints):
            checkpoint_id = None
        try:
            discard_unreferenced(handles, self.store.registry, storage=self.storage, checkpoint_id=checkpoint_id)
        except OSError as exc:
            log.warning("could not delete discarded state: %s", exc)

    # -- restore and shutdown ----------------------------------------------------------------

    def recover(self) -> Optional[CheckpointMetadata]:
        """For a run that continues in the job directory a dead run left: the store
        adopts the checkpoints retention and restorability need and deletes the rest
        (``CompletedCheckpointStore.recover``), and new checkpoint ids start past every
        ``chk-<n>`` found there, completed or not, so none is reused. Returns the
        checkpoint to restore, or None."""
        with self._lock:
            latest = self.store.recover()
            self._next_id = max(self._next_id, self.store.highest_checkpoint_id + 1)
            return latest

    def restore_latest(self) -> Optional[CheckpointMetadata]:
        """The checkpoint a (re)started job resumes from: the latest completed one.

        Called on failover, after the pending checkpoints were aborted and before the
        new attempt starts, so nothing that may still complete is being written: the
        shared files nothing uses are the failed attempt's leftovers (a snapshot that
        failed after writing its delta), and go."""
        with self._lock:
            if not self._pending:
                try:
                    self.store.delete_unused_shared()
                except OSError as exc:
                    log.warning("could not delete unused shared state files: %s", exc)
            latest = self.store.latest()
            if latest is not None:
                self._next_id = max(self._next_id, latest.checkpoint_id + 1)
                self._restore_mark = (self.timers.now_ms(), self._state_size(latest))
                self.stats.report_restored(
                    latest.checkpoint_id,
                    self.timers.now_ms(),
                    self.storage.uri_of(self.storage.checkpoint_dir(latest.checkpoint_id)),
                    False,
                )
            return latest

    def note_restored_from(self, metadata: CheckpointMetadata, path: str) -> None:
        """The job started from an external checkpoint or savepoint."""
        with self._lock:
            self._next_id = max(self._next_id, metadata.checkpoint_id + 1)
            self._restore_mark = (self.timers.now_ms(), self._state_size(metadata))
            self.stats.report_restored(metadata.checkpoint_id, self.timers.now_ms(), path, metadata.type == "savepoint")

    def _state_size(self, metadata: CheckpointMetadata) -> int:
        """The full size of a checkpoint's state: as its statistics recorded it, else
        the sizes of the files its metadata lists."""
        stats = self.stats.latest_completed
        if stats is not None and stats.id == metadata.checkpoint_id and stats.full_size:
            return int(stats.full_size)
        total = 0
        for handle in metadata.handles():
            try:
                total += int(handle.state_size)
            except Exception:
                pass
        return total

    @property
    def pending_checkpoints(self) -> Dict[int, PendingCheckpoint]:
        with self._lock:
            return dict(self._pending)

    @property
    def num_queued_requests(self) -> int:
        return len(self._queue)

    def shutdown(self) -> None:
        """Stops for good: every queued request and pending checkpoint fails with
        CHECKPOINT_COORDINATOR_SHUTDOWN - periodic requests too, failed before the
        scheduler stops (which would say PERIODIC_SCHEDULER_SHUTDOWN), as in Flink, so
        a caller sees the reason that holds."""
        with self._lock:
            self._shutdown = True
            self._fail_queued(lambda r: True, CheckpointFailureReason.CHECKPOINT_COORDINATOR_SHUTDOWN)
            self.stop_checkpoint_scheduler(abort_pending=False)
            self.abort_pending_checkpoints(CheckpointFailureReason.CHECKPOINT_COORDINATOR_SHUTDOWN)
            if self._pause_timer is not None:
                self._pause_timer.cancel()
