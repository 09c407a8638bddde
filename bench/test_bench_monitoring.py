"""What watching a job costs it (issue #15: at most 2% of its throughput).

The same job runs with monitoring on (its server, its sampling thread, and a
client reading ``/metrics``, the checkpoint statistics, the progress and the job
every second, as Prometheus and an open dashboard would) and with
``monitoring=None``: one pytest-benchmark row each, every round a whole run, so
``--benchmark-compare`` shows what monitoring costs between commits. The monitored
row's rounds are interleaved with unmonitored runs (untimed, pytest-benchmark's
``setup``), so both variants meet the same load; the ratio takes the best of each.
The jobs checkpoint every second and read 1,024 records per buffer (the
vectorised job's Arrow source too, where the default reads ~256 KiB slices): many
buffers a second for the per-buffer counters, and runs of seconds, long enough that
the monitor's start-up does not dominate its share (with the default slices the
vectorised runs took 2.5 s, and the share of the same monitor rose from ~0.9% to
1.75-2.1%: its start-up, not its running cost).
The client is a separate process, as Prometheus and a browser are: in this
process its own HTTP code would hold the GIL the job needs and be counted as
monitoring's cost.

Two figures, because this machine cannot resolve 2% by timing alone: the same
variant's runs differ by more than that when other processes share its two
cores.

- **The monitor's own CPU time** (``JobMonitor.cpu_seconds``: sampling, every
  request's thread, the server's accept loop, each on its thread's CPU clock) as
  a share of the run. Under the embedded runner the tasks are threads of this
  process, so this is GIL time they could not have: the upper bound of what
  monitoring takes from a GIL-bound job, and unaffected by other processes' load.
  It is asserted at the 2% target.
- **The throughput ratio**, best monitored run against best unmonitored run over
  interleaved rounds: reported with the target, and asserted at a guard (90%)
  when the runs can resolve it, that is when each variant's median run is within
  10% of its best. On this shared machine they often are not: with other
  developers' jobs on its two cores, the same variant's runs have differed 4x in
  one session (best-of-5 ratios of 62% and 399% in the same hour). Then the
  ratio is reported as unresolved, and the CPU share above is what holds the
  monitor to its budget. Before the guard fails, up to five more pairs of runs
  (``RETRIES``) join the best: a spell that hit one variant's runs gives way, a
  cost that monitoring adds to every run does not.

The per-buffer counters in ``StreamTask`` run in both variants: they cost one
addition per buffer, nothing per record."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pytest
from conftest import SUMMARY

import pyengine as pe

RECORDS = int(os.environ.get("PYENGINE_BENCH_RECORDS", 10_000_000))
PER_RECORD = max(RECORDS // 4, 200_000)  # a Python call per record: a quarter runs as long as the rest
# The vectorised job's records: half the suite's count, runs of ~7 s at 1,024 records a
# buffer, still long against the monitor's start-up (the docstring); the whole count
# made this benchmark 2.5 of CI's minutes.
VECTORISED = max(RECORDS // 2, 200_000)
KEYS = 10_000
ROUNDS = 4  # monitored rounds, each but the first after an unmonitored run
OFF_ROUNDS = 3  # the unmonitored row's own rounds: with the runs between, 6 unmonitored runs to 4 monitored
TARGET = 0.98  # issue #15: monitoring costs at most 2% of the throughput
# What the timed ratio must show when the runs resolve it (see the docstring). A user's run
# on this machine under other developers' load measured 91.9% with both variants' runs
# within 10% of their best, after the retries (a CPU-bound job's wall time loses more than
# the monitor's own CPU share when the cores are oversubscribed); the 2% target is held
# by the CPU share, asserted, and the ratio's target is reported met or not beside it.
GUARD = 0.90
RESOLVING = 1.10  # the runs resolve the guard when each variant's median run is within this of its best
# Runs of 1-2 s: a CI run once measured 85.6% for the per-record job with both variants'
# runs within 10% of their best, where this machine measured 103-110% for the same commit
# (and, timing the two variants alternately, 3 ms between them on a 1,000-record job).
# Before failing, up to this many more pairs, alternately: a slow spell gives way to
# them, a cost that is monitoring's does not.
RETRIES = 5

# The client, in its own process: reads every path once a second from the URL given
# on a line of its stdin until that job's server stops answering, then says how many
# requests it made and waits for the next URL.
_SCRAPER = r"""
import sys, time, urllib.request
for line in sys.stdin:
    url, job = line.split()
    paths = ["metrics", f"jobs/{job}/checkpoints", f"jobs/{job}/progress", f"jobs/{job}"]
    served, gone = 0, False
    while not gone:
        time.sleep(1.0)
        for path in paths:
            try:
                with urllib.request.urlopen(url + path, timeout=5) as response:
                    response.read()
                served += 1
            except OSError:
                gone = True
                break
    print(served, flush=True)
