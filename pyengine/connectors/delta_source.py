"""``DeltaSource``: a Delta Lake table read as a stream, exactly once (``env.read_delta``).

What Spark's ``spark.readStream.format("delta").load(path)`` reads, in the model of
``connectors/files.py``: the table's data files in the order of its versions, each
row once, across failures.

- **Where it starts.** ``starting_version=None``: the table's snapshot at its latest
  version when the job is built (every file it holds), then every version after it;
  ``starting_version=v``: the changes of versions ``v, v+1, ...`` (Spark's
  ``startingVersion``), no snapshot. Bounded (``monitor_interval_ms=None``): it ends
  at the version that was the latest when the job was built; unbounded: it looks for
  the next version every ``monitor_interval_ms``, without end.
- **Splits.** Split ``i`` of ``p`` takes the files of each version whose path hashes
  to ``i`` (``stable_hash(path) % p``), so a version's files are read by every
  subtask at once; a restore at another parallelism deals the splits round-robin,
  as for every source (``SourceOperator``). A snapshot's files are read oldest first
  (by modification time, then path, as Spark's Delta source orders them), a version's
  in the order of its log entry.
- **Position.** A split's position is the rows it has read; its split state is the
  next version to look at, the files it has taken and not finished (in order), and
  the rows it read before the first of them. So a checkpoint holds (table version,
  file, row), and a restore seeks to that row of that file: a file is never read
  twice nor skipped. The state stays small: finished files leave it.
- **What a version means.** Delta's ``dataChange`` flag says whether an action
  changes the table's rows: a compaction (``OPTIMIZE``, ``dataChange=false``) adds
  files holding rows already read, so they are skipped. A version that removes rows
  (a ``DELETE``, ``UPDATE``, ``MERGE`` or an overwrite) is refused, as by Spark's
  Delta source: a stream cannot take rows back. The options name the way out
  (Spark's names): ``ignore_deletes`` skips versions that only remove files,
  ``skip_change_commits`` skips every version that removes rows (its new files
  too), ``ignore_changes`` reads the files such a version adds (rows it did not
  change are read again: duplicates downstream).
- **Schema.** The stream's schema is the table's when the job is built. Older files
  are widened to it (a column added since: nulls; ``int32`` read as ``int64``); a
  later version whose schema does not fit it (a new column, a narrowed type) is
  refused, never truncated: a restart of the job (``resume="auto"``) builds it with
  the new schema and reads on from its checkpoint.

Files are read with ``pyarrow.parquet`` through ``pyarrow.fs`` (what ``read_files``
does), the log through Delta's JSON commit files (the Delta protocol), and the
snapshot and schema through ``deltalake``. Deletion vectors and column mapping are
refused when the job is built, or at the version that brings them."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.fs as pafs

from ..errors import NonRetryableError
from ..state.keygroups import stable_hash
from ..storage.filesystem import resolve
from .base import Source, check_columns

if TYPE_CHECKING:
    import pyarrow.parquet as pq

__all__ = ["DeltaSource", "DeltaChangeError"]

_File = Tuple[str, Dict[str, Optional[str]]]  # (path relative to the table or a URI, partition values)


class DeltaChangeError(NonRetryableError):
    """A version of the table a stream cannot read as appends: it removes rows, or
    changes the schema beyond what the stream's schema can hold."""


def _require_deltalake() -> Any:
    try:
        import deltalake
    except ImportError:
        raise ImportError(
            "read_delta needs the deltalake package (delta-rs), which is not installed: pip install deltalake "
            "(the delta extra of pyengine)"
        ) from None
    return deltalake


def _widens(old: pa.DataType, new: pa.DataType) -> bool:
    """Values of ``old`` are read as ``new`` without loss."""
    if old.equals(new):
        return True
    if pa.types.is_integer(old) and pa.types.is_integer(new):
        return pa.types.is_signed_integer(old) == pa.types.is_signed_integer(new) and new.bit_width >= old.bit_width
    if pa.types.is_floating(old) and pa.types.is_floating(new):
        return new.bit_width >= old.bit_width
    if pa.types.is_integer(old) and pa.types.is_floating(new):
        return old.bit_width <= 32 and new.bit_width == 64
    if pa.types.is_timestamp(old) and pa.types.is_timestamp(new):
        # a unit the cast checks (Spark's INT96 files read as ns: a fraction below the table's us fails the
        # cast instead of being cut); a file's naive time under a zoned column is UTC, as Delta writes it
        return (old.tz is None) == (new.tz is None) or new.tz == "UTC"
    strings = (pa.string(), pa.large_string(), pa.string_view())
    return any(old.equals(s) for s in strings) and any(new.equals(s) for s in strings)


