"""The coordinator's edge rules (issue 12, from Flink 1.11's coordinator tests):
storage failures at trigger time, stopping the scheduler, savepoints in unaligned
jobs, refusing to complete or subsume what must not be, and deleting only the
job's own files whatever an acknowledgement names."""

from __future__ import annotations

import random
import time
from typing import Any, Dict, List, Tuple

import pytest

from pyengine.coordinator import (
    AckResult,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointException,
    ExecutionAttempt,
    IllegalCheckpointStateError,
    ManualTimerService,
    TaskStateSnapshot,
)
from pyengine.coordinator.timers import ThreadTimerService
from pyengine.io import CheckpointFailureReason
from pyengine.storage import checkpoint_storage
from pyengine.storage.filesystem import resolve
from pyengine.storage.handles import KeyGroupsStateHandle, StreamStateHandle
from pyengine.storage.metadata import SubtaskState

TASKS = [ExecutionAttempt("source", 0), ExecutionAttempt("sink", 0)]


class Gateway:
    def __init__(self) -> None:
        self.triggered: List[Tuple[int, bool]] = []  # (checkpoint id, unaligned)
        self.completed: List[int] = []
        self.aborted: List[int] = []
        self.failures: List[BaseException] = []

    def tasks_to_trigger(self) -> List[ExecutionAttempt]:
        return TASKS[:1]

    def tasks_to_ack(self) -> List[ExecutionAttempt]:
        return TASKS

    def all_running(self) -> bool:
        return True

    def operator_parallelism(self) -> Dict[str, Tuple[int, int]]:
        return {"op": (1, 128)}

    def trigger(self, task: Any, checkpoint_id: int, timestamp: int, options: Any) -> None:
        self.triggered.append((checkpoint_id, options.unaligned))

    def notify_complete(self, task: Any, checkpoint_id: int) -> None:
        if task is TASKS[0]:
            self.completed.append(checkpoint_id)

    def notify_aborted(self, task: Any, checkpoint_id: int) -> None:
        if task is TASKS[0]:
            self.aborted.append(checkpoint_id)

    def fail_job(self, cause: BaseException) -> None:
        self.failures.append(cause)

    @property
    def ids(self) -> List[int]:
        return [c for c, _ in self.triggered]


@pytest.fixture
def make(tmp_path):
    def make(timers: Any = None, **config: Any) -> Tuple[CheckpointCoordinator, Gateway, Any, Any]:
        storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
        gateway = Gateway()
        timers = timers or ManualTimerService()
        coordinator = CheckpointCoordinator(
            "job", CheckpointConfig(**config), storage, gateway, timers, rng=random.Random(3)
        )
        return coordinator, gateway, timers, storage

    return make


def ack_all(coordinator: CheckpointCoordinator, checkpoint_id: int) -> None:
    for task in TASKS:
        coordinator.receive_acknowledge_message(checkpoint_id, task)


def reason_of(future: Any) -> CheckpointFailureReason:
    with pytest.raises(CheckpointException) as info:
        future.result(0)
    return info.value.reason


def failing_locations(storage: Any, *bad_ids: int) -> None:
    """Creating these checkpoints' locations fails, as a full or unreachable disk would."""
    location = storage.location

    def broken(checkpoint_id: int) -> Any:
        if checkpoint_id in bad_ids:
            raise OSError(f"no space left creating chk-{checkpoint_id}")
        return location(checkpoint_id)

    storage.location = broken


# -- a storage failure while creating a checkpoint's location --------------------------------


def test_a_location_failure_fails_the_request_and_not_the_caller(make) -> None:
    coordinator, gateway, _timers, storage = make(tolerable_failures=5)
    failing_locations(storage, 1)
    future = coordinator.trigger_checkpoint()  # must not raise
    assert reason_of(future) is CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE
    assert "no space left" in str(future.exception())
    assert gateway.triggered == [] and coordinator.pending_checkpoints == {}
    assert coordinator.stats.counts["failed"] == 1
    second = coordinator.trigger_checkpoint()  # the next one goes ahead
    ack_all(coordinator, 2)
    assert second.result(0).checkpoint_id == 2


