"""``DeltaSink``: a Delta Lake table written exactly once, over ``deltalake`` (delta-rs).

Two-phase commit, with Delta's own idempotent-commit mechanism as the record of
what is committed:

- **stage** (every sink subtask, at each checkpoint barrier): the records since the
  last barrier become one parquet data file in the table's directory, invisible to
  readers (no Delta log entry names it), and a small manifest under
  ``_pyengine/staging/<lineage id>/`` says what it holds;
- **commit** (on notify-complete of checkpoint ``n``, by sink subtask 0 for all
  subtasks): every manifest of this run up to ``n`` goes into **one** Delta
  transaction, which carries the application transaction
  ``Transaction("pyengine-<lineage id>", version(run, n))``. A checkpoint that
  brought no records is committed too, with the transaction alone: as Delta's own
  streaming sink commits a ``SetTransaction`` for every batch it is given, files
  or not (``DeltaSink.addBatch`` in delta-io/delta), so the table's history shows
  one commit per completed checkpoint, and ``transaction_version`` always says
  the latest checkpoint whose output the table holds (a reader waiting for the
  job's output up to a point, or an operator comparing it with the job's
  checkpoints, is not left behind by a quiet stretch). The one exception: a table
  that does not exist yet, with no ``schema`` declared, is not created empty (its
  columns are not known until records come);
- **recover** (the driver, before each attempt): pieces the restored checkpoint
  covers whose version is above the table's recorded version for the app id are
  committed (their checkpoint completed; only the commit never ran), pieces it
  does not cover are deleted, and files this lineage committed beyond the restored
  checkpoint (a restore from an older checkpoint) are removed from the table.

Each attempt stages under an **epoch**, a token ``recover`` draws before the attempt
starts (the sink travels to the attempt's tasks after it): a commit takes only its own
epoch's pieces. A Spark task of a failed attempt can outlive the restart and stage a
piece after ``recover`` ran (it was still reading its input); that piece is neither
covered nor the new attempt's, and the new attempt's commit deletes it instead of
publishing records the new attempt replays.

The table's first commit creates it, with no automatic retry: two creators (a zombie
task and the driver's recovery, both committing the first checkpoint) would otherwise
both land, delta-rs rebasing the loser's create onto the winner's as version 1
(measured: 19 of 40 concurrent creates). The loser fails, reads the table again, and
finds its commit there.

Checkpoint ids restart in every run of a lineage, so the version of ``(run, n)``
is ``n`` plus the sum of the last checkpoint ids of the runs the run restored from
(``RunInfo.restored``): it grows along the lineage, and a replayed commit has the
version of its first attempt, which Delta's table state already holds
(``DeltaTable.transaction_version``), so it is skipped. Two commits racing with one
app id (a zombie task and the driver's recovery) are refused by delta-rs's conflict
checker; the loser re-reads the version and skips."""

from __future__ import annotations

import base64
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import NonRetryableError, OutputInUseError
from ..storage.filesystem import resolve
from .base import FINAL, Covered, RecordRejectedError, RunInfo, Sink, run_tag
from .records import _table_of

__all__ = ["DeltaSink"]

log = logging.getLogger(__name__)

STAGING = "_pyengine/staging"
MODES = ("error", "append", "overwrite")
COMMIT_ATTEMPTS = 8

# part-<lineage tag>-<run tag>-<subtask>-<checkpoint>-<unique>.parquet: a data file, staged or committed
_DATA = re.compile(r"^part-([0-9a-f]{12})-([0-9a-f]{12})-(\d+)-(\d+)-([0-9a-f]+)\.parquet$")
# <run tag>-<checkpoint, 19 digits>-<subtask>-<unique>.json: a staged piece's manifest
_MANIFEST = re.compile(r"^([0-9a-f]{12})-(\d{19})-(\d+)-([0-9a-f]+)\.json$")


def _require_deltalake() -> Any:
    try:
        import deltalake
    except ImportError:
        raise ImportError(
            "DeltaSink needs the deltalake package (delta-rs), which is not installed: pip install deltalake "
            "(the delta extra of pyengine)"
        ) from None
    return deltalake


