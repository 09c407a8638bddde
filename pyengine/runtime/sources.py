"""Replayable sources: each subtask reads its split and keeps its position in
operator state, so a restore rewinds exactly to the checkpoint."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import pyarrow as pa

from ..errors import ColumnNotFoundError, NonRetryableError, suggest_keywords
from ..io.events import MIN_WATERMARK, WATERMARK_ACTIVE, WATERMARK_IDLE, Watermark
from ..state import ListStateDescriptor
from ..storage.metadata import OperatorState
from .operators import Operator, OperatorContext, UserFunctionError, _mono_ms

if TYPE_CHECKING:
    import pyarrow.fs

__all__ = [
    "CollectionSource",
    "ColumnNotFoundError",
    "FileSource",
    "GeneratorSource",
    "MonitoredFileSource",
    "Source",
    "SourceOperator",
    "check_columns",
    "refuse_wrong_collection",
]

log = logging.getLogger(__name__)

_POSITION = ListStateDescriptor("position")


class Source:
    """A bounded, replayable input, read split by split.

    ``read(subtask, parallelism, position, n)`` returns up to ``n`` records of the
    split that subtask ``subtask`` of ``parallelism`` reads, starting at
    ``position`` (the number of records of that split already read):

    - a list of records or a ``pyarrow.RecordBatch``, possibly shorter than ``n`` or
      empty: what is there now. A short or empty result does **not** end the split:
      the source is polled again (after a short back-off when nothing came), so a
      source that waits on something outside (a queue, a service) returns what it
      has and lets checkpoints and other tasks go on meanwhile;
    - ``None`` (``Source.END``): the split has ended; it is not read again.

    ``read`` must be deterministic by position: the records from ``position`` on
    are the same in every attempt, so that a restore, which rewinds each split to
    its checkpointed position, replays exactly what the checkpoint had not covered.

    ``schema`` is the ``pyarrow.Schema`` of the records when the source knows it
    (Arrow sources), else None; with it, column names are checked when the job is
    built (``key_by``, ``aggregate``) instead of failing at run time.

    Ordering: records of one split reach the next operator in the order ``read``
    returns them; records of different splits interleave. Each source says below
    what that means for the order of one key's records downstream."""

    END: Optional[Any] = None
    """What ``read`` returns at the end of a split."""

    schema: Optional[pa.Schema] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every source's constructor, a user's own too, answers an unknown keyword with
        # "did you mean", its signature unchanged.
        super().__init_subclass__(**kwargs)
        suggest_keywords(cls)

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        """Up to ``n`` records from ``position`` of the split; ``None`` at its end."""
        raise NotImplementedError

    def split_state(self, subtask: int, parallelism: int) -> Any:
        """What a split needs besides its position to be read again the same way after
        a restore (plain data; None: nothing), checkpointed with the position. A
        source whose splits grow as it runs (a watched directory: the files a split
        has taken, in order) keeps it here."""
        return None

    def restore_split_state(self, subtask: int, parallelism: int, state: Any) -> None:
        """Before a run reads a split: the state ``split_state`` gave at the restored
        checkpoint, or None for a fresh start."""

    def is_processing_backlog(self) -> bool:
        """True while the source is catching up on a backlog (Flink's
        ``isProcessingBacklog``, FLIP-309): the job then checkpoints every
        ``CheckpointConfig.interval_during_backlog_ms``. Asked from the coordinator's
        thread at every checkpoint tick, so it must be cheap and thread-safe (read a
        flag). A source may also tell the coordinator itself,
        ``coordinator.set_processing_backlog(name, True)``."""
        return False


class CollectionSource(Source):
    """A list of records, or an Arrow table (read as batches), read in its order by
    one subtask.

    Ordering: like Flink's ``fromCollection``, this source is not parallel: subtask
    0 reads the whole collection, from first to last, and every other source subtask
    ends at once. So whatever the parallelism, the records of one key reach a keyed
    operator in the order of the collection (a hash exchange keeps the order of each
    sender). The operators chained to the source before the first exchange run on
    subtask 0 only: add ``.rebalance()`` after the source to spread stateless work
    over every subtask (this gives up the order per key), or read files with
    ``read_files``, which is parallel by split."""

    def __init__(self, records: Any) -> None:
        refuse_wrong_collection(records)
        if isinstance(records, pa.RecordBatch):
            records = pa.Table.from_batches([records])
        self.records = records if isinstance(records, pa.Table) else list(records)
        self.schema = self.records.schema if isinstance(self.records, pa.Table) else None

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if subtask != 0:
            if position:  # an older CollectionSource dealt rows round-robin to every subtask
                raise NonRetryableError(
                    f"from_collection: the checkpoint has read position {position} for source split {subtask} "
                    "of a collection, which only split 0 reads now; it was written by an older pyengine "
                    "that dealt a collection round-robin: run the job again without restoring it"
                )
            return None
        if isinstance(self.records, pa.Table):
            if position >= self.records.num_rows:
                return None
            rows = self.records.slice(position, n)
            batches = rows.to_batches()
            return batches[0] if len(batches) == 1 else rows.combine_chunks().to_batches()[0]
        if position >= len(self.records):
            return None
        return self.records[position : position + n]


