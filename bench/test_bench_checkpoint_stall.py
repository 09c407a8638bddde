"""The task's speed while a checkpoint's asynchronous part runs (issue #43).

A per-record keyed job as users write it: dict records from Python, an untyped
``ValueState`` (a count) and an untyped ``ListState`` (the amounts) per user, state that
grows to ``KEYS`` users (then every user again), parallelism 1, checkpoints every second,
the default settings otherwise; with and without a 6-hour TTL, on the heap and the
incremental backends. A thread samples the operator's processed-record counter every
10 ms; the asynchronous parts' start and end come from their ``run``.

The figure: the task's events/s inside asynchronous parts against between them. Both are
taken relative to the same job without checkpoints over the same records (its time for
records n1..n2 over this run's time for them), because the state grows and records late
in the stream cost more than early ones: the raw "between" would otherwise be mostly the
cheap start of the stream. Rows per configuration, in one run: without checkpoints (the
baseline), checkpoints with the asynchronous part paced (the default), and unpaced
(``PYENGINE_SNAPSHOT_SHARE=1``: the asynchronous part's Python work as it ran before).

Target (issue #43): inside >= 0.9x of between, reported met or not; asserted, as a
regression guard on a loaded 2-core machine, that the paced part starves the task no more
than the unpaced one (paced over unpaced >= 0.9; best of ``ROUNDS``, measured again below
it). ``PYENGINE_BENCH_STALL_KEYS`` sets the size (default 100,000 users, 5 records each),
``PYENGINE_BENCH_STALL_ROUNDS`` the rounds (default 1: about a minute for the four rows).
"""

from __future__ import annotations

import bisect
import itertools
import os
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from conftest import SUMMARY, measured_again

import pyengine as pe
from pyengine.runtime.keyed import KeyedContext, KeyedProcessFunction
from pyengine.snapshot import strategies
from pyengine.state import ListStateDescriptor, ValueStateDescriptor, incremental

KEYS = int(os.environ.get("PYENGINE_BENCH_STALL_KEYS", 100_000))
RECORDS = 5 * KEYS
INTERVAL_MS = 1_000
TTL_MS = 6 * 3600 * 1000
ROUNDS = int(os.environ.get("PYENGINE_BENCH_STALL_ROUNDS", 1))
TARGET = 0.9  # events/s inside asynchronous parts over between (issue #43)
GUARD = 0.9  # asserted: paced over unpaced (the paced part must not starve the task more)

_COUNT = [0]
_WINDOWS: List[Tuple[float, float]] = []


class CountAndAmounts(KeyedProcessFunction):
    """A count and the amounts per user, nothing emitted; counts what it processed."""

    def __init__(self, ttl_ms: Optional[int]) -> None:
        self.ttl_ms = ttl_ms

    def open(self, ctx: KeyedContext) -> None:
        ttl: Dict[str, Any] = {"ttl": self.ttl_ms} if self.ttl_ms else {}
        self.count = ctx.get_state(ValueStateDescriptor("count", **ttl))
        self.amounts = ctx.get_list_state(ListStateDescriptor("amounts", **ttl))

    def process_element(self, value: Dict[str, Any], ctx: KeyedContext) -> Iterator[Any]:
        self.count.update((self.count.value() or 0) + 1)
        self.amounts.add(value["amount"])
        _COUNT[0] += 1
        return iter(())


def _record(i: int) -> Dict[str, Any]:
    # the first 4 * KEYS records over a growing set of users (hot early users), then every user once more
    user = (i * 2654435761) % (i // 4 + 1) if i < 4 * KEYS else i % KEYS
    return {"user": user, "amount": i * 0.5}


@pytest.fixture
def timed_async_parts(monkeypatch: Any) -> None:
    """Records each asynchronous part's (start, end)."""
    for cls in (strategies.FullSnapshot, incremental.IncrementalSnapshot):
        run = cls.run

        def timed(self: Any, run: Any = run) -> Any:
            started = time.perf_counter()
            try:
                return run(self)
            finally:
                _WINDOWS.append((started, time.perf_counter()))

        monkeypatch.setattr(cls, "run", timed)


def _run(backend: str, ttl_ms: Optional[int], checkpoints: bool) -> Tuple[List[Tuple[float, int]], List[Any]]:
    _WINDOWS.clear()
    _COUNT[0] = 0
    samples: List[Tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter(), _COUNT[0]))
            time.sleep(0.01)

    config = pe.CheckpointConfig(interval_ms=INTERVAL_MS) if checkpoints else None
    storage = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    env = pe.StreamEnvironment(parallelism=1, checkpointing=config, state_backend=backend, checkpoint_storage=storage)
    env.from_generator(_record, RECORDS).key_by("user").process(CountAndAmounts(ttl_ms)).uid("keep").sink_to(
        pe.sinks.DiscardSink()
    )
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = env.execute("checkpoint-stall")
    stop.set()
    sampler.join()
    assert result.succeeded
    return samples, list(_WINDOWS)


