"""Shared pieces of the benchmark suite.

Every benchmark times its real work in pytest-benchmark's own rounds, one row per
engine or setting it compares, so ``--benchmark-compare`` between two commits shows a
real difference (a row that timed ``lambda: None`` would show a microsecond of nothing).
Targets are ratios against a row measured earlier in the same run (``RESULTS``: these
machines are shared and noisy); a row selected alone measures its baseline itself.
Figures beyond time go to each benchmark's ``extra_info`` and a summary printed at the
end of the session. Whole jobs are timed with ``pyengine.testing.JobBenchmark``, the
fixture users benchmark their own jobs with.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Sequence, Tuple

import pytest

RESULTS: Dict[Tuple[Any, ...], float] = {}
SUMMARY: list = []


class NullListener:
    """A listener that does nothing, so only the gate is measured."""

    def trigger_checkpoint_on_barrier(self, barrier: Any, metrics: Any) -> None:
        pass

    def abort_checkpoint_on_barrier(self, checkpoint_id: int, reason: Any) -> None:
        pass

    def add_input_data(self, checkpoint_id: int, channel: int, buffer: Any) -> None:
        pass

    def finish_input(self, checkpoint_id: int) -> None:
        pass


def best_seconds(benchmark: Any) -> float:
    stats = benchmark.stats
    if stats is None:
        pytest.fail("benchmarks are disabled; run bench/ without --benchmark-disable to check the targets")
    return stats.stats.min


def per_unit(benchmark: Any, n: int) -> None:
    """Makes this row's times per unit when a round does ``n`` units (calls, records):
    its timer reads ``perf_counter() / n``, so the table, the saved JSON and
    ``--benchmark-compare`` show the time of one unit, the name's, not of the batch.
    Used where a round needs a ``setup`` between batches (pytest-benchmark refuses
    ``iterations`` with one)."""
    _set_timer(benchmark, lambda: time.perf_counter() / n)


class FigureClock:
    """A timer for a row whose time is a figure the round measures rather than its
    duration (a paced run's latency p99: the run lasts as long as its pacing, whatever
    the engine does). The round calls ``record(seconds)``; the row then shows that figure,
    so ``--benchmark-compare`` compares what the row's name says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def record(self, seconds: float) -> None:
        self.now += seconds


def figure_clock(benchmark: Any) -> FigureClock:
    """A ``FigureClock`` installed as this row's timer."""
    clock = FigureClock()
    _set_timer(benchmark, clock)
    return clock


def per_checkpoint(benchmark: Any, durations_ms: Sequence[float]) -> None:
    """Times this row per checkpoint: one round per completed checkpoint of a run just
    made (``durations_ms``, end to end, as the coordinator's statistics recorded them),
    through a ``FigureClock``. For rows whose run lasts as long as it is told to (or as its
    slowed sink makes it), where the run's time says nothing and its checkpoints are the
    figure. Fails when the run completed fewer than three."""
    if len(durations_ms) < 3:
        pytest.fail(f"only {len(durations_ms)} checkpoint(s) completed: a row per checkpoint needs at least three")
    clock = figure_clock(benchmark)
    left = [d / 1e3 for d in durations_ms]
    benchmark.pedantic(lambda: clock.record(left.pop(0)), rounds=len(left), iterations=1)


def _set_timer(benchmark: Any, timer: Callable[[], float]) -> None:
    # pytest-benchmark reads the fixture's ``_timer`` when it builds a round's runner
    # (pedantic included); a version without it must fail here, not time the wrong thing
    if not hasattr(benchmark, "_timer"):
        pytest.fail("this pytest-benchmark has no per-fixture timer; bench/conftest.py needs updating")
    benchmark._timer = timer


def start_spark(builder: Any) -> Any:
    """``builder.getOrCreate()``, or a skip that says why Spark cannot start here (no Java,
    a JVM that dies at start): a Spark baseline that cannot run is not a failure of pyengine.
    pyengine's own runs on Spark fail as they should once a session exists."""
    try:
        return builder.getOrCreate()
    except Exception as exc:  # py4j's and pyspark's errors share no base class but Exception
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        pytest.skip(f"Spark cannot start a session here ({first}): install Java 17 and pyspark, then rerun")


def baseline_failed(what: str, exc: BaseException) -> None:
    """Skips a row whose Spark baseline (Structured Streaming) failed, saying why."""
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    pytest.skip(f"{what} failed on this machine ({first}): it cannot be compared against here")


def measured_again(ratio: float, guard: float, again: Callable[[], float], times: int = 2) -> Tuple[float, int]:
    """A ratio under its guard measured again, up to ``times`` times, before a test fails.

    ``again`` measures both variants once more, alternately, and returns the ratio from
    all it has measured (the ratio of the bests, or a median of paired ratios). A slow
    spell of a shared machine hits one variant and not the other; a regression misses
    every time. Returns the last ratio and how many
    times it was measured again (for the summary line)."""
    n = 0
    while ratio < guard and n < times:
        n += 1
        ratio = again()
    return ratio, n


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SUMMARY:
        terminalreporter.write_sep("=", "pyengine benchmark figures")
        for line in SUMMARY:
            terminalreporter.write_line(line)


_NOT_A_ROW = "Skipping non-benchmark"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: Any, items: list) -> None:
    """``--benchmark-only`` (pytest-benchmark's) skips every test that does not use the
    ``benchmark`` fixture. In this suite those check the targets over the rows' figures
    (the gate's ratios) or measure what a row cannot (CPU time, peak memory): skipped,
    ``pytest bench/ --benchmark-only`` passed without checking them. They run under it too."""
    for item in items:
        item.own_markers[:] = [m for m in item.own_markers if not _not_a_row(m)]


def _not_a_row(mark: Any) -> bool:
    return bool(mark.name == "skip" and str(mark.kwargs.get("reason", "")).startswith(_NOT_A_ROW))
