"""``FileSink``: part files in a directory, exactly once, by two-phase commit.

A subtask writes each checkpoint's records to a hidden part file and renames it into
view when the checkpoint commits (see ``pyengine.connectors.base`` for the protocol).
The directory's own files under ``_pyengine/`` say who wrote it and who writes it now:
``runs.json`` (the manifest of runs and lineages), ``lock.json`` (the writer's lock,
kept alive by a heartbeat, taken over only when stale) and, for parquet,
``schema.json`` (the column types every part file has)."""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import Any, ContextManager, Dict, List, Optional, Set, Tuple

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyarrow.fs import FileSelector

from ..errors import OutputInUseError
from ..storage.filesystem import guarded, resolve
from ..storage.jobs import pid_alive
from .base import Covered, RunInfo, Sink, _covered_map, run_tag
from .records import _cast_columns, _describe, _jsonl, _needs_rewrite, _table_of, _unify_columns

__all__ = [
    "FileSink",
]

log = logging.getLogger(__name__)


# part-<run tag>-<subtask>-<checkpoint>-<seq>.<format>: committed in the directory, staged in _staging/
_PART = re.compile(r"^part-([0-9a-f]{12})-(\d+)-(\d+)-(\d+)\.(jsonl|csv|parquet)$")
# what FileSink wrote before part names carried the run (an unknown writer's output now)
_LEGACY_PART = re.compile(r"^part-(\d+)-(\d+)-(\d+)\.(jsonl|csv|parquet)$")
# .part-<run tag>-...-<unique>.tmp: a piece being written
_TEMP = re.compile(r"^\.part-([0-9a-f]{12})-.*\.tmp$")

META_DIR = "_pyengine"  # the sink's own files: who wrote the directory, who writes it now
RUNS_FILE = "runs.json"
SCHEMA_FILE = "schema.json"  # parquet: the column types every part file of the directory has
SCHEMA_FORMAT = "pyengine-filesink-schema"
LOCK_FILE = "lock.json"
RUNS_FORMAT = "pyengine-filesink-runs"
HEARTBEAT_S = 10.0
STALE_S = 60.0
MODES = ("error", "append", "overwrite")

# Tokens of the directory locks this process holds: a lock of this host and pid whose
# token is not here was left by a run of this process that is gone.
_LIVE_TOKENS: Set[str] = set()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _utc(ms: Any) -> str:
    if not isinstance(ms, (int, float)) or not ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def _visible(name: str) -> bool:
    """Output a reader sees (Spark and pyarrow skip names starting with ``_`` or ``.``)."""
    return not name.startswith(("_", "."))