def refuse_wrong_collection(records: Any) -> None:
    """``from_collection`` takes a list (any iterable) of records or an Arrow table.
    A pandas, polars or Spark DataFrame, a dict or a string is iterable too, by
    column names or characters, and would fail later with a confusing message or
    none at all: refused here, naming the call that takes it. The check goes by the
    type's module, so neither pandas nor pyspark is imported."""
    t = type(records)
    module = t.__module__ or ""
    if module.startswith("pyspark.") and hasattr(records, "isStreaming"):
        if records.isStreaming:
            raise TypeError(
                "from_collection takes a list of records or a pyarrow.Table, got a streaming Spark DataFrame "
                "(spark.readStream): read the same input as a batch DataFrame (spark.read...) and pass it to "
                "env.from_dataframe(df), or feed a running job from Structured Streaming's foreachBatch"
            )
        raise TypeError(
            "from_collection takes a list of records or a pyarrow.Table, got a Spark DataFrame: "
            "use env.from_dataframe(df)"
        )
    if module.startswith("pandas.") and t.__name__ == "DataFrame":
        raise TypeError(
            "from_collection takes a list of records or a pyarrow.Table, got a pandas DataFrame: "
            "use env.from_collection(pa.Table.from_pandas(df))"
        )
    if module.startswith("polars.") and t.__name__ in ("DataFrame", "LazyFrame"):
        call = "df.to_arrow()" if t.__name__ == "DataFrame" else "lf.collect().to_arrow()"
        raise TypeError(
            f"from_collection takes a list of records or a pyarrow.Table, got a polars {t.__name__}: "
            f"use env.from_collection({call})"
        )
    if isinstance(records, (str, bytes, bytearray)):
        raise TypeError(
            f"from_collection takes a list of records or a pyarrow.Table, got a {t.__name__} "
            f"(its characters would be the records): wrap it in a list, env.from_collection([value])"
        )
    if isinstance(records, Mapping):
        raise TypeError(
            "from_collection takes a list of records or a pyarrow.Table, got a mapping (its keys would be the "
            "records): for columns use env.from_collection(pa.table(d)), for pairs list(d.items())"
        )
    if not isinstance(records, (pa.Table, pa.RecordBatch)) and not isinstance(records, Iterable):
        raise TypeError(f"from_collection takes a list of records or a pyarrow.Table, got {t.__name__}")


def check_columns(schema: Optional[pa.Schema], columns: Sequence[str], where: str) -> None:
    """Raises ``ColumnNotFoundError`` naming the first of ``columns`` that ``schema``
    lacks, the columns there are, and the closest name; nothing when the schema is
    unknown (None), as after a ``map``."""
    if schema is None:
        return
    names = list(schema.names)
    for column in columns:
        if column not in names:
            raise ColumnNotFoundError(_missing(column, names, where))