"""


class Scraper:
    """The client process, one for the whole benchmark (its start-up is not a run's cost)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SCRAPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def watch(self, url: str, job_id: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{url} {job_id}\n")
        self.process.stdin.flush()

    def served(self) -> int:
        """Requests served in the run just ended (the client sees its server gone)."""
        assert self.process.stdout is not None
        return int(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(10)


def _warm_up() -> None:
    """One small monitored job whose every path is read once, untimed: the first
    monitored run in a process otherwise pays the server's and the answers' one-time
    imports and first builds (a CI run's worst share, 2.73%, was its first run; the
    same job's later runs took 0.6%). A process pays that once, not per run."""
    import urllib.request

    env = pe.StreamEnvironment(
        parallelism=2, monitoring=pe.Monitoring(sample_interval_s=1.0, progress=False, announce=False)
    )
    env.from_collection(list(range(1000))).map(lambda x: (time.sleep(0.001), x)[1]).sink_to(pe.sinks.DiscardSink())
    client = env.execute_async("monitoring-bench-warm-up")
    url, job = client.monitoring_url, client._runner.job_id
    assert url is not None
    for path in ["metrics", f"jobs/{job}/checkpoints", f"jobs/{job}/progress", f"jobs/{job}"]:
        with urllib.request.urlopen(url + path, timeout=5) as response:
            response.read()
    assert client.wait().status == "FINISHED"


@pytest.fixture(scope="module")
def scraper() -> Any:
    _warm_up()
    client = Scraper()
    yield client
    client.close()


class Run:
    def __init__(self, elapsed: float, requests: int = 0, cpu_s: float = 0.0) -> None:
        self.elapsed, self.requests, self.cpu_s = elapsed, requests, cpu_s
        self.extra = False  # a retry's run (``RETRIES``): counts for the best, not for the spread


def _run(build: Any, monitored: bool, scraper: Scraper) -> Run:
    """One whole run; a monitored run's requests are counted later (``_served``): the
    client notices the server gone up to a second after the run, which is not its time."""
    monitoring: Optional[pe.Monitoring] = (
        pe.Monitoring(sample_interval_s=1.0, progress=False, announce=False) if monitored else None
    )
    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=1000), monitoring=monitoring, buffer_size=1024
    )
    build(env)
    start = time.perf_counter()
    client = env.execute_async("monitoring-bench")
    if monitored:
        assert client.monitoring_url is not None
        scraper.watch(client.monitoring_url, client._runner.job_id)
    result = client.wait()
    elapsed = time.perf_counter() - start
    assert result.status == "FINISHED", result.cause
    if not monitored:
        return Run(elapsed)
    return Run(elapsed, -1, client._runner.monitor.cpu_seconds)


_OFF_ROWS: Dict[str, List[Run]] = {}  # the unmonitored rows' runs, by job


def _served(runs: List[Run], scraper: Scraper) -> None:
    for run in runs:
        if run.requests < 0:
            run.requests = scraper.served()


def _rows(benchmark: Any, monitored: bool, what: str, build: Any, scraper: Scraper) -> Optional[Dict[bool, List[Run]]]:
    """Times this row's rounds; for the monitored row, returns both variants' runs
    (this row's, the unmonitored ones between its rounds and the unmonitored row's)."""
    benchmark.group = f"monitoring: {what}"
    if not monitored:
        runs: List[Run] = []
        benchmark.pedantic(lambda: runs.append(_run(build, False, scraper)), rounds=OFF_ROUNDS)
        _OFF_ROWS[what] = runs
        return None
    on: List[Run] = []
    off: List[Run] = list(_OFF_ROWS.get(what, []))

    def between() -> None:  # untimed: an unmonitored run, and the last monitored run's requests
        _served(on, scraper)
        if on or not off:  # before the first round, the unmonitored row has just run
            off.append(_run(build, False, scraper))

    benchmark.pedantic(lambda: on.append(_run(build, True, scraper)), setup=between, rounds=ROUNDS)
    _served(on, scraper)
    runs = {False: off, True: on}
    extra = 0
    while extra < RETRIES and _failing(runs):  # perhaps a slow spell: more pairs, untimed, best of all
        for monitored, runs_of in ((False, off), (True, on)):
            runs_of.append(_run(build, monitored, scraper))
            runs_of[-1].extra = True
        _served(on, scraper)
        extra += 1
    return runs


