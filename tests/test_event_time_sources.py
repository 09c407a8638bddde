"""Unbounded sources for event-time jobs: a watched directory (each file exactly once
across failures and restores), the paced and endless generator, and cancel()."""

from __future__ import annotations

import io
import os
import threading
import time
from collections import Counter
from typing import Any, List

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pyengine as pe
from pyengine.connectors.collection import GeneratorSource
from pyengine.connectors.files import MonitoredFileSource
from pyengine.storage.jobs import list_jobs


def _write(directory: str, name: str, first: int, rows: int) -> None:
    """Written under a hidden name and renamed: a watched directory never sees a partial file."""
    table = pa.table({"id": list(range(first, first + rows)), "k": [i % 7 for i in range(first, first + rows)]})
    tmp = os.path.join(directory, f".{name}.tmp")
    pq.write_table(table, tmp)
    os.rename(tmp, os.path.join(directory, name))


def _until(condition: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


class FailOnce:
    def __init__(self, at: int) -> None:
        self.at, self.seen, self.fired, self.lock = at, 0, False, threading.Lock()

    def __call__(self, record: Any) -> Any:
        with self.lock:
            self.seen += 1
            if not self.fired and self.seen >= self.at:
                self.fired = True
                raise RuntimeError("injected failure")
        return record


@pytest.mark.parametrize("parallelism", [1, 3])
def test_a_watched_directory_reads_each_file_exactly_once_across_a_failure_and_a_restore(
    tmp_path: Any, parallelism: int
) -> None:
    data = tmp_path / "in"
    data.mkdir()
    _write(str(data), "part-000.parquet", 0, 50)
    sink = pe.sinks.CollectSink()

    def job(p: int, fail_at: int = 10**9) -> Any:
        env = pe.StreamEnvironment(
            parallelism=p,
            checkpointing=pe.CheckpointConfig(interval_ms=20),
            checkpoint_storage=str(tmp_path / f"ckpt{p}"),
            restart_attempts=2,
            buffer_size=16,
            buffer_timeout_ms=1,
        )
        stream = env.read_files(str(data), monitor_interval_ms=10).map(lambda r: r["id"]).map(FailOnce(fail_at))
        stream.rebalance().map(lambda i: i).sink_to(sink)
        return env

    client = job(parallelism, fail_at=120).execute_async("watch")
    for n in range(1, 8):  # files keep coming while the job runs (and fails once, and restores)
        time.sleep(0.03)
        _write(str(data), f"part-{n:03d}.parquet", n * 50, 50)
    _until(lambda: len(sink.records) >= 400)
    assert client.restarts == 1
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    client.wait(60)
    assert Counter(sink.records) == Counter(range(400)), "a file was skipped or read twice"

    # files that arrive while the job is down are read by the restored job, at another parallelism
    for n in range(8, 11):
        _write(str(data), f"part-{n:03d}.parquet", n * 50, 50)
    client = job(2).execute_async("watch", restore_from=savepoint)
    _until(lambda: len(sink.records) >= 550)
    client.cancel()
    result = client.wait(60)
    assert result.status == "CANCELED"
    assert Counter(sink.records) == Counter(range(550))


def test_a_watched_directory_skips_hidden_and_underscore_files_and_needs_a_directory(tmp_path: Any) -> None:
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".part.tmp").write_text("partial")
    _write(str(tmp_path), "a.parquet", 0, 3)
    source = MonitoredFileSource(str(tmp_path), "parquet", None, 5)
    assert source.schema is not None and source.schema.names == ["id", "k"]
    assert source._list() == ["a.parquet"]
    with pytest.raises(ValueError, match="watches a directory"):
        MonitoredFileSource(str(tmp_path / "a.parquet"), "parquet", None, 5)
    with pytest.raises(ValueError, match="monitor_interval_ms"):
        MonitoredFileSource(str(tmp_path), "parquet", None, 0)


