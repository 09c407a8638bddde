"""The ``transformWithState`` adapter with Spark's semantics (micro-batches kept), at
the issue's shape: 200,000 rows (dicts from Python) over 2,000 keys, default settings
with checkpoints on (``CheckpointConfig()``: every 500 ms), two subtasks.

1. The running count through the adapter, both flavours, a row each: whole jobs (wall
   seconds, best of three, start-up included) and the steady-state rate, which leaves
   the start-up out as Spark's figure does: the rows over the difference between the
   whole job and the same job on ``SMALL`` rows (each the best of three, interleaved),
   so a job's start-up and end count nowhere. The pandas flavour is also compared with
   the same processor given a DataFrame per key per input buffer (``micro_batch=False``,
   what it did before; on a fifth of the rows, it runs ~6 k rows/s): kept micro-batches
   remove the per-buffer pandas cost, asserted as a ratio (>= ``PANDAS_GUARD``).
2. Opt-in (``PYENGINE_BENCH_SPARK_TWS=1``, minutes): the same processors through Spark's
   own ``transformWithState`` and ``transformWithStateInPandas`` (``local[2]``, RocksDB,
   the same rows as ``SPARK_BATCHES`` micro-batches of parquet), in the same run. Spark's
   steady state is its best micro-batch (``triggerExecution``; the first, which carries
   the query's start-up, left out), ours the steady-state rate above: both without
   start-up. The issue's targets are asserted on these: the adapter at >= 100x Spark's
   Row flavour and >= 30x its pandas flavour. Both whole runs (Spark's query from
   ``start()`` to its end, our whole job) are reported beside them."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Dict, List

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from conftest import SUMMARY, measured_again
from test_bench_tws import RunningCount, RunningCountPandas, _spark_rows_per_s, spark  # noqa: F401

import pyengine as pe

ROWS = 200_000
KEYS = 2_000
SMALL = 1  # the job whose time is taken off for the steady-state rate: the start-up alone
# (a job on one row; one on a fraction of the rows would take off per-key calls too, and the
# pandas flavour's time is mostly per key: 50,000 rows over 2,000 keys take as long as 200,000)
SPARK_BATCHES = 4  # of ROWS // SPARK_BATCHES rows each; the first is left out
PANDAS_GUARD = 3.0  # kept micro-batches against a DataFrame per key per buffer: measured 3-5x on
# 20,000 rows, where the kept job is mostly its start-up (0.5 s), more on 40,000; 30x on 200,000
ROW_TARGET, PANDAS_TARGET = 100.0, 30.0

_WALL: Dict[str, List[float]] = {}


@pytest.fixture(scope="module")
def rows() -> List[Dict[str, Any]]:
    users = np.random.default_rng(11).integers(0, KEYS, ROWS).tolist()
    return [{"user": u, "v": i} for i, u in enumerate(users)]


def _job(records: List[Dict[str, Any]], flavour: str, micro_batch: bool = True) -> float:
    """One job's wall seconds: default settings, checkpoints on, the output discarded."""
    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(), checkpoint_storage=tempfile.mkdtemp(prefix="tws-bench-")
    )
    keyed = env.from_collection(records).key_by("user")
    if flavour == "row":
        out = keyed.transform_with_state(RunningCount(), "user bigint, count bigint", micro_batch=micro_batch)
    else:
        out = keyed.transform_with_state_in_pandas(
            RunningCountPandas(), "user bigint, count bigint", micro_batch=micro_batch
        )
    out.sink_to(pe.sinks.DiscardSink())
    start = time.perf_counter()
    result = env.execute(f"tws-batches-{flavour}")
    assert result.status == "FINISHED"
    return time.perf_counter() - start


def _adapter_rows_per_s(records: List[Dict[str, Any]], flavour: str) -> float:
    """Whole jobs: the rows over the best of three, start-up included."""
    while len(_WALL.get(flavour, ())) < 3:
        _WALL.setdefault(flavour, []).append(_job(records, flavour))
    return len(records) / min(_WALL[flavour])


def _steady_rows_per_s(records: List[Dict[str, Any]], flavour: str) -> float:
    """The steady-state rate: the rows past ``SMALL`` over what they add to a job (the
    best whole job less the best job on the first ``SMALL`` rows, three of each,
    interleaved): start-up, the first checkpoint's set-up and the end count nowhere."""
    small = f"{flavour}/small"
    while len(_WALL.get(small, ())) < 3 or len(_WALL.get(flavour, ())) < 3:
        _WALL.setdefault(small, []).append(_job(records[:SMALL], flavour))
        _WALL.setdefault(flavour, []).append(_job(records, flavour))
    return (len(records) - SMALL) / max(min(_WALL[flavour]) - min(_WALL[small]), 1e-9)