def _failing(runs: Dict[bool, List[Run]]) -> bool:
    """Whether these runs, as they stand, would fail the timed guard."""
    best = min(r.elapsed for r in runs[False]) / min(r.elapsed for r in runs[True])
    return max(_spread(runs[False]), _spread(runs[True])) <= RESOLVING and best < GUARD


def _spread(runs: List[Run]) -> float:
    """The median run's time over the best's: how far this machine let the runs wander,
    over the timed rounds (and the runs between them) only: a retry's runs must not make
    a failing ratio "unresolved" by widening it."""
    times = sorted(r.elapsed for r in runs if not r.extra)
    return times[len(times) // 2] / times[0]


def _report(benchmark: Any, what: str, records: int, runs: Dict[bool, List[Run]]) -> Tuple[float, float, bool]:
    off = min(r.elapsed for r in runs[False])
    on = min(r.elapsed for r in runs[True])
    ratio = off / on
    cpu_share = max(r.cpu_s / r.elapsed for r in runs[True])  # the worst run's
    requests = sum(r.requests for r in runs[True])
    spread = max(_spread(runs[False]), _spread(runs[True]))
    resolved = spread <= RESOLVING
    benchmark.extra_info.update(
        records_per_s_on=records / on,
        records_per_s_off=records / off,
        ratio=ratio,
        monitor_cpu_share=cpu_share,
        spread=spread,
    )
    verdict = ("met" if ratio >= TARGET else "NOT MET in this run") if resolved else "not resolved by these runs"
    SUMMARY.append(
        f"{what}, {records:,} records, p=2, best of {len(runs[True])} monitored and {len(runs[False])} unmonitored "
        f"runs: {records / on / 1e6:.2f} M records/s "
        f"monitored, {records / off / 1e6:.2f} M/s with monitoring=None -> {ratio:.1%} (target >= {TARGET:.0%}: "
        f"{verdict}: a variant's median run {spread - 1:.0%} slower than its best, the {GUARD:.0%} guard holds "
        f"runs within {RESOLVING - 1:.0%}); the monitor's own CPU time at most "
        f"{cpu_share:.2%} of a run (target <= {1 - TARGET:.0%}; {requests} API requests served in "
        f"{len(runs[True])} runs)"
    )
    return ratio, cpu_share, resolved


def _check(ratio: float, cpu_share: float, resolved: bool) -> None:
    assert cpu_share <= 1 - TARGET, f"the monitor's own threads took {cpu_share:.2%} of the run"
    if resolved:
        assert ratio >= GUARD, f"monitoring cost {1 - ratio:.1%} of the throughput"


ROWS = [pytest.param(False, id="monitoring-off"), pytest.param(True, id="monitoring-on")]


@pytest.fixture(scope="module")
def table() -> pa.Table:
    rng = np.random.default_rng(0)
    return pa.table({"user": rng.integers(0, KEYS, VECTORISED), "v": rng.integers(0, 1000, VECTORISED)})


@pytest.mark.parametrize("monitored", ROWS)
def test_monitoring_costs_a_vectorised_job_at_most_2_percent(
    benchmark: Any, scraper: Scraper, table: pa.Table, monitored: bool
) -> None:
    def build(env: Any) -> None:
        env.from_collection(table).key_by("user").aggregate(pe.agg.count()).sink_to(pe.sinks.DiscardSink())

    what = "keyed count via aggregate"
    runs = _rows(benchmark, monitored, what, build, scraper)
    if runs is not None:
        _check(*_report(benchmark, what, VECTORISED, runs))


@pytest.mark.parametrize("monitored", ROWS)
def test_monitoring_costs_a_per_record_job_at_most_2_percent(benchmark: Any, scraper: Scraper, monitored: bool) -> None:
    records: List[Any] = list(range(PER_RECORD))

    def build(env: Any) -> None:
        (
            env.from_collection(records)
            .map(lambda x: (x % KEYS, x))
            .rebalance()
            .map(lambda r: r[1])
            .sink_to(pe.sinks.DiscardSink())
        )

    what = "map -> rebalance -> map, a Python call per record"
    runs = _rows(benchmark, monitored, what, build, scraper)
    if runs is not None:
        _check(*_report(benchmark, what, PER_RECORD, runs))
