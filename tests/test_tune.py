"""``pyengine tune``: the search finds a setting near the best of an exhaustive grid run
in the same test, the constraints are honoured or reported, and the report renders.

Throughput comparisons are between runs of this test (a shared, noisy machine): the
grid's points are each measured twice, interleaved, and keep their best."""

from __future__ import annotations

import json
import math
from typing import Any, Dict

import pytest

import pyengine as pe
from pyengine.cli import main
from pyengine.tune import Measurement, Setting, measure, recommend
from pyengine.tune.jobs import LATENCY_FIELD, keyed_count
from pyengine.tune.settings import grid

# Buffer size matters several times over on this job, the checkpoint mode about twice
# (unaligned checkpoints persist the in-flight buffers), the channel capacity within noise:
# the search must find the big differences and not be fooled by the small.
SPACE = {"buffer_size": (256, 4096), "channel_capacity": (2, 8), "unaligned": (False, True), "interval_ms": (200,)}
TRIAL_S = 0.5


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    report = tmp_path_factory.mktemp("tune-report")
    result = pe.tune(
        "keyed-count",
        goal="throughput",
        max_recovery_s=60,
        budget_s=10,
        trial_s=TRIAL_S,
        space=SPACE,
        report_dir=str(report),
        benchmark_json=str(report / "bench.json"),
    )
    return result, report


@pytest.mark.slow  # the module's tune search (`tuned`) takes half a minute
def test_tune_finds_a_setting_within_10_percent_of_the_grids_best(tuned) -> None:
    result, _ = tuned
    points = grid(SPACE)
    assert len(points) == 8
    best: Dict[Setting, float] = {}
    build = keyed_count()
    for _ in range(2):  # interleaved: a slow spell of the machine hits every point
        for p in points:
            m = measure(build, p, seconds=TRIAL_S, latency_field=LATENCY_FIELD)
            best[p] = max(best.get(p, 0.0), m.throughput)
    top = max(best.values())
    assert result.recommended in best, "tune recommended a setting outside the space it was given"
    leader = max(best, key=best.__getitem__)
    for _ in range(3):  # a short (0.5 s) run's lucky spell: the two measured again, alternately
        if best[result.recommended] >= 0.9 * top:
            break
        for p in (result.recommended, leader):
            m = measure(build, p, seconds=TRIAL_S, latency_field=LATENCY_FIELD)
            best[p] = max(best[p], m.throughput)
        top = max(best.values())
    leader = max(best, key=best.__getitem__)
    picked = result.recommended
    said = f"tune picked {picked.label} ({best[picked]:,.0f}/s); the grid's best is {leader.label} ({top:,.0f}/s)"
    if best[picked] < 0.9 * top:
        # Short runs on a shared machine spread 2x for one setting (one measured 454-990 k/s):
        # past the re-measurements, the pick may differ from the leader only in what is
        # within that noise on this job, the capacity (see SPACE), never in what is not.
        assert (picked.buffer_size, picked.unaligned) == (leader.buffer_size, leader.unaligned), said
    # a search, not a grid in disguise: fewer settings tried than the grid has
    assert len({m.setting for m in result.trials}) < len(points)


@pytest.mark.slow  # the module's tune search (`tuned`) takes half a minute
def test_tune_honours_a_reachable_constraint_and_says_so(tuned) -> None:
    result, _ = tuned
    m = result.measurement
    assert m.restore_measured and m.restore_s > 0
    assert m.recovery_s <= 60
    assert result.honoured == {"max_recovery_s": True}
    assert "honoured" in result.messages[0] and "NOT" not in result.messages[0]
    assert m.throughput > 0 and m.checkpoints >= 1 and m.latency_measured
    assert m.latency_p99_ms >= m.latency_p50_ms > 0


def _m(buffer_size: int, throughput: float, p99: float, recovery: float) -> Measurement:
    m = Measurement(Setting(buffer_size=buffer_size), 1000, 1.0, throughput, latency_p50_ms=p99 / 2)
    m.latency_p99_ms, m.restore_s, m.replay_s = p99, recovery / 2, recovery / 2
    return m


