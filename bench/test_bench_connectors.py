"""The Delta source and the PostgreSQL sink (issue #42), as users run them: default
settings, checkpoints on (``CheckpointConfig()``: every 500 ms), parallelism 2.

- **Delta source**: ``env.read_delta(table)`` against ``env.read_files`` over the same
  parquet files (the table's own, ``_delta_log`` skipped as read_files skips ``_``
  names), into a ``DiscardSink``; the two jobs alternate, best of ``ROUNDS`` each.
  Target: rows/s >= ``DELTA_TARGET`` x read_files'.
- **PostgreSQL sink, throughput**: parquet files read at p=2 into ``PostgresSink`` (append,
  a checkpoint every 500 ms, so every row goes through stage and commit), a realistic
  row (ids, a key, a float, a short string). Target: >= ``PG_TARGET`` rows/s. Beside it,
  the same rows as Python dicts (``map`` to dicts first), reported.
- **PostgreSQL sink, one checkpoint**: ``stage`` + ``commit`` of ``COMMIT_ROWS`` rows
  against a plain ``COPY`` of the same rows (the same CSV) into a table like the target,
  alternately, best of ``ROUNDS`` + 2. Target: stage + commit <= ``COMMIT_TARGET`` x COPY
  (the rows are written twice, into the staging table and then the target, so ~1.5x is
  the floor; the commit alone, on notify-complete, is reported: ~0.6x).

Needs a PostgreSQL (``sudo bash .ci/postgres``; ``PYENGINE_TEST_PG_DSN``): the sink rows
skip without one. Sizes: ``PYENGINE_BENCH_CONNECTOR_ROWS`` (default 1,000,000 rows per run)."""

from __future__ import annotations

import io
import os
import tempfile
import time
import uuid
from typing import Any, Callable, List

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
from conftest import SUMMARY, measured_again

import pyengine as pe
from pyengine.sinks import RunInfo

deltalake = pytest.importorskip("deltalake")

ROWS = int(os.environ.get("PYENGINE_BENCH_CONNECTOR_ROWS", 1_000_000))
FILES = 8
ROUNDS = 3
DELTA_TARGET = 0.8
PG_TARGET = 100_000
COMMIT_ROWS = 200_000
COMMIT_TARGET = 2.0
DSN = os.environ.get("PYENGINE_TEST_PG_DSN", "postgresql://pyengine:pyengine@127.0.0.1:5432/pyengine_test")


def _rows(first: int, n: int) -> pa.Table:
    ids = np.arange(first, first + n, dtype=np.int64)
    rng = np.random.default_rng(first)
    return pa.table(
        {
            "id": ids,
            "user": (rng.zipf(1.3, n) % 10_000).astype(np.int64),  # hot keys
            "amount": rng.random(n) * 100,
            "country": pa.array(np.array(["de", "fr", "us", "jp", "br"])[ids % 5]),
        }
    )


@pytest.fixture(scope="module")
def delta_table() -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="pyengine-bench-delta-"), "t")
    per = ROWS // FILES
    for f in range(FILES):
        deltalake.write_deltalake(path, _rows(f * per, per), mode="append")
    return path


def _env() -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(),
        checkpoint_storage=tempfile.mkdtemp(prefix="pyengine-bench-conn-ckpt-"),
    )


def _timed(build: Callable[[pe.StreamEnvironment], Any]) -> float:
    env = _env()
    build(env)
    start = time.perf_counter()
    env.execute("bench")
    return time.perf_counter() - start


def test_delta_source_against_read_files(benchmark: Any, delta_table: str) -> None:
    def delta(env: pe.StreamEnvironment) -> None:
        env.read_delta(delta_table).sink_to(pe.sinks.DiscardSink())

    def files(env: pe.StreamEnvironment) -> None:
        env.read_files(delta_table).sink_to(pe.sinks.DiscardSink())

    baseline: List[float] = []
    runs: List[float] = []
    _timed(delta)  # warm: the first job of a process pays for imports and pools

    def round_() -> None:
        runs.append(_timed(delta))

    benchmark.pedantic(round_, setup=lambda: baseline.append(_timed(files)), rounds=ROUNDS, iterations=1)

    def again() -> float:
        baseline.append(_timed(files))
        runs.append(_timed(delta))
        return min(baseline) / min(runs)

    ratio, n = measured_again(min(baseline) / min(runs), DELTA_TARGET, again)
    benchmark.extra_info.update(
        rows_per_s=ROWS / min(runs), read_files_rows_per_s=ROWS / min(baseline), ratio=ratio, measured_again=n
    )
    SUMMARY.append(
        f"read_delta: {ROWS / min(runs):,.0f} rows/s, read_files over the same files {ROWS / min(baseline):,.0f} "
        f"rows/s: {ratio:.2f}x (target >= {DELTA_TARGET}x)"
    )
    assert ratio >= DELTA_TARGET, f"read_delta at {ratio:.2f}x read_files' rows/s"


