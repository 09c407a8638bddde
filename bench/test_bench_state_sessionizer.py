"""The issue #19 sessionizer, measured so that its ratios survive a loaded machine.

The job is ``test_bench_state_calls``'s (a ValueState pair, a MapState of page
counts, a ListState of amounts; with and without a 6-hour TTL). Two figures, TTL
and no TTL interleaved, best of ``ROUNDS`` each:

* the whole job (``env.execute``, parallelism 1, the embedded runner): wall time,
  the issue's definition of events/s, and the process's CPU time (the job's
  threads), which moves far less when other jobs share the two cores;
* the operator alone: ``KeyedProcessOperator.process`` over buffers of 1,024
  records, the task thread's CPU time per record (the per-record path: key
  selection, ``set_current_key``, the state calls).

Targets (issue #19): >= 200 k events/s with TTL, TTL costing <= 15% of the events/s
without it; reported met or not. Asserted, as regression guards: TTL costing at
most 60% of the events/s without it, in CPU time, for the job and for the operator
(test_bench_state_calls's guard). Measured on this 2-core machine under a load
average of 9-19: TTL costs 45-51% before the per-step clock (the operator reading
it per record), 21-32% of the job's CPU time and 26-35% of the operator's with it
(/tmp/patches/state-ttl-step.patch); the guard can go to 40% once that is in.
Then the state calls went to C (``bindings/_statecalls.pxi``): both variants faster
(best job CPU of six runs each, A/B against the commit before: 1.74 -> 1.42 us per
event without TTL, 2.57 -> 1.89 with it), TTL's share 32% -> 25%: what TTL still adds
(~0.3-0.5 us per event) is its (value, stamp) tuple per write and what allocating,
keeping and freeing them costs, not the calls' checks. A value or map entry that only
the state holds is now rewritten in place (operator, four interleaved A/B runs: 1.58-1.63
-> 1.51-1.53 us per event with TTL, its share 29% -> 20-25%). Where the rest goes (the
operator with TTL on one state at a time, us per event over none): the list's
elements +0.20-0.30 (a tuple per element, freed cold when the session closes, and
unwrapped by get()), the map +0.15-0.25 and the value pair +0.09-0.13 before the
in-place rewrite. Then a TTL list's stamps went apart from its elements
(``StampedList``: no tuple per element): the operator with TTL 1.58-1.64 -> 1.35-1.51
us per event (TTL's share 28-31% -> 16-20%), the whole job with TTL (best of five,
four interleaved A/B pairs) 2.23-3.29 -> 2.10-2.44 us. Left: the map (+0.2 us; its
entry tuple is one more cold object per read) and the value pair (+0.06 us).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
from conftest import SUMMARY, measured_again
from test_bench_state_calls import EVENTS, PAGES, TTL_MS, USERS, Sessionizer

import pyengine as pe
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.keyed import KeyedContext, KeyedProcessOperator, key_selector
from pyengine.storage import checkpoint_storage

ROUNDS = 5
BUFFER = 1024


@pytest.fixture(scope="module")
def sessionizer_events() -> List[Tuple[int, str, float, int]]:
    """The input of test_bench_state_calls's sessionizer (same seed, same events)."""
    rng = np.random.default_rng(19)
    users = rng.integers(0, USERS, EVENTS).tolist()
    pages = rng.integers(0, len(PAGES), EVENTS).tolist()
    amounts = rng.random(EVENTS).round(2).tolist()
    steps = rng.integers(0, 200, EVENTS)
    steps[rng.integers(0, EVENTS, 10)] += 3_600_000
    times = np.cumsum(steps).tolist()
    return [(u, PAGES[p], a, t) for u, p, a, t in zip(users, pages, amounts, times, strict=True)]


def _job(events: List[Any], ttl_ms: Any) -> Tuple[float, float, int]:
    env = pe.StreamEnvironment(parallelism=1)
    sink = pe.sinks.CollectSink()
    env.from_collection(events).key_by(0).process(Sessionizer(ttl_ms)).uid("sessions").sink_to(sink)
    wall, cpu = time.perf_counter(), time.process_time()
    result = env.execute("sessionizer")
    return time.perf_counter() - wall, time.process_time() - cpu, len(result.records)


def _operator(events: List[Any], ttl_ms: Any) -> Tuple[float, int]:
    op = KeyedProcessOperator("sessions", "sessions", key_selector(0), Sessionizer(ttl_ms))
    ctx = OperatorContext(
        job_name="sessionizer",
        subtask=0,
        parallelism=1,
        max_parallelism=128,
        state_backend="heap",
        local_recovery_dir=None,
        attempt=0,
    )
    op.setup(ctx, None)
    op.open()
    buffers = [events[i : i + BUFFER] for i in range(0, len(events), BUFFER)]
    produced = 0
    start = time.thread_time()
    for buffer in buffers:
        produced += len(op.process(buffer))
    return time.thread_time() - start, produced


