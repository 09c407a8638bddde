"""Files as a replayable source: ``FileSource`` (a fixed set of files) and
``MonitoredFileSource`` (a directory watched for new files).

A split is a parquet row group or a whole file of the other formats, so a position
is a row within one split, and a restore rewinds exactly to the checkpoint."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import pyarrow as pa

from ..errors import NonRetryableError
from .base import Source, check_columns

if TYPE_CHECKING:
    import pyarrow.fs

__all__ = [
    "FileSource",
    "MonitoredFileSource",
]


class FileSource(Source):
    """Files read with ``pyarrow.dataset`` (parquet, csv, json, feather/ipc), as Arrow batches.

    The input is cut into splits, a parquet row group or a whole file of the other
    formats, sorted by path; subtask ``i`` of ``p`` reads splits ``i, i+p, ...`` one
    after the other, and its position is the number of rows it has read — so a
    restore seeks to the file and row it had reached. ``schema`` is the dataset's
    (from file footers or the first file, not a scan). ``filesystem``: a
    ``pyarrow.fs.FileSystem`` to read ``path`` with (an object store with its own
    credentials, say); by default it is inferred from ``path``.

    Reading fails rather than ends short: a split ends only when its reader has gone
    through every split normally, and a parquet row group that gives fewer rows than
    its footer says is an error. A read error (a damaged page, a file that cannot be
    opened, an object store's hiccup) fails the task with an error naming the file;
    the reader it broke is dropped, and every attempt (``restore_split_state``) opens
    the files again at the checkpointed position, so a restart after a transient
    error reads on, and an error that persists fails each attempt and then the job.

    Ordering: per split. The rows of one split (a row group, a file) reach the next
    operator in file order, and one subtask's splits in path order; splits read by
    different subtasks interleave. So one key's rows keep their file order downstream
    when they are all in one split (or at parallelism 1); a key spread over several
    files has no order across them, as with Flink's file source."""

    FORMATS = ("parquet", "csv", "json", "feather", "ipc", "arrow")

    def __init__(
        self,
        path: Any,
        format: str = "parquet",
        columns: Optional[List[str]] = None,
        filesystem: Optional[pyarrow.fs.FileSystem] = None,
    ) -> None:
        import pyarrow.dataset as ds

        if format not in self.FORMATS:
            raise ValueError(f"read_files format must be one of {', '.join(self.FORMATS)}, got {format!r}")
        try:
            dataset = ds.dataset(path, format=format, filesystem=filesystem)
        except (FileNotFoundError, OSError, pa.ArrowInvalid) as exc:
            raise ValueError(f"read_files({path!r}): {exc}") from None
        if columns is not None:
            check_columns(dataset.schema, columns, f"read_files({path!r})")
        splits = []
        for fragment in sorted(dataset.get_fragments(), key=lambda f: f.path):
            if format == "parquet":
                splits.extend(fragment.split_by_row_group())
            else:
                splits.append(fragment)
        if not splits:
            raise ValueError(f"read_files({path!r}): no {format} files there")
        self.path = path
        schema = dataset.schema
        self.schema: pa.Schema = schema if columns is None else pa.schema([schema.field(c) for c in columns])
        self.columns = columns
        self._splits = splits
        # what each split's file says it holds (a parquet row group's footer); None: unknown
        self._rows: List[Optional[int]] = [
            sum(rg.num_rows for rg in split.row_groups) if format == "parquet" else None for split in splits
        ]
        self._readers: Dict[Tuple[int, int], _SplitReader] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:  # to Spark executors: no open readers, a new lock
        state = self.__dict__.copy()
        state.pop("_lock", None)
        state["_readers"] = {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_rows" not in state:
            self._rows = [None] * len(self._splits)
        self._lock = threading.Lock()

    def restore_split_state(self, subtask: int, parallelism: int, state: Any) -> None:
        """An attempt starts: the split's files are opened again, at the position it
        restores (a reader kept from the attempt before may have failed midway)."""
        with self._lock:
            self._readers.pop((subtask, parallelism), None)

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        split = (subtask, parallelism)
        with self._lock:
            reader = self._readers.get(split)
            if reader is not None and reader.position == position and reader.batch_size != n:
                # a new slice size (adaptive buffers grow a source's reads): the reader goes
                # on from where it is, its next split decoded in batches of the new size;
                # opening it again would decode the current split anew up to the position
                reader.batch_size = n
            if reader is None or reader.position != position:
                self._readers.pop(split, None)
                reader = _SplitReader(
                    self.path,
                    self._splits[subtask::parallelism],
                    self._rows[subtask::parallelism],
                    self.schema,
                    self.columns,
                    n,
                    position,
                )
                self._readers[split] = reader
        try:
            return reader.take(n)  # None only when every split was read to its end
        except BaseException:
            with self._lock:  # a reader that failed is never asked again
                if self._readers.get(split) is reader:
                    del self._readers[split]
            raise


class _SplitReader:
    """Reads a subtask's splits in order, ``n`` rows at a time, from a row position.

    It tells the end (``take`` returns None) only after every split's batches have run
    out normally and each parquet row group gave the rows its footer says; an error
    while reading names the file and leaves the reader broken (it raises again)."""

    def __init__(
        self,
        path: Any,
        splits: List[Any],
        rows: List[Optional[int]],
        schema: pa.Schema,
        columns: Any,
        n: int,
        position: int,
    ) -> None:
        self.path = path
        self.batch_size = n
        self.schema = schema
        self.columns = columns
        self.position = 0
        self._splits = splits
        self._rows = rows
        self._next = 0  # the next split to open
        self._current: Optional[int] = None  # the split being read
        self._batches: Any = None
        self._read = 0  # rows the current split has given
        self._broken: Optional[BaseException] = None
        self._pending: List[pa.RecordBatch] = []
        self._pending_rows = 0
        while self._next < len(splits) and rows[self._next] is not None:  # seek: whole row groups by footer
            known = rows[self._next]
            assert known is not None
            if self.position + known > position:
                break
            self.position += known
            self._next += 1
        while self.position < position:  # then batches skipped, the last one sliced
            batch = self._batch()
            if batch is None:
                raise NonRetryableError(
                    f"read_files({path!r}): the checkpoint has read {position} rows of this split, but its files "
                    f"hold {self.position}: they changed since; restore from a checkpoint of these files, or run "
                    "the job fresh"
                )
            skip = min(batch.num_rows, position - self.position)
            self.position += skip
            if skip < batch.num_rows:
                self._pending, self._pending_rows = [batch.slice(skip)], batch.num_rows - skip

    def _where(self) -> str:
        index = self._current if self._current is not None else self._next
        if index >= len(self._splits):
            return f"read_files({self.path!r})"
        split = self._splits[index]
        groups = getattr(split, "row_groups", None)
        group = f" (row group {groups[0].id})" if groups and len(groups) == 1 else ""
        return f"read_files({self.path!r}): {split.path}{group}, after {self._read} rows of it"

    def _batch(self) -> Optional[pa.RecordBatch]:
        """The next batch with rows, or None at the end of the last split."""
        if self._broken is not None:
            raise RuntimeError(f"{self._where()}: this reader failed before ({self._broken})")
        try:
            while True:
                if self._batches is None:
                    if self._next >= len(self._splits):
                        return None
                    self._current, self._next, self._read = self._next, self._next + 1, 0
                    split = self._splits[self._current]
                    self._batches = iter(
                        split.to_batches(batch_size=self.batch_size, columns=self.columns, use_threads=False)
                    )
                batch = next(self._batches, None)
                if batch is None:  # the split ran out: as many rows as its file says?
                    assert self._current is not None
                    known = self._rows[self._current]
                    if known is not None and self._read != known:
                        raise OSError(f"the file's footer says {known} rows, the read gave {self._read}")
                    self._batches = None
                    continue
                if batch.num_rows:
                    self._read += batch.num_rows
                    return batch
        except Exception as exc:
            self._broken = exc
            message = f"{self._where()}: {exc}"
            try:
                error = type(exc)(message)
            except Exception:
                error = OSError(message)
            raise error from exc

    def take(self, n: int) -> Optional[pa.RecordBatch]:
        """Up to ``n`` rows; None once every split has been read to its end."""
        while self._pending_rows < n:
            batch = self._batch()
            if batch is None:
                break
            self._pending.append(batch)
            self._pending_rows += batch.num_rows
        pieces, taken = [], 0
        while self._pending and taken < n:
            head = self._pending[0]
            want = n - taken
            if head.num_rows <= want:
                pieces.append(self._pending.pop(0))
                taken += head.num_rows
            else:
                pieces.append(head.slice(0, want))
                self._pending[0] = head.slice(want)
                taken += want
        self._pending_rows -= taken
        self.position += taken
        if not pieces:
            return None
        return pieces[0] if len(pieces) == 1 else pa.concat_batches(pieces)


class MonitoredFileSource(Source):
    """``read_files(path, ..., monitor_interval_ms=...)``: a directory watched for new
    files, without end (until the job is cancelled or stopped with a savepoint).

    Every ``monitor_interval_ms`` a split lists the directory and takes the files it
    owns that it has not taken yet, by path order; a file belongs to split ``i`` of
    ``p`` when ``stable_hash(its path relative to the directory) % p == i``. Files
    whose name starts with ``.`` or ``_`` are skipped (write a file under such a name
    and rename it when complete: a file must not change once seen). A split reads
    its files in the order it took them, and its position is the rows read over
    them; the list of files it took is checkpointed with the position, so a restore
    reads on where it was, takes the files that came since, and neither skips nor
    repeats a file.

    Ordering: per file, in file order; one split's files in the order it took them."""

    def __init__(
        self,
        path: str,
        format: str,
        columns: Optional[List[str]],
        monitor_interval_ms: int,
        filesystem: Optional[pyarrow.fs.FileSystem] = None,
    ) -> None:
        import pyarrow.dataset as ds
        import pyarrow.fs as pafs

        if format not in FileSource.FORMATS:
            raise ValueError(f"read_files format must be one of {', '.join(FileSource.FORMATS)}, got {format!r}")
        if type(monitor_interval_ms) is not int or monitor_interval_ms < 1:
            raise ValueError(f"read_files monitor_interval_ms must be an int >= 1, got {monitor_interval_ms!r}")
        try:
            if filesystem is not None:
                fs, root = filesystem, path
            else:
                fs, root = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)
            info = fs.get_file_info(root)
        except (OSError, pa.ArrowInvalid) as exc:
            raise ValueError(f"read_files({path!r}): {exc}") from None
        if info.type != pafs.FileType.Directory:
            raise ValueError(f"read_files({path!r}, monitor_interval_ms=...) watches a directory, and there is none")
        self.path = path
        self.format = format
        self.columns = columns
        self.interval_s = monitor_interval_ms / 1000
        self.filesystem = filesystem
        self._fs, self._root = fs, root.rstrip("/")
        files = self._list()
        self.schema = None  # type: ignore[assignment]
        if files:  # known from the files there now: columns are checked when the job is built
            schema = ds.dataset(f"{self._root}/{files[0]}", format=format, filesystem=fs).schema
            if columns is not None:
                check_columns(schema, columns, f"read_files({path!r})")
                schema = pa.schema([schema.field(c) for c in columns])
            self.schema = schema
        self._taken: Dict[Tuple[int, int], List[str]] = {}
        self._readers: Dict[Tuple[int, int], Any] = {}
        self._scanned: Dict[Tuple[int, int], float] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_lock", "_fs"):
            state.pop(name, None)
        state["_readers"], state["_scanned"] = {}, {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        import pyarrow.fs as pafs

        self.__dict__.update(state)
        self._lock = threading.Lock()
        if getattr(self, "filesystem", None) is not None:
            self._fs = self.filesystem
        else:
            self._fs = pafs.FileSystem.from_uri(self.path)[0] if "://" in self.path else pafs.LocalFileSystem()

    def _list(self) -> List[str]:
        """Every readable file under the directory, by path relative to it, sorted."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self._root, recursive=True)
        out = []
        for info in self._fs.get_file_info(selector):
            if info.type != pafs.FileType.File:
                continue
            relative = info.path[len(self._root) :].lstrip("/")
            if any(part.startswith((".", "_")) for part in relative.split("/")):
                continue
            out.append(relative)
        return sorted(out)

    def split_state(self, subtask: int, parallelism: int) -> Any:
        return list(self._taken.get((subtask, parallelism), []))

    def restore_split_state(self, subtask: int, parallelism: int, state: Any) -> None:
        with self._lock:
            self._taken[(subtask, parallelism)] = [str(f) for f in state] if state else []
            self._readers.pop((subtask, parallelism), None)
            self._scanned.pop((subtask, parallelism), None)

    def _discover(self, subtask: int, parallelism: int) -> List[str]:
        from ..state.keygroups import stable_hash

        taken = self._taken.setdefault((subtask, parallelism), [])
        seen = set(taken)
        new = [f for f in self._list() if f not in seen and stable_hash(f) % parallelism == subtask]
        taken.extend(new)
        return new

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        split = (subtask, parallelism)
        reader = self._readers.get(split)
        if reader is None or reader.position != position:
            reader = _FilesReader(self, list(self._taken.get(split, [])), position)
            self._readers[split] = reader
        try:
            batch = reader.take(n)
            if batch is not None:
                return batch
            now = time.monotonic()
            if now - self._scanned.get(split, -1e9) < self.interval_s:
                return []
            self._scanned[split] = now
            new = self._discover(subtask, parallelism)
            if not new:
                return []
            reader.files.extend(new)
            return reader.take(n) or []
        except BaseException:  # a reader that failed is never asked again (it would skip the file's rest)
            if self._readers.get(split) is reader:
                del self._readers[split]
            raise


class _FilesReader:
    """Rows of a list of files in order, ``n`` at a time, from a row position; the
    list may grow at its end."""

    def __init__(self, source: MonitoredFileSource, files: List[str], position: int) -> None:
        self.source = source
        self.files = files
        self.position = 0
        self._next_file = 0
        self._batches: Any = iter(())
        self._pending: List[pa.RecordBatch] = []
        skip = position
        while skip > 0:  # seek: whole files by their row counts, then rows
            batch = self._next_batch(4096)
            if batch is None:
                break
            if batch.num_rows > skip:
                self._pending = [batch.slice(skip)]
                self.position += skip
                break
            skip -= batch.num_rows
            self.position += batch.num_rows

    def _open(self, name: str) -> Any:
        import pyarrow.dataset as ds

        s = self.source
        dataset = ds.dataset(f"{s._root}/{name}", format=s.format, filesystem=s._fs)
        return dataset.to_batches(columns=s.columns, use_threads=False)

    def _next_batch(self, n: int) -> Optional[pa.RecordBatch]:
        while True:
            try:
                batch = next(self._batches, None)
            except Exception as exc:  # name the file: which one failed is what a user needs
                name = self.files[self._next_file - 1]
                message = f"read_files({self.source.path!r}): {self.source._root}/{name}: {exc}"
                try:
                    error = type(exc)(message)
                except Exception:
                    error = OSError(message)
                raise error from exc
            if batch is not None:
                if batch.num_rows:
                    return batch
                continue
            if self._next_file >= len(self.files):
                return None
            self._batches = self._open(self.files[self._next_file])
            self._next_file += 1

    def take(self, n: int) -> Optional[pa.RecordBatch]:
        pieces, taken = [], 0
        while taken < n:
            batch = self._pending.pop(0) if self._pending else self._next_batch(n)
            if batch is None:
                break
            want = n - taken
            if batch.num_rows > want:
                self._pending.insert(0, batch.slice(want))
                batch = batch.slice(0, want)
            pieces.append(batch)
            taken += batch.num_rows
        if not pieces:
            return None
        self.position += taken
        if len(pieces) == 1:
            return pieces[0]
        try:
            return pa.concat_batches(pieces)
        except pa.ArrowInvalid:  # files of different schemas: one at a time
            self._pending = pieces[1:] + self._pending
            self.position -= taken - pieces[0].num_rows
            return pieces[0]
