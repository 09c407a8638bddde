"""A file source whose read fails (issue 37, item 1): a damaged Parquet data page, an
object store's transient read error. A restart reads the file again from the
checkpointed position; an error that persists fails the job naming the file; an
empty read is never taken for the end of the input."""

from __future__ import annotations

import os
from typing import Any, List

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chaos import FlakyFiles

import pyengine as pe
from pyengine.connectors.files import FileSource
from pyengine.errors import JobFailedError, NonRetryableError

FILES, ROWS = 3, 1000


def write_files(root: Any, row_group_size: int = ROWS) -> str:
    """Three parquet files of 1000 rows each, ``v`` numbering every row."""
    os.makedirs(root, exist_ok=True)
    for k in range(FILES):
        v = list(range(k * ROWS, (k + 1) * ROWS))
        table = pa.table({"user": [i % 13 for i in v], "v": v})
        pq.write_table(table, f"{root}/part-{k}.parquet", row_group_size=row_group_size)
    return str(root)


def damage(path: str) -> None:
    """Overwrites bytes of the first data page of column ``v`` with garbage: the page
    cannot be decoded (a real damaged file, as a disk or a partial upload leaves)."""
    column = pq.ParquetFile(path).metadata.row_group(0).column(1)
    data = bytearray(open(path, "rb").read())
    start = column.data_page_offset + 30
    data[start : start + 200] = b"\xab" * 200
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(OSError):
        pq.read_table(path)


def env(tmp_path: Any, executor: str, parallelism: int) -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=parallelism,
        executor=executor,
        restart_attempts=1,
        restart_delay_ms=0,
        checkpointing=pe.CheckpointConfig(interval_ms=10),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=100,
    )


def values(sink: pe.sinks.FileSink) -> List[int]:
    return sorted(r["v"] for r in sink.read_committed())


@pytest.mark.parametrize(
    ("executor", "parallelism", "damaged"),
    [("threads", 2, 1), ("threads", 1, 0), ("processes", 2, 1)],
)
def test_a_damaged_file_fails_the_job_naming_it_instead_of_finishing_short(
    tmp_path, executor: str, parallelism: int, damaged: int
) -> None:
    """Before: on threads the restarted job kept the broken reader, which answered
    empty, taken for the end: FINISHED with 2,000 of 3,000 rows (p=2), 0 of 3,000 with
    the damaged file first (p=1). The processes executor failed, without the file."""
    root = write_files(tmp_path / "in")
    damage(f"{root}/part-{damaged}.parquet")
    e = env(tmp_path, executor, parallelism)
    sink = pe.sinks.FileSink(str(tmp_path / "out"))
    e.read_files(root).sink_to(sink)
    with pytest.raises(JobFailedError) as info:
        e.execute(f"damaged-{executor}-{parallelism}")
    result = info.value.result
    assert result.status == "FAILED" and result.restarts == 1
    assert f"part-{damaged}.parquet" in str(result.cause), result.cause


@pytest.mark.parametrize(
    ("executor", "parallelism", "at"),
    [("threads", 1, 1), ("threads", 2, 2), ("threads", 2, 9), ("processes", 2, 4)],
)
def test_a_transient_read_error_is_read_past_after_the_restart(
    tmp_path, executor: str, parallelism: int, at: int
) -> None:
    """The ``at``-th read of the files' bytes fails once (an object store's hiccup);
    the restart reopens the file at the checkpointed position and the job delivers
    every row once. Before: at=1, p=1 FINISHED with none of the 3,000 rows."""
    root = write_files(tmp_path / "in", row_group_size=250)
    flaky = FlakyFiles(str(tmp_path / "fired"), at)
    e = env(tmp_path, executor, parallelism)
    sink = pe.sinks.FileSink(str(tmp_path / "out"))
    e.read_files(root, filesystem=flaky.filesystem()).sink_to(sink)
    flaky.arm()
    result = e.execute(f"flaky-{executor}-{parallelism}-{at}")
    assert flaky.fired(), "the read error was never injected: this run tested nothing"
    assert result.status == "FINISHED" and result.restarts == 1, result.cause
    assert values(sink) == list(range(FILES * ROWS))


