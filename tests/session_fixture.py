"""The job of ``tests/data/savepoint-session-windows`` (written by
``tests/data/make_session_savepoint.py`` with a release before the vectorised session
operator, restored by test_session_windows with this one): session-window aggregates
over a held source, keyed by an int column and by a str column. Imports nothing that
release lacks."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Dict, List

from test_windows import make_records
from test_windows_lateness import Held

import pyengine as pe

SESSION_FIXTURE = Path(__file__).parent / "data" / "savepoint-session-windows"
HELD = 150  # records per split (of 2) before the savepoint
GAP = 15
RECORDS: List[Dict[str, Any]] = [{**r, "name": f"user-{r['k']}"} for r in make_records(600, 11, 2, 8, 5)]
AGGS = (pe.agg.count(), pe.agg.sum("v"), pe.agg.min("v"), pe.agg.max("v"), pe.agg.mean("v"))


def session_job(
    tmp: Path, parallelism: int, release: threading.Event, ints: Any, strs: Any, by_function: bool = False
) -> pe.StreamEnvironment:
    """``by_function``: keys by functions (the per-record WindowOperator, the reference)."""
    env = pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=50),
        checkpoint_storage=str(tmp / f"ckpt{parallelism}"),
        auto_watermark_interval_ms=1,
    )
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(8).with_timestamp_assigner("ts")
    stream = env.from_source(Held(RECORDS, HELD, release), watermark_strategy=strategy).uid("held")
    for column, sink in (("k", ints), ("name", strs)):
        keyed = stream.key_by((lambda r, c=column: r[c]) if by_function else column)
        keyed.window(pe.windows.session(GAP)).aggregate(*AGGS).uid(f"sessions-{column}").sink_to(sink)
    return env