class FileSink(Sink):
    """Part files under ``path`` (a local path or a ``pyarrow.fs`` URI), in ``jsonl``,
    ``csv`` or ``parquet``, written exactly once per run and named by the run.

    Layout of ``path``::

        part-<run tag>-<subtask>-<checkpoint>-<seq>.<format>   committed output
        _staging/part-<run tag>-...                             staged, not yet committed
        _staging/.part-<run tag>-...-<unique>.tmp               being written
        _pyengine/runs.json                                     every run that wrote here
        _pyengine/lock.json                                     the run writing now

    ``mode`` says what to do with a directory that holds another job's committed
    output (as ``DataFrame.write.mode``): ``"error"`` refuses it (``OutputInUseError``
    naming the run that wrote it), ``"append"`` adds to it, ``"overwrite"`` replaces
    it. A run that continues its own lineage (a restore or ``resume="auto"``) always
    continues its own output, in every mode. Two live runs never write one
    directory: the second is refused, naming the first.

    ``schema`` (parquet and csv): a ``pyarrow.Schema`` every record must fit; without
    it, each staged piece takes the union of its records' fields.

    Parquet without ``schema``: every part file of the directory has one type per
    column, recorded in ``_pyengine/schema.json``, so ``pyarrow.parquet.read_table``
    (which reads the directory as its first file's schema) and Spark read it whole. A
    piece whose column is of a narrower type (whole numbers where fractions were) is
    written as the recorded type; one that needs a wider type (fractions after whole
    numbers: Arrow unifies int64 and float64 as float64) widens the record and
    rewrites the directory's part files of the narrower type in place (their values
    unchanged). Types Arrow cannot unify (int64, then text) are refused
    (``RecordRejectedError`` naming the column and both types)."""

    FORMATS = ("jsonl", "csv", "parquet")
    MODES = MODES

    def __init__(
        self,
        path: str,
        format: str = "jsonl",
        mode: str = "error",
        schema: Optional[pa.Schema] = None,
    ) -> None:
        if format not in self.FORMATS:
            raise ValueError(f"FileSink format must be one of {', '.join(self.FORMATS)}, got {format!r}")
        if not isinstance(path, str) or not path:
            raise ValueError(f"FileSink needs a path, got {path!r}")
        if mode not in MODES:
            raise ValueError(
                f"FileSink mode must be one of {', '.join(repr(m) for m in MODES)} "
                f"(as DataFrame.write.mode), got {mode!r}"
            )
        if schema is not None:
            if not isinstance(schema, pa.Schema):
                raise ValueError(f"FileSink schema must be a pyarrow.Schema, got {type(schema).__name__}")
            if format == "jsonl":
                raise ValueError("FileSink schema= applies to parquet and csv; jsonl writes each record as it is")
        self.path = path
        self.format = format
        self.mode = mode
        self.schema = schema
        self._seq: Dict[Tuple[int, int], int] = {}
        # (checkpoint id, staged name) this object staged per subtask in the current
        # attempt: commit publishes these only, never a piece found by listing, which
        # could be a zombie attempt's (a Spark task of a failed attempt still running)
        self._mine: Dict[int, List[Tuple[int, str]]] = {}
        self._lock = threading.Lock()
        self._run: Optional[RunInfo] = None
        self._tag: Optional[str] = None
        self._token: Optional[str] = None  # the directory lock this object holds (driver only)
        self._heartbeat: Optional[_Heartbeat] = None
        self._columns: Optional[pa.Schema] = None  # parquet: the directory's column types, as last read

    # The heartbeat thread stays on the driver; a copy (a Spark executor's) holds no lock.
    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.pop("_heartbeat", None)
        state["_token"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._heartbeat = None
        self._mine = {}

    @property
    def run_tag(self) -> Optional[str]:
        """The tag this run's part files carry (None before ``begin_run``)."""
        return self._tag

    def _fs(self) -> Tuple[Any, str]:
        fs, root, _ = resolve(self.path)
        return fs, root

    def _require_run(self, what: str) -> RunInfo:
        if self._run is None:
            raise RuntimeError(
                f"FileSink.{what} before begin_run(run): part files are named by the run that writes them, "
                "so a runner must call begin_run first"
            )
        return self._run

    def open(self, subtask: int) -> None:
        """A new attempt of ``subtask``: what an earlier attempt staged is the driver's
        ``recover``'s to publish or delete, never this attempt's commits'."""
        with self._lock:
            self._mine[subtask] = []
        fs, root = self._fs()
        fs.create_dir(f"{root}/_staging", recursive=True)

    # -- the run: identity, lock, mode ---------------------------------------------------------------------------

    def begin_run(self, run: RunInfo) -> None:
        """Takes the directory for ``run``: refuses it while another live run holds it
        (``OutputInUseError``), applies ``mode`` to other jobs' output (``"error"``:
        ``OutputInUseError`` naming their writer), records the run in
        ``_pyengine/runs.json`` and keeps the lock's heartbeat until ``end_run``."""
        if not isinstance(run, RunInfo):
            raise TypeError(f"FileSink.begin_run needs a RunInfo, got {type(run).__name__}")
        if self._token is not None:  # a run that never ended (its runner died): let it go first
            self._release("FAILED")
        fs, root = self._fs()
        fs.create_dir(f"{root}/{META_DIR}", recursive=True)
        tag = run_tag(run.run_id)
        token = self._take_lock(fs, root, run)
        try:
            runs = self._read_runs(fs, root)
            ours = _lineage_tags(runs, run.lineage_id, run.restored) | {tag}
            if self.mode == "error":
                self._refuse_foreign_output(fs, root, runs, ours, run)
            elif self.mode == "overwrite":
                self._delete_foreign(fs, root, ours)
                runs = {t: r for t, r in runs.items() if t in ours}
            runs[tag] = {
                "job_name": run.job_name,
                "run_id": run.run_id,
                "lineage_id": run.lineage_id,
                "restored": [list(c) for c in run.restored],
                "started_ms": _now_ms(),
                "ended_ms": None,
                "status": "RUNNING",
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "format": self.format,
                "mode": self.mode,
            }
            self._write_runs(fs, root, runs)
        except BaseException:
            _drop_lock(fs, f"{root}/{META_DIR}/{LOCK_FILE}", token)
            _LIVE_TOKENS.discard(token)
            raise  # refused: nothing a reader sees changed (a hidden _pyengine/.guard stays)
        fs.create_dir(f"{root}/_staging", recursive=True)
        self._settle_schema(fs, root)
        with self._lock:
            self._run, self._tag, self._token = run, tag, token
            self._seq = {}
        self._heartbeat = _Heartbeat(fs, f"{root}/{META_DIR}/{LOCK_FILE}", token, self.path)
        self._heartbeat.start()

    def end_run(self, status: str) -> None:
        """Records ``status`` for this run in ``_pyengine/runs.json``, stops the heartbeat
        and removes the lock. Never raises for storage trouble: it runs in the runner's
        ``finally``, where an error would hide the job's own."""
        if self._token is None:
            return  # begin_run did not take the directory (refused, or never called)
        self._release(status)

    def _release(self, status: str) -> None:
        token, self._token = self._token, None
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()
        fs, root = self._fs()
        try:
            runs = self._read_runs(fs, root)
            entry = runs.get(self._tag or "")
            if entry is not None:
                entry["status"] = str(status)
                entry["ended_ms"] = _now_ms()
                self._write_runs(fs, root, runs)
        except OSError as exc:
            log.warning("FileSink %s: could not record run status %s: %s", self.path, status, exc)
        if token is not None:
            _drop_lock(fs, f"{root}/{META_DIR}/{LOCK_FILE}", token)
            _LIVE_TOKENS.discard(token)

    def _take_lock(self, fs: Any, root: str, run: RunInfo) -> str:
        """Creates ``_pyengine/lock.json`` exclusively (a hard link or ``O_EXCL`` on a
        local disk; check-then-write-then-verify elsewhere), taking over a stale one."""
        path = f"{root}/{META_DIR}/{LOCK_FILE}"
        token = uuid.uuid4().hex
        now = _now_ms()
        body = {
            "run_id": run.run_id,
            "job_name": run.job_name,
            "lineage_id": run.lineage_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_ms": now,
            "heartbeat_ms": now,
            "token": token,
        }
        data = json.dumps(body, indent=1).encode()
        local = isinstance(fs, pafs.LocalFileSystem)
        _LIVE_TOKENS.add(token)
        try:
            with _guard(fs, path):
                return self._take_lock_guarded(fs, path, token, data, local)
        except BaseException:
            _LIVE_TOKENS.discard(token)
            raise

    def _take_lock_guarded(self, fs: Any, path: str, token: str, data: bytes, local: bool) -> str:
        """The taking itself, with the guard held (see ``_guard``)."""
        for _ in range(8):
            if local:
                created = _create_exclusive_local(path, data)
            else:
                created = fs.get_file_info(path).type == pafs.FileType.NotFound
                if created:
                    _write_atomic(fs, path, data)
                    held_now = _read_lock(fs, path)
                    if held_now is None or held_now.get("token") != token:
                        continue  # another writer's lock replaced ours: judge it below
            if created:
                return token
            held = _read_lock(fs, path)
            if held is None:
                continue  # removed meanwhile: try again
            if not _lock_stale(held):
                raise OutputInUseError(self._in_use_message(held))
            log.warning(
                "FileSink %s: taking over the stale lock of run %s of job %r (host %s, pid %s, heartbeat %s)",
                self.path,
                held.get("run_id"),
                held.get("job_name"),
                held.get("host"),
                held.get("pid"),
                _utc(held.get("heartbeat_ms")),
            )
            _remove_stale_lock(fs, path, held, local, token)
        raise OutputInUseError(
            f"FileSink output {self.path}: could not take {META_DIR}/{LOCK_FILE}: other runs keep taking it"
        )

    def _in_use_message(self, held: Dict[str, Any]) -> str:
        if held.get("_unreadable"):
            who = "another run (its lock file is being written)"
        else:
            beat = held.get("heartbeat_ms")
            age = f"{(_now_ms() - beat) / 1000:.0f} s ago" if isinstance(beat, (int, float)) else "unknown"
            who = (
                f"run {held.get('run_id')} of job {held.get('job_name')!r} "
                f"(host {held.get('host')}, pid {held.get('pid')}, heartbeat {age})"
            )
        return (
            f"FileSink output {self.path} is in use by {who}: two runs must not write one directory. "
            f"Wait for that run to end (or stop it), or write to another path. A lock left by a dead run is "
            f"taken over once its process is gone (same host) or its heartbeat is older than {STALE_S:.0f} s"
        )

    def _read_runs(self, fs: Any, root: str) -> Dict[str, Dict[str, Any]]:
        """``runs.json``: run tag -> that run's record (empty when missing or unreadable)."""
        path = f"{root}/{META_DIR}/{RUNS_FILE}"
        try:
            with fs.open_input_stream(path) as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("FileSink %s: %s is unreadable (%s): its writers are unknown", self.path, path, exc)
            return {}
        runs = data.get("runs") if isinstance(data, dict) and data.get("format") == RUNS_FORMAT else None
        if not isinstance(runs, dict):
            return {}
        return {str(t): dict(r) for t, r in runs.items() if isinstance(r, dict)}

    def _write_runs(self, fs: Any, root: str, runs: Dict[str, Dict[str, Any]]) -> None:
        body = {"format": RUNS_FORMAT, "version": 1, "runs": runs}
        _write_atomic(fs, f"{root}/{META_DIR}/{RUNS_FILE}", json.dumps(body, indent=1).encode())

    def _refuse_foreign_output(
        self, fs: Any, root: str, runs: Dict[str, Dict[str, Any]], ours: Set[str], run: RunInfo
    ) -> None:
        """``mode="error"``: raise ``OutputInUseError`` when the directory holds committed
        output that is not this lineage's, naming who wrote it and the ways out."""
        writers: Dict[str, List[str]] = {}  # run tag ("" for unknown) -> names
        for info in fs.get_file_info(FileSelector(root, allow_not_found=True)):
            if not _visible(info.base_name):
                continue
            m = _PART.match(info.base_name)
            if m and m.group(1) in ours:
                continue
            tag = m.group(1) if m and m.group(1) in runs else ""
            writers.setdefault(tag, []).append(info.base_name)
        if not writers:
            return
        parts = []
        resumable = None
        for tag, names in sorted(
            writers.items(), key=lambda kv: (kv[0] == "", runs.get(kv[0], {}).get("started_ms", 0))
        ):
            example = sorted(names)[0]
            count = f"{len(names)} file{'s' if len(names) != 1 else ''} (e.g. {example!r})"
            if not tag:
                parts.append(f"{count} of an unknown writer")
                continue
            r = runs[tag]
            status = str(r.get("status", "?"))
            if status == "RUNNING":
                status = "did not finish (its process ended without ending the run)"
            parts.append(
                f"{count} of run {r.get('run_id')} of job {r.get('job_name')!r}, "
                f"started {_utc(r.get('started_ms'))}, {status}"
            )
            if r.get("job_name") == run.job_name and r.get("status") != "FINISHED":
                resumable = r
        message = (
            f"FileSink output {self.path} holds committed output of another run: {'; '.join(parts)}. "
            f'Pass FileSink(..., mode="append") to add this run\'s output to it, mode="overwrite" to replace it, '
            f"or write to another path"
        )
        if resumable is not None:
            message += (
                f"; or, to continue run {resumable.get('run_id')} of job {run.job_name!r} where it stopped, "
                f"execute({run.job_name!r}, resume='auto')"
            )
        raise OutputInUseError(message)

    def _delete_foreign(self, fs: Any, root: str, ours: Set[str]) -> None:
        """``mode="overwrite"``: remove committed output and staged pieces not of this lineage."""
        for info in fs.get_file_info(FileSelector(root, allow_not_found=True)):
            if not _visible(info.base_name):
                continue
            m = _PART.match(info.base_name)
            if m and m.group(1) in ours:
                continue
            if info.type == pafs.FileType.Directory:
                fs.delete_dir(info.path)
            else:
                fs.delete_file(info.path)
        for info in self._staging_infos(fs, root):
            m = _PART.match(info.base_name) or _TEMP.match(info.base_name)
            if m and m.group(1) in ours:
                continue
            if info.type == pafs.FileType.Directory:
                fs.delete_dir(info.path)
            else:
                fs.delete_file(info.path)

    # -- staging and committing ----------------------------------------------------------------------------------

    def _encode(self, records: Any) -> bytes:
        if self.format == "jsonl":
            return _jsonl(records)
        table = _table_of(records, self.schema)
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
        self._require_run("stage")
        if not len(records):
            return
        fs, root = self._fs()
        typed = self.format == "parquet" and self.schema is None  # the directory keeps one type per column
        if typed:
            table = self._fit_directory(fs, root, _table_of(records))
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            data = bytes(sink.getvalue().to_pybytes())
        else:
            data = self._encode(records)  # refuses a bad record before anything is written
        with self._lock:
            seq = self._seq.get((subtask, checkpoint_id), 0)
            self._seq[(subtask, checkpoint_id)] = seq + 1
        name = f"part-{self._tag}-{subtask}-{checkpoint_id}-{seq}.{self.format}"
        temp = f"{root}/_staging/.{name}.{uuid.uuid4().hex[:12]}.tmp"  # never shared by two writers
        with fs.open_output_stream(temp) as out:
            out.write(data)
        fs.move(temp, f"{root}/_staging/{name}")
        if typed:
            # Another subtask may have widened the directory since this piece was fitted: it
            # wrote the record before listing the files, so it either saw this piece or the
            # record read here is the wider one.
            recorded = self._read_schema(fs, root)
            if recorded is not None and _needs_rewrite(table.schema, recorded):
                self._columns = recorded
                _rewrite_part(fs, f"{root}/_staging/{name}", recorded, self.path)
        with self._lock:
            self._mine.setdefault(subtask, []).append((checkpoint_id, name))

    # -- parquet: one type per column in the whole directory ------------------------------------------------------

    def _read_schema(self, fs: Any, root: str) -> Optional[pa.Schema]:
        """The recorded column types (``_pyengine/schema.json``), or None."""
        try:
            with fs.open_input_stream(f"{root}/{META_DIR}/{SCHEMA_FILE}") as f:
                body = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise OSError(f"FileSink {self.path}: {META_DIR}/{SCHEMA_FILE} is unreadable ({exc})") from exc
        if not isinstance(body, dict) or body.get("format") != SCHEMA_FORMAT:
            return None
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(body["schema"])))

    def _write_schema(self, fs: Any, root: str, schema: pa.Schema, rewriting: bool) -> None:
        body = {
            "format": SCHEMA_FORMAT,
            "version": 1,
            # True while part files are being rewritten to it: the next run finishes the rewrite
            "rewriting": rewriting,
            "columns": {f.name: str(f.type) for f in schema},
            "schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
        }
        _write_atomic(fs, f"{root}/{META_DIR}/{SCHEMA_FILE}", json.dumps(body, indent=1).encode())

    def _fit_directory(self, fs: Any, root: str, table: pa.Table) -> pa.Table:
        """``table`` with the directory's column types: cast up to them where narrower,
        and the directory widened first where ``table`` needs a wider type."""
        known = self._columns if self._columns is not None else self._read_schema(fs, root)
        merged = _unify_columns(known, table.schema, "FileSink", self.path)
        if known is None or not merged.equals(known):
            merged = self._widen_directory(fs, root, table.schema)
        self._columns = merged
        return _cast_columns(table, merged, "FileSink")

    def _widen_directory(self, fs: Any, root: str, schema: pa.Schema) -> pa.Schema:
        """Records ``schema``'s columns unified with the recorded ones and rewrites the
        part files of narrower types; one writer at a time (``guarded``)."""
        fs.create_dir(f"{root}/{META_DIR}", recursive=True)
        with guarded(fs, f"{root}/{META_DIR}/.schema-guard"):
            current = self._read_schema(fs, root)
            merged = _unify_columns(current, schema, "FileSink", self.path)
            if current is not None and merged.equals(current):
                return merged  # another writer widened it meanwhile
            wider = current is not None and any(
                f.name in merged.names and not merged.field(f.name).type.equals(f.type) for f in current
            )
            self._write_schema(fs, root, merged, rewriting=wider)
            if wider:
                log.info("FileSink %s: widening the part files' columns to (%s)", self.path, _describe(merged))
                self._conform_parts(fs, root, merged)
                self._write_schema(fs, root, merged, rewriting=False)
            return merged

    def _conform_parts(self, fs: Any, root: str, schema: pa.Schema) -> None:
        """Rewrites every parquet part file (committed or staged, of any run) whose
        columns are narrower than ``schema``'s."""
        # staging first: a piece published (moved from staging to the root) between the two
        # listings is then seen at least once, never in neither
        for info in self._staging_infos(fs, root) + list(fs.get_file_info(FileSelector(root, allow_not_found=True))):
            name = info.base_name
            if not info.is_file or not name.endswith(".parquet") or not (_PART.match(name) or _LEGACY_PART.match(name)):
                continue
            staged = info.path != f"{root}/{name}"
            try:
                _rewrite_part(fs, info.path, schema, self.path)
            except FileNotFoundError:
                if not staged:
                    continue  # deleted meanwhile
            if staged and fs.get_file_info(f"{root}/{name}").type == pafs.FileType.File:
                # committed before or while it was rewritten: the published copy counts
                _rewrite_part(fs, f"{root}/{name}", schema, self.path)
                try:
                    fs.delete_file(info.path)
                except FileNotFoundError:
                    pass

    def _settle_schema(self, fs: Any, root: str) -> None:
        """At the start of a run: a rewrite a crash interrupted is finished; a record
        with no part file left (an overwrite, a directory emptied by hand) goes."""
        self._columns = None
        if self.format != "parquet" or self.schema is not None:
            return
        recorded = self._read_schema(fs, root)
        if recorded is None:
            return
        names = [i.base_name for i in fs.get_file_info(FileSelector(root, allow_not_found=True))]
        names += [i.base_name for i in self._staging_infos(fs, root)]
        if not any(_PART.match(n) or _LEGACY_PART.match(n) for n in names):
            try:
                fs.delete_file(f"{root}/{META_DIR}/{SCHEMA_FILE}")
            except FileNotFoundError:
                pass
            return
        with fs.open_input_stream(f"{root}/{META_DIR}/{SCHEMA_FILE}") as f:
            rewriting = bool(json.loads(f.read()).get("rewriting"))
        if rewriting:
            with guarded(fs, f"{root}/{META_DIR}/.schema-guard"):
                self._conform_parts(fs, root, recorded)
                self._write_schema(fs, root, recorded, rewriting=False)

    def _staging_infos(self, fs: Any, root: str) -> List[Any]:
        try:
            return list(fs.get_file_info(FileSelector(f"{root}/_staging", allow_not_found=True)))
        except FileNotFoundError:
            return []

    def _publish(self, fs: Any, root: str, name: str) -> None:
        staged, final = f"{root}/_staging/{name}", f"{root}/{name}"
        if fs.get_file_info(final).type == pafs.FileType.File:
            # Names are unique per run and piece: the same piece, moved by a copy-then-delete
            # filesystem that died between the two.
            fs.delete_file(staged)
        else:
            fs.move(staged, final)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        self._require_run("commit")
        fs, root = self._fs()
        with self._lock:
            pending = self._mine.get(subtask, [])
            due = [name for cid, name in pending if cid <= checkpoint_id]
            self._mine[subtask] = [(cid, name) for cid, name in pending if cid > checkpoint_id]
        for name in due:
            self._publish(fs, root, name)
        # Any other piece of this subtask up to here is a zombie attempt's, staged after
        # the driver's recover (an earlier attempt's covered pieces were published then,
        # the rest deleted): delete it now, before a later recover would find it covered.
        for info in self._staging_infos(fs, root):
            m = _PART.match(info.base_name)
            if m and m.group(1) == self._tag and int(m.group(2)) == subtask and int(m.group(3)) <= checkpoint_id:
                log.warning(
                    "FileSink %s: deleting %s, staged by an earlier attempt after its restart", self.path, m.group(0)
                )
                try:
                    fs.delete_file(info.path)
                except FileNotFoundError:
                    pass

    def recover(self, covered: Covered) -> None:
        """Makes this lineage's output exactly what ``covered`` covers: staged pieces it
        covers are committed, every other staged piece, temp file and committed part
        file of the lineage is deleted (they come after the restore point, or from a
        branch a restore abandoned). Other lineages' files are never touched."""
        run = self._require_run("recover")
        with self._lock:
            self._mine = {}  # earlier attempts' pieces are this method's, published or deleted here
        fs, root = self._fs()
        fs.create_dir(f"{root}/_staging", recursive=True)
        fs.create_dir(f"{root}/{META_DIR}", recursive=True)
        # under the guard a widening holds while it rewrites part files: a rewrite must not
        # move a part file back that this deletes (its records would then be there twice)
        with guarded(fs, f"{root}/{META_DIR}/.schema-guard"):
            self._recover_files(fs, root, run, covered)

    def _recover_files(self, fs: Any, root: str, run: Any, covered: Covered) -> None:
        upto = _covered_map(covered)
        ours = _lineage_tags(self._read_runs(fs, root), run.lineage_id, covered) | {self._tag or ""}

        def is_covered(tag: str, checkpoint_id: int) -> bool:
            return tag in upto and checkpoint_id <= upto[tag]

        for info in self._staging_infos(fs, root):
            m = _PART.match(info.base_name)
            if m and m.group(1) in ours:
                if is_covered(m.group(1), int(m.group(3))):
                    self._publish(fs, root, info.base_name)
                else:
                    fs.delete_file(info.path)
                continue
            t = _TEMP.match(info.base_name)
            if t and t.group(1) in ours:  # a dead attempt's piece, half written
                fs.delete_file(info.path)
        for info in fs.get_file_info(FileSelector(root, allow_not_found=True)):
            m = _PART.match(info.base_name)
            if m and m.group(1) in ours and not is_covered(m.group(1), int(m.group(3))):
                fs.delete_file(info.path)

    # -- reading -------------------------------------------------------------------------------------------------

    def committed_files(self) -> List[str]:
        """Paths of the committed files: runs in the order they started (legacy
        unnamed-run part files first), then by subtask, checkpoint and sequence number;
        files pyengine did not write last, by name."""
        fs, root = self._fs()
        infos = fs.get_file_info(FileSelector(root, allow_not_found=True))
        runs = self._read_runs(fs, root)
        started = sorted(runs, key=lambda t: (runs[t].get("started_ms") or 0, t))
        rank = {t: i for i, t in enumerate(started)}

        def order(info: Any) -> Tuple[int, int, str, int, int, int, str]:
            name = info.base_name
            m = _PART.match(name)
            if m:
                tag = m.group(1)
                return (1, rank.get(tag, len(rank)), tag, int(m.group(2)), int(m.group(3)), int(m.group(4)), name)
            legacy = _LEGACY_PART.match(name)
            if legacy:
                return (0, 0, "", int(legacy.group(1)), int(legacy.group(2)), int(legacy.group(3)), name)
            return (2, 0, "", 0, 0, 0, name)

        files = [i for i in infos if i.is_file and _visible(i.base_name)]
        return [i.path for i in sorted(files, key=order)]

    def read_committed(self) -> List[Any]:
        """Every committed record (jsonl: as parsed JSON; csv/parquet: dicts)."""
        fs, _ = self._fs()
        out: List[Any] = []
        for path in self.committed_files():
            with fs.open_input_file(path) as f:
                if self.format == "parquet":
                    # One thread, Arrow-owned buffers: pq.read_table would scan through
                    # pyarrow.dataset, whose pool may still be releasing buffers after it
                    # returns; a buffer owned by Python then needs the GIL while the
                    # interpreter exits, and the process aborts ("terminate called without
                    # an active exception", apache/arrow#39862).
                    out.extend(pq.ParquetFile(f).read(use_threads=False).to_pylist())
                    continue
                data = f.read()
            if self.format == "jsonl":
                out.extend(json.loads(line) for line in data.decode().splitlines() if line)
            else:
                out.extend(csv.DictReader(io.StringIO(data.decode())))
        return out