@pytest.mark.parametrize(("parallelism", "at"), [(1, 1), (1, 2), (2, 3)])
def test_a_permission_error_fixed_before_the_restart_loses_no_rows(tmp_path, parallelism: int, at: int) -> None:
    """The ``at``-th opening of a file is refused once (a permission fixed before the
    restart; as root a chmod refuses nothing, so the filesystem refuses). Before: at=1,
    p=1 FINISHED with none of the 3,000 rows."""
    root = write_files(tmp_path / "in")
    flaky = FlakyFiles(str(tmp_path / "fired"), at, what="open")
    e = env(tmp_path, "threads", parallelism)
    sink = pe.sinks.FileSink(str(tmp_path / "out"))
    e.read_files(root, filesystem=flaky.filesystem()).sink_to(sink)
    flaky.arm()
    result = e.execute(f"refused-{parallelism}-{at}")
    assert flaky.fired(), "the open was never refused: this run tested nothing"
    assert result.status == "FINISHED" and result.restarts == 1, result.cause
    assert values(sink) == list(range(FILES * ROWS))


def test_a_read_after_a_failed_one_reopens_the_file_and_never_reads_as_the_end(tmp_path) -> None:
    """``FileSource.read`` after a read that raised (same split, same position) reads
    the rows again; before, the broken reader answered empty, which ended the split."""
    root = write_files(tmp_path / "in")
    flaky = FlakyFiles(str(tmp_path / "fired"), 1)
    source = FileSource(root, filesystem=flaky.filesystem())
    flaky.arm()
    with pytest.raises(OSError, match=r"part-0\.parquet.*injected transient read error"):
        source.read(0, 1, 0, 500)
    batch = source.read(0, 1, 0, 500)
    assert batch is not None and batch.column("v").to_pylist() == list(range(500))
    position, seen = 500, 500
    while (batch := source.read(0, 1, position, 500)) is not None:
        assert batch.num_rows, "an empty batch: only None ends a split"
        position += batch.num_rows
        seen += batch.num_rows
    assert seen == FILES * ROWS


def test_a_checkpoint_past_the_end_of_changed_files_is_refused(tmp_path) -> None:
    """A restore whose position lies past the rows the files now hold (they shrank
    since the checkpoint) fails naming the way out, instead of ending the split there."""
    root = write_files(tmp_path / "in")
    source = FileSource(root)
    with pytest.raises(NonRetryableError, match="changed since"):
        source.read(0, 1, FILES * ROWS + 1, 100)


def test_a_watched_directory_reads_a_file_again_after_a_failed_read(tmp_path) -> None:
    """``read_files(..., monitor_interval_ms=...)``: a read that raised names the file,
    and the next read at the same position reads that file again instead of going on
    with the reader that failed, which would skip the rest of the file."""
    from pyengine.connectors.files import MonitoredFileSource

    root = write_files(tmp_path / "in", row_group_size=250)
    flaky = FlakyFiles(str(tmp_path / "fired"), 2)
    source = MonitoredFileSource(root, "parquet", None, 1, filesystem=flaky.filesystem())
    source.restore_split_state(0, 1, None)
    flaky.arm()
    position, seen = 0, []
    with pytest.raises(OSError, match=r"part-0\.parquet.*injected transient read error"):
        while len(seen) < FILES * ROWS:
            batch = source.read(0, 1, position, 100)
            if batch is not None and len(batch):
                seen.extend(batch.column("v").to_pylist())
                position += len(batch)
    assert flaky.fired()
    for _ in range(1000):
        batch = source.read(0, 1, position, 100)
        if batch is not None and len(batch):
            seen.extend(batch.column("v").to_pylist())
            position += len(batch)
        if len(seen) >= FILES * ROWS:
            break
    assert seen == list(range(FILES * ROWS))