def _figures(best: Dict[bool, float]) -> Tuple[float, float, float]:
    plain, with_ttl = EVENTS / best[False], EVENTS / best[True]
    return plain, with_ttl, 1 - with_ttl / plain


def test_sessionizer_ttl_cost_in_cpu_time(sessionizer_events) -> None:
    events = sessionizer_events
    wall = {False: float("inf"), True: float("inf")}
    cpu = dict(wall)
    op_cpu = dict(wall)
    sessions: Dict[bool, int] = {}
    for _ in range(ROUNDS):
        for ttl in (False, True):
            w, c, n = _job(events, TTL_MS if ttl else None)
            wall[ttl], cpu[ttl] = min(wall[ttl], w), min(cpu[ttl], c)
            sessions[ttl] = n
            o, m = _operator(events, TTL_MS if ttl else None)
            op_cpu[ttl] = min(op_cpu[ttl], o)
            assert m == n
    assert sessions[True] == sessions[False]
    lines = []
    for what, best in (("job, wall", wall), ("job, CPU", cpu), ("operator, CPU", op_cpu)):
        plain, with_ttl, cost = _figures(best)
        lines.append(
            f"  {what:<14} {with_ttl / 1e3:.0f} k events/s with TTL ({1e6 / with_ttl:.2f} us/event), "
            f"{plain / 1e3:.0f} k without ({1e6 / plain:.2f} us) -> TTL costs {cost:.0%} "
            f"(<= 15%: {'met' if cost <= 0.15 else 'NOT MET'}; >= 200 k with TTL: "
            f"{'met' if with_ttl >= 200e3 else 'NOT MET'})"
        )
    SUMMARY.append(
        f"sessionizer, {EVENTS:,} events, {sessions[True]:,} sessions, best of {ROUNDS} interleaved "
        "(targets: TTL <= 15%, >= 200 k events/s with TTL):"
    )
    SUMMARY.extend(lines)
    for what, best in (("job", cpu), ("operator", op_cpu)):
        cost = _figures(best)[2]
        assert cost <= 0.6, f"TTL costs {cost:.0%} of the sessionizer's {what} CPU time (guard: 60%)"


# --- With checkpoints (issue #43) -------------------------------------------------------
#
# The issue's job: 300 k events over 2,000 users, parallelism 1, a 6 h TTL, checkpoints
# every second (defaults otherwise) against the same job without checkpoints. 300 k events
# take well under a second here, so the input is the issue's events PASSES times over
# (event time going on, an hour's gap between passes): a few periodic checkpoints of
# state that has grown, not just the final one.
#
# Measured before the TTL entries went to columns (version 5, ``snapshot/stamped.py``):
# the keyed operator's asynchronous part took 62-124 ms with TTL against 8-17 ms without
# (the direct measurement below), the serialization of each stamped entry and the
# Python filtering of expired ones holding the interpreter.
CKPT_EVENTS = 300_000
CKPT_USERS = 2_000
PASSES = int(os.environ.get("PYENGINE_BENCH_SESSIONIZER_PASSES", 2))
CKPT_ROUNDS = int(os.environ.get("PYENGINE_BENCH_SESSIONIZER_ROUNDS", 3))
INTERVAL_MS = 1000
CHECKPOINTED_TARGET = 0.9  # issue #43's target: TTL sessionizer with checkpoints against itself without (reported)
CHECKPOINTED_GUARD = 0.75  # asserted: a regression guard (a CI run measured 0.87x under its own load)
ASYNC_GUARD = 3.0  # its asynchronous part against the same state without TTL (asserted)
PROGRESS_EVERY = 256  # events between two samples of the task's progress


def _issue_events(passes: int) -> List[Tuple[int, str, float, int]]:
    rng = np.random.default_rng(43)
    users = rng.integers(0, CKPT_USERS, CKPT_EVENTS).tolist()
    pages = rng.integers(0, len(PAGES), CKPT_EVENTS).tolist()
    amounts = rng.random(CKPT_EVENTS).round(2).tolist()
    steps = rng.integers(0, 200, CKPT_EVENTS)
    steps[rng.integers(0, CKPT_EVENTS, 10)] += 3_600_000
    times = np.cumsum(steps)
    span = int(times[-1]) + 3_600_000
    out: List[Tuple[int, str, float, int]] = []
    for p in range(passes):
        ts = (times + p * span).tolist()
        out.extend((u, PAGES[g], a, t) for u, g, a, t in zip(users, pages, amounts, ts, strict=True))
    return out


@pytest.fixture(scope="module")
def issue_events() -> List[Tuple[int, str, float, int]]:
    return _issue_events(PASSES)