def _ms(value: Any) -> int:
    """A file's modification time as ms (deltalake gives an int or a datetime)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    return int(value.timestamp() * 1000)


def _plain(schema: pa.Schema) -> pa.Schema:
    """The schema as pyarrow reads the table's parquet files (views as plain strings)."""
    fields = []
    for f in schema:
        t = f.type
        if t.equals(pa.string_view()):
            t = pa.string()
        elif t.equals(pa.binary_view()):
            t = pa.binary()
        fields.append(pa.field(f.name, t, True))
    return pa.schema(fields)


@dataclass
class _Split:
    """One split's progress: its checkpointed part (``state``) and its open file."""

    next_version: int  # the next version to look at
    snapshot: Optional[int]  # a snapshot still to take (its version), before next_version
    files: List[_File]  # taken, not finished: files[0] is being read
    base: int  # rows of the split before files[0]
    offset: int = 0  # rows of files[0] read
    batches: Any = None  # files[0]'s batches from ``offset``
    pending: Optional[pa.RecordBatch] = None
    scanned: float = field(default=-1e18)  # when the log was last looked at (monotonic)

    @property
    def position(self) -> int:
        return self.base + self.offset

    def state(self) -> Dict[str, Any]:
        return {
            "format": "pyengine-delta-split",
            "version": 1,
            "next_version": self.next_version,
            "snapshot": self.snapshot,
            "files": [[p, dict(v)] for p, v in self.files],
            "base": self.base,
        }