def test_recommend_trades_the_goal_for_the_constraints() -> None:
    fast = _m(16384, 3e6, p99=900, recovery=8)
    quick = _m(1024, 1e6, p99=80, recovery=2)
    # no constraint: the fastest
    assert recommend([fast, quick], "throughput")[0] is fast
    # a latency bound the fastest breaks: the one inside it, honoured
    best, honoured, messages = recommend([fast, quick], "throughput", max_latency_ms=100, max_recovery_s=5)
    assert best is quick and honoured == {"max_latency_ms": True, "max_recovery_s": True}
    # a bound nothing meets: the closest, and it says so
    best, honoured, messages = recommend([fast, quick], "latency", max_latency_ms=10)
    assert best is quick and honoured == {"max_latency_ms": False}
    assert "NOT honoured" in messages[0]
    # the latency goal ranks by p99
    assert recommend([fast, quick], "latency")[0] is quick


def test_the_table_lists_the_finalists_first_and_marks_the_recommendation() -> None:
    """A short trial's lucky figure above the recommendation made it look wrong (seen in
    a user's trial: 416 k records/s on top, a finalist at 383 k recommended)."""
    import io

    from rich.console import Console

    from pyengine.tune import TuneResult
    from pyengine.tune.report import _rows, print_table

    lucky = _m(16384, 4.2e6, p99=500, recovery=1)  # a short trial, never measured again
    chosen = _m(4096, 3.8e6, p99=500, recovery=1)
    other = _m(1024, 3.0e6, p99=500, recovery=1)
    result = TuneResult(
        "throughput",
        chosen.setting,
        chosen,
        [lucky, other, chosen],
        {},
        [],
        2,
        finalists=[chosen.setting, other.setting],
    )
    assert [m.setting for m in _rows(result)] == [chosen.setting, other.setting, lucky.setting]
    out = io.StringIO()
    print_table(result, Console(file=out, width=400, color_system=None))
    lines = [line for line in out.getvalue().splitlines() if "buf=" in line and "│" in line]
    assert "(recommended)" in lines[0] and "(finalist)" in lines[1], lines
    assert "(recommended)" not in lines[2] and "(finalist)" not in lines[2], lines


@pytest.mark.slow  # the module's tune search (`tuned`) takes half a minute
def test_the_report_renders(tuned) -> None:
    result, report = tuned
    page = (report / "report.html").read_text()
    for name in ("frontier.png", "checkpoint_duration.png", "recovery.png"):
        png = report / name
        assert png.exists() and png.stat().st_size > 5000, f"{name} is missing or empty"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'src="{name}"' in page
    assert "buffer_size=" in page and result.recommended.label in page
    # the snippet runs as it is pasted
    namespace = {"pe": pe}
    exec(result.snippet(), namespace)
    env = namespace["env"]
    assert env.buffer_size == result.recommended.buffer_size
    assert env.checkpointing.interval_ms == result.recommended.interval_ms
    # pytest-benchmark JSON: one benchmark per setting, with real times and the figures
    doc = json.loads((report / "bench.json").read_text())
    assert doc["benchmarks"] and all(b["stats"]["min"] > 0 for b in doc["benchmarks"])
    recommended = [b for b in doc["benchmarks"] if b["extra_info"]["recommended"]]
    assert len(recommended) == 1 and recommended[0]["extra_info"]["throughput"] > 0


def test_measurement_json_has_no_nan() -> None:
    m = Measurement(Setting(), 0, 0.0, 0.0)
    assert math.isnan(m.recovery_s)
    json.dumps(m.to_json(), allow_nan=False)


def test_cli_refuses_what_it_cannot_run(capsys) -> None:
    assert main(["tune", "no_such_module_here:build", "--no-progress", "--budget-s", "1"]) == 1
    assert "No module named" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--goal", "cost"])
    with pytest.raises(SystemExit):
        main(["tune", "--max-latency-ms", "0"])
    with pytest.raises(ValueError, match="unknown setting"):
        pe.tune(space={"buffer_bytes": (1,)})
    with pytest.raises(ValueError, match="goal"):
        pe.tune(goal="cost")


