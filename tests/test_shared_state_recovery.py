"""A run that continues in the job directory a dead run left (issue 12): the
coordinator's ``recover()`` adopts what retention and restorability need, deletes
the rest, and starts new checkpoint ids past every ``chk-<n>`` it found."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, List

import pyarrow.fs as pafs
import pytest
from test_shared_state import COUNT, Job, QueueGateway, state_of, stream_paths

import pyengine.state.incremental as incremental_module
from pyengine.coordinator import CheckpointConfig, CheckpointCoordinator, ManualTimerService
from pyengine.state import create_keyed_backend
from pyengine.state.reader import read_keyed_state
from pyengine.storage import checkpoint_storage
from pyengine.storage.filesystem import CheckpointStorage


@pytest.fixture(autouse=True)
def files_not_inline(monkeypatch) -> None:
    monkeypatch.setattr(incremental_module, "INLINE_THRESHOLD", 0)


def completed(job: Job, rng: random.Random, count: int) -> None:
    """``count`` checkpoints that every subtask takes, acknowledges and hears of."""
    for _ in range(count):
        for i in range(len(job.tasks)):
            job.update(i, rng)
        checkpoint_id = job.trigger()
        assert checkpoint_id is not None
        for i in range(len(job.tasks)):
            job.snapshot(i, checkpoint_id)
            job.ack(i, checkpoint_id)
        job.deliver_all()


def dead_run(tmp_path: Any, *, retained: int) -> Job:
    """A run that completed checkpoints 1-5 (retaining ``retained``), then died with
    checkpoint 6 acknowledged by one subtask of two, snapshot 7 written and never
    acknowledged, and a file half-written in shared/."""
    job = Job(tmp_path, parallelism=2, retained=retained, max_concurrent=3, max_chain=2)
    rng = random.Random(5)
    for i in range(2):  # a real base
        for k in job.keys[i]:
            job.backends[i].set_current_key(k)
            job.backends[i].get_state(COUNT).update(k)
    completed(job, rng, 5)
    six = job.trigger()
    seven = job.trigger()
    assert (six, seven) == (6, 7)
    job.snapshot(0, 6)
    job.ack(0, 6)
    job.snapshot(1, 7)
    job.snapshots.pop((1, 7)).run()
    with job.storage.fs.open_output_stream(f"{job.storage.shared_dir}/.delta-x.inprogress-abc") as out:
        out.write(b"torn")
    return job


def successor(tmp_path: Any, *, retained: int) -> CheckpointCoordinator:
    """The next run's coordinator, on the same job directory."""
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    return CheckpointCoordinator(
        "job", CheckpointConfig(retained=retained), storage, QueueGateway([]), ManualTimerService()
    )


def chk_dirs(storage: CheckpointStorage) -> List[int]:
    """The ``chk-<n>`` directories in the job's directory, empty ones included."""
    infos = storage.fs.get_file_info(pafs.FileSelector(storage.root))
    return sorted(int(i.base_name[4:]) for i in infos if i.base_name.startswith("chk-"))


def shared(storage: CheckpointStorage) -> List[str]:
    return sorted(storage.uri_of(p) for p in storage.list_files(storage.shared_dir))


def test_recover_adopts_the_retained_checkpoints_and_deletes_everything_else(tmp_path) -> None:
    old = dead_run(tmp_path, retained=5)  # it kept five; the new run keeps two
    assert chk_dirs(old.storage) == [1, 2, 3, 4, 5, 6, 7]
    coordinator = successor(tmp_path, retained=2)
    latest = coordinator.recover()
    assert latest is not None and latest.checkpoint_id == 5
    assert [m.checkpoint_id for m in coordinator.store.checkpoints] == [4, 5]
    assert coordinator.store.highest_checkpoint_id == 7
    storage = coordinator.storage
    assert chk_dirs(storage) == [4, 5], "older checkpoints and those without _metadata go"
    used = {p for m in coordinator.store.checkpoints for p in stream_paths(m)}
    assert set(shared(storage)) == used, "shared/ holds exactly what the retained checkpoints use"
    for metadata in coordinator.store.checkpoints:
        old.check_restorable(metadata, "recovered")
    assert coordinator.trigger_checkpoint() and coordinator._next_id == 9  # 8: past chk-7, never reused


def test_the_recovered_run_goes_on_and_retention_keeps_working(tmp_path) -> None:
    old = dead_run(tmp_path, retained=1)
    job = Job(tmp_path, parallelism=2, retained=1, max_concurrent=3, max_chain=2)
    job.expected = old.expected
    latest = job.coordinator.recover()
    assert latest is not None and latest.checkpoint_id == 5
    for i, backend in enumerate(job.backends):
        backend.restore(latest.operators["op"].subtasks[i].keyed)  # a chain in this directory: deltas go on
        assert state_of(backend) == old.expected[5][i]
    completed(job, random.Random(9), 4)
    assert [m.checkpoint_id for m in job.coordinator.store.checkpoints] == [11]
    job.check_retained("after recovery")
    used = {p for m in job.coordinator.store.checkpoints for p in stream_paths(m)}
    assert set(shared(job.storage)) == used and chk_dirs(job.storage) == [11]


