"""Shared state files of incremental checkpoints: never deleted while a retained
checkpoint, or a snapshot that may still complete, uses them (issue 12).

A ``Job`` here is a real coordinator and real incremental backends, with the
runtime taken out: the test decides when each subtask takes its snapshot (a
barrier arriving), when its asynchronous part acknowledges, and when each queued
notification reaches it (its mailbox), so any order can be replayed exactly.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

import pyarrow as pa
import pytest

import pyengine.state.incremental as incremental_module
from pyengine.coordinator import (
    CheckpointConfig,
    CheckpointCoordinator,
    ExecutionAttempt,
    ManualTimerService,
    TaskStateSnapshot,
)
from pyengine.io import CheckpointFailureReason
from pyengine.state import ValueStateDescriptor, create_keyed_backend, key_group_range_for_subtask
from pyengine.storage import checkpoint_storage
from pyengine.storage.filesystem import resolve
from pyengine.storage.handles import StreamStateHandle
from pyengine.storage.metadata import CheckpointMetadata, SubtaskState, load_metadata

COUNT = ValueStateDescriptor("count", 0, pa.int64())
MAX_P = 8


@pytest.fixture(autouse=True)
def files_not_inline(monkeypatch) -> None:
    """Every delta and base becomes a file in shared/ (not bytes inside _metadata),
    so the file lifecycle is what these tests see."""
    monkeypatch.setattr(incremental_module, "INLINE_THRESHOLD", 0)


class QueueGateway:
    """Notifications wait in a per-subtask queue (the task's mailbox) until delivered."""

    def __init__(self, tasks: List[ExecutionAttempt]) -> None:
        self.tasks = tasks
        self.mailboxes: Dict[ExecutionAttempt, Deque[Tuple[str, int]]] = {t: deque() for t in tasks}
        self.triggered: List[int] = []
        self.failures: List[BaseException] = []
        self.running = True

    def tasks_to_trigger(self) -> List[ExecutionAttempt]:
        return self.tasks

    def tasks_to_ack(self) -> List[ExecutionAttempt]:
        return self.tasks

    def all_running(self) -> bool:
        return self.running

    def operator_parallelism(self) -> Dict[str, Tuple[int, int]]:
        return {"op": (len(self.tasks), MAX_P)}

    def trigger(self, task: ExecutionAttempt, checkpoint_id: int, timestamp: int, options: Any) -> None:
        if task is self.tasks[0]:
            self.triggered.append(checkpoint_id)

    def notify_complete(self, task: ExecutionAttempt, checkpoint_id: int) -> None:
        self.mailboxes[task].append(("complete", checkpoint_id))

    def notify_aborted(self, task: ExecutionAttempt, checkpoint_id: int) -> None:
        self.mailboxes[task].append(("aborted", checkpoint_id))

    def fail_job(self, cause: BaseException) -> None:
        self.failures.append(cause)


def state_of(backend: Any) -> Dict[Any, int]:
    count = backend.get_state(COUNT)
    out = {}
    for k in backend.keys("count"):
        backend.set_current_key(k)
        out[k] = count.value()
    return out


class Job:
    """One keyed operator at ``parallelism`` on incremental backends, driven by hand."""

    def __init__(self, tmp_path: Any, *, parallelism: int = 1, retained: int = 1, max_chain: int = 8, **config: Any):
        self.tmp_path = tmp_path
        self.storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
        self.tasks = [ExecutionAttempt("op", i) for i in range(parallelism)]
        self.gateway = QueueGateway(self.tasks)
        self.timers = ManualTimerService()
        self.coordinator = CheckpointCoordinator(
            "job",
            CheckpointConfig(retained=retained, **config),
            self.storage,
            self.gateway,
            self.timers,
            rng=random.Random(0),
        )
        self.max_chain = max_chain
        self.ranges = [key_group_range_for_subtask(MAX_P, parallelism, i) for i in range(parallelism)]
        self.backends = [self._backend(i) for i in range(parallelism)]
        self.keys = [[k for k in range(4000) if self._owner(k) == i] for i in range(parallelism)]
        # what each subtask's state was at each snapshot's synchronous part
        self.expected: Dict[int, Dict[int, Dict[Any, int]]] = {}
        self.snapshots: Dict[Tuple[int, int], Any] = {}  # (subtask, id) -> asynchronous part
        self.futures: Dict[int, Any] = {}
        # The coordinator's last line of defence (a checkpoint using a deleted file is
        # aborted) must never be needed: the backends build on live files only.
        self.unrestorable: List[str] = []
        refuse = self.coordinator._unrestorable

        def recorded(task: Any, path: str) -> Any:
            self.unrestorable.append(path)
            return refuse(task, path)

        self.coordinator._unrestorable = recorded  # type: ignore[method-assign]

    def _backend(self, i: int) -> Any:
        return create_keyed_backend(
            "incremental", max_parallelism=MAX_P, key_group_range=self.ranges[i], max_chain=self.max_chain
        )

    def _owner(self, key: int) -> int:
        from pyengine.state import assign_to_key_group

        group = assign_to_key_group(key, MAX_P)
        return next(i for i, r in enumerate(self.ranges) if r.start <= group <= r.end)

    def update(self, i: int, rng: random.Random, n: int = 40) -> None:
        backend = self.backends[i]
        count = backend.get_state(COUNT)
        for _ in range(n):
            backend.set_current_key(rng.choice(self.keys[i]))
            if rng.random() < 0.1:
                count.clear()
            else:
                count.update(rng.randrange(1000))

    def trigger(self) -> Optional[int]:
        before = len(self.gateway.triggered)
        future = self.coordinator.trigger_checkpoint()
        if len(self.gateway.triggered) == before:
            return None  # queued, or refused
        checkpoint_id = self.gateway.triggered[-1]
        self.futures[checkpoint_id] = future
        return checkpoint_id

    def snapshot(self, i: int, checkpoint_id: int) -> None:
        """Subtask ``i`` takes its snapshot of ``checkpoint_id`` (its barrier arrived)."""
        backend = self.backends[i]
        self.snapshots[(i, checkpoint_id)] = backend.snapshot(checkpoint_id, self.storage.location(checkpoint_id))
        self.expected.setdefault(checkpoint_id, {})[i] = state_of(backend)

    def ack(self, i: int, checkpoint_id: int) -> Any:
        """The asynchronous part of subtask ``i``'s snapshot runs and acknowledges."""
        result = self.snapshots.pop((i, checkpoint_id)).run()
        state = TaskStateSnapshot({"op": SubtaskState(keyed=list(result.handles))})
        return self.coordinator.receive_acknowledge_message(checkpoint_id, self.tasks[i], state)

    def deliver(self, i: int, n: int = 1) -> None:
        """The next ``n`` notifications reach subtask ``i``."""
        box = self.gateway.mailboxes[self.tasks[i]]
        for _ in range(n):
            kind, checkpoint_id = box.popleft()
            if kind == "complete":
                self.backends[i].notify_checkpoint_complete(checkpoint_id)
            else:
                self.backends[i].notify_checkpoint_aborted(checkpoint_id)

    def deliver_all(self) -> None:
        for i in range(len(self.tasks)):
            self.deliver(i, len(self.gateway.mailboxes[self.tasks[i]]))

    def failover(self) -> None:
        """Every subtask restarts from the latest completed checkpoint."""
        self.coordinator.abort_pending_checkpoints(CheckpointFailureReason.JOB_FAILOVER_REGION)
        latest = self.coordinator.restore_latest()
        for box in self.gateway.mailboxes.values():
            box.clear()  # the old attempt's mailboxes are gone
        self.snapshots.clear()
        self.backends = [self._backend(i) for i in range(len(self.tasks))]
        if latest is not None:
            for i, backend in enumerate(self.backends):
                backend.restore(latest.operators["op"].subtasks[i].keyed)
                assert state_of(backend) == self.expected[latest.checkpoint_id][i]

    def settle(self) -> None:
        """Every pending (and then queued) checkpoint completes: each subtask that has
        not acknowledged takes its snapshot and acknowledges; notifications arrive."""
        while self.coordinator.pending_checkpoints:
            for checkpoint_id, pending in sorted(self.coordinator.pending_checkpoints.items()):
                for task in sorted(pending.not_yet_acknowledged, key=lambda t: t.subtask):
                    if (task.subtask, checkpoint_id) not in self.snapshots:
                        self.snapshot(task.subtask, checkpoint_id)
                    self.ack(task.subtask, checkpoint_id)
            self.deliver_all()

    # -- checks -------------------------------------------------------------------------

    def check_restorable(self, metadata: CheckpointMetadata, where: str = "") -> None:
        """Every file the checkpoint uses exists, and it restores to the state its
        snapshots had."""
        for path in stream_paths(metadata):
            fs, p, _ = resolve(path)
            assert fs.get_file_info(p).type.name == "File", (
                f"{where}: checkpoint {metadata.checkpoint_id} uses {path}, which is gone"
            )
        for i in range(len(self.tasks)):
            restored = create_keyed_backend("heap", max_parallelism=MAX_P, key_group_range=self.ranges[i])
            restored.restore(metadata.operators["op"].subtasks[i].keyed)
            assert state_of(restored) == self.expected[metadata.checkpoint_id][i], (
                f"{where}: checkpoint {metadata.checkpoint_id}, subtask {i} restores to other state"
            )

    def check_retained(self, where: str = "") -> None:
        for metadata in self.coordinator.store.checkpoints:
            self.check_restorable(metadata, where)

    def shared_files(self) -> Set[str]:
        return {self.storage.uri_of(p) for p in self.storage.list_files(self.storage.shared_dir)}


def stream_paths(metadata: CheckpointMetadata) -> List[str]:
    paths = []
    for handle in metadata.handles():
        stream = getattr(handle, "stream", handle)
        if isinstance(stream, StreamStateHandle):
            paths.append(stream.path)
    return paths


def test_a_snapshot_taken_before_the_previous_notification_never_uses_a_deleted_delta(tmp_path) -> None:
    """The trace of issue 12, step by step: snapshot C+1 is taken before
    notify_checkpoint_complete(C) arrives (an unaligned barrier is handled straight
    from the gate), C+1 completes and the store (retaining one) deletes C's delta,
    and snapshot C+2 is taken before notify(C+1). C+2 must not use C's delta."""
    job = Job(tmp_path, retained=1)
    rng = random.Random(7)
    for k in job.keys[0]:  # a real base
        job.backends[0].set_current_key(k)
        job.backends[0].get_state(COUNT).update(k)
    first = job.trigger()
    job.snapshot(0, first)
    job.ack(0, first)
    job.deliver(0)  # chain 1 is the base
    job.update(0, rng)
    c = job.trigger()
    job.snapshot(0, c)
    job.ack(0, c)  # C completes; its notification waits in the mailbox
    job.update(0, rng)
    c1 = job.trigger()
    job.snapshot(0, c1)  # C+1 before notify(C): builds on chain C-1
    job.deliver(0)  # notify(C)
    job.ack(0, c1)  # C+1 completes; C is discarded, and with it C's delta
    job.update(0, rng)
    c2 = job.trigger()
    job.snapshot(0, c2)  # C+2 before notify(C+1)
    job.ack(0, c2)
    metadata = job.futures[c2].result(0)  # completes...
    job.check_restorable(metadata, "C+2")  # ...and can be restored
    assert not job.unrestorable
    job.deliver_all()
    job.check_retained()
    restored = create_keyed_backend("incremental", max_parallelism=MAX_P)
    restored.restore(
        load_metadata(job.storage.uri_of(job.storage.checkpoint_dir(c2))).operators["op"].subtasks[0].keyed
    )
    assert state_of(restored) == job.expected[c2][0]


def _random_run(tmp_path: Any, seed: int, steps: int = 90) -> None:
    """Barriers, acknowledgements, notifications, declines, expiries, savepoints and
    failovers in a random order; after every step each retained checkpoint and each
    completed savepoint still restores to the state its snapshots had."""
    rng = random.Random(seed)
    job = Job(
        tmp_path / f"run{seed}",
        parallelism=rng.choice((1, 2)),
        retained=rng.choice((1, 1, 2)),
        max_chain=rng.choice((0, 1, 2, 3)),
        max_concurrent=rng.choice((1, 2, 3)),
        timeout_ms=1000,
        tolerable_failures=1_000_000,
    )
    n = len(job.tasks)
    cursor = [0] * n  # the next triggered checkpoint each subtask's barrier brings
    savepoints: List[Any] = []
    for i in range(n):
        for k in job.keys[i][:: rng.choice((1, 3))]:
            job.backends[i].set_current_key(k)
            job.backends[i].get_state(COUNT).update(k)
    for step in range(steps):
        where = f"seed {seed}, step {step}"
        action = rng.choices(
            ("update", "trigger", "barrier", "ack", "deliver", "decline", "expire", "savepoint", "failover"),
            (6, 4, 6, 6, 6, 1, 0.5, 0.5, 0.4),
        )[0]
        i = rng.randrange(n)
        if action == "update":
            job.update(i, rng)
        elif action == "trigger":
            job.trigger()
        elif action == "barrier" and cursor[i] < len(job.gateway.triggered):
            checkpoint_id = job.gateway.triggered[cursor[i]]
            cursor[i] += 1
            if rng.random() < 0.05:  # the subtask cannot take it (an alignment limit, say)
                job.coordinator.receive_decline_message(checkpoint_id, job.tasks[i])
            else:
                job.snapshot(i, checkpoint_id)
        elif action == "ack" and job.snapshots:
            subtask, checkpoint_id = rng.choice(sorted(job.snapshots))
            job.ack(subtask, checkpoint_id)
        elif action == "deliver" and job.gateway.mailboxes[job.tasks[i]]:
            job.deliver(i)
        elif action == "decline" and job.coordinator.pending_checkpoints:
            checkpoint_id = rng.choice(sorted(job.coordinator.pending_checkpoints))
            job.coordinator.receive_decline_message(checkpoint_id, job.tasks[i])
        elif action == "expire":
            job.timers.advance(1000)
        elif action == "savepoint":
            before = len(job.gateway.triggered)
            future = job.coordinator.trigger_savepoint(str(tmp_path / f"sp{seed}"))
            if len(job.gateway.triggered) > before:
                savepoints.append((job.gateway.triggered[-1], future))
        elif action == "failover":
            job.failover()
            cursor = [len(job.gateway.triggered)] * n
        job.check_retained(where)
        for savepoint_id, future in savepoints:
            if future.done() and future.exception() is None:
                job.check_restorable(future.result(), f"{where}, savepoint {savepoint_id}")
    # Everything settles: the snapshots in flight finish, and so does every pending
    # checkpoint; then two more checkpoints complete.
    for subtask, checkpoint_id in sorted(job.snapshots):
        job.ack(subtask, checkpoint_id)
    job.deliver_all()
    job.settle()
    for _ in range(2):
        job.trigger()
        job.settle()
    job.check_retained(f"seed {seed}, settled")
    used = {p for md in job.coordinator.store.checkpoints for p in stream_paths(md)}
    leftover = job.shared_files() - used
    assert not leftover, f"seed {seed}: shared files no retained checkpoint uses: {sorted(leftover)[:3]}"
    assert not job.gateway.failures, f"seed {seed}: {job.gateway.failures}"
    assert not job.unrestorable, f"seed {seed}: a snapshot built on deleted files {job.unrestorable[:3]}"


@pytest.mark.parametrize("seed", range(40))
def test_any_order_of_barriers_notifications_and_aborts_keeps_every_checkpoint_restorable(tmp_path, seed) -> None:
    _random_run(tmp_path, seed)


# -- the coordinator's side, with hand-made acknowledgements (a backend that got it wrong) --


def _chain(job: Job, checkpoint_id: int, *files: Any) -> TaskStateSnapshot:
    """An acknowledgement whose keyed state is a chain of incremental files."""
    from pyengine.storage.handles import KeyGroupsStateHandle

    handles = [KeyGroupsStateHandle(f, 0, MAX_P - 1, backend="incremental") for f in files]
    return TaskStateSnapshot({"op": SubtaskState(keyed=handles)})


def _shared_file(job: Job, checkpoint_id: int, name: str) -> StreamStateHandle:
    stream = job.storage.location(checkpoint_id).create_output_stream(name, shared=True)
    stream.write(name.encode() * 10)
    handle = stream.close_and_get_handle()
    assert isinstance(handle, StreamStateHandle)
    return handle


def _exists(handle: StreamStateHandle) -> bool:
    fs, p, _ = resolve(handle.path)
    return fs.get_file_info(p).type.name == "File"


def test_a_pending_checkpoints_acknowledged_files_outlive_the_checkpoint_that_wrote_them(tmp_path) -> None:
    """Subtask 0 acknowledged checkpoint 3 with a chain on checkpoint 1's base; then
    checkpoint 2, a full base, completes and discards 1: the base stays, because
    pending checkpoint 3 uses it, and goes once nothing does."""
    job = Job(tmp_path, parallelism=2, max_concurrent=3)
    first, second = job.tasks
    job.trigger()
    base1 = _shared_file(job, 1, "base-1")
    job.coordinator.receive_acknowledge_message(1, first, _chain(job, 1, base1))
    job.coordinator.receive_acknowledge_message(1, second)
    job.trigger()
    job.trigger()
    delta3 = _shared_file(job, 3, "delta-3")
    job.coordinator.receive_acknowledge_message(3, first, _chain(job, 3, base1, delta3))
    base2 = _shared_file(job, 2, "base-2")
    job.coordinator.receive_acknowledge_message(2, first, _chain(job, 2, base2))
    job.coordinator.receive_acknowledge_message(2, second)
    assert [m.checkpoint_id for m in job.coordinator.store.checkpoints] == [2]
    assert _exists(base1), "deleted while pending checkpoint 3 uses it"
    job.coordinator.receive_acknowledge_message(3, second)
    assert job.futures[3].result(0).checkpoint_id == 3 and _exists(base1) and not _exists(base2)
    job.trigger()
    base4 = _shared_file(job, 4, "base-4")
    job.coordinator.receive_acknowledge_message(4, first, _chain(job, 4, base4))
    job.coordinator.receive_acknowledge_message(4, second)
    assert not _exists(base1) and not _exists(delta3)  # and nothing is left behind


def test_an_acknowledgement_that_uses_a_deleted_file_aborts_its_checkpoint(tmp_path) -> None:
    """The last line of defence: a checkpoint whose state refers to a file the store
    already deleted is aborted with the reason, never completed (it could not be
    restored); the files it wrote go with it."""
    job = Job(tmp_path, tolerable_failures=5)
    task = job.tasks[0]
    job.trigger()
    base1 = _shared_file(job, 1, "base-1")
    job.coordinator.receive_acknowledge_message(1, task, _chain(job, 1, base1))
    job.trigger()
    job.coordinator.receive_acknowledge_message(2, task, _chain(job, 2, _shared_file(job, 2, "base-2")))
    assert not _exists(base1)
    job.trigger()
    delta3 = _shared_file(job, 3, "delta-3")
    job.coordinator.receive_acknowledge_message(3, task, _chain(job, 3, base1, delta3))
    with pytest.raises(Exception) as info:
        job.futures[3].result(0)
    assert info.value.reason is CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE  # type: ignore[attr-defined]
    assert base1.path in str(info.value) and "already deleted" in str(info.value)
    assert [m.checkpoint_id for m in job.coordinator.store.checkpoints] == [2]
    assert not _exists(delta3)
