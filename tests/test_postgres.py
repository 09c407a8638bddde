"""PostgresSink: exactly once into a real PostgreSQL (start one with ``sudo bash
.ci/postgres``; the DSN is ``PYENGINE_TEST_PG_DSN``, by default the role and database
that script makes). Without a server these tests skip, saying so; CI starts one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from typing import Any, Iterator, List

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.connectors.postgres import _safe_dsn
from pyengine.errors import NonRetryableError
from pyengine.sinks import RecordRejectedError, RunInfo

psycopg = pytest.importorskip("psycopg", reason="PostgresSink needs psycopg: pip install 'psycopg[binary]'")

DSN = os.environ.get("PYENGINE_TEST_PG_DSN", "postgresql://pyengine:pyengine@127.0.0.1:5432/pyengine_test")


def _server() -> str:
    try:
        with psycopg.connect(DSN, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return ""
    except Exception as exc:
        why = " ".join(str(exc).split())[:160]
        return f"no PostgreSQL at {_safe_dsn(DSN)} ({why}); start one with: sudo bash .ci/postgres"


_DOWN = _server()
_CI = os.environ.get("CI") == "true"  # CI starts a server (.ci/run): there, none is a failure, not a skip
pytestmark = pytest.mark.skipif(bool(_DOWN) and not _CI, reason=_DOWN)


@pytest.fixture(autouse=True)
def _server_up() -> None:
    if _DOWN:
        pytest.fail(f"CI runs the PostgreSQL tests, and {_DOWN}")


def sql(statement: str, *args: Any) -> List[Any]:
    with psycopg.connect(DSN, autocommit=True) as conn:
        cur = conn.execute(statement, args or None)
        return cur.fetchall() if cur.description else []


@pytest.fixture
def table() -> Iterator[str]:
    """A fresh table (id, user, v), dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    sql(f'CREATE TABLE public.{name} (id bigint NOT NULL, "user" int, v double precision CHECK (v >= 0), note text)')
    yield name
    sql(f"DROP TABLE IF EXISTS public.{name}")


def _records(n: int) -> List[dict]:
    return [{"id": i, "user": i % 7, "v": float(i), "note": f"n{i}" if i % 5 else ""} for i in range(n)]


class FailOnce:
    def __init__(self, at: int) -> None:
        self.at, self.seen, self.fired, self.lock = at, 0, False, threading.Lock()

    def __call__(self, record: Any) -> Any:
        with self.lock:
            self.seen += 1
            if not self.fired and self.seen >= self.at:
                self.fired = True
                raise RuntimeError("injected failure")
        if record["id"] % 64 == 0:
            time.sleep(0.002)  # long enough for a few checkpoints
        return record


def _env(tmp_path: Any, parallelism: int = 2, **kwargs: Any) -> pe.StreamEnvironment:
    settings: dict = dict(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=15),
        checkpoint_storage=str(tmp_path / "ckpt"),
        restart_attempts=2,
        buffer_size=32,
        buffer_timeout_ms=1,
    )
    settings.update(kwargs)
    return pe.StreamEnvironment(**settings)


def _ids(name: str) -> Counter:
    return Counter(r[0] for r in sql(f"SELECT id FROM {name}"))