def test_the_generator_paces_to_its_rate_over_all_subtasks() -> None:
    source = GeneratorSource(lambda i: i, None, rate_per_s=2000)
    got: List[int] = []
    start = time.monotonic()
    positions = [0, 0]
    while len(got) < 300:
        for sub in (0, 1):
            batch = source.read(sub, 2, positions[sub], 64)
            assert batch is not None, "an unbounded generator never ends"
            positions[sub] += len(batch)
            got.extend(batch)
    elapsed = time.monotonic() - start
    assert 0.1 <= elapsed < 2, f"300 records at 2000/s took {elapsed:.3f} s"
    assert sorted(got)[:10] == list(range(10))
    with pytest.raises(ValueError, match="rate_per_s"):
        GeneratorSource(lambda i: i, None, rate_per_s=0)


def test_an_unbounded_job_runs_until_cancelled_and_resumes_after(tmp_path: Any) -> None:
    out = tmp_path / "out"
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")

    def job() -> Any:
        env = pe.StreamEnvironment(
            parallelism=2,
            checkpointing=pe.CheckpointConfig(interval_ms=30),
            checkpoint_storage=str(tmp_path / "ckpt"),
            auto_watermark_interval_ms=5,
        )
        env.from_generator(lambda i: {"k": i % 3, "ts": i}, rate_per_s=20_000, watermark_strategy=strategy).key_by(
            "k"
        ).window(pe.windows.tumbling(1000)).aggregate(pe.agg.count()).sink_to(
            pe.sinks.FileSink(str(out), format="jsonl")
        )
        return env

    client = job().execute_async("endless")
    _until(lambda: any(m >= 3000 for m in client.watermarks().get("v1", [])))
    client.cancel()
    result = client.wait(60)
    assert result.status == "CANCELED"
    jobs = list_jobs(str(tmp_path / "ckpt"))
    assert jobs[0].last_run.status == "CANCELED"
    # running it again resumes the cancelled run from its latest checkpoint
    client = job().execute_async("endless")
    _until(lambda: any(m >= 2 * 3000 for m in client.watermarks().get("v1", [])))
    client.cancel()
    assert client.wait(60).status == "CANCELED"
    rows = pe.sinks.FileSink(str(out), format="jsonl").read_committed()
    windows = Counter((r["k"], r["window_start"]) for r in rows)
    assert windows and max(windows.values()) == 1, "a window was emitted twice across the cancel and the resume"
    assert all(r["count"] == 334 or r["count"] == 333 for r in rows), "every window complete (1000 ts / 3 keys)"


def _printed(out: io.StringIO) -> List[int]:
    return [int(line) for line in out.getvalue().split()]


def _stoppable(tmp_path: Any, parallelism: int, out: io.StringIO) -> Any:
    env = pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=30),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_timeout_ms=1,
    )
    env.from_generator(lambda i: i, rate_per_s=4000).map(lambda i: i).sink_to(pe.sinks.PrintSink(out))
    return env


@pytest.mark.parametrize("parallelism", [1, 2])
def test_stop_with_savepoint_outputs_nothing_past_the_savepoint(tmp_path: Any, parallelism: int) -> None:
    """Flink's synchronous savepoint: the sources emit nothing after the stop's barrier,
    so even a sink that is not transactional (PrintSink prints as records come) shows
    each record once across the stop and the run resumed from the savepoint. Before,
    the job went on until it was cancelled, and the resumed run printed those again."""
    first = io.StringIO()
    client = _stoppable(tmp_path, parallelism, first).execute_async("stop")
    _until(lambda: len(_printed(first)) >= 200)
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    assert client.wait(60).status == "FINISHED"
    before = _printed(first)
    second = io.StringIO()
    client = _stoppable(tmp_path, parallelism, second).execute_async("stop", resume=savepoint)
    _until(lambda: {i % parallelism for i in _printed(second)} == set(range(parallelism)))
    client.cancel()
    client.wait(60)
    after = _printed(second)
    assert len(set(before)) == len(before)
    assert not set(before) & set(after), "records printed before the stop were printed again after the resume"
    for split in range(parallelism):  # the generator's split s gives s, s + p, s + 2p, ...
        mine = sorted(i for i in before if i % parallelism == split)
        assert mine == list(range(split, mine[-1] + 1, parallelism)) if mine else True
        nxt = min(i for i in after if i % parallelism == split)
        assert nxt == (mine[-1] + parallelism if mine else split), "a record was lost across the stop"


