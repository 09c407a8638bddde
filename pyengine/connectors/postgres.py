"""``PostgresSink``: a PostgreSQL table written exactly once, over psycopg 3.

Two-phase commit on the ``Sink`` protocol, with the database itself as the durable
place of both phases (Flink's ``JdbcSink.exactlyOnceSink`` uses XA prepared
transactions instead, which PostgreSQL allows only with ``max_prepared_transactions``
raised, and whose row locks would block a later checkpoint's upsert of the same key):

- **stage** (every sink subtask, at each checkpoint barrier): the records since the
  last barrier go by ``COPY`` into a staging table of their own
  (``<meta_schema>.s_<unique>``, made ``LIKE`` the target with its defaults and
  constraints, so a value the target cannot take is refused here, naming its row
  and column), recorded in ``<meta_schema>.staged`` in the same transaction. Readers
  of the target see nothing of it.
- **commit** (on notify-complete of checkpoint ``n``, by sink subtask 0 for all, as
  ``DeltaSink`` does): **one** transaction moves every subtask's staged tables up to
  ``n`` into the target (``INSERT ... SELECT``; with ``key``, an upsert:
  ``ON CONFLICT (key) DO UPDATE``, the last row of a key in a checkpoint winning) and
  records ``(table, lineage, run, subtask, checkpoint)`` in ``<meta_schema>.commits``.
  Readers see a checkpoint whole or not at all. A replayed commit finds its staged
  tables gone (dropped in that transaction) and its records there, and moves nothing.
- **recover** (the driver, before each attempt): staged tables the restored
  checkpoint covers are committed as above (their checkpoint completed; only its
  commit never ran); the others are dropped (their records replay). Commits of this
  lineage that the restored checkpoint does not cover (a restore from an older
  checkpoint) cannot be taken back from a table: that is refused, naming them.

Each attempt stages under an **epoch** drawn by ``recover`` (as ``DeltaSink`` does): a
task of a failed attempt that stages after the restart is neither covered nor the
new attempt's, and the new attempt's commit drops it instead of committing records
that are replayed. Epochs grow with time, so such a late task, committing, leaves the
newer attempt's staging tables alone. A lost connection is opened again and the transaction retried
(``retries`` times, with back-off); what a transaction did is all or nothing, so a
retry never doubles a row, and a commit whose outcome was unknown finds its record."""

from __future__ import annotations

import io
import logging
import re
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pyarrow as pa

from ..errors import NonRetryableError, OutputInUseError
from .base import FINAL, Covered, RecordRejectedError, RunInfo, Sink, run_tag

__all__ = ["PostgresSink"]

log = logging.getLogger(__name__)

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
_LINE = re.compile(r"line (\d+)(?:, column ([^:]+))?")
KEPT_COMMITS = 1000  # commit records kept per (table, run, subtask): the newest
SEQ_COLUMN = "_seq"  # aggregate(emit="updates"): grows per key; the row with the largest is the latest


def _require_psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise ImportError(
            "PostgresSink needs psycopg 3, which is not installed: pip install 'psycopg[binary]' (the postgres "
            "extra of pyengine)"
        ) from None
    return psycopg


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _qualified(table: str) -> Tuple[str, str]:
    """(schema, name) of ``table`` ("name" or "schema.name"; a bare name's schema, "",
    is the one the server's ``search_path`` finds it in, looked up by ``begin_run``)."""
    parts = table.split(".")
    if len(parts) == 1:
        parts = ["", parts[0]]
    if len(parts) != 2 or not parts[1] or (len(table.split(".")) == 2 and not parts[0]):
        raise ValueError(f"PostgresSink table must be 'name' or 'schema.name', got {table!r}")
    return parts[0], parts[1]