class _Progress(Sessionizer):
    """The sessionizer, sampling the wall clock every PROGRESS_EVERY events (on the task's
    thread), so its throughput while a checkpoint's asynchronous part runs can be told
    from its throughput between checkpoints. The samples go to a module-level list
    (``_SAMPLES``): the job runs a copy of this function."""

    def __init__(self, ttl_ms: Any) -> None:
        super().__init__(ttl_ms)
        self.n = 0

    def process_element(self, value: Any, ctx: KeyedContext) -> Any:
        self.n += 1
        if self.n % PROGRESS_EVERY == 0:
            _SAMPLES.append(time.time())
        return super().process_element(value, ctx)


_SAMPLES: List[float] = []


def _checkpointed_job(events: List[Any], ttl_ms: Any, checkpoints: bool) -> Dict[str, Any]:
    """One run: wall time, the keyed operator's checkpoints (async ms, (start, end) epoch s)
    and the task's progress samples."""
    _SAMPLES.clear()
    env = pe.StreamEnvironment(
        parallelism=1, checkpointing=pe.CheckpointConfig(interval_ms=INTERVAL_MS) if checkpoints else None
    )
    sink = pe.sinks.CollectSink()
    env.from_collection(events).key_by(0).process(_Progress(ttl_ms)).uid("sessions").sink_to(sink)
    start = time.perf_counter()
    result = env.execute("sessionizer")
    wall = time.perf_counter() - start
    asyncs: List[float] = []
    windows: List[Tuple[float, float]] = []
    for c in result.checkpoints.to_json().get("history", []):
        if c.get("status") != "COMPLETED" or not c.get("subtasks"):
            continue
        keyed = max(c["subtasks"].values(), key=lambda st: st.get("full_size", 0))  # the sessionizer's
        asyncs.append(keyed["async_duration_ms"])
        end = keyed["ack_timestamp"] / 1e3
        windows.append((end - keyed["async_duration_ms"] / 1e3, end))
    return {
        "wall": wall,
        "sessions": len(result.records),
        "async": asyncs,
        "windows": windows,
        "samples": list(_SAMPLES),
    }


def _during_and_between(samples: List[float], windows: List[Tuple[float, float]]) -> Tuple[float, float, int]:
    """Events/s of the task while an asynchronous part ran, and between (the first and
    last 5% of the run left out), and how many sample intervals fell in the windows."""
    during_t = between_t = 0.0
    during_n = between_n = 0
    lo, hi = int(len(samples) * 0.05), int(len(samples) * 0.95)
    for a, b in zip(samples[lo:hi], samples[lo + 1 : hi], strict=False):
        mid = (a + b) / 2
        if any(s <= mid <= e for s, e in windows):
            during_t += b - a
            during_n += 1
        else:
            between_t += b - a
            between_n += 1
    rate = lambda n, t: n * PROGRESS_EVERY / t if t > 0 else float("nan")  # noqa: E731
    return rate(during_n, during_t), rate(between_n, between_t), during_n


def _keyed_backend(events: List[Any], ttl_ms: Any) -> Any:
    op = KeyedProcessOperator("sessions", "sessions", key_selector(0), Sessionizer(ttl_ms))
    ctx = OperatorContext(
        job_name="sessionizer",
        subtask=0,
        parallelism=1,
        max_parallelism=128,
        state_backend="heap",
        local_recovery_dir=None,
        attempt=0,
    )
    op.setup(ctx, None)
    op.open()
    for i in range(0, len(events), BUFFER):
        op.process(events[i : i + BUFFER])
    return op.backend


def _async_parts(events: List[Any], rounds: int) -> Dict[Tuple[str, bool], float]:
    """The sessionizer's keyed backend after ``events`` (the state a checkpoint of the
    job's run holds), snapshotted ``rounds`` times with and without TTL, alternately:
    the best asynchronous part of each, in wall seconds (``("wall", ttl)``) and in the
    process's CPU seconds (``("cpu", ttl)``: every thread's, the encoding pool's
    included; nothing else runs meanwhile), which other jobs on the machine move less."""
    backends = {ttl: _keyed_backend(events, TTL_MS if ttl else None) for ttl in (False, True)}
    storage = checkpoint_storage(tempfile.mkdtemp(prefix="sessionizer-"), "sessionizer")
    best = {(what, ttl): float("inf") for what in ("wall", "cpu") for ttl in (False, True)}
    n = 0
    for _ in range(rounds):
        for ttl in (False, True):
            n += 1
            part = backends[ttl].snapshot(n, storage.location(n))
            wall, cpu = time.perf_counter(), time.process_time()
            part.run()
            best[("cpu", ttl)] = min(best[("cpu", ttl)], time.process_time() - cpu)
            best[("wall", ttl)] = min(best[("wall", ttl)], time.perf_counter() - wall)
    return best


