"""A Delta table streamed into PostgreSQL, exactly once: clicks per user, upserted.

The script writes a Delta table of clicks in a few versions (appends, and an
``OPTIMIZE`` that the stream skips), then runs a job that reads it with
``env.read_delta`` while more versions are committed, counts clicks per user
(``aggregate``, an update stream) and upserts the totals into a PostgreSQL table with
``pe.sinks.PostgresSink(..., key="user_id")``. The job fails once on purpose halfway:
it restarts from its last checkpoint, and the totals in the database are still exact.

Needs deltalake and psycopg (``pip install ".[delta,postgres]"``) and a PostgreSQL
(``sudo bash .ci/postgres`` starts one for the default DSN).

    python examples/delta_to_postgres.py [--dsn DSN] [--versions N] [--rows-per-version N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from typing import Any, Dict

import deltalake
import psycopg
import pyarrow as pa

import pyengine as pe

DSN = os.environ.get("PYENGINE_TEST_PG_DSN", "postgresql://pyengine:pyengine@127.0.0.1:5432/pyengine_test")


def clicks(version: int, rows: int) -> pa.Table:
    first = version * rows
    return pa.table({"user_id": [(first + i) % 50 for i in range(rows)], "ms": [first + i for i in range(rows)]})


class FailOnce:
    """Fails the job once, after ``at`` batches: the restart must leave the totals exact."""

    def __init__(self, at: int) -> None:
        self.at, self.seen, self.lock = at, 0, threading.Lock()

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        with self.lock:
            self.seen += 1
            if self.seen == self.at:
                raise RuntimeError("a failure on purpose: the job restarts from its checkpoint")
        return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=DSN)
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--rows-per-version", type=int, default=20_000)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="pyengine-delta-to-pg-")
    table_path = os.path.join(work, "clicks")
    for v in range(args.versions // 2):
        deltalake.write_deltalake(table_path, clicks(v, args.rows_per_version), mode="append")
    deltalake.DeltaTable(table_path).optimize.compact()  # dataChange=false: read no row twice

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS public.clicks_per_user")
        conn.execute("CREATE TABLE public.clicks_per_user (user_id bigint PRIMARY KEY, clicks bigint, _seq bigint)")

    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=100),
        checkpoint_storage=os.path.join(work, "checkpoints"),
        restart_attempts=1,
    )
    (
        env.read_delta(table_path, starting_version=0, monitor_interval_ms=50)
        .map_batches(FailOnce(at=4))
        .key_by("user_id")
        .aggregate(pe.agg.count(alias="clicks"))
        .sink_to(pe.sinks.PostgresSink(args.dsn, "public.clicks_per_user", key="user_id"))
    )
    client = env.execute_async("delta-to-postgres")
    for v in range(args.versions // 2, args.versions):  # versions committed while the job runs
        time.sleep(0.2)
        deltalake.write_deltalake(table_path, clicks(v, args.rows_per_version), mode="append")

    total = args.versions * args.rows_per_version
    deadline = time.monotonic() + 120
    got: Dict[Any, Any] = {}
    while time.monotonic() < deadline:
        with psycopg.connect(args.dsn) as conn:
            got = dict(conn.execute("SELECT user_id, clicks FROM public.clicks_per_user").fetchall())
        if sum(got.values()) >= total:
            break
        time.sleep(0.2)
    client.cancel()
    result = client.wait(60)
    want = {u: sum(1 for i in range(total) if i % 50 == u) for u in range(50)}
    assert got == want, f"the totals in PostgreSQL differ from the clicks: {sum(got.values())} of {total}"
    print(
        f"{total} clicks over {args.versions} Delta versions -> {len(got)} users' totals in PostgreSQL, exact "
        f"after {result.restarts} restart(s) ({result.status})"
    )


if __name__ == "__main__":
    main()