def _safe_dsn(dsn: str) -> str:
    """The DSN without its password, for messages."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(dsn)
    except Exception:
        return "<dsn>"
    parts.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in parts.items())


class PostgresSink(Sink):
    """A PostgreSQL table ``table`` (``"name"`` or ``"schema.name"``; it must exist),
    reached with ``dsn`` (a libpq connection string or URI), written exactly once:
    each checkpoint's rows in one transaction with its record in the commit table
    (see the module docstring).

    ``key`` (a column or a list of columns with a unique index or primary key on
    them): each row updates the row of its key, or inserts it: an update stream
    (``aggregate(emit="updates")``) becomes the latest value per key. Within a
    checkpoint the last row of a key wins; when the records and the table have the
    ``_seq`` column (``emit="updates"`` adds it), a row never replaces one with a
    larger ``_seq``. Without ``key``, rows are appended.

    Records are dicts or Arrow batches; their columns must be the table's (a subset:
    the others take their defaults). A row the table cannot take (a value of the
    wrong type, a null in a ``NOT NULL`` column, a ``CHECK`` it fails) fails the job
    at once with the row and the column named (``RecordRejectedError``), and nothing
    of its checkpoint is committed. ``meta_schema``: where the sink keeps its staging
    tables and its commit table (created on first use; the role needs ``CREATE`` on
    the database, or make the schema beforehand). ``retries``: how often a lost
    connection is opened again for one transaction before the task fails (and the
    job restarts, as its restart strategy says)."""

    def __init__(
        self,
        dsn: str,
        table: str,
        key: Optional[Any] = None,
        *,
        meta_schema: str = "pyengine",
        retries: int = 3,
        connect_timeout_s: float = 10.0,
    ) -> None:
        _require_psycopg()
        if not isinstance(dsn, str) or not dsn:
            raise ValueError(f"PostgresSink needs a DSN (a libpq connection string or URI), got {dsn!r}")
        if not isinstance(table, str):
            raise ValueError(f"PostgresSink table must be a string, got {table!r}")
        self.schema_name, self.table_name = _qualified(table)
        keys = [key] if isinstance(key, str) else list(key) if key is not None else []
        if not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"PostgresSink key must be a column name or a list of them, got {key!r}")
        if not _IDENT.match(meta_schema):
            raise ValueError(f"PostgresSink meta_schema must be a plain identifier, got {meta_schema!r}")
        if type(retries) is not int or retries < 0:
            raise ValueError(f"PostgresSink retries must be an int >= 0, got {retries!r}")
        self.dsn = dsn
        self.table = table  # "schema.name" once begin_run has found it
        self.key: List[str] = keys
        self.meta_schema = meta_schema
        self.retries = retries
        self.connect_timeout_s = connect_timeout_s
        self._run: Optional[RunInfo] = None
        self._tag = ""
        self._columns: Dict[str, str] = {}  # the target's columns and their types
        self._epoch = ""
        self._conns: Dict[int, Any] = {}
        self._lock = threading.Lock()
        self.commits = 0  # commit transactions this object made that moved rows

    # -- connections ------------------------------------------------------------------------------------------------

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_conns"] = {}
        return state

    def _target(self) -> str:
        return f"{_quote(self.schema_name)}.{_quote(self.table_name)}"

    def _meta(self, name: str) -> str:
        return f"{_quote(self.meta_schema)}.{_quote(name)}"

    def _connect(self) -> Any:
        psycopg = _require_psycopg()
        return psycopg.connect(self.dsn, connect_timeout=max(1, int(self.connect_timeout_s)))

    def _transaction(self, slot: int, what: str, fn: Any) -> Any:
        """``fn(connection)`` in one transaction on ``slot``'s connection, retried on a
        new connection when the connection is lost (all or nothing, so a retry is safe)."""
        psycopg = _require_psycopg()
        error: Optional[BaseException] = None
        for attempt in range(self.retries + 1):
            with self._lock:
                conn = self._conns.get(slot)
            try:
                if conn is None or conn.closed:
                    conn = self._connect()
                    with self._lock:
                        self._conns[slot] = conn
                with conn.transaction():
                    return fn(conn)
            except psycopg.OperationalError as exc:
                error = exc
                with self._lock:
                    self._conns.pop(slot, None)
                try:
                    if conn is not None:
                        conn.close()
                except Exception:
                    pass
                log.warning("PostgresSink %s: %s: connection lost (%s); connecting again", self.table, what, exc)
                time.sleep(min(0.1 * 2**attempt, 2.0))
        raise ConnectionError(
            f"PostgresSink {self.table}: {what}: the connection to PostgreSQL ({_safe_dsn(self.dsn)}) failed "
            f"{self.retries + 1} times: {' '.join(str(error).split())}; check that the server is up and reachable "
            "from every task"
        ) from error

    def close(self) -> None:
        """Closes the connections this object opened."""
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            try:
                conn.close()
            except Exception:
                pass

    # -- the run -----------------------------------------------------------------------------------------------------

    def _require_run(self, what: str) -> RunInfo:
        if self._run is None:
            raise RuntimeError(f"PostgresSink.{what} before begin_run(run): a runner must call begin_run first")
        return self._run

    def begin_run(self, run: RunInfo) -> None:
        """Makes the commit and staging bookkeeping (once per database), and checks the
        target table and its key."""
        if not isinstance(run, RunInfo):
            raise TypeError(f"PostgresSink.begin_run needs a RunInfo, got {type(run).__name__}")
        self._run = run
        self._tag = run_tag(run.run_id)
        self._transaction(-1, "setting up", self._setup)

    def _setup(self, conn: Any) -> None:
        meta = _quote(self.meta_schema)
        # two sinks setting up at once: one after the other (CREATE ... IF NOT EXISTS races otherwise)
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('pyengine.postgres-sink'))")
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {meta}")
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {self._meta('commits')} (target text NOT NULL, lineage text NOT NULL, "
            "run text NOT NULL, subtask int NOT NULL, checkpoint bigint NOT NULL, job text, run_id text, "
            "rows bigint, committed_at timestamptz NOT NULL DEFAULT now(), "
            "PRIMARY KEY (target, lineage, run, subtask, checkpoint))"
        )
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {self._meta('staged')} (name text PRIMARY KEY, target text NOT NULL, "
            "lineage text NOT NULL, run text NOT NULL, epoch text NOT NULL, subtask int NOT NULL, "
            "checkpoint bigint NOT NULL, columns text[] NOT NULL, rows bigint NOT NULL, "
            "staged_at timestamptz NOT NULL DEFAULT now())"
        )
        if not self.schema_name:  # a bare name: where search_path finds it
            found = conn.execute(
                "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE c.oid = to_regclass(%s)",
                (_quote(self.table_name),),
            ).fetchone()
            if found is None:
                raise NonRetryableError(
                    f"PostgresSink: there is no table {self.table_name!r} on the search_path of the database "
                    f"({_safe_dsn(self.dsn)}); create it first (CREATE TABLE ...), with a primary key or unique "
                    "index on the key columns for upserts, or name its schema ('schema.name')"
                )
            self.schema_name = str(found[0])
        self.table = f"{self.schema_name}.{self.table_name}"
        rows = conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (self.schema_name, self.table_name),
        ).fetchall()
        if not rows:
            raise NonRetryableError(
                f"PostgresSink: there is no table {self.table} in the database ({_safe_dsn(self.dsn)}); create it "
                "first (CREATE TABLE ...), with a primary key or unique index on the key columns for upserts"
            )
        self._columns = {str(name): str(type_) for name, type_ in rows}
        missing = [k for k in self.key if k not in self._columns]
        if missing:
            raise NonRetryableError(
                f"PostgresSink {self.table}: key column(s) {missing} are not in the table (columns: "
                f"{', '.join(self._columns)})"
            )
        if self.key:
            unique = conn.execute(
                "SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_index i "
                "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
                "WHERE i.indrelid = %s::regclass AND i.indisunique AND i.indpred IS NULL GROUP BY i.indexrelid",
                (f"{_quote(self.schema_name)}.{_quote(self.table_name)}",),
            ).fetchall()
            if sorted(self.key) not in [sorted(u[0]) for u in unique]:
                raise NonRetryableError(
                    f"PostgresSink {self.table}: an upsert by key {self.key} needs a primary key or unique index on "
                    f"exactly those columns (ON CONFLICT names it); add one: CREATE UNIQUE INDEX ON {self.table} "
                    f"({', '.join(self.key)})"
                )

    def end_run(self, status: str) -> None:
        self.close()

    # -- staging -----------------------------------------------------------------------------------------------------

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        run = self._require_run("stage")
        if not len(records):
            return
        table, rows = self._arrow(records)
        columns = list(table.schema.names) if table is not None else list(rows[0]) if rows else []
        unknown = [c for c in columns if c not in self._columns]
        lacking = [k for k in self.key if k not in columns]
        if lacking:
            raise RecordRejectedError(
                f"PostgresSink {self.table}: an upsert by key {self.key} needs the key in every record, and these "
                f"records lack {lacking} (columns: {', '.join(columns)})"
            )
        if unknown:
            raise RecordRejectedError(
                f"PostgresSink {self.table}: the records have column(s) {unknown}, which the table lacks (columns: "
                f"{', '.join(self._columns)}); add them to the table, or drop them before the sink"
            )
        name = f"s_{uuid.uuid4().hex[:24]}"
        count = table.num_rows if table is not None else len(rows)

        def staged(conn: Any) -> None:
            # the arrival order only matters to an upsert (the last row of a key wins): an append's
            # staging table has no row number to draw (a sequence per row costs a fifth of the COPY)
            numbered = ", _pe_row bigint GENERATED ALWAYS AS IDENTITY" if self.key else ""
            conn.execute(
                f"CREATE TABLE {self._meta(name)} (LIKE {self._target()} INCLUDING DEFAULTS INCLUDING CONSTRAINTS"
                f"{numbered})"
            )
            self._copy(conn, name, columns, table, rows)
            conn.execute(
                f"INSERT INTO {self._meta('staged')} (name, target, lineage, run, epoch, subtask, checkpoint, "
                "columns, rows) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (name, self.table, run.lineage_id, self._tag, self._epoch, subtask, checkpoint_id, columns, count),
            )

        self._transaction(subtask, f"staging checkpoint {checkpoint_id}", staged)

    def _arrow(self, records: Any) -> Tuple[Optional[pa.Table], List[Dict[str, Any]]]:
        """The records as an Arrow table when they make one (COPY as CSV, vectorised),
        else as dicts (COPY row by row, for mixed or nested values)."""
        if isinstance(records, pa.RecordBatch):
            return pa.Table.from_batches([records]), []
        if isinstance(records, pa.Table):
            return records, []
        rows = list(records)
        if not all(isinstance(r, dict) for r in rows):
            bad = next(r for r in rows if not isinstance(r, dict))
            raise RecordRejectedError(
                f"PostgresSink {self.table}: a record must be a dict of column values, got {type(bad).__name__} "
                f"{bad!r:.200}"
            )
        names = list(rows[0])
        uniform = all(len(r) == len(names) and list(r) == names for r in rows)
        if not uniform:  # the columns differ from row to row: every one named, None where a row lacks it
            seen: Dict[str, None] = {}
            for r in rows:
                seen.update(dict.fromkeys(r))
            names = list(seen)
        try:
            if uniform:
                table = pa.Table.from_pylist(rows)
            else:  # from_pylist would take the first row's keys only
                table = pa.table({n: pa.array([r.get(n) for r in rows]) for n in names})
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            return None, [{n: r.get(n) for n in names} for r in rows]
        if not _csv_types(table.schema):
            return None, [{n: r.get(n) for n in names} for r in rows]
        return table, []

    def _copy(self, conn: Any, name: str, columns: List[str], table: Optional[pa.Table], rows: List[Any]) -> None:
        psycopg = _require_psycopg()
        listed = ", ".join(_quote(c) for c in columns)
        try:
            with conn.cursor() as cur:
                if table is not None and _csv_types(table.schema):
                    import pyarrow.csv as pacsv

                    buf = io.BytesIO()
                    pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=False, batch_size=65536))
                    with cur.copy(f"COPY {self._meta(name)} ({listed}) FROM STDIN (FORMAT csv, FREEZE)") as copy:
                        copy.write(buf.getbuffer())
                else:
                    from psycopg.types.json import Jsonb

                    source = rows if table is None else table.to_pylist()
                    # a dict, or a list bound for a json column, goes as JSON; other lists as arrays
                    json = [c in self._columns and "json" in self._columns[c] for c in columns]
                    with cur.copy(f"COPY {self._meta(name)} ({listed}) FROM STDIN (FREEZE)") as copy:
                        for r in source:
                            copy.write_row(
                                [
                                    Jsonb(v) if isinstance(v, dict) or (j and isinstance(v, list)) else v
                                    for v, j in zip((r.get(c) for c in columns), json, strict=True)
                                ]
                            )
        except (psycopg.DataError, psycopg.IntegrityError) as exc:
            raise self._rejected(exc, table, rows) from None

    def _rejected(self, exc: Any, table: Optional[pa.Table], rows: List[Any]) -> RecordRejectedError:
        """The error naming the row (by COPY's line) and the column PostgreSQL refused."""
        diag = getattr(exc, "diag", None)
        context = (getattr(diag, "context", None) or "") if diag is not None else ""
        column = getattr(diag, "column_name", None) if diag is not None else None
        m = _LINE.search(context)
        row: Any = None
        if m:
            column = column or m.group(2)
            index = int(m.group(1)) - 1  # COPY counts lines from 1: one per row, unless a value holds a newline
            if table is None and 0 <= index < len(rows):
                row = rows[index]
            elif table is not None and 0 <= index < table.num_rows and not _has_newlines(table):
                row = table.slice(index, 1).to_pylist()[0]
            elif table is not None:
                row = f"at line {index + 1} of the COPY"
        where = f"row {row!r:.300}" if row is not None else "a row"
        col = f", column {column.strip()!r}" if column else ""
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return RecordRejectedError(
            f"PostgresSink {self.table}: {where}{col} cannot go into the table: {message}; nothing of this "
            "checkpoint is committed. Fix or filter such records before the sink, or change the column's type"
        )

    # -- committing --------------------------------------------------------------------------------------------------

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        """Sink subtask 0 moves every subtask's staged tables of this run up to
        ``checkpoint_id`` into the target in **one** transaction, with a record per
        (subtask, checkpoint) in the commit table: a reader never sees part of a
        checkpoint, and a row that fails there fails all of it. (The checkpoint
        completed, so every subtask has staged; the others have nothing to do.)
        Without checkpoints (``FINAL``, at each subtask's end of input) each subtask
        commits its own."""
        run = self._require_run("commit")
        final = checkpoint_id >= FINAL
        if subtask != 0 and not final:
            return
        mine = "AND subtask = %s " if final else ""

        def committed(conn: Any) -> None:
            staged = conn.execute(
                f"SELECT name, epoch, subtask, checkpoint, columns, rows FROM {self._meta('staged')} WHERE "
                f"target = %s AND lineage = %s AND run = %s {mine}AND checkpoint <= %s "
                "ORDER BY checkpoint, subtask, staged_at FOR UPDATE",
                (self.table, run.lineage_id, self._tag, *([subtask] if final else []), checkpoint_id),
            ).fetchall()
            for name, epoch, owner, checkpoint, columns, count in staged:
                if epoch == self._epoch:
                    self._move(conn, run, self._tag, int(owner), name, int(checkpoint), list(columns), int(count))
                elif epoch < self._epoch:  # staged by a failed attempt's task after recover() ran: it replays
                    log.warning("PostgresSink %s: dropping %s, staged by a failed attempt", self.table, name)
                    self._drop(conn, name)
                # a newer epoch's: this object is the late task of an older attempt, and leaves it be

        self._transaction(subtask, f"committing checkpoint {checkpoint_id}", committed)

    def _move(
        self,
        conn: Any,
        run: RunInfo,
        tag: str,
        subtask: int,
        name: str,
        checkpoint: int,
        columns: List[str],
        count: int,
    ) -> None:
        """Inside a transaction: the staged table into the target, once (the commit table says)."""
        psycopg = _require_psycopg()
        fresh = conn.execute(
            f"INSERT INTO {self._meta('commits')} (target, lineage, run, subtask, checkpoint, job, run_id, rows) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1",
            (self.table, run.lineage_id, tag, subtask, checkpoint, run.job_name, run.run_id, count),
        ).fetchone()
        if fresh is not None:
            # Only the newest records matter (a replay finds its staged table gone with the commit that
            # made its record; recover() looks for commits past the restored checkpoint): the table stays small.
            conn.execute(
                f"DELETE FROM {self._meta('commits')} WHERE target = %s AND lineage = %s AND run = %s AND "
                "subtask = %s AND checkpoint < %s",
                (self.table, run.lineage_id, tag, subtask, checkpoint - KEPT_COMMITS),
            )
            listed = ", ".join(_quote(c) for c in columns)
            try:
                conn.execute(self._insert(name, columns, listed))
            except (psycopg.DataError, psycopg.IntegrityError) as exc:
                detail = getattr(getattr(exc, "diag", None), "message_detail", None)
                raise RecordRejectedError(
                    f"PostgresSink {self.table}: checkpoint {checkpoint}'s rows cannot go into the table: "
                    f"{str(exc).strip().splitlines()[0]}{f' ({detail})' if detail else ''}; nothing of this "
                    "checkpoint is committed. A key that is already there needs PostgresSink(..., key=[...]) "
                    "(an upsert) or another table"
                ) from None
            self.commits += 1
        self._drop(conn, name)

    def _insert(self, name: str, columns: List[str], listed: str) -> str:
        source = self._meta(name)
        if not self.key:
            return f"INSERT INTO {self._target()} ({listed}) SELECT {listed} FROM {source}"
        keys = ", ".join(_quote(k) for k in self.key)
        order = f"{_quote(SEQ_COLUMN)} DESC, _pe_row DESC" if SEQ_COLUMN in columns else "_pe_row DESC"
        rest = [c for c in columns if c not in self.key]
        sql = (
            f"INSERT INTO {self._target()} ({listed}) SELECT DISTINCT ON ({keys}) {listed} FROM {source} "
            f"ORDER BY {keys}, {order} ON CONFLICT ({keys}) DO "
        )
        if not rest:
            return sql + "NOTHING"
        sql += "UPDATE SET " + ", ".join(f"{_quote(c)} = EXCLUDED.{_quote(c)}" for c in rest)
        if SEQ_COLUMN in columns and SEQ_COLUMN in self._columns:
            sql += f" WHERE {self._target()}.{_quote(SEQ_COLUMN)} <= EXCLUDED.{_quote(SEQ_COLUMN)}"
        return sql

    def _drop(self, conn: Any, name: str) -> None:
        conn.execute(f"DROP TABLE IF EXISTS {self._meta(name)}")
        conn.execute(f"DELETE FROM {self._meta('staged')} WHERE name = %s", (name,))

    # -- recovery ----------------------------------------------------------------------------------------------------

    def recover(self, covered: Covered) -> None:
        """Makes the table what ``covered`` covers for this lineage: covered staged
        tables are committed, the others dropped; commits it does not cover are refused."""
        run = self._require_run("recover")
        # the attempt about to start stages and commits under it; epochs order as attempts do
        # (the clock first), so a late task of an older attempt never drops a newer one's tables
        self._epoch = f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}"
        upto: Dict[str, int] = {}
        for run_id, checkpoint_id in covered:
            tag = run_tag(str(run_id))
            upto[tag] = max(upto.get(tag, -1), int(checkpoint_id))

        def covers(tag: str, checkpoint: int) -> bool:
            return tag in upto and checkpoint <= upto[tag]

        def recovered(conn: Any) -> None:
            beyond = [
                (r, int(c))
                for r, c in conn.execute(
                    f"SELECT DISTINCT run, checkpoint FROM {self._meta('commits')} WHERE target = %s AND lineage = %s "
                    "AND checkpoint < %s",
                    (self.table, run.lineage_id, FINAL),
                ).fetchall()
                if not covers(r, int(c))
            ]
            if beyond:
                raise OutputInUseError(
                    f"PostgresSink {self.table}: job {run.job_name!r} committed checkpoint(s) "
                    f"{sorted(beyond)[:5]} (run, id) that the checkpoint it restores does not cover (restored from "
                    "an older checkpoint, or a savepoint the job ran past?); rows in a table cannot be taken back. "
                    "Restore from the latest checkpoint (resume='auto'), or a savepoint taken with "
                    "stop_with_savepoint, or run the job fresh into an emptied table"
                )
            staged = conn.execute(
                f"SELECT name, run, subtask, checkpoint, columns, rows FROM {self._meta('staged')} WHERE target = %s "
                "AND lineage = %s ORDER BY checkpoint, staged_at FOR UPDATE",
                (self.table, run.lineage_id),
            ).fetchall()
            for name, tag, subtask, checkpoint, columns, count in staged:
                if covers(str(tag), int(checkpoint)):
                    original = RunInfo(run.job_name, _run_of(covered, str(tag)), run.lineage_id, run.restored)
                    self._move(conn, original, str(tag), int(subtask), name, int(checkpoint), list(columns), int(count))
                else:
                    self._drop(conn, name)

        self._transaction(-1, "recovering", recovered)

    # -- reading (tests, examples) ----------------------------------------------------------------------------------

    def read_table(self, order_by: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
        """The target's rows as dicts (in ``order_by`` order when given)."""
        order = f" ORDER BY {', '.join(_quote(c) for c in order_by)}" if order_by else ""

        def read(conn: Any) -> List[Dict[str, Any]]:
            cur = conn.execute(f"SELECT * FROM {self._target()}{order}")
            names = [d.name for d in cur.description]
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

        rows: List[Dict[str, Any]] = self._transaction(-2, "reading", read)
        return rows


def _run_of(covered: Covered, tag: str) -> str:
    for run_id, _ in covered:
        if run_tag(str(run_id)) == tag:
            return str(run_id)
    return tag


def _csv_types(schema: pa.Schema) -> bool:
    """Whether every column writes as CSV that PostgreSQL reads back the same."""
    for f in schema:
        t = f.type
        if not (
            pa.types.is_integer(t)
            or pa.types.is_floating(t)
            or pa.types.is_boolean(t)
            or pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_timestamp(t)
            or pa.types.is_date(t)
            or pa.types.is_decimal(t)
            or pa.types.is_null(t)
        ):
            return False
    return True


def _has_newlines(table: pa.Table) -> bool:
    import pyarrow.compute as pc

    for f, column in zip(table.schema, table.columns, strict=True):
        if (pa.types.is_string(f.type) or pa.types.is_large_string(f.type)) and pc.any(
            pc.match_substring(column, "\n")
        ).as_py():
            return True
    return False