def test_a_location_failure_on_a_periodic_tick_keeps_the_scheduler_going(make) -> None:
    coordinator, gateway, timers, storage = make(interval_ms=100, tolerable_failures=5)
    failing_locations(storage, 1)
    coordinator.start_checkpoint_scheduler()
    timers.advance(101)  # the first tick fails creating chk-1: nothing may escape the timer
    assert gateway.ids == []
    timers.advance(100)
    assert gateway.ids == [2]
    ack_all(coordinator, 2)
    timers.advance(100)
    assert gateway.ids == [2, 3]


def test_a_location_failure_on_the_timer_thread_does_not_kill_it(make) -> None:
    timers = ThreadTimerService()
    try:
        coordinator, gateway, _, storage = make(timers, interval_ms=5, tolerable_failures=100)
        failing_locations(storage, 1)
        coordinator.start_checkpoint_scheduler()
        deadline = time.monotonic() + 10
        while not gateway.ids and time.monotonic() < deadline:
            time.sleep(0.005)
        assert gateway.ids and gateway.ids[0] == 2, "no periodic checkpoint after the failed one"
        coordinator.shutdown()
    finally:
        timers.shutdown()


def test_a_queued_request_whose_location_fails_fails_alone(make) -> None:
    """The queued request starts inside another task's acknowledgement: the failure
    must come back in the request's own future, not in that acknowledgement."""
    coordinator, gateway, _timers, storage = make(max_concurrent=1, tolerable_failures=5)
    coordinator.trigger_checkpoint()
    queued = coordinator.trigger_checkpoint()
    failing_locations(storage, 2)
    ack_all(coordinator, 1)  # completes 1, starts the queued request: must not raise
    assert reason_of(queued) is CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE
    assert gateway.ids == [1] and coordinator.num_queued_requests == 0


def test_trigger_failures_count_against_tolerable_failures(make) -> None:
    coordinator, gateway, _timers, storage = make(tolerable_failures=1)
    failing_locations(storage, 1, 2)
    coordinator.trigger_checkpoint()
    assert gateway.failures == []
    coordinator.trigger_checkpoint()
    assert len(gateway.failures) == 1 and "tolerable_failures=1" in str(gateway.failures[0])


# -- stopping the periodic scheduler ---------------------------------------------------------


@pytest.mark.parametrize("abort_pending", [True, False])
def test_stopping_the_scheduler_fails_queued_periodic_requests(make, abort_pending) -> None:
    coordinator, gateway, timers, _storage = make(interval_ms=100, max_concurrent=1)
    coordinator.start_checkpoint_scheduler()
    timers.advance(101)
    assert gateway.ids == [1]
    timers.advance(100)  # the next tick queues behind checkpoint 1
    assert coordinator.num_queued_requests == 1
    queued = coordinator._queue[0].future
    coordinator.stop_checkpoint_scheduler(abort_pending=abort_pending)
    assert reason_of(queued) is CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN
    if not abort_pending:
        ack_all(coordinator, 1)  # checkpoint 1 ends: nothing queued may start now
    assert gateway.ids == [1] and coordinator.num_queued_requests == 0
    timers.advance(1000)
    assert gateway.ids == [1]


def test_a_periodic_request_while_the_scheduler_is_stopped_fails(make) -> None:
    coordinator, gateway, _timers, _storage = make()
    future = coordinator.trigger_checkpoint(periodic=True)
    assert reason_of(future) is CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN
    assert gateway.ids == []
    manual = coordinator.trigger_checkpoint()  # a manual request is not the scheduler's
    ack_all(coordinator, 1)
    assert manual.result(0).checkpoint_id == 1