def _time_at(samples: List[Tuple[float, int]], n: int) -> float:
    counts = [c for _, c in samples]
    i = bisect.bisect_left(counts, n)
    if i == 0:
        return samples[0][0]
    if i >= len(samples):
        return samples[-1][0]
    (ta, na), (tb, nb) = samples[i - 1], samples[i]
    return ta + (tb - ta) * (n - na) / max(1, nb - na)


def _inside_over_between(base: List[Tuple[float, int]], samples: List[Tuple[float, int]], windows: List[Any]) -> float:
    """Speed relative to the baseline over the same records, inside asynchronous parts
    over between them (nan when the run had no time of either)."""
    took = {True: [0.0, 0.0], False: [0.0, 0.0]}  # [this run's seconds, the baseline's]
    for (ta, na), (tb, nb) in itertools.pairwise(samples):
        if nb == na or na >= RECORDS:
            continue
        middle = (ta + tb) / 2
        inside = any(start <= middle <= end for start, end in windows)
        took[inside][0] += tb - ta
        took[inside][1] += _time_at(base, nb) - _time_at(base, na)
    if not took[True][0] or not took[False][0]:
        return float("nan")
    return (took[True][1] / took[True][0]) / (took[False][1] / took[False][0])


@pytest.mark.parametrize("backend", ["heap", "incremental"])
@pytest.mark.parametrize("ttl_ms", [None, TTL_MS], ids=["no-ttl", "ttl"])
def test_task_speed_while_async_part_runs(
    backend: str, ttl_ms: Optional[int], timed_async_parts: None, monkeypatch: Any
) -> None:
    best = {"paced": float("nan"), "unpaced": float("nan")}
    parts: List[float] = []
    rounds = 0

    def measure() -> float:
        """One more round of the three runs; paced over unpaced, of the bests so far."""
        nonlocal rounds
        rounds += 1
        base, _ = _run(backend, ttl_ms, checkpoints=False)
        for mode in ("unpaced", "paced"):
            if mode == "unpaced":
                monkeypatch.setenv("PYENGINE_SNAPSHOT_SHARE", "1")
            else:
                monkeypatch.setenv("PYENGINE_SNAPSHOT_SHARE", "0.05")  # opt-in: pacing.py says why
            samples, windows = _run(backend, ttl_ms, checkpoints=True)
            ratio = _inside_over_between(base, samples, windows)
            if not ratio <= best[mode]:  # max, nan-aware
                best[mode] = ratio
            if mode == "paced":
                parts.extend(end - start for start, end in windows)
        gain = best["paced"] / best["unpaced"]
        return gain if gain == gain else 0.0  # a run with no asynchronous part inside its records: again

    for _ in range(ROUNDS - 1):
        measure()
    # a shared machine's slow spell (or a round whose asynchronous parts all fell after
    # the records) hits one run, not every one: measured again before it fails
    gain, again = measured_again(measure(), GUARD, measure)
    parts.sort()
    p50 = parts[len(parts) // 2] * 1e3 if parts else float("nan")
    paced, unpaced = best["paced"], best["unpaced"]
    SUMMARY.append(
        f"checkpoint stall ({backend}, {'TTL' if ttl_ms else 'no TTL'}, {KEYS:,} users, {RECORDS:,} records, p=1, "
        f"every {INTERVAL_MS} ms; best of {rounds}, measured again {again}x): task events/s inside async parts "
        f"over between {paced:.2f}x paced (target >= {TARGET}: {'met' if paced >= TARGET else 'NOT MET'}), "
        f"{unpaced:.2f}x unpaced; async part p50 {p50:.0f} ms"
    )
    assert paced == paced and unpaced == unpaced, "no asynchronous part ran while records were processed"
    assert gain >= GUARD, f"the task ran at {paced:.2f}x inside paced asynchronous parts, {unpaced:.2f}x unpaced"
