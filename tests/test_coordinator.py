"""CheckpointCoordinator rules, driven by a manual timer service (no sleeps)."""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

import pytest

from pyengine.coordinator import (
    AckResult,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointException,
    ExecutionAttempt,
    ManualTimerService,
    SubtaskMetrics,
    TaskStateSnapshot,
)
from pyengine.io import CheckpointFailureReason
from pyengine.storage import checkpoint_storage
from pyengine.storage.metadata import SubtaskState, load_metadata

SOURCE = [ExecutionAttempt("source", i) for i in range(2)]
SINK = [ExecutionAttempt("sink", 0)]


class Gateway:
    def __init__(self) -> None:
        self.running = True
        self.triggered: List[Tuple[str, int]] = []
        self.completed: List[Tuple[str, int]] = []
        self.aborted: List[Tuple[str, int]] = []
        self.failures: List[BaseException] = []

    def tasks_to_trigger(self):
        return SOURCE

    def tasks_to_ack(self):
        return SOURCE + SINK

    def all_running(self) -> bool:
        return self.running

    def operator_parallelism(self) -> Dict[str, Tuple[int, int]]:
        return {"src": (2, 128), "sink": (1, 128)}

    def trigger(self, task, checkpoint_id, timestamp, options) -> None:
        self.triggered.append((str(task), checkpoint_id))

    def notify_complete(self, task, checkpoint_id) -> None:
        self.completed.append((str(task), checkpoint_id))

    def notify_aborted(self, task, checkpoint_id) -> None:
        self.aborted.append((str(task), checkpoint_id))

    def fail_job(self, cause) -> None:
        self.failures.append(cause)

    def triggered_ids(self) -> List[int]:
        return sorted({c for _, c in self.triggered})


@pytest.fixture
def env(tmp_path):
    def make(**config):
        storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
        gateway = Gateway()
        timers = ManualTimerService()
        coordinator = CheckpointCoordinator(
            "job", CheckpointConfig(**config), storage, gateway, timers, rng=random.Random(1)
        )
        return coordinator, gateway, timers, storage

    return make


def state_file(storage, checkpoint_id: int, name: str) -> TaskStateSnapshot:
    """A real file in the checkpoint's location, as a task would write it."""
    stream = storage.location(checkpoint_id).create_output_stream(name)
    stream.write(b"x" * 100)
    handle = stream.close_and_get_handle()
    return TaskStateSnapshot({"src": SubtaskState(operator=[handle])})


def ack_all(coordinator, storage, checkpoint_id: int) -> None:
    for task in SOURCE + SINK:
        coordinator.receive_acknowledge_message(checkpoint_id, task, state_file(storage, checkpoint_id, f"{task}"))


def exists(storage, snapshot: TaskStateSnapshot) -> bool:
    from pyengine.storage.filesystem import resolve

    path = snapshot.handles()[0].path
    fs, p, _ = resolve(path)
    return fs.get_file_info(p).type.name == "File"


def test_periodic_scheduler_starts_after_a_random_initial_delay_and_repeats(env) -> None:
    coordinator, gateway, timers, _storage = env(interval_ms=1000, max_concurrent=5)
    coordinator.start_checkpoint_scheduler()
    assert gateway.triggered == []
    timers.advance(1001)  # the initial delay is at most one interval
    assert gateway.triggered_ids() == [1]
    assert {t for t, _ in gateway.triggered} == {"source#0", "source#1"}  # only sources are triggered
    timers.advance(1000)
    assert gateway.triggered_ids() == [1, 2]
    coordinator.job_status_changed(running=False)
    assert not coordinator.is_periodic_checkpointing_started
    assert coordinator.pending_checkpoints == {}  # stopping aborts what was pending
    timers.advance(5000)
    assert gateway.triggered_ids() == [1, 2]
    coordinator.job_status_changed(running=True)
    timers.advance(1001)
    assert gateway.triggered_ids() == [1, 2, 3]