def test_stopping_with_abort_fails_queued_manual_requests_as_suspended(make) -> None:
    coordinator, gateway, _timers, _storage = make(max_concurrent=1)
    pending = coordinator.trigger_checkpoint()
    queued = coordinator.trigger_checkpoint()
    coordinator.stop_checkpoint_scheduler()
    assert reason_of(pending) is CheckpointFailureReason.CHECKPOINT_COORDINATOR_SUSPEND
    assert reason_of(queued) is CheckpointFailureReason.CHECKPOINT_COORDINATOR_SUSPEND
    assert gateway.ids == [1]  # the abort of 1 did not start the queued one
    assert gateway.failures == []


# -- savepoints in an unaligned job ------------------------------------------------------------


def test_an_unaligned_jobs_savepoint_queues_behind_checkpoints_and_holds_new_ones_back(make, tmp_path) -> None:
    coordinator, gateway, _timers, _storage = make(unaligned=True, max_concurrent=1)
    coordinator.trigger_checkpoint()
    savepoint = coordinator.trigger_savepoint(str(tmp_path / "sp"))
    assert gateway.ids == [1], "a savepoint ran beside an unaligned checkpoint"
    later = coordinator.trigger_checkpoint()
    ack_all(coordinator, 1)
    assert gateway.triggered[-1] == (2, False)  # the savepoint, first in the queue, aligned
    assert gateway.ids == [1, 2], "a checkpoint ran beside the savepoint"
    ack_all(coordinator, 2)
    assert savepoint.result(0).type == "savepoint"
    assert gateway.triggered[-1] == (3, True)
    ack_all(coordinator, 3)
    assert later.result(0).checkpoint_id == 3


def test_an_unaligned_jobs_savepoint_runs_alone_whatever_max_concurrent(make, tmp_path) -> None:
    coordinator, gateway, _timers, _storage = make(unaligned=True, max_concurrent=3)
    coordinator.trigger_checkpoint()
    coordinator.trigger_savepoint(str(tmp_path / "sp"))
    coordinator.trigger_checkpoint()
    assert gateway.ids == [1]
    ack_all(coordinator, 1)
    assert gateway.ids == [1, 2]  # the savepoint, and nothing beside it
    ack_all(coordinator, 2)
    assert gateway.ids == [1, 2, 3]


def test_an_aligned_jobs_savepoint_still_runs_beside_a_checkpoint(make, tmp_path) -> None:
    coordinator, gateway, _timers, _storage = make(max_concurrent=1)
    coordinator.trigger_checkpoint()
    coordinator.trigger_savepoint(str(tmp_path / "sp"))
    assert gateway.ids == [1, 2]


# -- refusing to complete or subsume ---------------------------------------------------------


def test_completing_a_checkpoint_that_misses_acknowledgements_is_refused(make) -> None:
    coordinator, gateway, _timers, storage = make()
    future = coordinator.trigger_checkpoint()
    coordinator.receive_acknowledge_message(1, TASKS[0])
    pending = coordinator.pending_checkpoints[1]
    with pytest.raises(CheckpointException, match="sink#0") as info:
        coordinator.complete_pending_checkpoint(pending)
    assert info.value.reason is CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE
    assert 1 in coordinator.pending_checkpoints and not future.done()
    assert storage.completed_checkpoint_ids() == [] and gateway.completed == []
    coordinator.receive_acknowledge_message(1, TASKS[1])
    assert future.result(0).checkpoint_id == 1
    with pytest.raises(CheckpointException, match="not pending"):
        coordinator.complete_pending_checkpoint(pending)  # and not twice


def test_aborting_as_subsumed_leaves_savepoints(make, tmp_path) -> None:
    coordinator, _gateway, _timers, _storage = make(max_concurrent=2)
    checkpoint = coordinator.trigger_checkpoint()
    savepoint = coordinator.trigger_savepoint(str(tmp_path / "sp"))
    coordinator.abort_pending_checkpoints(CheckpointFailureReason.CHECKPOINT_SUBSUMED)
    assert reason_of(checkpoint) is CheckpointFailureReason.CHECKPOINT_SUBSUMED
    assert list(coordinator.pending_checkpoints) == [2] and not savepoint.done()
    ack_all(coordinator, 2)
    assert savepoint.result(0).type == "savepoint"