@dataclass(frozen=True)
class _Piece:
    """One staged data file, as its manifest describes it."""

    manifest: str  # the manifest's path
    run: str  # run tag
    checkpoint_id: int
    subtask: int
    path: str  # the data file, relative to the table
    size: int
    rows: int
    stats: str
    schema: bytes  # Arrow IPC schema
    epoch: str  # the attempt that staged it (see ``DeltaSink.recover``)


def _versions(covered: Covered) -> Dict[str, Tuple[int, int]]:
    """Run tag -> (version base, last covered checkpoint id) along a lineage: a run's
    base is the sum of the covered ids of the runs before it."""
    out: Dict[str, Tuple[int, int]] = {}
    base = 0
    for run_id, checkpoint_id in covered:
        c = int(checkpoint_id)
        out[run_tag(str(run_id))] = (base, c)
        if c < FINAL:
            base += c
    return out


def _same_columns(a: pa.Schema, b: pa.Schema) -> bool:
    """The same column names and types (nullability and metadata aside: Delta makes
    every column nullable, and keeps no Arrow metadata)."""
    return len(a) == len(b) and all(x.name == y.name and x.type.equals(y.type) for x, y in zip(a, b, strict=True))


def _stats(table: pa.Table) -> str:
    """The add action's statistics: the row count, each top-level column's null count,
    and min/max of integer columns (exact, so data skipping never skips a match)."""
    import pyarrow.compute as pc

    nulls: Dict[str, int] = {}
    mins: Dict[str, int] = {}
    maxs: Dict[str, int] = {}
    for field, column in zip(table.schema, table.columns, strict=True):
        if pa.types.is_nested(field.type):
            continue
        nulls[field.name] = int(column.null_count)
        if pa.types.is_integer(field.type) and column.null_count < len(column):
            mm = pc.min_max(column)
            mins[field.name] = int(mm["min"].as_py())
            maxs[field.name] = int(mm["max"].as_py())
    return json.dumps(
        {"numRecords": table.num_rows, "nullCount": nulls, "minValues": mins, "maxValues": maxs},
        separators=(",", ":"),
    )


