"""Randomized failure soak for event time: windows and timers, several failures per
run at random points (a record in the pipeline, a sink's commit, a keyed snapshot's
asynchronous part), random parallelism, backend and checkpoint alignment; the
committed output must equal the brute-force reference every time."""

from __future__ import annotations

import random
from typing import Any, List, Tuple

import pytest
from chaos import Chaos, ChaosSink
from test_timers import Buckets, buckets_reference
from test_windows import AGGS, make_records, reference, rows

import pyengine as pe
from pyengine.state import HeapKeyedStateBackend

SEEDS = range(10)


def _snapshot_chaos(monkeypatch: Any, chaos: Chaos) -> None:
    original = HeapKeyedStateBackend.snapshot

    def snapshot(self: Any, checkpoint_id: int, location: Any) -> Any:
        frozen = original(self, checkpoint_id, location)
        run = frozen.run

        def failing_run() -> Any:
            chaos.hit("snapshot")
            return run()

        frozen.run = failing_run
        return frozen

    monkeypatch.setattr(HeapKeyedStateBackend, "snapshot", snapshot)


def _env(rng: random.Random, tmp: Any, tag: str) -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=rng.randint(1, 4),
        checkpointing=pe.CheckpointConfig(interval_ms=rng.choice([5, 15, 40]), unaligned=rng.random() < 0.5),
        state_backend=rng.choice(["heap", "incremental"]),
        checkpoint_storage=str(tmp / f"ckpt-{tag}"),
        buffer_size=rng.choice([8, 32]),
        buffer_timeout_ms=1,
        channel_capacity=2,
        restart_attempts=6,
        auto_watermark_interval_ms=rng.choice([1, 5]),
    )


def _plan(rng: random.Random, records: int) -> List[Tuple[str, int]]:
    points = [("record", rng.randrange(1, records)) for _ in range(rng.randint(1, 2))]
    points.append((rng.choice(["commit", "snapshot"]), rng.randint(1, 4)))
    return points


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_windows_stay_exact_under_random_failures(tmp_path: Any, monkeypatch: Any, seed: int) -> None:
    rng = random.Random(seed)
    assigner = rng.choice([pe.windows.tumbling(60), pe.windows.sliding(90, 30), pe.windows.session(20)])
    records = make_records(500, keys=9, step=2, jitter=20, seed=seed)
    chaos = Chaos(_plan(rng, len(records)))
    _snapshot_chaos(monkeypatch, chaos)
    env = _env(rng, tmp_path, "w")
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(20).with_timestamp_assigner("ts")

    def watch(record: Any) -> Any:
        chaos.hit("record")
        return record

    sink = ChaosSink(chaos)
    stream = env.from_generator(lambda i: records[i], len(records), watermark_strategy=strategy).map(watch)
    stream.key_by("k").window(assigner).aggregate(*AGGS).uid("windows").sink_to(sink)
    result = env.execute(f"soak-windows-{seed}")
    assert result.status == "FINISHED", result.cause
    assert chaos.fired, "no failure was injected: this run tested nothing"
    assert rows(result) == reference(records, assigner), (seed, assigner, chaos.fired)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_timers_stay_exact_under_random_failures(tmp_path: Any, monkeypatch: Any, seed: int) -> None:
    rng = random.Random(1000 + seed)
    records = make_records(500, keys=9, step=2, jitter=10, seed=seed)
    chaos = Chaos(_plan(rng, len(records)))
    _snapshot_chaos(monkeypatch, chaos)
    env = _env(rng, tmp_path, "t")
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(10).with_timestamp_assigner("ts")

    def watch(record: Any) -> Any:
        chaos.hit("record")
        return record

    sink = ChaosSink(chaos)
    stream = env.from_generator(lambda i: records[i], len(records), watermark_strategy=strategy).map(watch)
    stream.key_by("k").process(Buckets(40)).uid("buckets").sink_to(sink)
    result = env.execute(f"soak-timers-{seed}")
    assert result.status == "FINISHED", result.cause
    assert chaos.fired, "no failure was injected: this run tested nothing"
    assert sorted(result.records) == buckets_reference(records, 40), (seed, chaos.fired)