def _lineage_tags(runs: Dict[str, Dict[str, Any]], lineage_id: str, covered: Covered) -> Set[str]:
    """Run tags of a lineage: the runs ``runs.json`` records under it, and every run
    its restored state covers (even when ``runs.json`` lost them)."""
    tags = {t for t, r in runs.items() if r.get("lineage_id") == lineage_id}
    tags.update(run_tag(str(run_id)) for run_id, _ in covered)
    return tags


# -- the directory lock ------------------------------------------------------------------------------------------


class _Heartbeat:
    """Refreshes the lock's heartbeat every ``HEARTBEAT_S`` from a daemon thread on the
    driver, so another host can tell a live writer from a dead one."""

    def __init__(self, fs: Any, path: str, token: str, output: str) -> None:
        self.fs, self.path, self.token, self.output = fs, path, token, output
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pyengine-filesink-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with _guard(self.fs, self.path):
                    held = _read_lock(self.fs, self.path)
                    if held is None or held.get("token") != self.token:
                        log.warning("FileSink %s: this run lost its lock to another run (%s)", self.output, held)
                        return
                    held["heartbeat_ms"] = _now_ms()
                    _write_atomic(self.fs, self.path, json.dumps(held, indent=1).encode())
            except OSError as exc:  # a storage hiccup: the next beat tries again
                log.warning("FileSink %s: heartbeat failed: %s", self.output, exc)


