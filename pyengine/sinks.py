"""Sinks: where a job's output goes, exactly once.

Transactional sinks stage what a subtask wrote between two checkpoints and make
it visible when the checkpoint covering it completes (two-phase commit). A
staged piece is named by the checkpoint that covers it, so recovery needs no
state: restoring from checkpoint ``R`` commits every staged piece of a
checkpoint ``<= R`` (that checkpoint completed; only its commit never ran) and
aborts the rest (their records will be replayed)."""

from __future__ import annotations

import csv
import io
import json
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow.fs import FileSelector

from .storage.filesystem import resolve

__all__ = ["CollectSink", "DiscardSink", "FileSink", "PrintSink", "RunInfo", "Sink"]

FINAL = 2**62  # the checkpoint id of what is staged at the end of input without checkpoints

# The lineage a restored state covers: (run id, last checkpoint id of that run it covers), oldest first.
Covered = Sequence[Tuple[str, int]]


@dataclass(frozen=True)
class RunInfo:
    """Who is writing: one run of a job.

    ``run_id`` is this run's id (the job id of ``JobResult``); ``lineage_id`` the id of
    the first run of the chain of restores this run continues (a fresh run: its own
    id), so a sink tells its own earlier output from another job's; ``restored`` the
    lineage of the checkpoint this run started from (``()`` for a fresh start)."""

    job_name: str
    run_id: str
    lineage_id: str
    restored: Tuple[Tuple[str, int], ...] = ()


class Sink:
    """A sink's subtasks call ``stage``/``commit``; the runner calls ``recover``."""

    transactional = True

    def open(self, subtask: int) -> None:
        pass

    # Sinks travel to Spark executors inside the job: their locks are made anew there.
    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        """Keeps ``records`` invisibly until ``commit`` of a checkpoint >= ``checkpoint_id``.

        ``records`` is a list of records, or a ``pyarrow.Table`` when the stream
        carried Arrow batches (``map_batches``, ``aggregate``, ``read_files``)."""
        raise NotImplementedError

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        """Makes visible what ``subtask`` staged for checkpoints <= ``checkpoint_id``."""
        raise NotImplementedError

    def recover(self, restored_checkpoint: int) -> None:
        """Before a (re)start from ``restored_checkpoint`` (0: none): commit what is
        staged for checkpoints up to it, abort the rest."""
        raise NotImplementedError


class CollectSink(Sink):
    """Results kept in memory and returned in ``JobResult.records``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: Dict[Tuple[int, int], List[Any]] = {}
        self.records: List[Any] = []

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        rows = _rows(records)
        with self._lock:
            self._staged.setdefault((subtask, checkpoint_id), []).extend(rows)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        with self._lock:
            for key in sorted(k for k in self._staged if k[0] == subtask and k[1] <= checkpoint_id):
                self.records.extend(self._staged.pop(key))

    def recover(self, restored_checkpoint: int) -> None:
        with self._lock:
            for key in sorted(self._staged, key=lambda k: k[1]):
                records = self._staged.pop(key)
                if key[1] <= restored_checkpoint:
                    self.records.extend(records)


class PrintSink(Sink):
    """Prints each record as it arrives (not transactional: for looking, not for keeping)."""

    transactional = False

    def __init__(self, stream: Optional[TextIO] = None, prefix: str = "") -> None:
        self._stream = stream
        self.prefix = prefix
        self._lock = threading.Lock()

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        out = self._stream or sys.stdout
        with self._lock:
            for r in _rows(records):
                print(f"{self.prefix}{r}", file=out)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        pass

    def recover(self, restored_checkpoint: int) -> None:
        pass


class DiscardSink(Sink):
    """Drops everything, counting records: for benchmarks, as Flink's DiscardingSink."""

    transactional = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        with self._lock:
            self.count += len(records)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        pass

    def recover(self, restored_checkpoint: int) -> None:
        pass


_STAGED = re.compile(r"^part-(\d+)-(\d+)-(\d+)\.(jsonl|csv|parquet)$")