def _missing(column: str, names: Sequence[str], where: str) -> str:
    import difflib

    close = difflib.get_close_matches(column, list(names), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: no column {column!r} in the records (columns: {', '.join(map(str, names))}){hint}"


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
            if reader is None or reader.position != position or reader.batch_size != n:
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


class GeneratorSource(Source):
    """Records ``fn(sequence_number)``: ``count`` of them, or without end when
    ``count`` is None; at most ``rate_per_s`` per second over all subtasks when given
    (paced: a split that is ahead has "nothing now"). Deterministic by construction.

    The rate is a ceiling: each split has a token bucket that fills at its share of
    the rate and holds at most ``BURST_S`` seconds of it, so over any window of ``T``
    seconds the source gives at most ``rate_per_s * (T + BURST_S)`` records. Time the
    job spent not reading (backpressure, a stall, a restart) is not made up for later
    with a burst; the bound of 50 ms is above the source's longest idle back-off
    (20 ms), so an unhindered source still reaches the rate.

    Ordering: parallel, like Flink's ``fromSequence``: subtask ``i`` of ``p`` makes
    the records of sequence numbers ``i, i+p, i+2p, ...``, in increasing order, and
    the subtasks interleave. A key's records keep the sequence order downstream only
    when they all come from one subtask (at parallelism 1, say); otherwise use
    ``from_collection``, which keeps its order per key at any parallelism."""

    BURST_S = 0.05
    """The most of the rate a split saves up while it is not read (its bucket's size)."""

    def __init__(self, fn: Callable[[int], Any], count: Optional[int], rate_per_s: Optional[float] = None) -> None:
        if count is not None and (type(count) is not int or count < 0):
            raise ValueError(f"from_generator count must be an int >= 0 or None (unbounded), got {count!r}")
        if rate_per_s is not None and (isinstance(rate_per_s, bool) or not rate_per_s > 0):
            raise ValueError(f"from_generator rate_per_s must be a number > 0 or None, got {rate_per_s!r}")
        self.fn = fn
        self.count = count
        self.rate_per_s = rate_per_s
        # split -> (when its bucket was last filled, tokens then, the position it expects next)
        self._pace: Dict[Tuple[int, int], Tuple[float, float, int]] = {}

    def __getstate__(self) -> Dict[str, Any]:  # to Spark executors: pacing starts there
        state = self.__dict__.copy()
        state["_pace"] = {}
        return state

    def _allowed(self, subtask: int, parallelism: int, position: int, n: int) -> int:
        """How many records the split may give now: the whole tokens in its bucket,
        which fills at ``rate_per_s / parallelism`` a second up to ``BURST_S`` seconds'
        worth. A split read from another position than the one it gave last (the first
        read, a restore) starts with one token (a restore starts the clock again)."""
        assert self.rate_per_s is not None
        now = time.monotonic()
        rate = self.rate_per_s / parallelism
        size = max(1.0, rate * self.BURST_S)
        bucket = self._pace.get((subtask, parallelism))
        if bucket is None or bucket[2] != position:
            tokens = 1.0
        else:
            tokens = min(size, bucket[1] + (now - bucket[0]) * rate)
        give = max(0, min(n, int(tokens)))
        self._pace[(subtask, parallelism)] = (now, tokens - give, position + give)
        return give

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Optional[List[Any]]:
        first = subtask + position * parallelism
        if self.count is not None and first >= self.count:
            return None
        if self.rate_per_s is not None:
            n = self._allowed(subtask, parallelism, position, n)
            if n == 0:
                return []
        end = first + n * parallelism
        if self.count is not None:
            end = min(self.count, end)
        return [self.fn(i) for i in range(first, end, parallelism)]


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


class SourceOperator(Operator):
    """The head of a source task: reads its splits from their positions.

    A split is what subtask ``i`` of ``p`` read when the job first ran (``Source.read``
    with that ``i`` and ``p``); every split's position is in union list state, so a
    restore at another parallelism hands the splits round-robin to the new subtasks
    and each resumes exactly where its split stopped (as Flink's split enumerator
    reassigns splits).

    A split is read until it has nothing now, then the next one is tried; a split
    ends only when ``read`` returns ``None``. When no split has anything, ``read``
    waits ``idle_wait(seconds)`` before returning nothing: 1 ms, doubling up to
    20 ms while it stays idle, so a source that is polled gives its core to the
    other tasks instead of spinning. ``idle_wait`` is ``time.sleep`` unless the task
    gives a wait that also wakes for its mailbox.

    With a watermark strategy, each split has its own watermark generator (Flink's
    per-split watermarks): the subtask's watermark is the lowest of its splits that
    are neither ended nor idle, and the subtask is idle when all of them are. Each
    split's largest timestamp is checkpointed with its position, so a restored
    split's watermark starts where it was."""

    generates_watermarks = True

    MIN_IDLE_S = 0.001
    MAX_IDLE_S = 0.02
    WARN_IDLE_S = 60.0  # a source idle this long is told once how to end a split

    def __init__(self, uid: str, name: str, source: Source, strategy: Any = None) -> None:
        super().__init__(uid, name)
        self.source = source
        self.strategy = strategy
        self.timestamps = strategy.require_timestamps("watermark_strategy") if strategy is not None else None
        self.splits: List[List[int]] = []  # [index, count, position, done]
        self.exhausted = False
        self.idle_wait: Callable[[float], None] = time.sleep
        self._turn = 0  # which of the splits not yet done is read next
        self._idle_s = 0.0  # the current back-off; 0 while records come
        self._idle_since: Optional[float] = None
        self._warned = False
        self._generators: Dict[Tuple[int, int], Any] = {}  # per split (index, count)
        self._restored_max: Dict[Tuple[int, int], int] = {}
        self._sent = MIN_WATERMARK
        self._status_idle = False

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        super().setup(ctx, restored)
        assert self.operator_state is not None
        state = self.operator_state.get_union_list_state(_POSITION)
        if restored is None:
            self.splits = [[ctx.subtask, ctx.parallelism, 0, 0]]
        else:
            # [index, count, position, done, owner, owner_parallelism(, max timestamp)]
            entries = sorted(state.get(), key=lambda e: e[:6])
            same = all(e[5] == ctx.parallelism for e in entries)
            mine = [e for e in entries if e[4] == ctx.subtask] if same else entries[ctx.subtask :: ctx.parallelism]
            self.splits = [list(e[:4]) for e in mine]
            self._restored_max = {(e[0], e[1]): int(e[6]) for e in mine if len(e) > 6 and e[6] is not None}
        extra = {(e[0], e[1]): e[7] for e in mine if len(e) > 7} if restored is not None else {}
        for split in self.splits:
            self._call(self.source.restore_split_state, split[0], split[1], extra.get((split[0], split[1])))
        self.exhausted = all(split[3] for split in self.splits)
        self._state = state

    def open(self) -> None:
        if self.strategy is not None:
            now = _mono_ms()
            for split in self.splits:
                generator = self.strategy.create_generator(now)
                restored = self._restored_max.get((split[0], split[1]))
                if restored is not None:
                    generator.max_ts = max(generator.max_ts, restored)
                self._generators[(split[0], split[1])] = generator

    @property
    def position(self) -> int:
        """Records read so far, over this subtask's splits."""
        return sum(split[2] for split in self.splits)

    def read(self, n: int) -> Any:
        """Up to ``n`` records of the next split that has some; ``[]`` when none has
        any now (after the idle wait) or every split has ended (``exhausted``)."""
        assert self.ctx is not None
        tried = 0
        while True:
            live = [split for split in self.splits if not split[3]]
            if not live:
                self.exhausted = True
                return []
            if tried >= len(live):
                break
            split = live[self._turn % len(live)]
            records = self._call(self.source.read, split[0], split[1], split[2], n)
            if records is None:
                split[3] = 1  # the next split not done now has this turn
                continue
            if not hasattr(records, "__len__"):
                raise UserFunctionError(
                    f"{self.where()}: Source.read must return a list, a pyarrow.RecordBatch or None (end of split), "
                    f"got {type(records).__name__}"
                )
            if len(records):
                split[2] += len(records)
                self._idle_s, self._idle_since = 0.0, None
                if self.timestamps is not None:
                    self._observe(split, records)
                return records
            self._turn += 1
            tried += 1
        self._idle()
        return []

    def _observe(self, split: List[int], records: Any) -> None:
        try:
            ts = self.timestamps.of_buffer(records)  # type: ignore[union-attr]
        except NonRetryableError as exc:
            raise type(exc)(f"{self.where()}: {exc}") from None
        self._generators[(split[0], split[1])].on_timestamps(ts, _mono_ms())

    def poll_watermark(self, now_mono_ms: int) -> List[Any]:
        """The subtask's watermark over its live splits (see the class docstring)."""
        if self.strategy is None or self.exhausted:
            return []
        active = []
        for split in self.splits:
            if not split[3]:
                generator = self._generators[(split[0], split[1])]
                if not generator.check_idle(now_mono_ms):
                    active.append(generator.current)
        if not active:
            if self._status_idle:
                return []
            self._status_idle = True
            return [WATERMARK_IDLE]
        out: List[Any] = []
        if self._status_idle:
            self._status_idle = False
            out.append(WATERMARK_ACTIVE)
        watermark = min(active)
        if watermark > self._sent:
            self._sent = watermark
            out.append(Watermark(watermark))
        return out

    def _idle(self) -> None:
        """No split has records now: wait, longer while it lasts (see the class docstring)."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif not self._warned and now - self._idle_since >= self.WARN_IDLE_S:
            self._warned = True
            log.warning(
                "%s: source %s has returned no records for %.0f s; if its split has ended, read must return "
                "None (an empty read means 'nothing now' and is polled again)",
                self.where(),
                type(self.source).__name__,
                now - self._idle_since,
            )
        self._idle_s = min(self.MAX_IDLE_S, max(self.MIN_IDLE_S, self._idle_s * 2))
        self.idle_wait(self._idle_s)

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        assert self.ctx is not None
        me, p = self.ctx.subtask, self.ctx.parallelism
        entries = []
        for split in self.splits:
            generator = self._generators.get((split[0], split[1]))
            extra = self._call(self.source.split_state, split[0], split[1])
            if generator is not None or extra is not None:  # else the six fields older checkpoints have
                entries.append([*split, me, p, generator.max_ts if generator is not None else None, extra])
            else:
                entries.append([*split, me, p])
        self._state.update(entries)
        return super().snapshot(checkpoint_id, location)