def _guard(fs: Any, lock_path: str) -> ContextManager[None]:
    """Serialises every read-judge-write of the lock file (taking, taking over,
    heartbeat, removal) through ``_pyengine/.guard``: two runs that find one stale
    lock never both take it (see ``storage.filesystem.guarded``)."""
    return guarded(fs, f"{lock_path.rpartition('/')[0]}/.guard")


def _write_atomic(fs: Any, path: str, data: bytes) -> None:
    """Writes ``path`` whole or not at all: a unique temp name, then a move."""
    parent, _, name = path.rpartition("/")
    temp = f"{parent}/.{name}.{uuid.uuid4().hex[:12]}.tmp"
    with fs.open_output_stream(temp) as out:
        out.write(data)
    fs.move(temp, path)


def _create_exclusive_local(path: str, data: bytes) -> bool:
    """Creates ``path`` holding ``data`` only if it does not exist (False if it does).
    A hard link from a complete temp file, so no reader sees a half-written lock;
    ``O_CREAT | O_EXCL`` where the filesystem has no hard links."""
    temp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    with open(temp, "wb") as f:
        f.write(data)
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    finally:
        os.unlink(temp)


def _read_lock(fs: Any, path: str) -> Optional[Dict[str, Any]]:
    """The lock's content; None when there is none; ``{"_unreadable": True, "mtime_ms": ...}``
    when it cannot be parsed (being written with ``O_EXCL``, or damaged)."""
    try:
        with fs.open_input_stream(path) as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
        if isinstance(data, dict):
            return data
    except ValueError:
        pass
    info = fs.get_file_info(path)
    mtime = info.mtime.timestamp() * 1000 if info.mtime is not None else 0
    return {"_unreadable": True, "mtime_ms": mtime}


