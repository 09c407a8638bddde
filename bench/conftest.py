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

from typing import Any, Callable, Dict, Tuple

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