# -- Flink's CheckpointCoordinatorTest scenarios (issue 37) ----------------------------------


@pytest.mark.parametrize("how", ["declined", "expired"])
def test_a_failed_savepoint_discards_what_its_tasks_acknowledged(make, tmp_path, how) -> None:
    """As Flink's testAbortDiscardsState for a savepoint: what a task acknowledged goes
    (its files in the job's chk-<n>/ and shared/), and so does the savepoint-<run>-<n>
    directory made for it in the target, which would look like a savepoint."""
    coordinator, gateway, timers, storage = make(timeout_ms=10)
    target = tmp_path / "sp"
    savepoint = coordinator.trigger_savepoint(str(target))
    own = _file(tmp_path / "ckpt" / "job" / "chk-1" / "state")
    delta = _file(tmp_path / "ckpt" / "job" / "shared" / "delta-1")
    assert coordinator.receive_acknowledge_message(1, TASKS[0], _forged(own, delta)) is AckResult.SUCCESS
    if how == "declined":
        coordinator.receive_decline_message(1, TASKS[1], RuntimeError("snapshot failed"))
        assert reason_of(savepoint) is CheckpointFailureReason.CHECKPOINT_DECLINED
    else:
        timers.advance(10)
        assert reason_of(savepoint) is CheckpointFailureReason.CHECKPOINT_EXPIRED
    assert not _exists(own) and not _exists(delta)
    assert storage.fs.get_file_info(storage.checkpoint_dir(1)).type.name == "NotFound"
    assert sorted(p.name for p in target.iterdir()) == [], "the failed savepoint left its directory"
    assert gateway.aborted == [1] and gateway.failures == []  # a savepoint's failure is not counted
    again = coordinator.trigger_savepoint(str(target))  # the target still takes savepoints
    ack_all(coordinator, 2)
    assert again.result(0).type == "savepoint"
    assert [p.name for p in target.iterdir()] == ["savepoint-job-2"]


def test_a_failed_savepoint_leaves_other_files_in_its_directory(make, tmp_path) -> None:
    """The savepoint's directory goes only when empty: never a file this savepoint did not write."""
    coordinator, _gateway, _timers, _storage = make()
    savepoint = coordinator.trigger_savepoint(str(tmp_path / "sp"))
    foreign = _file(tmp_path / "sp" / "savepoint-job-1" / "notes.txt")
    coordinator.receive_decline_message(1, TASKS[0], RuntimeError("snapshot failed"))
    assert reason_of(savepoint) is CheckpointFailureReason.CHECKPOINT_DECLINED
    assert _exists(foreign)
    assert not (tmp_path / "sp" / "savepoint-job-1" / "chk-1").exists()


def test_queued_requests_at_shutdown_fail_as_coordinator_shutdown(make, tmp_path) -> None:
    """As Flink's testTriggerCheckpointWithShuttingDownCoordinator: a periodic request
    queued when the coordinator shuts down fails for the shutdown, not for the scheduler
    stopping on the way; so do queued manual requests and the pending checkpoint."""
    coordinator, gateway, timers, _storage = make(interval_ms=100, max_concurrent=1)
    coordinator.start_checkpoint_scheduler()
    timers.advance(101)
    assert gateway.ids == [1]
    timers.advance(100)  # the next tick queues behind checkpoint 1
    manual = coordinator.trigger_checkpoint()
    periodic = coordinator._queue[0].future
    assert coordinator._queue[0].periodic and coordinator.num_queued_requests == 2
    pending = coordinator.pending_checkpoints[1].future
    coordinator.shutdown()
    for future in (periodic, manual, pending):
        assert reason_of(future) is CheckpointFailureReason.CHECKPOINT_COORDINATOR_SHUTDOWN
    assert coordinator.num_queued_requests == 0 and gateway.ids == [1] and gateway.failures == []
    assert reason_of(coordinator.trigger_checkpoint()) is CheckpointFailureReason.CHECKPOINT_COORDINATOR_SHUTDOWN