def _pg() -> Any:
    psycopg = pytest.importorskip("psycopg")
    try:
        conn = psycopg.connect(DSN, autocommit=True, connect_timeout=3)
    except Exception as exc:
        from pyengine.connectors.postgres import _safe_dsn

        why = " ".join(str(exc).split())[:160]
        pytest.skip(f"no PostgreSQL at {_safe_dsn(DSN)} ({why}); start one with: sudo bash .ci/postgres")
    return conn


@pytest.fixture
def pg_table() -> Any:
    conn = _pg()
    name = f"bench_{uuid.uuid4().hex[:10]}"
    conn.execute(f'CREATE TABLE public.{name} (id bigint, "user" bigint, amount double precision, country text)')
    yield conn, name
    conn.execute(f"DROP TABLE IF EXISTS public.{name}")
    conn.execute(f"DROP TABLE IF EXISTS public.{name}_copy")
    conn.close()


@pytest.mark.parametrize("records", ["arrow", "dicts"])
def test_postgres_sink_rows_per_second(benchmark: Any, delta_table: str, pg_table: Any, records: str) -> None:
    conn, name = pg_table
    rates: List[float] = []

    def build(env: pe.StreamEnvironment) -> None:
        stream = env.read_files(delta_table)
        if records == "dicts":
            stream = stream.map(lambda r: {"id": r["id"], "user": r["user"], "amount": r["amount"], "country": "x"})
        stream.sink_to(pe.sinks.PostgresSink(DSN, name))

    def round_() -> None:
        conn.execute(f"TRUNCATE public.{name}")
        rates.append(ROWS / _timed(build))

    benchmark.pedantic(round_, rounds=ROUNDS, iterations=1)
    assert conn.execute(f"SELECT count(*) FROM public.{name}").fetchone()[0] == ROWS
    best = max(rates)
    benchmark.extra_info.update(rows_per_s=best)
    SUMMARY.append(f"PostgresSink ({records}, p=2, checkpoints every 500 ms): {best:,.0f} rows/s")
    if records == "arrow":
        assert best >= PG_TARGET, f"PostgresSink at {best:,.0f} rows/s"


def test_postgres_checkpoint_commit_against_a_plain_copy(benchmark: Any, pg_table: Any) -> None:
    conn, name = pg_table
    conn.execute(f"CREATE TABLE public.{name}_copy (LIKE public.{name})")
    rows = _rows(0, COMMIT_ROWS)
    sink = pe.sinks.PostgresSink(DSN, name)
    sink.begin_run(RunInfo("bench", uuid.uuid4().hex, uuid.uuid4().hex))
    sink.recover(())
    copies: List[float] = []
    commits: List[float] = []
    commit_only: List[float] = []
    checkpoint = [0]

    def plain_copy() -> None:
        start = time.perf_counter()
        buf = io.BytesIO()
        pacsv.write_csv(rows, buf, pacsv.WriteOptions(include_header=False, batch_size=65536))
        with conn.transaction(), conn.cursor() as cur:
            with cur.copy(f'COPY public.{name}_copy (id, "user", amount, country) FROM STDIN (FORMAT csv)') as copy:
                copy.write(buf.getbuffer())
        copies.append(time.perf_counter() - start)

    def checkpoint_() -> None:
        checkpoint[0] += 1
        start = time.perf_counter()
        sink.stage(0, checkpoint[0], rows)
        middle = time.perf_counter()
        sink.commit(0, checkpoint[0])
        commits.append(time.perf_counter() - start)
        commit_only.append(time.perf_counter() - middle)

    benchmark.pedantic(checkpoint_, setup=plain_copy, rounds=ROUNDS + 2, iterations=1)

    def again() -> float:
        plain_copy()
        checkpoint_()
        return min(copies) / min(commits)

    inverse, n = measured_again(min(copies) / min(commits), 1 / COMMIT_TARGET, again, times=3)
    ratio = 1 / inverse
    sink.close()
    benchmark.extra_info.update(
        stage_commit_s=min(commits), commit_s=min(commit_only), copy_s=min(copies), ratio=ratio, measured_again=n
    )
    SUMMARY.append(
        f"PostgresSink stage+commit of {COMMIT_ROWS:,} rows {min(commits) * 1e3:.0f} ms, a plain COPY "
        f"{min(copies) * 1e3:.0f} ms: {ratio:.2f}x (target <= {COMMIT_TARGET}x); the commit alone (on notify) "
        f"{min(commit_only) * 1e3:.0f} ms, {min(commit_only) / min(copies):.2f}x"
    )
    assert ratio <= COMMIT_TARGET, f"a checkpoint's stage+commit takes {ratio:.2f}x a plain COPY"
