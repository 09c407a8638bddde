"""env.read_delta: a Delta table as an exactly-once stream (DeltaSource), checked
against a batch read of the same versions through deltalake."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, List, Optional

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.connectors.delta_source import DeltaChangeError, DeltaSource

deltalake = pytest.importorskip("deltalake", reason='read_delta needs deltalake: pip install "pyengine[delta]"')
from deltalake import DeltaTable, write_deltalake  # noqa: E402


def _rows(first: int, n: int) -> pa.Table:
    ids = list(range(first, first + n))
    return pa.table({"id": pa.array(ids, pa.int64()), "k": [f"k{i % 5}" for i in ids], "p": [i % 3 for i in ids]})


def _table(path: str, versions: int = 3, rows: int = 200, partition_by: Optional[List[str]] = None) -> None:
    for v in range(versions):
        write_deltalake(path, _rows(v * rows, rows), mode="append", partition_by=partition_by)


def _batch_ids(path: str, version: Optional[int] = None) -> Counter:
    return Counter(DeltaTable(path, version=version).to_pyarrow_table().column("id").to_pylist())


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


def _env(tmp_path: Any, parallelism: int = 2, **kwargs: Any) -> pe.StreamEnvironment:
    settings: dict = dict(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=10),
        checkpoint_storage=str(tmp_path / "ckpt"),
        restart_attempts=2,
        buffer_size=16,
        buffer_timeout_ms=1,
    )
    settings.update(kwargs)
    return pe.StreamEnvironment(**settings)


def _collect(tmp_path: Any, path: str, parallelism: int = 2, fail_at: Optional[int] = None, **read: Any) -> Counter:
    env = _env(tmp_path, parallelism)
    sink = pe.sinks.CollectSink()
    stream = env.read_delta(path, **read).map(lambda r: r["id"])
    if fail_at is not None:
        stream = stream.map(FailOnce(fail_at))
    stream.sink_to(sink)
    env.execute("delta")
    return Counter(sink.records)


@pytest.mark.parametrize("parallelism", [1, 3])
def test_a_bounded_read_is_the_latest_snapshot_partitions_and_all(tmp_path: Any, parallelism: int) -> None:
    path = str(tmp_path / "t")
    _table(path, partition_by=["p"])
    env = _env(tmp_path, parallelism)
    sink = pe.sinks.CollectSink()
    env.read_delta(path).sink_to(sink)
    env.execute("snapshot")
    got = sorted((r["id"], r["k"], r["p"]) for r in sink.records)
    want = DeltaTable(path).to_pyarrow_table().to_pylist()
    assert got == sorted((r["id"], r["k"], r["p"]) for r in want)
    assert DeltaSource(path).schema == pa.schema([("id", pa.int64()), ("k", pa.string()), ("p", pa.int64())])


def test_starting_version_reads_the_changes_from_that_version_on(tmp_path: Any) -> None:
    path = str(tmp_path / "t")
    _table(path, versions=4, rows=50)
    assert _collect(tmp_path, path, starting_version=2) == Counter(range(100, 200))
    with pytest.raises(ValueError, match="past the table's latest version"):
        DeltaSource(path, starting_version=9)


def test_a_failure_mid_read_restores_version_file_and_row(tmp_path: Any) -> None:
    path = str(tmp_path / "t")
    _table(path, versions=6, rows=300)
    got = _collect(tmp_path, path, parallelism=2, fail_at=900, starting_version=0)
    assert got == _batch_ids(path), "a row was read twice or skipped across the restart"


def test_a_compaction_is_skipped_by_its_data_change_flag(tmp_path: Any) -> None:
    path = str(tmp_path / "t")
    _table(path, versions=3, rows=100)
    DeltaTable(path).optimize.compact()
    write_deltalake(path, _rows(300, 100), mode="append")
    assert _collect(tmp_path, path, starting_version=0) == Counter(range(400))


def test_deletes_and_overwrites_are_refused_unless_an_option_says_how_to_read_them(tmp_path: Any) -> None:
    path = str(tmp_path / "t")
    _table(path, versions=2, rows=100)
    DeltaTable(path).delete("id < 10")  # version 2: rewrites a file (removes it, adds the rest)
    write_deltalake(path, _rows(200, 50), mode="append")  # version 3
    with pytest.raises(pe.JobFailedError, match=r"version 2 \(DELETE\).*ignore_deletes=True.*skip_change_commits"):
        _collect(tmp_path, path, starting_version=0)
    assert _collect(tmp_path, path, starting_version=0, skip_change_commits=True) == Counter(range(250))
    # ignore_changes: the rewritten file's rows come again (Spark's ignoreChanges)
    again = _collect(tmp_path, path, starting_version=0, ignore_changes=True)
    assert set(again) == set(range(250)) and all(again[i] == 1 for i in range(200, 250))

    whole = str(tmp_path / "w")
    _table(whole, versions=2, rows=100, partition_by=["p"])
    DeltaTable(whole).delete("p = 1")  # only removes files: ignore_deletes skips it
    got = _collect(tmp_path, whole, starting_version=0, ignore_deletes=True)
    assert got == Counter(range(200))
    write_deltalake(whole, _rows(500, 10), mode="overwrite", partition_by=["p"])
    with pytest.raises(pe.JobFailedError, match="rewrites or overwrites rows"):
        _collect(tmp_path, whole, starting_version=0, ignore_deletes=True)


def test_older_files_widen_to_the_schema_and_a_later_new_column_is_refused(tmp_path: Any) -> None:
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1, 2], pa.int64())}))
    write_deltalake(
        path, pa.table({"id": pa.array([3], pa.int64()), "extra": ["x"]}), mode="append", schema_mode="merge"
    )
    source = DeltaSource(path, starting_version=0)
    env = _env(tmp_path, 1)
    sink = pe.sinks.CollectSink()
    env.from_source(source).sink_to(sink)
    env.execute("widen")
    assert sorted(sink.records, key=lambda r: r["id"]) == [
        {"id": 1, "extra": None},
        {"id": 2, "extra": None},
        {"id": 3, "extra": "x"},
    ]
    # built before the column came: the version that adds it is refused, not truncated
    old = str(tmp_path / "o")
    write_deltalake(old, pa.table({"id": pa.array([1], pa.int64())}))
    source = DeltaSource(old, starting_version=0)
    projected = DeltaSource(old, starting_version=0, columns=["id"])
    write_deltalake(
        old, pa.table({"id": pa.array([2], pa.int64()), "extra": ["y"]}), mode="append", schema_mode="merge"
    )
    source.latest = projected.latest = 1  # as if built just before the second version, bounded past it
    got, position = [], 0
    while (batch := projected.read(0, 1, position, 100)) is not None:  # a column it does not read may come
        position += len(batch)
        got += batch.column("id").to_pylist()
    assert got == [1, 2]
    position = 0
    with pytest.raises(DeltaChangeError, match=r"adds column 'extra'.*Restart the job"):
        while (batch := source.read(0, 1, position, 100)) is not None:
            position += len(batch)
    assert position == 1  # version 0's row, then the refusal


def test_an_unbounded_read_takes_new_versions_across_a_failure_and_a_restore_at_another_parallelism(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(0, 100))
    sink = pe.sinks.CollectSink()

    def job(p: int, fail_at: int = 10**9) -> Any:
        env = _env(tmp_path, p, checkpoint_storage=str(tmp_path / f"ckpt{p}"))
        stream = env.read_delta(path, monitor_interval_ms=10).map(lambda r: r["id"]).map(FailOnce(fail_at))
        stream.rebalance().map(lambda i: i).sink_to(sink)
        return env

    client = job(3, fail_at=250).execute_async("watch")
    for v in range(1, 6):
        time.sleep(0.03)
        write_deltalake(path, _rows(v * 100, 100), mode="append")
    DeltaTable(path).optimize.compact()  # rows already read: skipped
    _until(lambda: len(sink.records) >= 600)
    assert client.restarts == 1
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    client.wait(60)
    assert Counter(sink.records) == Counter(range(600)), "a row was skipped or read twice"

    for v in range(6, 8):  # versions committed while the job is down
        write_deltalake(path, _rows(v * 100, 100), mode="append")
    client = job(2).execute_async("watch", restore_from=savepoint)
    _until(lambda: len(sink.records) >= 800)
    client.cancel()
    assert client.wait(60).status == "CANCELED"
    assert Counter(sink.records) == Counter(range(800)) == _batch_ids(path)


def test_event_time_through_a_watermark_strategy(tmp_path: Any) -> None:
    path = str(tmp_path / "t")
    n = 400
    write_deltalake(
        path,
        pa.table({"ts": pa.array(range(0, n * 10, 10), pa.int64()), "user": [i % 4 for i in range(n)]}),
    )
    env = _env(tmp_path, 2)
    sink = pe.sinks.CollectSink()
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(0).with_timestamp_assigner("ts")
    stream = env.read_delta(path, watermark_strategy=strategy)
    stream.key_by("user").window(pe.windows.tumbling(1000)).aggregate(pe.agg.count()).sink_to(sink)
    env.execute("windows")
    counts = [r["count"] for r in sink.records]
    assert sum(counts) == n and len(counts) == 4 * (n * 10 // 1000)


@pytest.mark.parametrize("n", [7, 64, 1000])
def test_a_restored_split_reads_on_from_its_row_whatever_the_batch_size(tmp_path: Any, n: int) -> None:
    """Split state and position taken after every read, restored into a new source (a
    new process's), read on: the rows are exactly the uninterrupted read's."""
    path = str(tmp_path / "t")
    _table(path, versions=4, rows=700)
    whole: List[int] = []
    source, position = DeltaSource(path), 0
    while (batch := source.read(0, 2, position, n)) is not None:
        position += len(batch)
        whole += batch.column("id").to_pylist()
    for stop in (1, 3, 40, 90):
        source, position, got = DeltaSource(path), 0, []
        for _ in range(stop):
            batch = source.read(0, 2, position, n)
            if batch is None:
                break
            assert len(batch), "a bounded split with rows left returns some"
            position += len(batch)
            got += batch.column("id").to_pylist()
        state = source.split_state(0, 2)
        restored = DeltaSource(path)
        restored.restore_split_state(0, 2, state)
        while (batch := restored.read(0, 2, position, n)) is not None:
            position += len(batch)
            got += batch.column("id").to_pylist()
        assert got == whole, f"restored after {stop} reads of {n}"


def test_a_snapshot_is_read_oldest_file_first(tmp_path: Any) -> None:
    """As Spark's Delta source: by modification time, so event time comes about in the
    order it was written (a path order would be the random one of the file names)."""
    path = str(tmp_path / "t")
    for v in range(6):
        write_deltalake(path, _rows(v * 10, 10), mode="append")
        time.sleep(0.01)
    source, position, got = DeltaSource(path), 0, []
    while (batch := source.read(0, 1, position, 1000)) is not None:
        position += len(batch)
        got += batch.column("id").to_pylist()
    assert got == list(range(60))