def _stopping_while_starting(coordinator: CheckpointCoordinator, storage: Any, stop: Any) -> None:
    """Creating the location stops the coordinator's scheduler (or shuts it down) while
    the request is running, as Flink's testTriggerCheckpointAfterCancel does from its
    checkpoint id counter."""
    location = storage.location

    def stopping(checkpoint_id: int) -> Any:
        made = location(checkpoint_id)
        stop(coordinator)
        return made

    storage.location = stopping


@pytest.mark.parametrize("abort_pending", [True, False])
def test_a_periodic_request_running_when_the_scheduler_stops_fails(make, abort_pending) -> None:
    coordinator, gateway, _timers, storage = make(interval_ms=100)
    coordinator.start_checkpoint_scheduler()
    _stopping_while_starting(coordinator, storage, lambda c: c.stop_checkpoint_scheduler(abort_pending))
    future = coordinator.trigger_checkpoint(periodic=True)
    assert reason_of(future) is CheckpointFailureReason.PERIODIC_SCHEDULER_SHUTDOWN
    assert gateway.ids == [] and coordinator.pending_checkpoints == {}
    assert storage.fs.get_file_info(storage.checkpoint_dir(1)).type.name == "NotFound"
    assert gateway.failures == []
    manual = coordinator.trigger_checkpoint()  # not the scheduler's: it goes on
    ack_all(coordinator, 2)
    assert manual.result(0).checkpoint_id == 2


def test_a_request_running_when_the_coordinator_shuts_down_fails(make, tmp_path) -> None:
    coordinator, gateway, _timers, storage = make()
    _stopping_while_starting(coordinator, storage, lambda c: c.shutdown())
    future = coordinator.trigger_checkpoint()
    assert reason_of(future) is CheckpointFailureReason.CHECKPOINT_COORDINATOR_SHUTDOWN
    assert gateway.ids == [] and coordinator.pending_checkpoints == {}
    assert storage.fs.get_file_info(storage.checkpoint_dir(1)).type.name == "NotFound"


def test_aborting_a_pending_savepoint_as_subsumed_is_an_illegal_state(make, tmp_path) -> None:
    """As Flink's PendingCheckpoint.abort: a savepoint is never subsumed, so being asked to
    is a bug; refused, and the savepoint stays pending and completes."""
    coordinator, gateway, _timers, _storage = make()
    savepoint = coordinator.trigger_savepoint(str(tmp_path / "sp"))
    pending = coordinator.pending_checkpoints[1]
    with pytest.raises(IllegalCheckpointStateError, match=r"savepoint 1 .*never subsumed"):
        coordinator._abort(pending, CheckpointException(CheckpointFailureReason.CHECKPOINT_SUBSUMED))
    assert coordinator.pending_checkpoints == {1: pending} and not savepoint.done() and gateway.aborted == []
    ack_all(coordinator, 1)
    assert savepoint.result(0).type == "savepoint"


def test_a_tasks_decline_of_a_savepoint_as_subsumed_is_a_declined_subsumption(make, tmp_path) -> None:
    """A task's decline names its reason (a remote task's comes by name): CHECKPOINT_SUBSUMED
    from a task fails the savepoint as CHECKPOINT_DECLINED_SUBSUMED, not with an error in
    the message handler, and not as the subsumption only the coordinator does."""
    coordinator, gateway, _timers, _storage = make()
    savepoint = coordinator.trigger_savepoint(str(tmp_path / "sp"))
    subsumed = CheckpointException(CheckpointFailureReason.CHECKPOINT_SUBSUMED)
    coordinator.receive_decline_message(1, TASKS[0], subsumed)
    assert reason_of(savepoint) is CheckpointFailureReason.CHECKPOINT_DECLINED_SUBSUMED
    assert coordinator.pending_checkpoints == {} and gateway.aborted == [1] and gateway.failures == []


