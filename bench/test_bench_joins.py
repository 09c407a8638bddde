"""Nexmark q4's join, as users write it first (issue #43, issue #40): auctions joined
with bids by auction id in an interval, a Python ``ProcessJoinFunction`` called per
pair, Python dicts from a generator source, a hot auction holding thousands of
buffered bids, parallelism 1, the engine's default settings, checkpoints every
second.

The events: one auction in 12 (``date_time`` + 1-10 s of ``expires``), the rest
bids, ten events per millisecond of event time; half the bids go to the hot auction
(a new one every 100 auctions), the others to one of the last 100 auctions. The
watermark trails by 500 ms, so the hot auction holds ~2,300 bids. The join pairs an
auction at ``t`` with its bids in ``[t, t + 10 s]``; the function keeps the bids
before the auction's end (q4's winning-bid candidates).

Measured, interleaved, best of ``ROUNDS`` each (a shared 2-core machine: the
process's CPU time is the figure, wall time is reported beside it):

- the join with checkpoints against the same job without them: the issue's target
  is checkpoints costing <= 15% of the events/s. Checkpoints are triggered by the
  wall clock, so on a loaded machine (a run stretched to twice its time) a run of
  the same work takes twice the checkpoints: the summary also gives the CPU time
  one checkpoint adds, per second of interval, which is the cost on a machine the
  job has to itself;
- the join with checkpoints against a plain ``map`` over the same two generators
  (union, a Python function per event, checkpoints every second): the issue's
  300 k events/s as a ratio against this machine's map (1.0-1.4 M events/s of CPU
  time measured here: 300 k is ~0.23 of it).

Targets are reported met or NOT MET in the summary; what is asserted are regression
guards under them (``COST_GUARD``, ``JOIN_VS_MAP_GUARD``), and the cyclic collector's
share of the join's CPU (``GC_SHARE_GUARD``). Measured here under a load average of 6-12
on the 2 cores, this file and the release before interleaved in the same runs:
checkpoints cost 17-25% (a checkpoint adds ~114 ms of CPU) and the join ran at 243-271 k
events/s with checkpoints, 316-352 k without, 0.20-0.235x the map, the collector 4-6% of
its CPU; the release before 19-24%, 233-256 k / 307-315 k, 0.186-0.193x, the collector
11-13% (7 full collections a run).

Reported, not asserted: the same join on Arrow batches with ``.project(...)`` (the
vectorised path the joins guide shows first), from the same events as tables.
``PYENGINE_BENCH_JOIN_EVENTS`` sets the events per run (default 600,000).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any, Callable, Dict, List, Tuple

import pyarrow as pa
import pytest
from conftest import SUMMARY, figure_clock

import pyengine as pe
from pyengine.joins import ProcessJoinFunction

EVENTS = int(os.environ.get("PYENGINE_BENCH_JOIN_EVENTS", 600_000))
ROUNDS = 3
COST_TARGET = 0.15  # checkpoints cost at most 15% of the join's events/s
COST_GUARD = 0.35
TARGET_EVENTS_PER_S = 300_000
JOIN_VS_MAP = 0.23  # 300 k events/s against this machine's plain map (1.2-1.4 M)
JOIN_VS_MAP_GUARD = 0.14
GC_SHARE_GUARD = 0.09  # the cyclic collector's share of the join's CPU (11-13% before tasks raised its threshold)
INTERVAL_MS = 1000
WATERMARKS = pe.WatermarkStrategy.for_bounded_out_of_orderness(500).with_timestamp_assigner("date_time")


def _mix(i: int) -> int:
    """A cheap deterministic hash of ``i`` (the generator's randomness)."""
    return (i * 2654435761) & 0xFFFFFFFF


def auction(j: int) -> Dict[str, Any]:
    """The ``j``-th auction: event ``12 j``."""
    ts = 12 * j // 10
    h = _mix(j)
    return {
        "id": j,
        "seller": h % 1000,
        "category": h % 10,
        "initial_bid": 10,
        "date_time": ts,
        "expires": ts + 1000 + h % 9000,
    }


def bid(j: int) -> Dict[str, Any]:
    """The ``j``-th bid: the ``j``-th event that is no auction."""
    i = j + j // 11 + 1
    newest = i // 12
    h = _mix(i)
    hot = h & 1 == 0
    return {
        "auction": newest // 100 * 100 if hot else max(newest - (h >> 1) % 100, 0),
        "bidder": h % 10_000,
        "price": 1 + (h >> 8) % 10_000,
        "date_time": i // 10,
    }


def counts(events: int) -> Tuple[int, int]:
    auctions = (events + 11) // 12
    return auctions, events - auctions


class WinningBids(ProcessJoinFunction):
    """q4's first step: the bids before the auction's end."""

    def process_element(self, auction: Any, bid: Any, ctx: Any) -> Any:
        if bid["date_time"] < auction["expires"]:
            yield (auction["id"], auction["category"], bid["price"])


def _env(checkpoints: bool) -> pe.StreamEnvironment:
    config = pe.CheckpointConfig(interval_ms=INTERVAL_MS) if checkpoints else None
    return pe.StreamEnvironment(parallelism=1, checkpointing=config, monitoring=None)


def python_join(events: int, checkpoints: bool) -> pe.StreamEnvironment:
    env = _env(checkpoints)
    n_auctions, n_bids = counts(events)
    a = env.from_generator(auction, n_auctions, name="auctions", watermark_strategy=WATERMARKS)
    b = env.from_generator(bid, n_bids, name="bids", watermark_strategy=WATERMARKS)
    joined = a.key_by("id").interval_join(b.key_by("auction")).between(0, 10_000)
    joined.process(WinningBids()).uid("q4").sink_to(pe.sinks.DiscardSink())
    return env


def plain_map(events: int, checkpoints: bool) -> pe.StreamEnvironment:
    env = _env(checkpoints)
    n_auctions, n_bids = counts(events)
    a = env.from_generator(auction, n_auctions, name="auctions", watermark_strategy=WATERMARKS)
    b = env.from_generator(bid, n_bids, name="bids", watermark_strategy=WATERMARKS)
    a.union(b).map(lambda e: (e.get("id", e.get("auction")), e["date_time"])).uid("map").sink_to(pe.sinks.DiscardSink())
    return env


def arrow_tables(events: int) -> Tuple[pa.Table, pa.Table]:
    n_auctions, n_bids = counts(events)
    return (
        pa.Table.from_pylist([auction(j) for j in range(n_auctions)]),
        pa.Table.from_pylist([bid(j) for j in range(n_bids)]),
    )


def project_join(tables: Tuple[pa.Table, pa.Table]) -> Callable[[], pe.StreamEnvironment]:
    def build() -> pe.StreamEnvironment:
        env = _env(True)
        a = env.from_collection(tables[0], name="auctions", watermark_strategy=WATERMARKS)
        b = env.from_collection(tables[1], name="bids", watermark_strategy=WATERMARKS)
        joined = a.key_by("id").interval_join(b.key_by("auction")).between(0, 10_000)
        joined.project(left=["category", "expires"], right=["price"]).uid("q4").sink_to(pe.sinks.DiscardSink())
        return env

    return build


class CollectorClock:
    """The CPU time the cyclic garbage collector takes, from ``gc.callbacks``: a
    collection runs on the thread that allocated, start to stop, so that thread's
    CPU clock between the two is the collection's."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start = 0.0

    def __call__(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.thread_time()
            return
        self.seconds += time.thread_time() - self._start
        self.full += info["generation"] == 2

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)


def _timed(env: pe.StreamEnvironment, collector: Any = None) -> Tuple[float, float, Any]:
    if collector is not None:
        with collector:
            return _timed(env)
    wall, cpu = time.perf_counter(), time.process_time()
    result = env.execute("q4")
    return time.perf_counter() - wall, time.process_time() - cpu, result


def test_q4_python_interval_join_with_checkpoints(benchmark: Any) -> None:
    _timed(plain_map(20_000, True))  # warm: the checkpoint path's first imports and pools
    tables = arrow_tables(EVENTS)
    runs: Dict[str, Callable[[], pe.StreamEnvironment]] = {
        "join, checkpoints": lambda: python_join(EVENTS, True),
        "join, no checkpoints": lambda: python_join(EVENTS, False),
        "map, checkpoints": lambda: plain_map(EVENTS, True),
        "project, checkpoints": project_join(tables),
    }
    wall = {k: float("inf") for k in runs}
    cpu = dict(wall)
    checkpoints: Dict[str, int] = {}
    joined: List[float] = []
    collector_share = float("inf")  # the collector's share of the join's CPU (with checkpoints), best run
    collections = 0
    for _ in range(ROUNDS):
        for name, build in runs.items():
            collector = CollectorClock() if name == "join, checkpoints" else None
            w, c, result = _timed(build(), collector)
            assert result.status == "FINISHED", result.cause
            if collector is not None:
                joined.append(c)
                if collector.seconds / c < collector_share:
                    collector_share, collections = collector.seconds / c, collector.full
                assert result.checkpoints is not None and result.checkpoints.counts["completed"] >= 1, (
                    "no checkpoint completed: the run is too short to measure their cost"
                )
            if c < cpu[name]:
                checkpoints[name] = result.checkpoints.counts["completed"] if result.checkpoints is not None else 0
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
    clock = figure_clock(benchmark)  # the row: the join's CPU time per run, with checkpoints
    benchmark.pedantic(lambda: clock.record(joined.pop(0)), rounds=len(joined), iterations=1)
    benchmark.extra_info.update({f"{k} events/s (CPU)": EVENTS / v for k, v in cpu.items()})

    def rate(name: str, best: Dict[str, float]) -> float:
        return EVENTS / best[name]

    with_, without = rate("join, checkpoints", cpu), rate("join, no checkpoints", cpu)
    cost = 1 - with_ / without
    per_checkpoint = (cpu["join, checkpoints"] - cpu["join, no checkpoints"]) / max(checkpoints["join, checkpoints"], 1)
    vs_map = with_ / rate("map, checkpoints", cpu)
    SUMMARY.append(
        f"q4 join (Python ProcessJoinFunction), {EVENTS:,} events, p=1, checkpoints every {INTERVAL_MS} ms, "
        f"best of {ROUNDS} interleaved (CPU time; wall time in brackets):"
    )
    for name in runs:
        SUMMARY.append(
            f"  {name:<22} {rate(name, cpu) / 1e3:6.0f} k events/s ({rate(name, wall) / 1e3:.0f} k wall), "
            f"{checkpoints[name]} checkpoint(s)"
        )
    SUMMARY.append(
        f"  checkpoints cost {cost:.0%} of the join's events/s (target <= {COST_TARGET:.0%}: "
        f"{'met' if cost <= COST_TARGET else 'NOT MET'}); one checkpoint adds {per_checkpoint * 1e3:.0f} ms of CPU "
        f"({per_checkpoint * 1e3 / INTERVAL_MS:.0%} of its interval)"
    )
    SUMMARY.append(
        f"  the join at {with_ / 1e3:.0f} k events/s with checkpoints, {vs_map:.3f}x the plain map (target "
        f">= {TARGET_EVENTS_PER_S / 1e3:.0f} k, ~{JOIN_VS_MAP}x here: {'met' if vs_map >= JOIN_VS_MAP else 'NOT MET'})"
    )
    SUMMARY.append(
        f"  the cyclic collector: {collector_share:.0%} of the join's CPU, {collections} full collection(s) "
        f"(asserted <= {GC_SHARE_GUARD:.0%})"
    )
    assert collector_share <= GC_SHARE_GUARD, (
        f"the cyclic collector takes {collector_share:.0%} of the q4 join's CPU (guard {GC_SHARE_GUARD:.0%})"
    )
    assert cost <= COST_GUARD, f"checkpoints cost {cost:.0%} of the q4 join's events/s (guard {COST_GUARD:.0%})"
    assert vs_map >= JOIN_VS_MAP_GUARD, f"the q4 join runs at {vs_map:.3f}x a plain map (guard {JOIN_VS_MAP_GUARD})"


if __name__ == "__main__":  # pragma: no cover - a quick look without pytest
    pytest.main([__file__, "-q", "-s"])