class FileSink(Sink):
    """Part files under ``path`` (a local path or a ``pyarrow.fs`` URI), in
    ``jsonl``, ``csv`` or ``parquet``. Staged files live in ``_staging/``;
    committed ones are the only files whose names start with neither ``_`` nor ``.``."""

    FORMATS = ("jsonl", "csv", "parquet")

    def __init__(self, path: str, format: str = "jsonl") -> None:
        if format not in self.FORMATS:
            raise ValueError(f"FileSink format must be one of {', '.join(self.FORMATS)}, got {format!r}")
        if not isinstance(path, str) or not path:
            raise ValueError(f"FileSink needs a path, got {path!r}")
        self.path = path
        self.format = format
        self._seq: Dict[Tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def _fs(self) -> Tuple[Any, str]:
        fs, root, _ = resolve(self.path)
        return fs, root

    def open(self, subtask: int) -> None:
        fs, root = self._fs()
        fs.create_dir(f"{root}/_staging", recursive=True)

    def _encode(self, records: Any) -> bytes:
        if self.format == "jsonl":
            return "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in _rows(records)).encode()
        table = records if isinstance(records, pa.Table) else _table_of(records)
        if self.format == "csv":
            text = io.StringIO()
            writer = csv.writer(text)
            writer.writerow(table.column_names)
            for row in zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True):
                writer.writerow(row)
            return text.getvalue().encode()
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        return bytes(sink.getvalue().to_pybytes())

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        if not len(records):
            return
        with self._lock:
            seq = self._seq.get((subtask, checkpoint_id), 0)
            self._seq[(subtask, checkpoint_id)] = seq + 1
        fs, root = self._fs()
        name = f"part-{subtask}-{checkpoint_id}-{seq}.{self.format}"
        temp = f"{root}/_staging/.{name}.tmp"
        with fs.open_output_stream(temp) as out:
            out.write(self._encode(records))
        fs.move(temp, f"{root}/_staging/{name}")

    def _staged(self) -> List[Tuple[str, int, int]]:
        fs, root = self._fs()
        try:
            infos = fs.get_file_info(FileSelector(f"{root}/_staging", allow_not_found=True))
        except FileNotFoundError:
            return []
        out = []
        for info in infos:
            match = _STAGED.match(info.base_name)
            if match:
                out.append((info.base_name, int(match.group(1)), int(match.group(2))))
        return out

    def _publish(self, name: str) -> None:
        fs, root = self._fs()
        staged, final = f"{root}/_staging/{name}", f"{root}/{name}"
        if fs.get_file_info(final).type.name == "File":
            fs.delete_file(staged)  # committed before, by an attempt that died before cleaning up
        else:
            fs.move(staged, final)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        for name, sub, cid in self._staged():
            if sub == subtask and cid <= checkpoint_id:
                self._publish(name)

    def recover(self, restored_checkpoint: int) -> None:
        fs, root = self._fs()
        fs.create_dir(f"{root}/_staging", recursive=True)
        for name, _, cid in self._staged():
            if cid <= restored_checkpoint:
                self._publish(name)
            else:
                fs.delete_file(f"{root}/_staging/{name}")
        for info in fs.get_file_info(FileSelector(f"{root}/_staging")):
            if info.base_name.endswith(".tmp"):
                fs.delete_file(info.path)

    def committed_files(self) -> List[str]:
        """Paths of the committed part files, in the order they were written per
        subtask (by subtask, checkpoint, sequence number; other files by name last)."""
        fs, root = self._fs()
        infos = fs.get_file_info(FileSelector(root, allow_not_found=True))

        def order(info: Any) -> Tuple[int, int, int, int, str]:
            match = _STAGED.match(info.base_name)
            if match is None:
                return (1, 0, 0, 0, info.base_name)
            return (0, int(match.group(1)), int(match.group(2)), int(match.group(3)), info.base_name)

        files = [i for i in infos if i.is_file and not i.base_name.startswith(("_", "."))]
        return [i.path for i in sorted(files, key=order)]

    def read_committed(self) -> List[Any]:
        """Every committed record (jsonl: as parsed JSON; csv/parquet: dicts)."""
        fs, _ = self._fs()
        out: List[Any] = []
        for path in self.committed_files():
            with fs.open_input_file(path) as f:
                data = f.read()
            if self.format == "jsonl":
                out.extend(json.loads(line) for line in data.decode().splitlines() if line)
            elif self.format == "csv":
                out.extend(csv.DictReader(io.StringIO(data.decode())))
            else:
                out.extend(pq.read_table(pa.py_buffer(data)).to_pylist())
        return out


def _rows(records: Any) -> List[Any]:
    if isinstance(records, (pa.Table, pa.RecordBatch)):
        return records.to_pylist()  # type: ignore[no-any-return]
    return list(records)


def _table_of(records: List[Any]) -> pa.Table:
    if records and not isinstance(records[0], dict):
        records = [{"value": r} for r in records]
    return pa.Table.from_pylist(records)