@pytest.mark.parametrize("flavour", ["row", "pandas"], ids=["transform_with_state", "transform_with_state_in_pandas"])
def test_the_adapter_with_sparks_micro_batches(benchmark: Any, rows: List[Dict[str, Any]], flavour: str) -> None:
    benchmark.group = "tws: Spark's semantics, 200 k rows / 2,000 keys"
    benchmark.pedantic(lambda: _WALL.setdefault(flavour, []).append(_job(rows, flavour)), rounds=3)
    rate = len(rows) / min(_WALL[flavour])
    steady = _steady_rows_per_s(rows, flavour)
    benchmark.extra_info["rows_per_s"] = rate
    benchmark.extra_info["steady_rows_per_s"] = steady
    figures = f"{rate / 1e3:.0f} k rows/s whole jobs, {steady / 1e3:.0f} k rows/s steady state (best of 3)"
    if flavour == "row":
        SUMMARY.append(f"tws adapter, Spark's micro-batches, Row flavour: {figures}")
        return
    # The pandas flavour per input buffer, on a fifth of the rows (it runs ~6 k rows/s),
    # interleaved with the kept micro-batches on the same fifth.
    part = rows[: len(rows) // 5]
    per_buffer: List[float] = []
    kept: List[float] = []

    def again() -> float:
        per_buffer.append(_job(part, "pandas", micro_batch=False))
        kept.append(_job(part, "pandas"))
        return min(per_buffer) / min(kept)

    ratio = again()
    ratio, n = measured_again(ratio, PANDAS_GUARD, again)
    SUMMARY.append(
        f"tws adapter, Spark's micro-batches, pandas flavour: {figures}; "
        f"{ratio:.0f}x a DataFrame per key per buffer on {len(part):,} rows (guard >= {PANDAS_GUARD:.0f}x"
        f"{f', measured again {n}x' if n else ''})"
    )
    assert ratio >= PANDAS_GUARD, f"micro-batches only {ratio:.1f}x the per-buffer pandas flavour"


@pytest.fixture(scope="module")
def spark_batches(rows: List[Dict[str, Any]]) -> str:
    """The same rows as Spark reads them: SPARK_BATCHES parquet files, one per micro-batch."""
    import pyarrow.parquet as pq

    folder = tempfile.mkdtemp(prefix="pyengine-bench-tws-batches-")
    size = len(rows) // SPARK_BATCHES
    for b in range(SPARK_BATCHES):
        part = rows[b * size : (b + 1) * size]
        table = pa.table({"user": [r["user"] for r in part], "v": [r["v"] for r in part]}, schema=pa.schema(
            [("user", pa.int64()), ("v", pa.int64())]
        ))  # fmt: skip
        pq.write_table(table, os.path.join(folder, f"batch-{b:03d}.parquet"))
    return folder


@pytest.mark.skipif(
    os.environ.get("PYENGINE_BENCH_SPARK_TWS") != "1",
    reason="opt-in (PYENGINE_BENCH_SPARK_TWS=1): Spark's transformWithState runs a few thousand rows/s here, minutes",
)
def test_the_adapter_against_sparks_own_at_200k_rows_2000_keys(
    benchmark: Any,
    spark: Any,  # noqa: F811
    spark_batches: str,
    rows: List[Dict[str, Any]],
) -> None:
    benchmark.group = "tws: Spark's semantics, 200 k rows / 2,000 keys"
    theirs: Dict[str, float] = {}
    theirs_whole: Dict[str, float] = {}

    def measure() -> None:
        for flavour in ("row", "pandas"):
            theirs[flavour] = _spark_rows_per_s(
                spark,
                spark_batches,
                flavour,
                False,
                rows=len(rows) // SPARK_BATCHES,
                batches=SPARK_BATCHES,
                whole=theirs_whole,
            )

    benchmark.pedantic(measure, rounds=1)
    ratios: Dict[str, float] = {}

    def again() -> float:
        for flavour in ("row", "pandas"):
            _WALL.setdefault(f"{flavour}/small", []).append(_job(rows[:SMALL], flavour))
            _WALL.setdefault(flavour, []).append(_job(rows, flavour))
        return margin()

    def margin() -> float:
        for flavour in ("row", "pandas"):
            ratios[flavour] = _steady_rows_per_s(rows, flavour) / theirs[flavour]
        return min(ratios["row"] / ROW_TARGET, ratios["pandas"] / PANDAS_TARGET)

    _, n = measured_again(margin(), 1.0, again)

    def figures(flavour: str, target: float) -> str:
        ours, whole = _steady_rows_per_s(rows, flavour), _adapter_rows_per_s(rows, flavour)
        return (
            f"{ours / 1e3:.0f} k rows/s against {theirs[flavour]:,.0f} -> {ratios[flavour]:.0f}x (target >= "
            f"{target:.0f}x); whole runs {whole / 1e3:.0f} k against {theirs_whole[flavour]:,.0f} -> "
            f"{whole / theirs_whole[flavour]:.0f}x"
        )

    line = (
        f"tws adapter vs Spark's own at {len(rows):,} rows / {KEYS:,} keys (Spark: local[2], RocksDB, "
        f"{SPARK_BATCHES} micro-batches; steady state, both without start-up): Row {figures('row', ROW_TARGET)}; "
        f"pandas {figures('pandas', PANDAS_TARGET)}" + (f", measured again {n}x" if n else "")
    )
    SUMMARY.append(line)
    assert ratios["row"] >= ROW_TARGET and ratios["pandas"] >= PANDAS_TARGET, line
