"""The per-record interval join's buffers (issue #43): kept by entry in the keyed
backend, checkpointed in segments (each buffered record encoded once, in bulk),
never copied whole on a read after a checkpoint, and cleaned per key once per
watermark advance. Checked against the brute-force answer; a savepoint written by
the release before (one value per key, ``{timestamp: [records]}``) still restores,
at its parallelism and rescaled."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from test_joins import Pairs, env_for, interval_reference, side, strategy
from test_windows_lateness import Held

import pyengine as pe

FIXTURE = Path(__file__).parent / "data" / "savepoint-interval-join-v1"
FIRST_RUN = Path(__file__).parent / "data" / "savepoint-interval-join-v1.first-run.json"
LEFT = side(400, 11, 2, 5, 31, 0)
RIGHT = side(400, 11, 2, 5, 32, 100_000)
HOLD = 120  # records per split (of 2) before the savepoint
LOWER, UPPER = -40, 40


def join_job(parallelism: int, release: threading.Event, sink: Any, storage: Path) -> pe.StreamEnvironment:
    env = env_for(
        parallelism,
        "heap",
        checkpointing=pe.CheckpointConfig(interval_ms=50),
        checkpoint_storage=str(storage / f"ckpt{parallelism}"),
    )
    a = env.from_source(Held(LEFT, HOLD, release), name="left", watermark_strategy=strategy(5)).uid("left")
    b = env.from_source(Held(RIGHT, HOLD, release), name="right", watermark_strategy=strategy(5)).uid("right")
    joined = a.key_by("k").interval_join(b.key_by("k")).between(LOWER, UPPER)
    joined.process(Pairs()).uid("join").sink_to(sink)
    return env


def test_a_savepoint_of_the_old_buffer_layout_restores_exactly(tmp_path: Path) -> None:
    """``savepoint-interval-join-v1`` (made by ``tests/data/make_join_savepoint.py`` at
    e145a3c): buffers of both sides mid-join. Resumed at 2 (its parallelism) and at 3
    (rescaled by key group), the pairs of both runs are exactly the brute-force ones."""
    first = Counter(tuple(r) for r in json.loads(FIRST_RUN.read_text()))
    expected = interval_reference(LEFT, RIGHT, LOWER, UPPER)
    assert 0 < sum(first.values()) < sum(expected.values()), "the fixture was taken mid-join"
    for parallelism in (2, 3):
        released = threading.Event()
        released.set()
        sink = pe.sinks.CollectSink()
        result = join_job(parallelism, released, sink, tmp_path).execute(
            f"join-v1-at-{parallelism}", restore_from=str(FIXTURE)
        )
        assert result.status == "FINISHED", result.cause
        assert first + Counter(tuple(r) for r in sink.records) == expected