@pytest.mark.parametrize("parallelism", [1, 2])
def test_appends_exactly_once_across_a_failure(tmp_path: Any, table: str, parallelism: int) -> None:
    n = 3000
    env = _env(tmp_path, parallelism)
    sink = pe.sinks.PostgresSink(DSN, table)
    env.from_collection(_records(n)).rebalance().map(FailOnce(n // 2)).sink_to(sink)
    result = env.execute("pg-append")
    assert result.restarts == 1
    assert _ids(table) == Counter(range(n))
    rows = sql(f'SELECT id, "user", v, note FROM {table} WHERE id IN (5, 6) ORDER BY id')
    assert rows == [(5, 5, 5.0, ""), (6, 6, 6.0, "n6")]  # an empty string stays one, not NULL
    commits = sql("SELECT count(*), sum(rows) FROM pyengine.commits WHERE target = %s", f"public.{table}")
    assert commits[0][1] >= n  # every committed checkpoint recorded, with its rows
    assert sql("SELECT count(*) FROM pyengine.staged WHERE target = %s", f"public.{table}") == [(0,)]


def test_an_update_stream_upserts_the_latest_value_per_key(tmp_path: Any) -> None:
    name = f"u_{uuid.uuid4().hex[:12]}"
    sql(f"CREATE TABLE {name} (user_id bigint PRIMARY KEY, total bigint, n bigint, _seq bigint)")
    try:
        rows = pa.table({"user_id": [i % 13 for i in range(4000)], "amount": list(range(4000))})
        env = _env(tmp_path, 2)
        sink = pe.sinks.PostgresSink(DSN, name, key="user_id")
        stream = env.from_collection(rows).key_by("user_id")
        stream.aggregate(pe.agg.sum("amount", alias="total"), pe.agg.count(alias="n")).sink_to(sink)
        env.execute("pg-upsert")
        got = {r[0]: (r[1], r[2]) for r in sql(f"SELECT user_id, total, n FROM {name}")}
        want = {k: (sum(a for a in range(4000) if a % 13 == k), len(range(k, 4000, 13))) for k in range(13)}
        assert got == want
    finally:
        sql(f"DROP TABLE IF EXISTS {name}")


def test_a_row_the_table_cannot_take_fails_the_job_naming_row_and_column(tmp_path: Any, table: str) -> None:
    records = _records(50)
    records[37] = {"id": 37, "user": "not a number", "v": 1.0, "note": "x"}
    env = _env(tmp_path, 1, checkpointing=None)
    env.from_collection(records).sink_to(pe.sinks.PostgresSink(DSN, table))
    with pytest.raises(pe.JobFailedError) as info:
        env.execute("pg-bad")
    text = str(info.value)
    assert "RecordRejectedError" in text and "row {'id': 37, 'user': 'not a number'" in text, text
    assert "column 'user'" in text and "nothing of this checkpoint is committed" in text, text
    assert _ids(table) == Counter(), "a part of the failed checkpoint was committed"

    records = _records(20)
    records[4]["v"] = -1.0  # the CHECK constraint
    sink = pe.sinks.PostgresSink(DSN, table)
    sink.begin_run(RunInfo("j", "r1", "r1"))
    sink.recover(())
    with pytest.raises(RecordRejectedError, match=r"row \{'id': 4.*'v': -1.0.*check constraint"):
        sink.stage(0, 1, records)
    with pytest.raises(RecordRejectedError, match=r"column\(s\) \['extra'\]"):
        sink.stage(0, 1, [{"id": 1, "extra": 2}])
    assert _ids(table) == Counter()


def test_a_replayed_commit_is_skipped_and_recovery_commits_what_the_checkpoint_covers(table: str) -> None:
    sink = pe.sinks.PostgresSink(DSN, table)
    run = RunInfo("j", "run-a", "run-a")
    sink.begin_run(run)
    sink.recover(())
    sink.stage(0, 1, _records(10))
    sink.stage(1, 1, pa.table({"id": [100, 101], "v": [1.0, 2.0]}))
    sink.commit(1, 1)  # sink subtask 0 commits for all: the others have nothing to do
    assert _ids(table) == Counter()
    sink.commit(0, 1)  # both subtasks' rows, in one transaction
    sink.commit(0, 1)  # replayed: nothing moves
    assert _ids(table) == Counter([*range(10), 100, 101])
    records = sql("SELECT subtask, checkpoint, rows FROM pyengine.commits WHERE target = %s", f"public.{table}")
    assert sorted(records) == [(0, 1, 10), (1, 1, 2)]
    sink.stage(0, 2, [{"id": 10}])  # checkpoint 2 completed, its notification lost
    sink.stage(0, 3, [{"id": 11}])  # checkpoint 3 never completed
    # the restart restores checkpoint 2: its rows are committed, 3's dropped (they replay)
    again = pe.sinks.PostgresSink(DSN, table)
    again.begin_run(RunInfo("j", "run-a", "run-a", (("run-a", 2),)))
    again.recover([("run-a", 2)])
    assert _ids(table) == Counter([*range(10), 100, 101, 10])
    again.recover([("run-a", 2)])  # again: nothing more
    assert _ids(table) == Counter([*range(10), 100, 101, 10])
    assert sql("SELECT count(*) FROM pyengine.staged WHERE target = %s", f"public.{table}") == [(0,)]
    # a zombie of the failed attempt stages after recover: the new attempt's commit drops it
    sink.stage(0, 4, [{"id": 12}])
    again.stage(0, 5, [{"id": 13}])
    again.commit(0, 5)
    assert _ids(table) == Counter([*range(10), 100, 101, 10, 13])
    # and a late task of the older attempt, committing, leaves the newer attempt's staging alone
    again.stage(0, 6, [{"id": 14}])
    sink.commit(0, 6)
    assert _ids(table) == Counter([*range(10), 100, 101, 10, 13])
    again.commit(0, 6)
    assert _ids(table) == Counter([*range(10), 100, 101, 10, 13, 14])
    # restoring an older checkpoint than one already committed: refused, rows cannot be taken back
    with pytest.raises(pe.errors.OutputInUseError, match="does not cover"):
        again.recover([("run-a", 1)])


def test_a_row_that_fails_at_the_commit_fails_the_whole_checkpoint() -> None:
    """Two subtasks' rows of one checkpoint commit together: a key one of them repeats
    (a unique index the staging tables do not have) leaves none of them in the table."""
    name = f"q_{uuid.uuid4().hex[:12]}"
    sql(f"CREATE TABLE public.{name} (id bigint PRIMARY KEY, v double precision)")
    try:
        sink = pe.sinks.PostgresSink(DSN, f"public.{name}")
        sink.begin_run(RunInfo("j", "run-q", "run-q"))
        sink.recover(())
        sink.stage(0, 1, [{"id": 1, "v": 1.0}, {"id": 2, "v": 1.0}])
        sink.stage(1, 1, [{"id": 3, "v": 1.0}, {"id": 1, "v": 2.0}])
        with pytest.raises(RecordRejectedError, match=r"checkpoint 1's rows.*Key \(id\)=\(1\) already exists"):
            sink.commit(0, 1)
        assert _ids(f"public.{name}") == Counter(), "a part of the checkpoint was committed"
    finally:
        sql(f"DROP TABLE IF EXISTS public.{name}")


def test_a_lost_connection_is_opened_again_and_an_unreachable_server_fails_clearly(table: str) -> None:
    sink = pe.sinks.PostgresSink(DSN, table)
    sink.begin_run(RunInfo("j", "run-b", "run-b"))
    sink.recover(())
    sink.stage(0, 1, _records(5))
    pid = sink._conns[0].info.backend_pid
    sql("SELECT pg_terminate_backend(%s)", pid)
    sink.commit(0, 1)
    assert _ids(table) == Counter(range(5))

    down = pe.sinks.PostgresSink("postgresql://pyengine:pyengine@127.0.0.1:1/none", table, retries=1)
    with pytest.raises(ConnectionError, match=r"failed 2 times.*server is up") as info:
        down.begin_run(RunInfo("j", "run-c", "run-c"))
    assert "pyengine:pyengine" not in str(info.value), "the password is not in messages"


def test_a_missing_table_or_key_index_is_refused_when_the_run_begins(table: str) -> None:
    with pytest.raises(NonRetryableError, match="there is no table 'nope' on the search_path"):
        pe.sinks.PostgresSink(DSN, "nope").begin_run(RunInfo("j", "r", "r"))
    with pytest.raises(NonRetryableError, match="needs a primary key or unique index"):
        pe.sinks.PostgresSink(DSN, table, key="id").begin_run(RunInfo("j", "r", "r"))
    with pytest.raises(NonRetryableError, match=r"key column\(s\) \['nokey'\]"):
        pe.sinks.PostgresSink(DSN, table, key=["nokey"]).begin_run(RunInfo("j", "r", "r"))


KILLED = textwrap.dedent(
    """
    import os, sys, time
    import pyengine as pe
    seen = [0]

    def step(r):
        seen[0] += 1
        if {kill} and seen[0] >= {at} and any("_metadata" in f for _, _, f in os.walk({storage!r})):
            os._exit(9)
        if seen[0] % 50 == 0:
            time.sleep(0.002)
        return r

    env = pe.StreamEnvironment(
        parallelism={parallelism}, checkpointing=pe.CheckpointConfig(interval_ms={interval}, unaligned={unaligned}),
        checkpoint_storage={storage!r}, state_backend={backend!r}, restart_attempts=0, buffer_size=64,
        buffer_timeout_ms=1,
    )
    stream = env.read_delta({delta!r}).map(step)
    if {upsert}:
        stream = stream.map(lambda r: {{"user_id": r["id"] % 97, "id": r["id"]}}).key_by("user_id")
        stream = stream.process(Count()).uid("count")
        sink = pe.sinks.PostgresSink({dsn!r}, {table!r}, key="user_id")
    else:
        stream = stream.map(lambda r: {{"id": r["id"], "v": float(r["id"])}})
        sink = pe.sinks.PostgresSink({dsn!r}, {table!r})
    stream.sink_to(sink)
    env.execute("killed")
    """
)

COUNT_FUNCTION = textwrap.dedent(
    """
    class Count(pe.KeyedProcessFunction):
        def open(self, ctx):
            self.n = ctx.get_state(pe.ValueStateDescriptor("n", 0))

        def process_element(self, value, ctx):
            n = self.n.value() + 1
            self.n.update(n)
            yield dict(user_id=ctx.current_key, n=n, last=value["id"])  # no braces: the script is format()ted
    """
)


# Two seeds in the fast tier, the others in the slow one.
@pytest.mark.parametrize("seed", [s if s < 2 else pytest.param(s, marks=pytest.mark.slow) for s in range(8)])
def test_killed_and_run_again_the_table_holds_what_a_failure_free_run_writes(tmp_path: Any, seed: int) -> None:
    """kill -9 mid-run (after a checkpoint completed), then the same job again: it
    resumes from its checkpoint, and the table holds what a failure-free run writes:
    each row of a batch read of the Delta table once (append), or each key's final
    count (upsert of a keyed update stream)."""
    import random

    deltalake = pytest.importorskip("deltalake")
    rng = random.Random(seed)
    upsert = seed % 2 == 1
    delta = str(tmp_path / "delta")
    for v in range(4):
        deltalake.write_deltalake(delta, pa.table({"id": list(range(v * 1500, (v + 1) * 1500))}), mode="append")
    if rng.random() < 0.5:
        deltalake.DeltaTable(delta).optimize.compact()  # a version the stream skips
    name = f"k_{uuid.uuid4().hex[:12]}"
    if upsert:
        sql(f"CREATE TABLE public.{name} (user_id bigint PRIMARY KEY, n bigint, last bigint)")
    else:
        sql(f"CREATE TABLE public.{name} (id bigint NOT NULL, v double precision)")
    args = dict(
        storage=str(tmp_path / "ckpt"),
        dsn=DSN,
        table=f"public.{name}",
        delta=delta,
        at=rng.randrange(1000, 5000),
        parallelism=rng.choice([1, 2]),
        interval=rng.choice([10, 20, 40]),
        unaligned=rng.random() < 0.5,
        backend=rng.choice(["heap", "incremental"]),
        upsert=upsert,
    )
    script = KILLED.replace("stream = env.read_delta", COUNT_FUNCTION + "\nstream = env.read_delta")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script.format(kill=True, **args)], capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 9, proc.stderr[-2000:]
        proc = subprocess.run(
            [sys.executable, "-c", script.format(kill=False, **args)], capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "resuming run" in proc.stderr, proc.stderr[-2000:]
        ids = deltalake.DeltaTable(delta).to_pyarrow_table().column("id").to_pylist()
        if upsert:
            got = {r[0]: r[1] for r in sql(f"SELECT user_id, n FROM public.{name}")}
            assert got == dict(Counter(i % 97 for i in ids)), args
        else:
            assert _ids(name) == Counter(ids), args
    finally:
        sql(f"DROP TABLE IF EXISTS public.{name}")


def test_worker_processes_read_delta_and_write_postgres(tmp_path: Any, table: str) -> None:
    """Both connectors travel to worker processes (pickled without their connections,
    readers or locks) and work there."""
    deltalake = pytest.importorskip("deltalake")
    delta = str(tmp_path / "delta")
    for v in range(3):
        deltalake.write_deltalake(delta, pa.table({"id": list(range(v * 400, (v + 1) * 400))}), mode="append")
    env = _env(tmp_path, 2, executor="processes")
    env.read_delta(delta).map(lambda r: {"id": r["id"], "v": 1.0}).sink_to(pe.sinks.PostgresSink(DSN, table))
    env.execute("processes")
    assert _ids(table) == Counter(range(1200))


def test_records_of_every_shape_go_in_as_they_are(monkeypatch: Any) -> None:
    """Dicts whose keys differ from row to row (every column kept, not the first row's),
    mixed and nested values (row by row: JSON into jsonb, lists into arrays), Arrow
    batches of temporal and decimal types; and the commit table keeps only the newest."""
    import datetime
    import decimal

    from pyengine.connectors import postgres

    name = f"s_{uuid.uuid4().hex[:12]}"
    sql(
        f"CREATE TABLE public.{name} (id bigint, a text, b double precision, doc jsonb, tags int[], "
        "at timestamptz, day date, price numeric(10, 2))"
    )
    try:
        monkeypatch.setattr(postgres, "KEPT_COMMITS", 2)
        sink = pe.sinks.PostgresSink(DSN, f"public.{name}")
        sink.begin_run(RunInfo("j", "run-s", "run-s"))
        sink.recover(())
        sink.stage(0, 1, [{"id": 1, "a": "x"}, {"id": 2, "b": 2.5}, {"b": 3, "id": 3, "a": None}])
        sink.stage(0, 2, [{"id": 4, "doc": {"k": [1, "two"]}, "tags": [1, 2]}, {"id": 5, "a": 7}])
        at = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.timezone.utc)
        batch = pa.record_batch(
            {
                "id": pa.array([6], pa.int64()),
                "at": pa.array([at], pa.timestamp("us", tz="UTC")),
                "day": pa.array([datetime.date(2026, 1, 2)], pa.date32()),
                "price": pa.array([decimal.Decimal("12.34")], pa.decimal128(10, 2)),
            }
        )
        sink.stage(0, 3, batch)
        for c in range(4, 8):
            sink.stage(0, c, [{"id": 100 + c}])
        sink.commit(0, 7)
        rows = {r[0]: r[1:] for r in sql(f"SELECT id, a, b, doc, tags, at, day, price FROM public.{name}")}
        assert rows[1][:2] == ("x", None) and rows[2][:2] == (None, 2.5) and rows[3][:2] == (None, 3.0)
        assert rows[4][2:4] == ({"k": [1, "two"]}, [1, 2]) and rows[5][0] == "7"
        assert rows[6][4:] == (at, datetime.date(2026, 1, 2), decimal.Decimal("12.34"))
        kept = sql("SELECT checkpoint FROM pyengine.commits WHERE target = %s ORDER BY 1", f"public.{name}")
        assert [k[0] for k in kept] == [5, 6, 7]
    finally:
        sql(f"DROP TABLE IF EXISTS public.{name}")