# -- forged acknowledgements: only the job's own files are deleted ------------------------------


def _file(path: Any) -> StreamStateHandle:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"precious")
    return StreamStateHandle(str(path), 8, "xxh3:0000000000000000")


def _exists(handle: StreamStateHandle) -> bool:
    fs, p, _ = resolve(handle.path)
    return fs.get_file_info(p).type.name == "File"


def _forged(*handles: StreamStateHandle) -> TaskStateSnapshot:
    keyed = [KeyGroupsStateHandle(h, 0, 127, backend="incremental") for h in handles]
    return TaskStateSnapshot({"op": SubtaskState(keyed=keyed, operator=list(handles))})


def test_a_forged_acknowledgement_cannot_delete_files_outside_the_jobs_directory(make, tmp_path) -> None:
    coordinator, _gateway, _timers, storage = make()
    outside = _file(tmp_path / "elsewhere" / "victim")
    sibling = _file(tmp_path / "ckpt" / "other-job" / "shared" / "victim")
    escape = StreamStateHandle(f"{storage.shared_dir}/../../elsewhere/victim", 8, "xxh3:0")
    job_file = _file(tmp_path / "ckpt" / "job" / "_job.json")  # the job directory's own records
    taskowned = _file(tmp_path / "ckpt" / "job" / "taskowned" / "x")
    forged = _forged(outside, sibling, escape, job_file, taskowned)
    assert coordinator.receive_acknowledge_message(99, TASKS[0], forged) is AckResult.DISCARDED
    coordinator.receive_decline_message(98, TASKS[0], state=forged)
    for handle in (outside, sibling, job_file, taskowned):
        assert _exists(handle), f"{handle.path} was deleted"


def test_a_forged_acknowledgement_cannot_delete_a_retained_or_pending_checkpoints_files(make, tmp_path) -> None:
    coordinator, _gateway, _timers, storage = make(max_concurrent=2)
    coordinator.trigger_checkpoint()
    retained_file = _file(tmp_path / "ckpt" / "job" / "chk-1" / "state")
    retained_shared = _file(tmp_path / "ckpt" / "job" / "shared" / "base-1")
    coordinator.receive_acknowledge_message(1, TASKS[0], _forged(retained_shared, retained_file))
    coordinator.receive_acknowledge_message(1, TASKS[1])
    metadata_file = StreamStateHandle(f"{storage.checkpoint_dir(1)}/_metadata", 1, "xxh3:0")
    coordinator.trigger_checkpoint()
    pending_shared = _file(tmp_path / "ckpt" / "job" / "shared" / "delta-2")
    coordinator.receive_acknowledge_message(2, TASKS[0], _forged(pending_shared))
    for checkpoint_id in (1, 5):  # the retained checkpoint's own id, and an unknown one
        forged = _forged(retained_file, retained_shared, metadata_file, pending_shared)
        assert coordinator.receive_acknowledge_message(checkpoint_id, TASKS[0], forged) is AckResult.DISCARDED
    old_attempt = ExecutionAttempt("sink", 0, attempt=9)  # an unknown attempt, on the pending checkpoint
    assert coordinator.receive_acknowledge_message(2, old_attempt, _forged(pending_shared)) is AckResult.UNKNOWN
    for handle in (retained_file, retained_shared, metadata_file, pending_shared):
        assert _exists(handle), f"{handle.path} was deleted"
    assert storage.completed_checkpoint_ids() == [1]


def test_a_late_acknowledgements_own_files_are_still_deleted(make, tmp_path) -> None:
    coordinator, _gateway, timers, _storage = make(timeout_ms=10, tolerable_failures=5)
    coordinator.trigger_checkpoint()
    timers.advance(10)  # checkpoint 1 expires
    own = _file(tmp_path / "ckpt" / "job" / "chk-1" / "late")
    new_shared = _file(tmp_path / "ckpt" / "job" / "shared" / "delta-late")
    assert coordinator.receive_acknowledge_message(1, TASKS[0], _forged(own, new_shared)) is AckResult.DISCARDED
    assert not _exists(own) and not _exists(new_shared)