def _lock_stale(held: Dict[str, Any]) -> bool:
    """A lock is stale when its run is gone: from this host with a dead pid (or, for
    this process, a run that no longer holds it), or a heartbeat older than ``STALE_S``."""
    now = _now_ms()
    if held.get("_unreadable"):
        return now - float(held.get("mtime_ms") or 0) > STALE_S * 1000
    if held.get("token") in _LIVE_TOKENS:
        return False
    pid = held.get("pid")
    if held.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0:
        if pid == os.getpid() or not pid_alive(pid):
            return True
    beat = held.get("heartbeat_ms")
    return not isinstance(beat, (int, float)) or now - beat > STALE_S * 1000


def _remove_stale_lock(fs: Any, path: str, held: Dict[str, Any], local: bool, token: str) -> None:
    """Removes the lock judged stale, and only it: on a local disk it is moved aside
    first and checked (another run may have replaced it meanwhile: then it is put back)."""
    if not local:
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            pass
        return
    aside = f"{path}.{token}.stale"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = _read_lock(fs, aside)
        if moved is not None and moved.get("token") != held.get("token") and not moved.get("_unreadable"):
            try:
                os.link(aside, path)  # a live run's lock, taken over meanwhile: put it back
            except FileExistsError:
                pass
    finally:
        os.unlink(aside)