def test_sessionizer_with_checkpoints_against_without(issue_events) -> None:
    """Whole job, TTL and not, checkpoints every second and none, interleaved, best wall
    time of CKPT_ROUNDS each. Asserted: with TTL, checkpoints on >= 0.75x of off (the 0.9x target reported); the
    keyed operator's asynchronous part with TTL within 3x of the same state's without
    (measured directly on the job's state: the process's CPU time, best of 7, alternately). Reported: the job's
    own asynchronous parts, and the task's events/s while they ran against between."""
    events = issue_events
    runs: Dict[Tuple[bool, bool], List[Dict[str, Any]]] = {(t, c): [] for t in (False, True) for c in (False, True)}

    def measure_jobs() -> float:
        for ttl in (False, True):
            for chk in (False, True):
                runs[(ttl, chk)].append(_checkpointed_job(events, TTL_MS if ttl else None, chk))
        return _job_ratio(True)

    def _job_ratio(ttl: bool) -> float:
        return min(r["wall"] for r in runs[(ttl, False)]) / min(r["wall"] for r in runs[(ttl, True)])

    for _ in range(CKPT_ROUNDS):
        measure_jobs()
    ratio, again = measured_again(_job_ratio(True), CHECKPOINTED_GUARD, measure_jobs)
    sessions = {r["sessions"] for rs in runs.values() for r in rs}
    assert len(sessions) == 1, f"the runs disagree on the sessions: {sessions}"

    state_events = events[: len(events) // 2]  # about what the job's middle checkpoints hold
    parts = _async_parts(state_events, 7)

    def async_ratio_of(what: str) -> float:
        return parts[(what, True)] / parts[(what, False)]

    if async_ratio_of("cpu") > ASYNC_GUARD:  # measured again: a slow spell of the machine misses some rounds
        again_parts = _async_parts(state_events, 7)
        parts = {k: min(v, again_parts[k]) for k, v in parts.items()}
    async_ratio = async_ratio_of("cpu")

    lines = [
        f"sessionizer with checkpoints every {INTERVAL_MS} ms, {len(events):,} events ({PASSES} passes of "
        f"{CKPT_EVENTS:,}) over {CKPT_USERS:,} users, best of {CKPT_ROUNDS + again} interleaved "
        f"(targets: TTL with checkpoints >= {CHECKPOINTED_TARGET}x of without, "
        f"{'met' if ratio >= CHECKPOINTED_TARGET else 'NOT MET'}, guard {CHECKPOINTED_GUARD}x; async part with TTL "
        f"<= {ASYNC_GUARD}x of without):"
    ]
    for ttl in (False, True):
        off = min(r["wall"] for r in runs[(ttl, False)])
        on = min(r["wall"] for r in runs[(ttl, True)])
        asyncs = sorted(a for r in runs[(ttl, True)] for a in r["async"])
        during = [_during_and_between(r["samples"], r["windows"]) for r in runs[(ttl, True)]]
        d_rate = float(np.nanmedian([d for d, _, n in during if n])) if any(n for _, _, n in during) else float("nan")
        b_rate = float(np.nanmedian([b for _, b, _ in during]))
        lines.append(
            f"  {'TTL 6 h' if ttl else 'no TTL':<8} {len(events) / off / 1e3:.0f} k events/s without checkpoints, "
            f"{len(events) / on / 1e3:.0f} k with -> {off / on:.2f}x; keyed async part p50 "
            f"{_pct(asyncs, 50):.0f} ms, max {_pct(asyncs, 100):.0f} ms over {len(asyncs)} checkpoints; task "
            f"{d_rate / 1e3:.0f} k events/s during async parts, {b_rate / 1e3:.0f} k between ({d_rate / b_rate:.2f}x)"
        )
    lines.append(
        f"  async part alone (the job's state after {len(state_events):,} events, best of 7+): CPU "
        f"{parts[('cpu', True)] * 1e3:.1f} ms with TTL, {parts[('cpu', False)] * 1e3:.1f} ms without -> "
        f"{async_ratio:.2f}x; wall {parts[('wall', True)] * 1e3:.1f} ms, {parts[('wall', False)] * 1e3:.1f} ms "
        f"-> {async_ratio_of('wall'):.2f}x"
    )
    SUMMARY.extend(lines)
    print("\n".join(lines))
    assert ratio >= CHECKPOINTED_GUARD, (
        f"the TTL sessionizer with checkpoints every {INTERVAL_MS} ms runs at {ratio:.2f}x of itself without "
        f"(guard {CHECKPOINTED_GUARD}x)"
    )
    assert async_ratio <= ASYNC_GUARD, (
        f"the TTL sessionizer's asynchronous part takes {async_ratio:.2f}x the same state's without TTL "
        f"(guard {ASYNC_GUARD}x)"
    )


def _pct(values: List[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else float("nan")