def test_a_user_job_runs_from_module_and_function(tmp_path, monkeypatch) -> None:
    (tmp_path / "myjob.py").write_text(
        "import pyengine as pe\n"
        "def build(env):\n"
        "    env.from_generator(lambda i: {'k': i % 10, 'v': i}, 20_000).map(lambda r: r)"
        ".sink_to(pe.sinks.DiscardSink())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from pyengine.tune.search import load_job

    build, field, name = load_job("myjob:build")
    assert field is None and name == "build"
    m = measure(build, Setting(interval_ms=100))
    assert m.status == "FINISHED" and m.records == 20_000 and m.throughput > 0


@pytest.mark.parametrize("seed", range(40))
def test_weighted_percentiles_equal_numpys_of_the_values_repeated(seed: int) -> None:
    """The latency derived from checkpoint completions weighs each read by its records
    instead of repeating its latency once per record; the figures must not change."""
    import numpy as np

    from pyengine.tune.measure import _percentiles

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    values = rng.choice(rng.normal(size=5), n) if seed % 2 else rng.normal(size=n)  # ties on odd seeds
    weights = rng.integers(0, 2000 if seed % 3 else 3, n)
    if not weights.any():
        assert all(math.isnan(v) for v in _percentiles(values, weights))
        return
    expected = [np.percentile(np.repeat(values, weights), q) for q in (50, 99)]
    assert np.allclose(_percentiles(values, weights), expected, rtol=1e-12, atol=1e-12)


def test_a_bounded_job_is_said_to_be_one_and_its_recovery_unmeasured() -> None:
    """A new user tuned a job over a collection: every trial ran it to its end in 0.4 s,
    a 5 s interval showed only the final checkpoint, recovery was "-" everywhere, and
    nothing said why (a ``max_recovery_s`` said "the closest: nan s")."""
    from pyengine.tune.measure import BOUNDED_NOTE, NO_RECOVERY_NOTE

    def build(env):
        env.from_collection([{"user": i % 10, "v": i} for i in range(2_000)]).key_by("user").aggregate(
            pe.agg.count()
        ).sink_to(pe.sinks.DiscardSink())

    m = measure(build, Setting(interval_ms=5000), seconds=30.0, measure_restore=True)
    assert m.status == "FINISHED"
    assert BOUNDED_NOTE in m.notes and NO_RECOVERY_NOTE in m.notes
    assert math.isnan(m.recovery_s)
    _, honoured, messages = recommend([m], "throughput", max_recovery_s=1)
    assert honoured == {"max_recovery_s": False}
    assert "could not be measured" in messages[0] and "nan" not in messages[0]
    assert BOUNDED_NOTE in messages and NO_RECOVERY_NOTE in messages


def test_a_setting_given_one_value_instead_of_a_tuple_is_named() -> None:
    with pytest.raises(
        TypeError, match=r"'buffer_size' takes the values to try as a tuple or list.*\{'buffer_size': \(64,\)\}"
    ):
        pe.tune(space={"buffer_size": 64})
    with pytest.raises(TypeError, match="'interval_ms' takes"):
        pe.tune(space={"interval_ms": "500"})


def test_cli_errors_name_the_command_once(capsys) -> None:
    assert main(["tune", "no_such_module_here:build", "--no-progress", "--budget-s", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pyengine tune: ") and "tune: tune:" not in err


@pytest.mark.slow  # the module's tune search (`tuned`) takes half a minute
def test_the_report_without_matplotlib_keeps_the_results_and_says_how_to_get_figures(
    tuned, tmp_path, monkeypatch
) -> None:
    """matplotlib is the optional `tune` extra; the CLI writes a report by default, and a
    plain install lost the whole search to an import error at its end."""
    import copy
    import sys

    from pyengine.tune.report import write_report

    result = copy.deepcopy(tuned[0])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    files = write_report(result, str(tmp_path / "report"))
    assert set(files) == {"html"}
    page = (tmp_path / "report" / "report.html").read_text()
    assert result.recommended.label in page and "pip install &quot;pyengine[tune]&quot;" in page
    assert any("pyengine[tune]" in m for m in result.messages)
    # printed as written: "[tune]" is not taken for rich markup
    import io

    from rich.console import Console

    from pyengine.tune.report import print_table

    out = io.StringIO()
    print_table(result, Console(file=out, width=400, color_system=None))
    assert 'pip install "pyengine[tune]"' in out.getvalue()


def test_trials_of_a_job_with_a_file_sink_write_nowhere_near_its_output(tmp_path) -> None:
    """A new user tuned a job writing to a FileSink: the first trial committed into the
    job's output directory and the second was refused it (OutputInUseError, a raw
    traceback from the CLI). Each trial writes into a directory of its own, deleted after
    it, and the job's output directory is never made."""
    out = tmp_path / "out"

    def build(env):
        env.from_generator(lambda i: {"user": i % 100}, None).key_by("user").aggregate(pe.agg.count()).sink_to(
            pe.sinks.FileSink(str(out), format="jsonl")
        )

    for interval in (100, 200):
        m = measure(build, Setting(interval_ms=interval), seconds=2.0, measure_restore=True)
        assert m.status in ("CANCELED", "FINISHED") and m.records > 0 and m.checkpoints >= 1
    assert not out.exists()


def test_the_first_job_benchmark_of_a_process_warms_up_untimed(monkeypatch) -> None:
    """A new user's two parametrized settings: whichever ran first took 8-10x longer (the
    process's first job pays for imports and first allocations) and so lost. The first
    benchmark of a process runs its job once before its timed rounds; later ones do not."""
    from pyengine.testing import JobBenchmark

    class FakeBenchmark:
        group = None

        def __init__(self) -> None:
            self.timed = 0
            self.extra_info: Dict = {}

        def pedantic(self, target, setup=None, rounds=1, iterations=1) -> None:
            for _ in range(rounds):
                if setup is not None:
                    setup()
                target()
                self.timed += 1

    runs = []

    def build(env):
        runs.append(1)
        env.from_collection(list(range(100))).map(lambda x: x).sink_to(pe.sinks.DiscardSink())

    monkeypatch.setattr(JobBenchmark, "_warmed", False)
    first = FakeBenchmark()
    JobBenchmark(first)(build, Setting(interval_ms=100), rounds=2)
    assert (len(runs), first.timed) == (3, 2)
    second = FakeBenchmark()
    JobBenchmark(second)(build, Setting(interval_ms=100), rounds=2)
    assert (len(runs), second.timed) == (5, 2)
    JobBenchmark(FakeBenchmark())(build, Setting(interval_ms=100), rounds=1, warm_up=True)
    assert len(runs) == 7


@pytest.mark.parametrize(
    ("defaults", "recommended", "said", "instead"),
    [
        ((100, 98, 101), (140, 138, 141), "more than the", False),
        ((100, 80, 120), (110, 90, 105), "within this machine's noise", False),
        ((140, 139, 141), (100, 99, 101), "the defaults are the recommendation", True),
    ],
)
def test_the_recommendation_is_measured_again_against_the_defaults(defaults, recommended, said, instead) -> None:
    """A new user's A/B of tune's recommendation against the defaults found no gain: the
    search had picked the best of single short runs, 7% apart, where one setting's runs
    differed by 20-40%. Runs of both, alternately, as many of each, say whether the gain
    is more than that spread, within it, or the defaults are ahead (then they are the
    recommendation)."""
    from pyengine.tune.search import _against_the_defaults

    start, chosen = Setting(), Setting(buffer_size=4096, interval_ms=2000)
    planned = {start: list(defaults), chosen: list(recommended)}
    order = []
    lengths = {start: 2.0, chosen: 5.2}  # a long interval's runs are longer (Search.seconds)

    def run(setting, seconds, restore):
        assert seconds == lengths[setting]
        order.append(setting)
        rate = planned[setting].pop()
        return Measurement(setting, int(rate * seconds), seconds, float(rate), status="CANCELED")

    message, ahead = _against_the_defaults(run, "throughput", chosen, start, lengths.__getitem__)
    assert order == [start, chosen] * 3, "alternately"
    assert said in message and "best of 3 runs each" in message
    assert (ahead is not None) == instead
    if instead:
        assert ahead.setting == start and ahead.throughput == 141


def test_a_recommended_interval_shorter_than_its_checkpoints_is_said_and_trials_stay_quiet() -> None:
    """``--intervals-ms 2`` (meant as seconds): tune recommended 2 ms beside a 399 ms
    checkpoint p50, silently. The recommendation says it; the trials, which try such
    intervals on purpose, leave out the coordinator's run-time warning."""
    import logging

    from pyengine.coordinator.coordinator import BACK_TO_BACK_WARNING
    from pyengine.tune.measure import _QuietBackToBack

    m = _m(4096, 3e5, p99=900, recovery=1)
    m.setting = Setting(interval_ms=2)
    m.interval_ms, m.checkpoints, m.checkpoint_p50_ms = 2.0, 5, 399.0
    _, _, messages = recommend([m], "throughput")
    assert any("interval of 2 ms is under half of its checkpoints' p50 (399 ms)" in x for x in messages), messages
    m.checkpoint_p50_ms = 3.0
    assert not any("back to back" in x for x in recommend([m], "throughput")[2])

    def record(msg: str, job: str) -> logging.LogRecord:
        return logging.LogRecord(
            "pyengine.coordinator.coordinator", logging.WARNING, __file__, 1, msg, (job, 3, 2, 399.0), None
        )

    quiet = _QuietBackToBack("tune-build")
    assert not quiet.filter(record(BACK_TO_BACK_WARNING, "tune-build"))
    assert quiet.filter(record(BACK_TO_BACK_WARNING, "production"))  # another job of the process still hears it
    assert quiet.filter(record("another warning %r %d %d %f", "tune-build"))


def test_a_sink_made_outside_the_build_function_writes_where_it_says_after_trials(tmp_path) -> None:
    """A trial redirects the job's FileSink into its own directory; a sink made outside
    ``build`` is the job's own object, and a run after the trials wrote into the deleted
    trial directory, reporting FINISHED (the review's reproducer)."""
    out = tmp_path / "out"
    sink = pe.sinks.FileSink(str(out), format="jsonl")

    def build(env):
        env.from_collection([{"k": i % 3} for i in range(100)]).key_by("k").aggregate(pe.agg.count()).sink_to(sink)

    measure(build, Setting(interval_ms=100), measure_restore=True)
    assert sink.path == str(out)
    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    build(env)
    assert env.execute("after-tuning").status == "FINISHED"
    assert any(p.name.endswith(".jsonl") for p in out.rglob("*"))


def test_auto_settings_start_the_search_inside_its_space() -> None:
    """``buffer_size`` and ``channel_capacity`` default to None (the engine chooses, per
    stream and per executor). A space without None starts from the value nearest to
    what auto means on threads, that value itself when the space has it (before, a
    space holding 1,024 kept buffer_size at None, outside the space)."""
    from pyengine.tune.search import _start

    start = _start({"buffer_size": (256, 1024, 4096), "channel_capacity": (2, 8, 32)})
    assert (start.buffer_size, start.channel_capacity) == (1024, 8)
    start = _start({"buffer_size": (256, 4096), "channel_capacity": (2, 4)})
    assert (start.buffer_size, start.channel_capacity) == (256, 4)
    start = _start({"buffer_size": (None, 256), "channel_capacity": (None, 2)})
    assert (start.buffer_size, start.channel_capacity) == (None, None)
    assert "cap=auto" in Setting().label and "channel_capacity" not in Setting().snippet()
    from pyengine.tune.settings import DEFAULT_SPACE

    assert _start(DEFAULT_SPACE).channel_capacity is None  # the defaults' snippet leaves it to the engine
    assert "channel_capacity=2," in Setting(channel_capacity=2).snippet()


def test_a_build_that_switches_to_worker_processes_is_refused_by_name() -> None:
    """A trial's probes stay in this process; a build that sets executor='processes' was
    refused with a pickling error about tune's own probe, read as the job's fault."""
    build = keyed_count()

    def in_processes(env: Any) -> None:
        env.executor = "processes"
        build(env)

    with pytest.raises(ValueError, match=r"measure a job on threads; build\(env\) set executor='processes'"):
        measure(in_processes, Setting(), seconds=0.2)