def test_a_damaged_latest_checkpoint_is_skipped_for_the_previous_intact_one(tmp_path, caplog) -> None:
    old = dead_run(tmp_path, retained=2)
    path = f"{old.storage.checkpoint_dir(5)}/_metadata"
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"#")
    coordinator = successor(tmp_path, retained=2)
    latest = coordinator.recover()
    assert latest is not None and latest.checkpoint_id == 4
    assert "checkpoint 5 is damaged" in caplog.text
    assert chk_dirs(coordinator.storage) == [4]  # 5 cannot be restored: it goes too
    old.check_restorable(latest, "fallback")
    assert set(shared(coordinator.storage)) == set(stream_paths(latest))
    assert coordinator.store.highest_checkpoint_id == 7


def test_a_latest_checkpoint_with_a_missing_file_is_skipped(tmp_path, caplog) -> None:
    old = dead_run(tmp_path, retained=2)
    five = old.coordinator.store.latest()
    four = old.coordinator.store.checkpoints[0]
    assert five is not None and five.checkpoint_id == 5
    only_five = sorted(set(stream_paths(five)) - set(stream_paths(four)))
    os.remove(only_five[0])
    coordinator = successor(tmp_path, retained=2)
    latest = coordinator.recover()
    assert latest is not None and latest.checkpoint_id == 4
    assert only_five[0] in caplog.text
    old.check_restorable(latest, "fallback")


def test_an_unreadable_metadata_file_keeps_the_shared_files(tmp_path, monkeypatch, caplog) -> None:
    """An I/O error is not damage: that checkpoint may be fine, so the files it may
    use stay (and so does its directory)."""
    dead_run(tmp_path, retained=2)
    coordinator = successor(tmp_path, retained=2)
    before = shared(coordinator.storage)
    read = CheckpointStorage.read_metadata_bytes

    def flaky(self: CheckpointStorage, checkpoint_id: int) -> Any:
        if checkpoint_id == 5:
            raise OSError("connection reset")
        return read(self, checkpoint_id)

    monkeypatch.setattr(CheckpointStorage, "read_metadata_bytes", flaky)
    latest = coordinator.recover()
    assert latest is not None and latest.checkpoint_id == 4
    assert "connection reset" in caplog.text
    assert 5 in chk_dirs(coordinator.storage)
    assert shared(coordinator.storage) == before


KILLED_JOB = textwrap.dedent(
    """
    import sys, time
    import pyarrow as pa
    import pyengine as pe
    import pyengine.state.incremental as incremental
    from pyengine.state import ValueStateDescriptor

    incremental.INLINE_THRESHOLD = 0  # deltas in shared/
    COUNT = ValueStateDescriptor("count", 0, pa.int64())

    class Count(pe.KeyedProcessFunction):
        def open(self, ctx):
            self.count = ctx.get_state(COUNT)

        def process_element(self, value, ctx):
            self.count.update(self.count.value() + 1)
            yield value

    def slow(r):
        time.sleep(0.0005)
        return r

    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=20, unaligned=True, retained=2),
        state_backend="incremental",
        checkpoint_storage=sys.argv[1],
        buffer_size=16,
        buffer_timeout_ms=1,
    )
    records = [{"user": i % 500, "i": i} for i in range(200_000)]
    env.from_collection(records).map(slow).key_by("user").process(Count()).uid("counter").sink_to(
        pe.sinks.CollectSink()
    )
    env.execute("killed")
    """
)


def test_recover_after_a_job_killed_mid_way(tmp_path) -> None:
    root = tmp_path / "ckpt"
    script = tmp_path / "job.py"
    script.write_text(KILLED_JOB)
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        job_dir = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            found = list(root.glob("*/chk-*/_metadata")) if root.exists() else []
            if any(int(p.parent.name[4:]) >= 5 for p in found):
                job_dir = found[0].parent.parent
                break
            time.sleep(0.05)
        assert job_dir is not None, "the job completed no checkpoints in time"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    storage = checkpoint_storage(str(root), job_dir.name)
    left = chk_dirs(storage)
    coordinator = CheckpointCoordinator(
        job_dir.name, CheckpointConfig(retained=1), storage, QueueGateway([]), ManualTimerService()
    )
    latest = coordinator.recover()
    assert latest is not None
    assert coordinator.store.highest_checkpoint_id >= max(left) and coordinator._next_id > max(left)
    assert chk_dirs(storage) == [latest.checkpoint_id]
    assert set(shared(storage)) == set(stream_paths(latest))
    path = storage.uri_of(storage.checkpoint_dir(latest.checkpoint_id))
    table = read_keyed_state(path, "counter", "count")
    counts = dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True))
    assert counts and min(counts.values()) > 0
    operator = latest.operators["counter"]
    backend = create_keyed_backend("incremental", max_parallelism=operator.max_parallelism)
    backend.restore(operator.keyed_handles())  # each subtask's chain, as a restore reads them
    assert state_of(backend) == counts