def test_a_stop_whose_savepoint_fails_lets_the_job_go_on(tmp_path: Any, monkeypatch: Any) -> None:
    """When a stop's savepoint fails, the paused sources go on, and a later stop is
    again exact: the run resumed from it prints nothing the first run printed."""
    from pyengine.coordinator.coordinator import CheckpointCoordinator, CheckpointException

    real = CheckpointCoordinator._self_contained
    calls = []

    def fail_first(self: Any, metadata: Any, location: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("injected: the savepoint directory is full")
        return real(self, metadata, location)

    monkeypatch.setattr(CheckpointCoordinator, "_self_contained", fail_first)
    out = io.StringIO()
    client = _stoppable(tmp_path, 1, out).execute_async("stop")
    _until(lambda: len(_printed(out)) >= 100)
    with pytest.raises(CheckpointException, match="directory is full"):
        client.stop_with_savepoint(str(tmp_path / "sp"))
    seen = len(_printed(out))
    _until(lambda: len(_printed(out)) >= seen + 100)  # not paused: the job goes on
    assert not client.done()
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    assert client.wait(60).status == "FINISHED"
    printed = _printed(out)
    assert printed == list(range(len(printed)))
    again = io.StringIO()
    client = _stoppable(tmp_path, 1, again).execute_async("stop", resume=savepoint)
    _until(lambda: len(_printed(again)) >= 10)
    client.cancel()
    client.wait(60)
    assert _printed(again)[0] == len(printed), "the resumed run repeated or skipped records"


class _Blockable(pe.KeyedProcessFunction):
    """Passes records on and sets a processing-time timer for each (on_timer emits
    "timer"); blocks in process_element while ``hold`` is set."""

    hold = threading.Event()
    release = threading.Event()

    def process_element(self, value: Any, ctx: Any) -> Any:
        if self.hold.is_set():
            self.release.wait(30)
        ctx.timer_service().register_processing_time_timer(ctx.timer_service().current_processing_time() + 1)
        return ()

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        return ["timer"]


def test_a_stop_aborted_before_its_barrier_reached_a_task_does_not_stop_that_task(tmp_path: Any) -> None:
    """A task hears of an abort from the coordinator at once but takes the barrier from
    its input later: the stop's savepoint expires while a task downstream is busy, its
    barrier reaches that task after the abort, and the task must not stop for it (its
    processing-time timers go on firing; they stopped for good before)."""
    _Blockable.hold.clear()
    _Blockable.release.clear()
    out = io.StringIO()
    env = pe.StreamEnvironment(
        parallelism=1,
        checkpointing=pe.CheckpointConfig(interval_ms=3_600_000, timeout_ms=300),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_timeout_ms=1,
    )
    env.from_generator(lambda i: i, rate_per_s=2000).key_by(lambda i: i % 4).process(_Blockable()).sink_to(
        pe.sinks.PrintSink(out)
    )
    client = env.execute_async("aborted-stop")
    _until(lambda: out.getvalue().count("timer") >= 10)
    _Blockable.hold.set()  # the keyed task blocks at its next record, before the stop's barrier
    time.sleep(0.1)
    from pyengine.coordinator.coordinator import CheckpointException

    with pytest.raises(CheckpointException, match=r"(?i)expired"):
        client.stop_with_savepoint(str(tmp_path / "sp"), timeout_s=30)
    _Blockable.hold.clear()
    _Blockable.release.set()  # now the barrier of the aborted stop reaches the keyed task
    time.sleep(0.5)
    fired = out.getvalue().count("timer")
    _until(lambda: out.getvalue().count("timer") >= fired + 20, timeout_s=20)
    client.cancel()
    client.wait(60, raise_failure=False)