class DeltaSink(Sink):
    """A Delta Lake table at ``table_uri`` (a local path, ``s3://``, ``gs://``,
    ``abfss://``, ... as ``deltalake`` takes it), written exactly once: one Delta
    commit per completed checkpoint (one without records carries only the
    checkpoint's application transaction version), none twice.

    ``mode`` (as ``write_deltalake``): ``"error"`` refuses a table that holds rows
    this job's lineage did not write (``OutputInUseError``); ``"append"`` adds to it;
    ``"overwrite"`` replaces its contents in the lineage's first commit. A run that
    continues its own lineage (a restart, a restore, ``resume="auto"``) continues its
    own commits in every mode.

    The table's schema is the stream's: an existing table's, else ``schema`` (a
    ``pyarrow.Schema``), else the first records' (Arrow batches keep theirs; records
    as dicts are inferred, so declare ``schema`` for them). Records that do not fit
    are refused (``RecordRejectedError``, naming the column and both types): a column
    of whole numbers that later holds fractions is not widened, as ``FileSink`` widens
    its part files, since the files a Delta commit names are typed by the table's
    schema; declare ``schema`` with float64 for such a column. ``storage_options`` go to ``deltalake``;
    the data files are written through ``pyarrow.fs`` for the same URI, so both must
    reach the table (on Spark: from every executor)."""

    MODES = MODES

    def __init__(
        self,
        table_uri: str,
        mode: str = "error",
        schema: Optional[pa.Schema] = None,
        storage_options: Optional[Dict[str, str]] = None,
    ) -> None:
        import importlib.util

        if importlib.util.find_spec("deltalake") is None:  # said now, not on an executor mid-job
            _require_deltalake()
        if not isinstance(table_uri, str) or not table_uri:
            raise ValueError(f"DeltaSink needs a table URI, got {table_uri!r}")
        if mode not in MODES:
            raise ValueError(
                f"DeltaSink mode must be one of {', '.join(repr(m) for m in MODES)} (as write_deltalake), got {mode!r}"
            )
        if schema is not None and not isinstance(schema, pa.Schema):
            raise ValueError(f"DeltaSink schema must be a pyarrow.Schema, got {type(schema).__name__}")
        self.table_uri = table_uri
        self.mode = mode
        self.schema = schema
        self.storage_options = dict(storage_options) if storage_options else None
        self._run: Optional[RunInfo] = None
        self._tag = ""
        self._lineage_tag = ""
        self._base = 0  # this run's version base
        self._target: Optional[pa.Schema] = None  # what every staged file is written as
        self._epoch = ""  # this attempt's, drawn by recover() on the driver before it starts
        self.commits = 0  # Delta commits this object made (a subtask's copy counts its own)

    # -- where things are -----------------------------------------------------------------------------------------

    @property
    def app_id(self) -> str:
        """The Delta application transaction id of this lineage (``None`` before ``begin_run``)."""
        return f"pyengine-{self._run.lineage_id}" if self._run is not None else ""

    def _fs(self) -> Tuple[Any, str]:
        fs, root, _ = resolve(self.table_uri)
        return fs, root.rstrip("/")

    def _staging(self, root: str) -> str:
        assert self._run is not None
        return f"{root}/{STAGING}/{self._run.lineage_id}"

    def _table(self) -> Any:
        """The ``DeltaTable``, or None when there is none yet."""
        deltalake = _require_deltalake()
        if not deltalake.DeltaTable.is_deltatable(self.table_uri, storage_options=self.storage_options):
            return None
        return deltalake.DeltaTable(self.table_uri, storage_options=self.storage_options)

    def _require_run(self, what: str) -> RunInfo:
        if self._run is None:
            raise RuntimeError(f"DeltaSink.{what} before begin_run(run): a runner must call begin_run first")
        return self._run

    # -- the run -------------------------------------------------------------------------------------------------

    def begin_run(self, run: RunInfo) -> None:
        """Checks the table against ``mode`` and the declared schema, and fixes this
        run's app transaction id and version base."""
        if not isinstance(run, RunInfo):
            raise TypeError(f"DeltaSink.begin_run needs a RunInfo, got {type(run).__name__}")
        _require_deltalake()
        self._run = run
        self._tag = run_tag(run.run_id)
        self._lineage_tag = run_tag(run.lineage_id)
        self._base = sum(c for _, c in run.restored if c < FINAL)
        self._target = self.schema
        table = self._table()
        if table is None:
            return
        version = table.transaction_version(self.app_id)
        if self.mode == "error" and version is None and _row_count(table) > 0:
            raise OutputInUseError(
                f"DeltaSink table {self.table_uri} holds rows that this run of job {run.job_name!r} does not continue "
                f'(table version {table.version()}, {_last_writer(table)}). Pass DeltaSink(..., mode="append") '
                f'to add this job\'s rows to it, mode="overwrite" to replace them, or write to another table'
            )
        existing = pa.schema(table.schema().to_arrow())
        if self.schema is not None and not _same_columns(self.schema, existing):
            raise OutputInUseError(
                f"DeltaSink table {self.table_uri} has schema ({_describe(existing)}), not the declared "
                f"({_describe(self.schema)}); declare the table's schema, or write to another table"
            )
        self._target = existing if self.schema is None else self.schema

    def end_run(self, status: str) -> None:
        """A finished run leaves no staging directory behind."""
        if self._run is None or status != "FINISHED":
            return
        fs, root = self._fs()
        try:
            staging = self._staging(root)
            if not fs.get_file_info(pafs.FileSelector(staging, allow_not_found=True)):
                fs.delete_dir(staging)
        except OSError as exc:
            log.warning("DeltaSink %s: could not remove the staging directory: %s", self.table_uri, exc)

    # -- staging and committing ---------------------------------------------------------------------------------

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        run = self._require_run("stage")
        if not len(records):
            return
        table = self._conform(records)
        fs, root = self._fs()
        staging = self._staging(root)
        fs.create_dir(staging, recursive=True)  # the table's directory too
        unique = uuid.uuid4().hex[:16]
        name = f"part-{self._lineage_tag}-{self._tag}-{subtask}-{checkpoint_id}-{unique}.parquet"
        with fs.open_output_stream(f"{root}/{name}") as out:  # invisible until a commit names it
            pq.write_table(table, out)
        size = fs.get_file_info(f"{root}/{name}").size
        manifest = {
            "format": "pyengine-delta-piece",
            "version": 1,
            "run_id": run.run_id,
            "checkpoint_id": int(checkpoint_id),
            "subtask": int(subtask),
            "path": name,
            "size": int(size),
            "rows": table.num_rows,
            "stats": _stats(table),
            "schema": base64.b64encode(table.schema.serialize().to_pybytes()).decode(),
            "epoch": self._epoch,
        }
        final = f"{staging}/{self._tag}-{int(checkpoint_id):019d}-{subtask}-{unique}.json"
        temp = f"{staging}/.{unique}.tmp"
        with fs.open_output_stream(temp) as out:
            out.write(json.dumps(manifest).encode())
        fs.move(temp, final)  # the piece is staged once its manifest exists

    def _conform(self, records: Any) -> pa.Table:
        """The records as the table's schema; the first piece of a new table without a
        declared schema fixes it for this subtask."""
        table = _table_of(records, self._target, "DeltaSink")
        if self._target is None:
            bad = [f.name for f in table.schema if pa.types.is_null(f.type)]
            if bad:
                raise RecordRejectedError(
                    f"DeltaSink cannot infer a Delta type for column(s) {bad}: every value is None. "
                    "Declare DeltaSink(..., schema=pyarrow.schema([...]))"
                )
            self._target = table.schema
        return table

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        """Subtask 0 commits every subtask's pieces of this run up to ``checkpoint_id``
        in one Delta transaction (the checkpoint completed: all of them are staged);
        the other subtasks have nothing to do. Without checkpoints (``FINAL``, at each
        subtask's end of input) each subtask commits its own, with no app transaction:
        such a job is never recovered."""
        self._require_run("commit")
        final = checkpoint_id >= FINAL
        if subtask != 0 and not final:
            return
        fs, root = self._fs()
        pieces: List[Tuple[_Piece, int]] = []
        for p in self._pieces(fs, root):
            if p.run != self._tag or p.checkpoint_id > checkpoint_id or (final and p.subtask != subtask):
                continue
            if p.epoch == self._epoch:
                pieces.append((p, self._base + checkpoint_id))
            else:  # staged by a failed attempt's task after recover() ran: its records replay in this one
                log.warning(
                    "DeltaSink %s: deleting %s, staged by a failed attempt after the job restarted",
                    self.table_uri,
                    p.path,
                )
                _delete(fs, f"{root}/{p.path}")
                _delete(fs, p.manifest)
        if final:
            if pieces:
                self._commit(fs, root, pieces, [], None, checkpoint_id, "checkpoint")
            return
        # Without pieces too: the transaction alone records that checkpoint_id is in the table.
        self._commit(fs, root, pieces, [], self._base + checkpoint_id, checkpoint_id, "checkpoint", record=True)

    def recover(self, covered: Covered) -> None:
        """Makes the table exactly what ``covered`` covers, for this lineage: staged
        pieces it covers and the table lacks are committed; staged pieces it does not
        cover are deleted; files this lineage committed that it does not cover (a
        restore from an older checkpoint) are removed, in the same Delta transaction,
        which sets the app transaction's version back to the covered one."""
        run = self._require_run("recover")
        self._epoch = uuid.uuid4().hex[:16]  # the attempt about to start stages and commits under it
        fs, root = self._fs()
        upto = _versions(covered)
        last = self._base_version(covered)

        def version_of(tag: str, checkpoint_id: int) -> Optional[int]:
            if tag in upto and checkpoint_id <= upto[tag][1]:
                return upto[tag][0] + checkpoint_id
            return None

        table = self._table()
        committed = table.transaction_version(self.app_id) if table is not None else None
        adds: List[Tuple[_Piece, int]] = []
        for piece in self._pieces(fs, root):
            version = version_of(piece.run, piece.checkpoint_id)
            if version is None:  # after the restore point (or an abandoned branch): its records replay
                _delete(fs, f"{root}/{piece.path}")
                _delete(fs, piece.manifest)
            elif committed is not None and version <= committed:  # committed; only the cleanup never ran
                _delete(fs, piece.manifest)
            else:
                adds.append((piece, version))
        # This lineage's commits beyond the restored checkpoint (restored from an older one, or past a
        # damaged one): their files leave the table, and the app transaction goes back to the restored version.
        beyond = committed is not None and committed > last
        active = set(_active_files(table)) if table is not None else set()
        staged = {p.path for p, _ in adds}
        removes: List[str] = []
        for name in _listing(fs, root):
            m = _DATA.match(name)
            if not m or m.group(1) != self._lineage_tag or version_of(m.group(2), int(m.group(4))) is not None:
                continue
            if name in active:
                if beyond:
                    removes.append(name)
            elif name not in staged:
                _delete(fs, f"{root}/{name}")  # a piece whose manifest was never written
        if removes:
            log.warning(
                "DeltaSink %s: removing %d file(s) job %r committed after the checkpoint it restores (%s); "
                "their records are processed again",
                self.table_uri,
                len(removes),
                run.job_name,
                tuple(covered[-1]) if covered else "a fresh start",
            )
        if adds or removes or beyond:
            checkpoint_id = int(covered[-1][1]) if covered else 0
            self._commit(fs, root, adds, removes, last, checkpoint_id, "recovery", reset=beyond)

    def _base_version(self, covered: Covered) -> int:
        """The version of the last checkpoint ``covered`` covers (0: none)."""
        if not covered:
            return 0
        base, c = _versions(covered)[run_tag(str(covered[-1][0]))]
        return base + c

    def _commit(
        self,
        fs: Any,
        root: str,
        pieces: Sequence[Tuple[_Piece, int]],
        removes: Sequence[str],
        version: Optional[int],
        checkpoint_id: int,
        kind: str,
        reset: bool = False,
        record: bool = False,
    ) -> None:
        """One Delta transaction adding the ``(piece, its version)`` Delta does not have
        yet and removing ``removes``, with the app transaction at ``version`` (None:
        none; ``reset``: committed even with no file to add or remove, to set it back;
        ``record``: committed with no file to add when ``version`` is above the
        table's, to move it on); then the manifests go. Refused by a concurrent
        commit, it looks again."""
        deltalake = _require_deltalake()
        from deltalake import CommitProperties, Transaction
        from deltalake.exceptions import CommitFailedError, TableNotFoundError
        from deltalake.transaction import AddAction, RemoveAction

        run = self._require_run("commit")
        ordered = sorted(pieces, key=lambda pv: (pv[0].checkpoint_id, pv[0].subtask, pv[0].path))
        error: Optional[BaseException] = None
        for attempt in range(COMMIT_ATTEMPTS):
            table = self._table()
            committed = table.transaction_version(self.app_id) if table is not None else None
            todo = [p for p, v in ordered if version is None or committed is None or v > committed]
            moves_on = record and version is not None and (committed is None or version > committed)
            if moves_on and table is None and self.schema is None and not todo:
                break  # no table yet and no columns to create it with: the first records' commit will
            if (
                not todo
                and not removes
                and not moves_on
                and not (reset and committed is not None and committed > (version or 0))
            ):
                break  # a replay: Delta has every piece already
            schema = self._commit_schema(table, todo)
            now = int(time.time() * 1000)
            actions: List[Any] = [AddAction(p.path, p.size, {}, now, True, p.stats) for p in todo]
            actions += [RemoveAction(name, True, now) for name in removes]
            properties = CommitProperties(
                # Creating: no rebase onto a concurrent creator's table (see the module's docstring).
                max_commit_retries=0 if table is None else None,
                custom_metadata={
                    "pyengine.job": run.job_name,
                    "pyengine.run_id": run.run_id,
                    "pyengine.lineage_id": run.lineage_id,
                    "pyengine.checkpoint_id": int(checkpoint_id),
                    "pyengine.commit": kind,
                    "pyengine.rows": sum(p.rows for p in todo),
                },
                app_transactions=[Transaction(self.app_id, int(version))] if version is not None else None,
            )
            try:
                if table is None:
                    from deltalake.transaction import create_table_with_add_actions

                    create_table_with_add_actions(
                        self.table_uri,
                        deltalake.Schema.from_arrow(schema),
                        actions,
                        mode="error",  # two creators: the second is refused (no retry) and looks again
                        storage_options=self.storage_options,
                        commit_properties=properties,
                    )
                else:
                    overwrite = self.mode == "overwrite" and committed is None and not removes
                    table.create_write_transaction(
                        actions, "overwrite" if overwrite else "append", schema, commit_properties=properties
                    )
                self.commits += 1
                break
            except (CommitFailedError, TableNotFoundError, deltalake.exceptions.DeltaError) as exc:
                if isinstance(exc, deltalake.exceptions.SchemaMismatchError):
                    raise
                error = exc
                log.info("DeltaSink %s: commit refused (%s); reading the table again", self.table_uri, exc)
                time.sleep(min(0.02 * 2**attempt, 1.0))
        else:
            raise RuntimeError(f"DeltaSink {self.table_uri}: could not commit checkpoint {checkpoint_id}: {error}")
        for p, _ in ordered:
            _delete(fs, p.manifest)

    def _commit_schema(self, table: Any, pieces: Sequence[_Piece]) -> pa.Schema:
        """The table's schema (every piece must have its columns), or for a new table the pieces'."""
        schemas = [pa.ipc.read_schema(pa.py_buffer(p.schema)) for p in pieces]
        target = pa.schema(table.schema().to_arrow()) if table is not None else (schemas[0] if schemas else self.schema)
        if target is None:
            return pa.schema([])
        for p, s in zip(pieces, schemas, strict=True):
            if not _same_columns(s, target):
                changed = [
                    f"{f.name!r} is {f.type} there and {target.field(f.name).type} in the table"
                    for f in s
                    if f.name in target.names and not target.field(f.name).type.equals(f.type)
                ]
                raise NonRetryableError(
                    f"DeltaSink {self.table_uri}: staged file {p.path} has columns ({_describe(s)}), the table "
                    f"({_describe(target)}){': ' + '; '.join(changed) if changed else ''}; records inferred "
                    "differently in different pieces (whole numbers in one, fractions in another, say), and a "
                    "Delta table's column has one type. Declare DeltaSink(..., schema=pyarrow.schema([...]))"
                )
        return target

    def _pieces(self, fs: Any, root: str) -> List[_Piece]:
        """Every staged piece of this lineage, by its manifest."""
        out = []
        staging = self._staging(root)
        try:
            infos = fs.get_file_info(pafs.FileSelector(staging, allow_not_found=True))
        except FileNotFoundError:
            return []
        for info in infos:
            if not _MANIFEST.match(info.base_name):
                continue
            try:
                with fs.open_input_stream(info.path) as f:
                    body = json.loads(f.read())
            except FileNotFoundError:  # committed and removed meanwhile
                continue
            out.append(
                _Piece(
                    manifest=info.path,
                    run=run_tag(str(body["run_id"])),
                    checkpoint_id=int(body["checkpoint_id"]),
                    subtask=int(body["subtask"]),
                    path=str(body["path"]),
                    size=int(body["size"]),
                    rows=int(body["rows"]),
                    stats=str(body["stats"]),
                    schema=base64.b64decode(body["schema"]),
                    epoch=str(body.get("epoch", "")),
                )
            )
        return out

    # -- reading -------------------------------------------------------------------------------------------------

    def read_table(self) -> pa.Table:
        """The table's current rows, read through ``deltalake``'s log with Arrow's own
        filesystem: deltalake's default is a Python filesystem handler, whose reads Arrow's
        I/O threads may still be finishing when a short script exits, which aborts the
        interpreter (apache/arrow#39862)."""
        table = self._table()
        if table is None:
            return pa.table({})
        fs, root = self._fs()
        return pa.table(table.to_pyarrow_table(filesystem=pafs.SubTreeFileSystem(root, fs)))


def _delete(fs: Any, path: str) -> None:
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass


def _listing(fs: Any, root: str) -> List[str]:
    try:
        return [i.base_name for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)) if i.is_file]
    except FileNotFoundError:
        return []


def _active_files(table: Any) -> List[str]:
    actions = pa.table(table.get_add_actions(flatten=True))
    return [str(p) for p in actions.column("path").to_pylist()] if actions.num_rows else []


def _row_count(table: Any) -> int:
    actions = pa.table(table.get_add_actions(flatten=True))
    if not actions.num_rows:
        return 0
    counts = actions.column("num_records").to_pylist()
    return sum(int(c) if c is not None else 1 for c in counts)


def _last_writer(table: Any) -> str:
    try:
        last = table.history(1)[0]
    except Exception:  # history is for the message only
        return "last writer unknown"
    who = last.get("pyengine.job")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(last.get("timestamp", 0)) / 1000))
    what = f"last commit {last.get('operation', '?')} at {stamp}"
    return f"{what} by job {who!r} (run {last.get('pyengine.run_id')})" if who else what


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)