@pytest.mark.parametrize("late", ["ack", "decline"])
def test_a_late_task_does_not_leave_the_aborted_checkpoints_directory_behind(make, late) -> None:
    """A task whose barrier came after the abort makes chk-<n> anew (its synchronous
    part opens the location); its late acknowledgement or decline removes it again."""
    coordinator, _gateway, timers, storage = make(timeout_ms=10, tolerable_failures=5)
    coordinator.trigger_checkpoint()
    timers.advance(10)
    storage.location(1)  # the late task's synchronous part
    if late == "ack":
        coordinator.receive_acknowledge_message(1, TASKS[0])
    else:
        coordinator.receive_decline_message(1, TASKS[0], RuntimeError("task ended"))
    assert storage.fs.get_file_info(storage.checkpoint_dir(1)).type.name == "NotFound"
    coordinator.trigger_checkpoint()
    storage.location(7)  # no checkpoint this coordinator aborted: left alone
    coordinator.receive_acknowledge_message(7, TASKS[0])
    assert storage.fs.get_file_info(storage.checkpoint_dir(7)).type.name == "Directory"
    assert storage.fs.get_file_info(storage.checkpoint_dir(2)).type.name == "Directory"  # pending


def test_a_snapshot_that_fails_in_its_async_part_declines_with_what_it_wrote(tmp_path, monkeypatch) -> None:
    """The operators' state files of a snapshot whose asynchronous part then fails go with
    the decline, and the coordinator deletes them: no checkpoint will reference them."""
    import os

    import pyengine as pe
    from pyengine.coordinator.coordinator import CheckpointCoordinator
    from pyengine.runtime.task import StreamTask

    declined: list = []
    real_decline = CheckpointCoordinator.receive_decline_message

    def spy(self, checkpoint_id, task, cause=None, state=None):  # type: ignore[no-untyped-def]
        if state is not None:
            streams = [getattr(h, "stream", h) for h in state.handles()]
            declined.append([st.path for st in streams if getattr(st, "path", None)])
        return real_decline(self, checkpoint_id, task, cause, state)

    real_write = StreamTask._write_channel_state

    def broken(self, checkpoint_id, inputs, outputs):  # type: ignore[no-untyped-def]
        # Writes fail until a declined snapshot had state files to go with it (the early
        # ones may have none); later ones, the final checkpoint's among them (in an
        # unaligned job the gate takes it unaligned too, with nothing in flight), write.
        if not any(declined):
            raise OSError("disk full while persisting in-flight data")
        return real_write(self, checkpoint_id, inputs, outputs)

    monkeypatch.setattr(CheckpointCoordinator, "receive_decline_message", spy)
    monkeypatch.setattr(StreamTask, "_write_channel_state", broken)

    class Count(pe.KeyedProcessFunction):
        def open(self, ctx):  # type: ignore[no-untyped-def]
            self.n = ctx.get_state(pe.ValueStateDescriptor("n", 0))

        def process_element(self, value, ctx):  # type: ignore[no-untyped-def]
            self.n.update(self.n.value() + 1)
            if value["i"] % 100 == 0:
                time.sleep(0.002)  # long enough for several checkpoints to start
            yield value

    env = pe.StreamEnvironment(
        parallelism=1,
        checkpointing=pe.CheckpointConfig(interval_ms=50, unaligned=True, tolerable_failures=1000),
        checkpoint_storage=str(tmp_path / "ckpt"),
        monitoring=None,
        buffer_size=64,
    )
    env.from_collection([{"k": i, "i": i} for i in range(20_000)]).key_by("k").process(Count()).uid("count").sink_to(
        pe.sinks.DiscardSink()
    )
    env.execute("declines", resume="never")
    files = [path for paths in declined for path in paths]
    assert declined, "no snapshot declined with its state"
    assert files and not [p for p in files if os.path.exists(p)], "a declined snapshot's files were left behind"