def _drop_lock(fs: Any, path: str, token: str) -> None:
    """Removes the lock if it is still ``token``'s."""
    try:
        with _guard(fs, path):
            held = _read_lock(fs, path)
            if held is not None and held.get("token") == token:
                fs.delete_file(path)
    except OSError as exc:
        log.warning("FileSink: could not remove lock %s: %s", path, exc)


# -- encoding ----------------------------------------------------------------------------------------------------


def _rewrite_part(fs: Any, path: str, target: pa.Schema, where: str) -> bool:
    """Rewrites the parquet file at ``path`` with ``target``'s column types where its
    own differ (a temp file moved over it: a reader sees the old file or the new one);
    False when nothing had to change. ``FileNotFoundError`` when it is gone."""
    with fs.open_input_file(path) as f:
        table = pq.ParquetFile(f).read(use_threads=False)
    if not _needs_rewrite(table.schema, target):
        return False
    table = _cast_columns(table, target, "FileSink")
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    parent, _, name = path.rpartition("/")
    temp = f"{parent}/.{name}.{uuid.uuid4().hex[:12]}.tmp"
    with fs.open_output_stream(temp) as out:
        out.write(sink.getvalue())
    if fs.get_file_info(path).type != pafs.FileType.File:  # deleted meanwhile (a recover): not brought back
        fs.delete_file(temp)
        raise FileNotFoundError(path)
    fs.move(temp, path)
    log.info("FileSink %s: rewrote %s with the directory's column types", where, name)
    return True
