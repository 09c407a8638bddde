"""The defaults against hand-tuned buffer sizes (issue #40: "defaults that find the speed").

Two jobs a data engineer writes first, at parallelism 2 with checkpoints every second:

- **parquet-aggregate**: a keyed aggregate (``count``, two ``sum``s, a ``mean``) over
  ``PYENGINE_BENCH_DEFAULTS_ROWS`` (3 M) Parquet rows with hot keys (Zipf over 100,000 users),
  the file written in a tmp dir;
- **keyed-process**: a per-record ``KeyedProcessFunction`` over dicts from Python (a
  ``ValueState`` counter per key, hot keys, state that grows with the keys seen).

Each job runs at the engine's defaults (``buffer_size=None``: adaptive buffers that grow
while a channel is not latency-bound) and at ``buffer_size`` in ``SIZES``, interleaved:
each round of the row measures every tuned size (untimed, in the round's setup) and then
the defaults (the row's time). Figures are rows/s from the first record read to the end
(``pyengine.tune.measure``: the job's start is not counted). The target, asserted as a
ratio of figures of this run: the defaults reach >= 0.9x of the best tuned size's rows/s
(best of ``ROUNDS`` each; a miss is measured again, both sides, up to twice). The target is
reported; ``GUARD`` is asserted, a regression guard: before buffers grew, the defaults ran
the Parquet aggregate at 0.33-0.35x of ``buffer_size=262144``; with growth, 0.64-0.92x on
this shared 2-core machine (the ramp-up of the first ~100 ms weighs on a run of 0.5 s)."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SUMMARY, measured_again

import pyengine as pe
from pyengine.state import ValueStateDescriptor
from pyengine.tune import Setting, measure

ROWS = int(os.environ.get("PYENGINE_BENCH_DEFAULTS_ROWS", 3_000_000))
PROCESS_RECORDS = int(os.environ.get("PYENGINE_BENCH_DEFAULTS_PROCESS_RECORDS", 1_000_000))
ROUNDS = int(os.environ.get("PYENGINE_BENCH_DEFAULTS_ROUNDS", 3))
SIZES = (4096, 16384, 65536, 262144)
TARGET = 0.9
GUARD = 0.5
COUNT = ValueStateDescriptor("count", 0, pa.int64())


class Count(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        if n % 1000 == 0:  # emit sparsely: the state and the call are measured, not the sink
            yield (ctx.current_key, n)


def _parquet_aggregate(tmp: str) -> Tuple[Callable[[Any], None], int]:
    rng = np.random.default_rng(0)
    path = os.path.join(tmp, "clicks.parquet")
    users = (rng.zipf(1.3, ROWS) % 100_000).astype(np.int64)
    table = pa.table({"user": users, "a": rng.integers(0, 1000, ROWS), "b": rng.random(ROWS)})
    pq.write_table(table, path, row_group_size=1 << 20)

    def build(env: Any) -> None:
        (
            env.read_files(path)
            .key_by("user")
            .aggregate(
                pe.agg.count(), pe.agg.sum("a"), pe.agg.sum("b", alias="sum_b"), pe.agg.mean("b", alias="mean_b")
            )
            .uid("aggregate")
            .sink_to(pe.sinks.DiscardSink())
        )

    return build, ROWS


def _keyed_process(tmp: str) -> Tuple[Callable[[Any], None], int]:
    rng = np.random.default_rng(1)
    users = (rng.zipf(1.3, PROCESS_RECORDS) % 10_000).tolist()
    records = [{"user": u, "v": i} for i, u in enumerate(users)]

    def build(env: Any) -> None:
        env.from_collection(records).key_by("user").process(Count()).uid("count").sink_to(pe.sinks.DiscardSink())

    return build, PROCESS_RECORDS


JOBS = {"parquet-aggregate": _parquet_aggregate, "keyed-process": _keyed_process}


def _rate(build: Callable[[Any], None], size: Optional[int]) -> float:
    m = measure(build, Setting(buffer_size=size, interval_ms=1000))
    assert m.status == "FINISHED", m.status
    return m.throughput


@pytest.mark.parametrize("job", list(JOBS))
def test_defaults_against_the_best_tuned_buffer_size(benchmark, tmp_path, job: str) -> None:
    build, rows = JOBS[job](str(tmp_path))
    best: Dict[Optional[int], float] = {s: 0.0 for s in (None, *SIZES)}

    def tuned_round() -> None:  # the round's setup: every tuned size, untimed
        for size in SIZES:
            best[size] = max(best[size], _rate(build, size))

    def defaults_round() -> None:
        best[None] = max(best[None], _rate(build, None))

    benchmark.group = f"defaults-vs-tuned: {job}"
    benchmark.pedantic(defaults_round, setup=tuned_round, rounds=ROUNDS, iterations=1)

    def ratio() -> float:
        return best[None] / max(best[s] for s in SIZES)

    def again() -> float:
        tuned_round()
        defaults_round()
        return ratio()

    got, n = measured_again(ratio(), TARGET, again)
    top = max(SIZES, key=lambda s: best[s])
    benchmark.extra_info.update(
        {"defaults_rows_per_s": best[None], "defaults_to_best_tuned": got, "best_tuned_buffer_size": top}
        | {f"rows_per_s_at_{s}": best[s] for s in SIZES}
    )
    figures: List[str] = [f"{s:,}: {best[s] / 1e6:.2f}" for s in SIZES]
    SUMMARY.append(
        f"{job}, {rows:,} rows, p=2, checkpoints every 1 s: defaults {best[None] / 1e6:.2f} M rows/s, "
        f"buffer_size {'; '.join(figures)} M rows/s -> defaults {got:.2f}x of the best ({top:,}) "
        f"(target >= {TARGET}: {'met' if got >= TARGET else 'NOT MET'}; asserted >= {GUARD})"
        + (f" (measured again {n}x after a miss)" if n else "")
    )
    assert got >= GUARD, f"{job}: the defaults ran at {got:.2f}x of buffer_size={top:,} (guard >= {GUARD})"
