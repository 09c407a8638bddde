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

import time
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
from conftest import SUMMARY
from test_bench_state_calls import EVENTS, PAGES, TTL_MS, USERS, Sessionizer

import pyengine as pe
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.keyed import KeyedProcessOperator, key_selector

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
