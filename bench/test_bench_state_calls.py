"""State calls (issue #19): each call's cost may not grow with the key's state, with
or without TTL; and the issue's sessionizer with a 6-hour TTL against the same job
without one.

Per call: value get/update, list add/get/view, map put/get/contains, each with and
without TTL, on a key whose list or map holds 1, 100 or 10,000 entries (value
state: a backend with 1, 100 or 10,000 keys): one pytest-benchmark row each, whose
rounds are batches of ``BATCH`` calls, timed per call (``conftest.per_unit``: the table,
the saved JSON and ``--benchmark-compare`` show one call's time), the rows of one call's
three sizes one after another. The p50 of the batch averages is the call's cost
reported. Each row's rounds interleave untimed batches of the other two sizes,
which count with those sizes' batches. Reported: the cost at 10,000 against 1, target 1.5x; asserted within 2x (a
ratio in the same run, of each size's fastest batch: p50s of calls this short
moved by up to 1.9x between sizes on this shared machine, in both directions).
Reported: the p50s against the issue's targets (<= 0.5 us value, <= 1 us list and
map), met or not. ``ListState.get()`` returns a ``ListView`` (no copy of the
elements); ``view()`` is the same call under its older name, timed as well. Before
``get()`` returned a view it copied the list: 14-21x at 10,000 elements.

TTL calls are timed within a record: outside a processing step the backend reads the
wall clock once per record (``set_current_key``), and that read (a system call on this
host, measured and reported as ``clock read``) is not in the calls' figures. A job's
keyed operator reads it once per buffer (``begin_ttl_step``).

Sessionizer (the issue's job, written here): per event a ValueState pair (session
start, last event), a MapState of page counts and a ListState of amounts; a gap
of 30 minutes of event time closes a session and emits its summary. Parallelism 1,
the embedded runner, no checkpoints. The target is TTL costing <= 15% and >= 200 k
events/s with TTL, reported met or not: measured here TTL costing 17-40% (no TTL
130-190 k events/s, with TTL 80-157 k, depending on the machine's load) when the clock
was read once per record; with one read per buffer, 21-36% of CPU time
(``bench/test_bench_state_sessionizer.py``). What remains is a ``(value, stamp)``
tuple per stamped entry, unpacked on every read (a list's ``get()`` most); the calls
themselves cost 0.05-0.15 us more with TTL (the rows above). Asserted, as a regression guard: with
TTL >= 40% of the events/s without it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np
import pytest
from conftest import SUMMARY, best_seconds, per_unit

import pyengine as pe
from pyengine.runtime.keyed import KeyedContext, KeyedProcessFunction
from pyengine.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
    create_keyed_backend,
)

SIZES = (1, 100, 10_000)
BATCH = 200
ROUNDS = 31
TTL_MS = 6 * 3600 * 1000
TARGET_US = {"value": 0.5, "list": 1.0, "map": 1.0}
CALLS = ("value get", "value update", "list add", "list get", "list view", "map put", "map get", "map contains")


GROWTH_GUARD = 2.0  # asserted; the target (1.5x) is reported


def _setup(size: int, ttl: Any) -> Dict[str, Tuple[Callable[[], Any], Callable[[], None]]]:
    """Per call: (the call, a reset run outside the timing before each batch)."""
    b = create_keyed_backend("heap", max_parallelism=128)
    v = b.get_state(ValueStateDescriptor("v", ttl=ttl))
    lst = b.get_state(ListStateDescriptor("l", ttl=ttl))
    m = b.get_state(MapStateDescriptor("m", ttl=ttl))
    for k in range(size):  # value state: `size` keys
        b.set_current_key(k)
        v.update(k)
    b.set_current_key(size // 2)
    lst.update(list(range(size)))
    m.put_all({i: i for i in range(size)})
    b.set_current_key(size // 2)  # a fresh record: the clock is read by its first call

    def reset_list() -> None:
        lst.update(list(range(size)))
        b.set_current_key(size // 2)
        lst.add(0)

    def nothing() -> None:
        v.value()

    probe = size // 2
    return {
        "value get": (v.value, nothing),
        "value update": (lambda: v.update(7), nothing),
        "list add": (lambda: lst.add(7), reset_list),
        "list get": (lst.get, reset_list),
        "list view": (lst.view, reset_list),
        "map put": (lambda: m.put(probe, 7), nothing),
        "map get": (lambda: m.get(probe), nothing),
        "map contains": (lambda: m.contains(probe), nothing),
    }


def _batch_us(call: Callable[[], Any]) -> float:
    r = range(BATCH)
    start = time.perf_counter_ns()
    for _ in r:
        call()
    return (time.perf_counter_ns() - start) / BATCH / 1000


def _loop_us() -> float:
    return _batch_us(lambda: None)  # the timing loop and a lambda call, subtracted from the lambdas' rows


@pytest.fixture(scope="module")
def overhead() -> float:
    """The timing loop's cost per call (and the clock read's, reported)."""
    loop = [_loop_us() for _ in range(ROUNDS)]
    clock = [_batch_us(time.time_ns) for _ in range(ROUNDS)]
    _OVERHEAD["loop"] = statistics.median(loop)
    SUMMARY.append(
        f"state calls, p50 of {ROUNDS} batches of {BATCH} (us per call; the {_OVERHEAD['loop']:.2f} us of a lambda "
        f"call taken off the rows that need one; clock read {statistics.median(clock):.2f} us, once per record with "
        "TTL):"
    )
    return _OVERHEAD["loop"]


_OVERHEAD: Dict[str, float] = {}
_BATCHES: Dict[Tuple[str, bool, int], List[float]] = {}  # us per call of each batch, by row
CALL_ROWS = [
    pytest.param(call, ttl, size, id=f"{call.replace(' ', '-')}{'-ttl' if ttl else ''}-{size}")
    for ttl in (False, True)
    for call in CALLS
    for size in SIZES
]


def _timed_batches(
    benchmark: Any, fn: Callable[[], Any], reset: Callable[[], None], between: Callable[[], None]
) -> List[float]:
    """``ROUNDS`` rounds of ``BATCH`` calls of ``fn``, ``between`` and ``reset``
    (untimed) before each: the us per call of each batch."""
    r = range(BATCH)

    def batch() -> None:
        for _ in r:
            fn()

    def setup() -> None:
        between()
        reset()

    per_unit(benchmark, BATCH)  # the row's times are per call
    benchmark.pedantic(batch, setup=setup, rounds=ROUNDS)
    best_seconds(benchmark)  # fails plainly when benchmarks are disabled
    return [t * 1e6 for t in benchmark.stats.stats.data]


@pytest.mark.parametrize("call, ttl, size", CALL_ROWS)
def test_state_call_costs_do_not_grow_with_the_state(benchmark: Any, overhead: float, call: str, ttl: bool, size: int):
    benchmark.group = f"state call: {call}{' with TTL' if ttl else ''}"
    # built per row (~10 ms for the three), and gone after it: states kept alive for the
    # whole module made the sessionizer after them pay for their objects at every
    # collection of the garbage collector (TTL costing 67-73% instead of 25-39%)
    backends = {(ttl, n): _setup(n, TTL_MS if ttl else None) for n in SIZES}
    fn, reset = backends[(ttl, size)][call]

    def other_sizes() -> None:
        # every row's rounds interleave untimed batches of the other sizes, as the sizes
        # were interleaved round by round before rows: a spell of the machine's load hits
        # every size, and every timed batch follows the same work (a row's batches back to
        # back would find the caches hot for the small sizes only: 1.5-1.8x ratios of nothing)
        for other in SIZES:
            if other != size:
                _BATCHES.setdefault((call, ttl, other), []).append(_batch_after(*backends[(ttl, other)][call]))

    batches = _timed_batches(benchmark, fn, reset, other_sizes)
    _BATCHES.setdefault((call, ttl, size), []).extend(batches)
    lambda_row = call in ("value update", "list add", "map put", "map get", "map contains")
    overhead = overhead if lambda_row else 0.0
    benchmark.extra_info.update(
        p50_us=max(statistics.median(batches) - overhead, 0.01), best_us=max(min(batches) - overhead, 0.01)
    )
    if size != SIZES[-1]:
        return
    p50, best = {}, {}
    for n in SIZES:
        got = _BATCHES[(call, ttl, n)]
        p50[n] = max(statistics.median(got) - overhead, 0.01)
        best[n] = max(min(got) - overhead, 0.01)
    # The ratio from each size's fastest batch: a call of 0.1-0.5 us is at the mercy of
    # the other jobs on this machine, and the fastest batch is the call's own cost.
    ratio = best[10_000] / best[1]
    benchmark.extra_info["ratio_10000_to_1"] = ratio
    target = TARGET_US[call.split()[0]]
    met = "met" if p50[1] <= target and p50[10_000] <= target else "NOT MET"
    SUMMARY.append(
        f"  {call:<13}{' ttl' if ttl else '    '}  1: {p50[1]:.2f}  100: {p50[100]:.2f}  "
        f"10,000: {p50[10_000]:.2f}  (fastest batches 10,000/1: {ratio:.2f}x; target <= {target} us: {met})"
    )
    # The target (<= 1.5x) is reported above; asserted is a guard against a call
    # that grows with the state (a scan is 100x+): a dict probe at 10,000 entries misses
    # caches a 1-entry one does not, and map contains measured 1.50x in one CI run.
    SUMMARY.append(f"    10,000/1 target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT MET'} ({ratio:.2f}x)")
    assert ratio <= GROWTH_GUARD, f"{call}{' with TTL' if ttl else ''}: {ratio:.2f}x at 10,000 against 1"


def _batch_after(fn: Callable[[], Any], reset: Callable[[], None]) -> float:
    reset()
    return _batch_us(fn)


# -- the sessionizer ------------------------------------------------------------------

GAP_MS = 30 * 60 * 1000
EVENTS = 150_000
USERS = 100
PAGES = [f"/page/{i}" for i in range(40)]


class Sessionizer(KeyedProcessFunction):
    """Sessions per user: start and last event time, page counts, amounts."""

    def __init__(self, ttl_ms: Any) -> None:
        self.ttl = ttl_ms

    def open(self, ctx: KeyedContext) -> None:
        self.start = ctx.get_state(ValueStateDescriptor[int]("start", ttl=self.ttl))
        self.last = ctx.get_state(ValueStateDescriptor[int]("last", ttl=self.ttl))
        self.pages = ctx.get_map_state(MapStateDescriptor[str, int]("pages", ttl=self.ttl))
        self.amounts = ctx.get_list_state(ListStateDescriptor[float]("amounts", ttl=self.ttl))

    def process_element(self, value: Tuple[int, str, float, int], ctx: KeyedContext) -> Iterator[Any]:
        _, page, amount, ts = value
        last = self.last.value()
        if last is not None and ts - last > GAP_MS:
            amounts = self.amounts.get()
            yield (ctx.current_key, self.start.value(), last, len(amounts), sum(amounts), len(self.pages.keys()))
            self.pages.clear()
            self.amounts.clear()
            last = None
        if last is None:
            self.start.update(ts)
        self.last.update(ts)
        self.pages.put(page, (self.pages.get(page) or 0) + 1)
        self.amounts.add(amount)


@pytest.fixture(scope="module")
def events() -> List[Tuple[int, str, float, int]]:
    rng = np.random.default_rng(19)
    users = rng.integers(0, USERS, EVENTS).tolist()
    pages = rng.integers(0, len(PAGES), EVENTS).tolist()
    amounts = rng.random(EVENTS).round(2).tolist()
    # Event time: 0.1 s apart on average (a user's events 10 s apart), and 10 gaps of an
    # hour that close every open session: sessions of about 140 events.
    steps = rng.integers(0, 200, EVENTS)
    steps[rng.integers(0, EVENTS, 10)] += 3_600_000
    times = np.cumsum(steps).tolist()
    return [(u, PAGES[p], a, t) for u, p, a, t in zip(users, pages, amounts, times, strict=True)]


def _run(events: List[Any], ttl_ms: Any) -> Tuple[float, int]:
    env = pe.StreamEnvironment(parallelism=1)
    sink = pe.sinks.CollectSink()
    env.from_collection(events).key_by(0).process(Sessionizer(ttl_ms)).uid("sessions").sink_to(sink)
    start = time.perf_counter()
    result = env.execute("sessionizer")
    return time.perf_counter() - start, len(result.records)


_SESSIONIZER: Dict[bool, List[Tuple[float, int]]] = {False: [], True: []}  # (seconds, sessions) per run


@pytest.mark.parametrize("ttl", [pytest.param(False, id="no-ttl"), pytest.param(True, id="ttl-6h")])
def test_sessionizer_with_ttl_against_without(benchmark: Any, events: List[Any], ttl: bool) -> None:
    """One row each, three rounds; the TTL row's rounds interleave untimed runs without TTL
    (all but the first: the row without TTL ran just before)."""
    benchmark.group = "sessionizer"
    runs = _SESSIONIZER
    if not ttl:
        benchmark.pedantic(lambda: runs[False].append(_run(events, None)), rounds=3)
        return

    def between() -> None:
        if runs[True] or not runs[False]:
            runs[False].append(_run(events, None))

    benchmark.pedantic(lambda: runs[True].append(_run(events, TTL_MS)), setup=between, rounds=3)
    best = {t: min(seconds for seconds, _ in runs[t]) for t in (False, True)}
    sessions = {t: runs[t][-1][1] for t in (False, True)}
    assert sessions[True] == sessions[False] > USERS  # the same sessions: nothing expires within the run
    plain, with_ttl = EVENTS / best[False], EVENTS / best[True]
    ratio = with_ttl / plain
    benchmark.extra_info.update(events_per_s_ttl=with_ttl, events_per_s_plain=plain, ratio=ratio)
    SUMMARY.append(
        f"sessionizer (ValueState pair, MapState of pages, ListState of amounts), p=1, {EVENTS:,} events, "
        f"{sessions[True]:,} sessions: {with_ttl / 1e3:.0f} k events/s with a 6 h TTL, {plain / 1e3:.0f} k without "
        f"-> TTL costs {1 - ratio:.0%} (target <= 15%: {'met' if ratio >= 0.85 else 'NOT MET'}); "
        f">= 200 k events/s with TTL: {'met' if with_ttl >= 200e3 else 'NOT MET, reported only'}"
    )
    assert ratio >= 0.4, f"TTL costs {1 - ratio:.0%} of the sessionizer's events/s (guard: 60%)"