class DeltaSource(Source):
    """A Delta table at ``table_uri`` as a replayable stream of Arrow batches (see the
    module docstring for the model; ``env.read_delta`` builds it).

    ``columns``: read only these. ``storage_options``: for ``deltalake`` (the table's
    log and snapshot); the data files and log entries are read through ``pyarrow.fs``
    for the same URI. Ordering: per split, versions in order and each version's files
    in log order; splits interleave."""

    def __init__(
        self,
        table_uri: str,
        starting_version: Optional[int] = None,
        columns: Optional[List[str]] = None,
        monitor_interval_ms: Optional[int] = None,
        ignore_deletes: bool = False,
        ignore_changes: bool = False,
        skip_change_commits: bool = False,
        storage_options: Optional[Dict[str, str]] = None,
    ) -> None:
        deltalake = _require_deltalake()
        where = f"read_delta({table_uri!r})"
        if not isinstance(table_uri, str) or not table_uri:
            raise ValueError(f"read_delta needs a table URI, got {table_uri!r}")
        if starting_version is not None and (type(starting_version) is not int or starting_version < 0):
            raise ValueError(f"{where}: starting_version must be an int >= 0, got {starting_version!r}")
        if monitor_interval_ms is not None and (type(monitor_interval_ms) is not int or monitor_interval_ms < 1):
            raise ValueError(f"{where}: monitor_interval_ms must be an int >= 1, got {monitor_interval_ms!r}")
        if ignore_changes and skip_change_commits:
            raise ValueError(f"{where}: ignore_changes and skip_change_commits exclude each other; choose one")
        try:
            table = deltalake.DeltaTable(table_uri, storage_options=storage_options)
        except Exception as exc:  # TableNotFoundError, an unreachable store
            raise ValueError(f"{where}: {exc}") from None
        self.table_uri = table_uri
        self.storage_options = dict(storage_options) if storage_options else None
        self.columns = columns
        self.ignore_deletes = ignore_deletes
        self.ignore_changes = ignore_changes
        self.skip_change_commits = skip_change_commits
        self.interval_s = None if monitor_interval_ms is None else monitor_interval_ms / 1000
        self.latest = int(table.version())
        self._check_features(table, where)
        self.table_schema = _plain(pa.schema(table.schema().to_arrow()))
        self.partition_columns = list(table.metadata().partition_columns)
        if columns is not None:
            check_columns(self.table_schema, columns, where)
            self.schema: pa.Schema = pa.schema([self.table_schema.field(c) for c in columns])
        else:
            self.schema = self.table_schema
        self._fs, self._root = self._filesystem()
        if starting_version is not None:
            if starting_version > self.latest + (1 if self.interval_s is not None else 0):
                raise ValueError(f"{where}: starting_version {starting_version} is past the table's latest version")
            if starting_version <= self.latest and not self._log_exists(starting_version):
                raise ValueError(
                    f"{where}: the log entry of version {starting_version} is gone (log retention); start at a later "
                    "version, or at None (the latest snapshot)"
                )
            self.starting_version: Optional[int] = starting_version
            self._snapshot_files: Optional[List[_File]] = None
        else:
            self.starting_version = None
            self._snapshot_files = self._snapshot(table)
        self._splits: Dict[Tuple[int, int], _Split] = {}
        self._lock = threading.Lock()

    # -- the table ------------------------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"read_delta({self.table_uri!r})"

    def _filesystem(self) -> Tuple[Any, str]:
        fs, root, _ = resolve(self.table_uri)
        return fs, root.rstrip("/")

    def _check_features(self, table: Any, where: str) -> None:
        mode = (table.metadata().configuration or {}).get("delta.columnMapping.mode")
        if mode not in (None, "none"):
            raise NonRetryableError(
                f"{where}: the table uses column mapping (delta.columnMapping.mode={mode}), which this source "
                "does not read; read it through Spark, or rewrite the table without column mapping"
            )

    def _snapshot(self, table: Any) -> List[_File]:
        """The files of the table at ``table``'s version, by path."""
        actions = pa.table(table.get_add_actions(flatten=True))
        names = actions.schema.names
        if any(n.startswith("deletionVector") for n in names):
            dv = next(n for n in names if n.startswith("deletionVector"))
            if actions.column(dv).null_count < actions.num_rows:
                raise NonRetryableError(
                    f"{self._where()}: files of version {table.version()} have deletion vectors, which this source "
                    "does not apply; purge them (REORG TABLE ... APPLY (PURGE)) or read the table through Spark"
                )
        paths = [str(p) for p in actions.column("path").to_pylist()] if actions.num_rows else []
        times = actions.column("modification_time").to_pylist() if actions.num_rows else []
        parts = {c: actions.column(f"partition.{c}").to_pylist() for c in self.partition_columns}
        out = []
        for i, path in enumerate(paths):
            values = {c: (None if parts[c][i] is None else str(parts[c][i])) for c in self.partition_columns}
            out.append((_ms(times[i]), path, values))
        # oldest first, as Spark's Delta source orders a snapshot: event time read in about the order it was written
        return [(path, values) for _, path, values in sorted(out, key=lambda f: (f[0], f[1]))]

    def _log_path(self, version: int) -> str:
        return f"{self._root}/_delta_log/{version:020d}.json"

    def _log_exists(self, version: int) -> bool:
        return self._fs.get_file_info(self._log_path(version)).type == pafs.FileType.File

    def _read_log(self, version: int) -> Optional[List[Dict[str, Any]]]:
        """The actions of ``version``, or None when it is not there (yet)."""
        try:
            with self._fs.open_input_stream(self._log_path(version)) as f:
                text = f.read().decode()
        except FileNotFoundError:
            return None
        except OSError as exc:
            if self._fs.get_file_info(self._log_path(version)).type == pafs.FileType.NotFound:
                return None
            raise OSError(f"{self._where()}: version {version}: {exc}") from exc
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def _gone(self, version: int) -> bool:
        """Whether ``version``'s log entry was removed (log retention) rather than not written yet."""
        try:
            with self._fs.open_input_stream(f"{self._root}/_delta_log/_last_checkpoint") as f:
                last = int(json.loads(f.read()).get("version", -1))
        except (FileNotFoundError, OSError, ValueError):
            return False
        return last >= version and not self._log_exists(version)

    def _version_files(self, version: int, actions: List[Dict[str, Any]]) -> List[_File]:
        """The files of ``version`` whose rows are new to a reader of appends (see the module docstring)."""
        adds, removed, operation = [], 0, "?"
        for action in actions:
            if "commitInfo" in action:
                operation = str(action["commitInfo"].get("operation", "?"))
            elif "metaData" in action:
                self._check_schema(version, action["metaData"])
            elif "add" in action:
                add = action["add"]
                if add.get("dataChange", True):
                    if add.get("deletionVector"):
                        raise DeltaChangeError(
                            f"{self._where()}: version {version} ({operation}) adds a file with a deletion vector, "
                            "which this source does not apply; read the table through Spark"
                        )
                    adds.append((str(add["path"]), dict(add.get("partitionValues") or {})))
            elif "remove" in action and action["remove"].get("dataChange", True):
                removed += 1
        if not removed:
            return adds
        if self.skip_change_commits or (self.ignore_deletes and not adds):
            return []
        if self.ignore_changes:
            return adds
        kind = "deletes rows" if not adds else "rewrites or overwrites rows"
        raise DeltaChangeError(
            f"{self._where()}: version {version} ({operation}) {kind} ({removed} file(s) removed); a stream reads "
            "appends and cannot take rows back. Pass read_delta(..., ignore_deletes=True) to skip versions that only "
            "delete, skip_change_commits=True to skip every version that changes existing rows, or "
            f"ignore_changes=True to read the files it rewrites (rows it did not change come again); or start a new "
            f"job at starting_version={version + 1}"
        )

    def _check_schema(self, version: int, metadata: Dict[str, Any]) -> None:
        deltalake = _require_deltalake()
        config = metadata.get("configuration") or {}
        mode = config.get("delta.columnMapping.mode")
        if mode not in (None, "none"):
            raise DeltaChangeError(
                f"{self._where()}: version {version} turns column mapping on ({mode}), which this source does not read"
            )
        text = metadata.get("schemaString")
        if not text:
            return
        schema = _plain(pa.schema(deltalake.Schema.from_json(text).to_arrow()))
        for f in schema:
            if self.columns is not None and f.name not in self.columns:
                continue  # not read: whatever it becomes
            if f.name not in self.table_schema.names:
                raise DeltaChangeError(
                    f"{self._where()}: version {version} adds column {f.name!r} ({f.type}), which the stream's "
                    f"schema (fixed when the job was built) lacks; it is not dropped silently. Restart the job "
                    '(resume="auto": it is built with the new schema and reads on from its checkpoint, older rows '
                    "with nulls there)"
                )
            mine = self.table_schema.field(f.name).type
            if not _widens(f.type, mine):
                raise DeltaChangeError(
                    f"{self._where()}: version {version} makes column {f.name!r} {f.type}, which the stream's type "
                    f"{mine} cannot hold; restart the job (it is built with the table's new schema) if older rows "
                    f"widen to it, or read the table from starting_version={version} in a new job"
                )

    # -- splits -----------------------------------------------------------------------------------------------------

    def __getstate__(self) -> Dict[str, Any]:  # to Spark executors or worker processes
        state = self.__dict__.copy()
        for name in ("_lock", "_fs"):
            state.pop(name, None)
        state["_splits"] = {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._fs, self._root = self._filesystem()

    def _fresh(self) -> _Split:
        if self.starting_version is None:
            return _Split(self.latest + 1, self.latest, [], 0)
        return _Split(self.starting_version, None, [], 0)

    def split_state(self, subtask: int, parallelism: int) -> Any:
        split = self._splits.get((subtask, parallelism))
        if split is None:
            split = self._splits[(subtask, parallelism)] = self._fresh()
        return split.state()

    def restore_split_state(self, subtask: int, parallelism: int, state: Any) -> None:
        with self._lock:
            if state is None:
                self._splits[(subtask, parallelism)] = self._fresh()
                return
            if not isinstance(state, dict) or state.get("format") != "pyengine-delta-split":
                raise NonRetryableError(
                    f"{self._where()}: the checkpoint's split state is not a Delta source's ({state!r:.80}); was the "
                    "job's source another one when it was taken?"
                )
            files = [
                (str(p), {str(k): (None if v is None else str(v)) for k, v in dict(vals).items()})
                for p, vals in state["files"]
            ]
            snapshot = state.get("snapshot")
            self._splits[(subtask, parallelism)] = _Split(
                int(state["next_version"]), None if snapshot is None else int(snapshot), files, int(state["base"])
            )

    def _take(self, split: _Split, subtask: int, parallelism: int) -> bool:
        """Takes the files of the next version(s) this split owns; whether the split has
        more to look at (False: a bounded source has passed its last version)."""
        mine = lambda path: stable_hash(path) % parallelism == subtask  # noqa: E731
        if split.snapshot is not None:
            files = self._snapshot_files
            if files is None or split.snapshot != self.latest or self.starting_version is not None:
                deltalake = _require_deltalake()
                table = deltalake.DeltaTable(
                    self.table_uri, version=split.snapshot, storage_options=self.storage_options
                )
                files = self._snapshot(table)
            split.files.extend(f for f in files if mine(f[0]))
            split.snapshot = None
        bounded = self.interval_s is None
        while not split.files:  # one version with files at a time: its rows go out before a later version is judged
            if bounded and split.next_version > self.latest:
                return False
            actions = self._read_log(split.next_version)
            if actions is None:
                if bounded or self._gone(split.next_version):
                    raise NonRetryableError(
                        f"{self._where()}: the log entry of version {split.next_version} is gone (log retention: the "
                        "stream fell behind it); start a new job at a later starting_version"
                    )
                return True
            split.files.extend(f for f in self._version_files(split.next_version, actions) if mine(f[0]))
            split.next_version += 1
        return True

    # -- reading ----------------------------------------------------------------------------------------------------

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        key = (subtask, parallelism)
        split = self._splits.get(key)
        if split is None:
            split = self._splits[key] = self._fresh()
        if split.position != position:
            self._seek(split, position)
        while True:
            if split.files:
                batch = self._next(split, n)
                if batch is not None:
                    return batch
                continue  # that file ended: the next one
            now = time.monotonic()
            if self.interval_s is not None and split.snapshot is None and now - split.scanned < self.interval_s:
                return []
            if not self._take(split, subtask, parallelism):
                return Source.END
            if not split.files:  # caught up: the log is looked at again after monitor_interval_ms
                split.scanned = now
                return []

    def _seek(self, split: _Split, position: int) -> None:
        """Puts the split at ``position``: whole files skipped by their footers, then rows."""
        if position < split.base:
            raise NonRetryableError(
                f"{self._where()}: asked for row {position} of a split whose checkpointed files start at row "
                f"{split.base}; restore the checkpoint the split state came from"
            )
        split.offset, split.batches, split.pending = 0, None, None
        skip = position - split.base
        while skip > 0:
            if not split.files:
                raise NonRetryableError(
                    f"{self._where()}: the checkpoint has read {position} rows of this split, its files hold "
                    f"{position - skip}: the table's files changed since (a VACUUM?); run the job fresh"
                )
            rows = self._open(split.files[0]).metadata.num_rows
            if rows <= skip:
                skip -= rows
                split.base += rows
                split.files.pop(0)
                continue
            split.offset = skip
            skip = 0

    def _open(self, file: _File) -> pq.ParquetFile:
        import pyarrow.parquet as pq  # on first read, so building a job does not load it

        path = unquote(file[0])
        try:
            if "://" in path:
                fs, inner = pafs.FileSystem.from_uri(path)
                return pq.ParquetFile(fs.open_input_file(inner))
            return pq.ParquetFile(self._fs.open_input_file(f"{self._root}/{path}"))
        except OSError as exc:  # name the file: which one failed is what a user needs
            raise OSError(f"{self._where()}: {path}: {exc}") from exc

    def _batches(self, split: _Split, n: int) -> Any:
        """files[0]'s batches from ``split.offset``, as the stream's schema."""
        file = split.files[0]
        reader = self._open(file)
        data = [c for c in (self.columns or self.table_schema.names) if c not in self.partition_columns]
        present = [c for c in data if c in reader.schema_arrow.names]
        skip, groups = split.offset, []
        for g in range(reader.num_row_groups):
            rows = reader.metadata.row_group(g).num_rows
            if skip >= rows:
                skip -= rows
            else:
                groups.append(g)
        for batch in reader.iter_batches(batch_size=n, row_groups=groups, columns=present, use_threads=False):
            if skip:  # rows of the first row group before the offset, over as many batches as they fill
                cut = min(skip, batch.num_rows)
                batch, skip = batch.slice(cut), skip - cut
            if batch.num_rows:
                yield self._conform(batch, file)

    def _conform(self, batch: pa.RecordBatch, file: _File) -> pa.RecordBatch:
        """The batch as the stream's schema: partition columns from the file's values,
        columns the file lacks as nulls, narrower types widened."""
        if batch.schema.equals(self.schema) and not self.partition_columns:
            return batch
        arrays = []
        names = batch.schema.names
        for f in self.schema:
            if f.name in self.partition_columns:
                value = file[1].get(f.name)
                arrays.append(pa.array([value] * batch.num_rows, pa.string()).cast(f.type))
            elif f.name in names:
                column = batch.column(names.index(f.name))
                if not column.type.equals(f.type):
                    if not _widens(column.type, f.type):
                        raise DeltaChangeError(
                            f"{self._where()}: {unquote(file[0])}: column {f.name!r} is {column.type} in the file, "
                            f"which the stream's type {f.type} cannot hold"
                        )
                    column = column.cast(f.type)
                arrays.append(column)
            else:
                arrays.append(pa.nulls(batch.num_rows, f.type))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _next(self, split: _Split, n: int) -> Optional[pa.RecordBatch]:
        """Up to ``n`` rows of files[0]; None when it has ended (it leaves the split)."""
        if split.batches is None:
            split.batches = self._batches(split, n)
        batch = split.pending
        split.pending = None
        if batch is None:
            try:
                batch = next(split.batches, None)
            except Exception:
                split.batches = None  # opened again at its offset by the next read
                raise
        if batch is None:
            split.base += split.offset
            split.offset, split.batches = 0, None
            split.files.pop(0)
            return None
        if batch.num_rows > n:
            split.pending = batch.slice(n)
            batch = batch.slice(0, n)
        split.offset += batch.num_rows
        return batch