def test_initial_delays_differ_between_jobs(env) -> None:
    delays = set()
    for seed in range(5):
        coordinator, gateway, timers, _ = env(interval_ms=10_000)
        coordinator._rng = random.Random(seed)
        coordinator.start_checkpoint_scheduler()
        step = 0
        while not gateway.triggered:
            timers.advance(100)
            step += 1
        delays.add(step)
    assert len(delays) > 1


def test_completion_writes_metadata_notifies_every_subtask_and_retains(env) -> None:
    coordinator, gateway, _timers, storage = env(retained=1)
    first = coordinator.trigger_checkpoint()
    ack_all(coordinator, storage, 1)
    metadata = first.result(0)
    assert metadata.checkpoint_id == 1
    assert sorted(gateway.completed) == sorted((str(t), 1) for t in SOURCE + SINK)
    on_disk = load_metadata(storage.uri_of(storage.checkpoint_dir(1)))
    assert on_disk.operators["src"].parallelism == 2
    coordinator.trigger_checkpoint()
    ack_all(coordinator, storage, 2)
    assert storage.completed_checkpoint_ids() == [2]  # retained=1 dropped checkpoint 1
    assert coordinator.stats.counts["completed"] == 2


def test_max_concurrent_queues_requests_and_min_pause_delays_them(env) -> None:
    coordinator, gateway, timers, storage = env(max_concurrent=1, min_pause_ms=500)
    coordinator.trigger_checkpoint()
    queued = coordinator.trigger_checkpoint()
    assert gateway.triggered_ids() == [1] and coordinator.num_queued_requests == 1
    ack_all(coordinator, storage, 1)
    assert gateway.triggered_ids() == [1]  # the minimum pause is not over
    timers.advance(499)
    assert gateway.triggered_ids() == [1]
    timers.advance(1)
    assert gateway.triggered_ids() == [1, 2]
    ack_all(coordinator, storage, 2)
    assert queued.result(0).checkpoint_id == 2


def test_savepoints_bypass_max_concurrent_and_are_never_subsumed(env, tmp_path) -> None:
    coordinator, gateway, _timers, storage = env(max_concurrent=1)
    coordinator.trigger_checkpoint()
    savepoint = coordinator.trigger_savepoint(str(tmp_path / "sp"))
    assert gateway.triggered_ids() == [1, 2]
    coordinator.trigger_checkpoint()  # queued behind checkpoint 1
    ack_all(coordinator, storage, 1)
    assert 2 in coordinator.pending_checkpoints  # completing 1 did not touch the savepoint
    for task in SOURCE + SINK:
        coordinator.receive_acknowledge_message(2, task)
    assert savepoint.result(0).type == "savepoint"
    assert coordinator.stats.latest_savepoint is not None and "sp" in coordinator.stats.latest_savepoint.external_path


def test_newer_completion_subsumes_older_pending_checkpoints(env) -> None:
    coordinator, gateway, _timers, storage = env(max_concurrent=3)
    old = coordinator.trigger_checkpoint()
    coordinator.trigger_checkpoint()
    kept = state_file(storage, 1, "early")
    coordinator.receive_acknowledge_message(1, SOURCE[0], kept)
    ack_all(coordinator, storage, 2)
    with pytest.raises(CheckpointException) as info:
        old.result(0)
    assert info.value.reason is CheckpointFailureReason.CHECKPOINT_SUBSUMED
    assert not exists(storage, kept)  # the subsumed checkpoint's state is deleted
    assert gateway.failures == []  # subsumption is not a failure


def test_acknowledgement_results(env) -> None:
    coordinator, _gateway, _timers, storage = env()
    coordinator.trigger_checkpoint()
    assert coordinator.receive_acknowledge_message(1, SOURCE[0]) is AckResult.SUCCESS
    assert coordinator.receive_acknowledge_message(1, SOURCE[0]) is AckResult.DUPLICATE
    stale = state_file(storage, 1, "stale")
    old_attempt = ExecutionAttempt("source", 1, attempt=7)
    assert coordinator.receive_acknowledge_message(1, old_attempt, stale) is AckResult.UNKNOWN
    assert not exists(storage, stale)
    late = state_file(storage, 9, "late")
    assert coordinator.receive_acknowledge_message(9, SOURCE[0], late) is AckResult.DISCARDED
    assert not exists(storage, late)


def test_expired_checkpoint_is_aborted_and_late_acks_are_discarded(env) -> None:
    coordinator, gateway, timers, storage = env(timeout_ms=1000, tolerable_failures=5)
    future = coordinator.trigger_checkpoint()
    early = state_file(storage, 1, "early")
    coordinator.receive_acknowledge_message(1, SOURCE[0], early)
    timers.advance(1000)
    with pytest.raises(CheckpointException) as info:
        future.result(0)
    assert info.value.reason is CheckpointFailureReason.CHECKPOINT_EXPIRED
    assert not exists(storage, early)
    assert sorted(gateway.aborted) == sorted((str(t), 1) for t in SOURCE + SINK)
    late = state_file(storage, 1, "late")
    assert coordinator.receive_acknowledge_message(1, SOURCE[1], late) is AckResult.DISCARDED
    assert not exists(storage, late)
    assert coordinator.stats.counts["failed"] == 1 and coordinator.stats.latest_failed.id == 1


def test_decline_aborts_and_tolerable_failures_fail_the_job(env) -> None:
    coordinator, gateway, _timers, _storage = env(tolerable_failures=1)
    coordinator.trigger_checkpoint()
    coordinator.receive_decline_message(1, SINK[0], RuntimeError("disk full"))
    assert gateway.failures == []  # one failure is tolerated
    coordinator.trigger_checkpoint()
    coordinator.receive_decline_message(2, SINK[0], RuntimeError("disk full"))
    assert len(gateway.failures) == 1 and "tolerable_failures=1" in str(gateway.failures[0])


def test_a_completed_checkpoint_resets_the_failure_count(env) -> None:
    coordinator, gateway, _timers, storage = env(tolerable_failures=1)
    coordinator.trigger_checkpoint()
    coordinator.receive_decline_message(1, SINK[0])
    coordinator.trigger_checkpoint()
    ack_all(coordinator, storage, 2)
    coordinator.trigger_checkpoint()
    coordinator.receive_decline_message(3, SINK[0])
    assert gateway.failures == []


def test_no_trigger_unless_every_subtask_runs(env) -> None:
    coordinator, gateway, _timers, _storage = env()
    gateway.running = False
    future = coordinator.trigger_checkpoint()
    with pytest.raises(CheckpointException) as info:
        future.result(0)
    assert info.value.reason is CheckpointFailureReason.NOT_ALL_REQUIRED_TASKS_RUNNING
    assert gateway.triggered == [] and gateway.failures == []


def test_statistics_summary_and_history_as_json(env) -> None:
    coordinator, _gateway, timers, _storage = env()
    for checkpoint_id in (1, 2):
        coordinator.trigger_checkpoint()
        timers.advance(100 * checkpoint_id)
        for task in SOURCE + SINK:
            coordinator.receive_acknowledge_message(
                checkpoint_id,
                task,
                metrics=SubtaskMetrics(sync_duration_ms=1, async_duration_ms=5, checkpointed_size=10, full_size=20),
            )
    data = coordinator.stats.to_json()
    assert data["counts"]["completed"] == 2
    assert data["summary"]["end_to_end_duration_ms"]["min"] == 100
    assert data["summary"]["end_to_end_duration_ms"]["max"] == 200
    assert data["summary"]["checkpointed_size"]["avg"] == 30
    newest = data["history"][0]
    assert newest["id"] == 2 and newest["status"] == "COMPLETED" and newest["num_acknowledged_subtasks"] == 3
    assert newest["subtasks"]["sink#0"]["async_duration_ms"] == 5


def test_invalid_configuration_names_the_setting() -> None:
    for bad, name in (
        ({"interval_ms": 0}, "interval_ms"),
        ({"min_pause_ms": -1}, "min_pause_ms"),
        ({"retained": 0}, "retained"),
        ({"unaligned": True, "mode": "at_least_once"}, "unaligned"),
        ({"mode": "twice"}, "mode"),
    ):
        with pytest.raises(ValueError, match=name):
            CheckpointConfig(**bad)
