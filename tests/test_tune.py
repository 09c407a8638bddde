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
    checkpoint p50, silently. Such an interval is never recommended (when it is all that
    was measured, tune refuses and says what to try); the trials, which try such intervals
    on purpose, leave out the coordinator's run-time warning."""
    import logging

    from pyengine.coordinator.coordinator import BACK_TO_BACK_WARNING
    from pyengine.tune.measure import _QuietBackToBack

    m = _m(4096, 3e5, p99=900, recovery=1)
    m.setting = Setting(interval_ms=2)
    m.interval_ms, m.checkpoints, m.checkpoint_p50_ms = 2.0, 5, 399.0
    # the only setting measured ran back to back: refused, with the intervals to try instead
    with pytest.raises(ValueError, match=r"back to back.*2 ms, had a p50 of 399 ms.*from 800 ms \(--intervals-ms"):
        recommend([m], "throughput")
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


def _run_of(setting: Setting, throughput: float, p99: float, checkpoint_p50: float) -> Measurement:
    interval = setting.nominal_interval_ms
    m = Measurement(setting, int(throughput), 1.0, throughput, latency_p50_ms=p99 / 2, latency_p99_ms=p99)
    m.checkpoints, m.interval_ms, m.checkpoint_p50_ms, m.checkpoint_p99_ms = 5, float(interval), checkpoint_p50, p99
    m.latency_measured, m.status, m.restore_s, m.replay_s = True, "CANCELED", 0.1, 0.1
    return m


def test_the_recommendation_is_on_its_own_frontier_and_never_an_interval_it_warns_about(monkeypatch) -> None:
    """The observed case (``pyengine tune myjob:build --budget-s 60``): short runs put
    ``buffer_size=16384`` at 500 ms and 4096 at 500 ms on top; measured again on longer runs
    they fell to 120 k and 100 k rows/s, and tune recommended the first of those two finalists
    (p99 1,846 ms, with checkpoints running back to back at its 500 ms interval) while its
    chart showed 16384 at 2,000 ms with 148 k rows/s at p99 953 ms. Synthetic, deterministic
    measurements (the fake ``measure`` below) replay that search."""
    import pyengine.tune.search as search_module
    from pyengine.tune.ranking import back_to_back, dominates, latest
    from pyengine.tune.report import _rows

    # (buffer_size, interval_ms) -> (records/s on a short run, on a finalist's run, p99 ms, checkpoint p50 ms)
    figures = {
        (1024, 500): (90e3, 90e3, 700.0, 200.0),
        (4096, 500): (155e3, 100e3, 1500.0, 300.0),
        (16384, 500): (160e3, 120e3, 1846.0, 1100.0),  # checkpoints back to back at 500 ms
        (16384, 2000): (148e3, 148e3, 953.0, 300.0),
        (1024, 2000): (80e3, 80e3, 1200.0, 200.0),
        (4096, 2000): (130e3, 130e3, 1100.0, 250.0),
    }

    def fake_measure(build, setting, *, seconds, measure_restore=False, **_: Any) -> Measurement:
        short, finalist, p99, p50 = figures[(setting.buffer_size, setting.interval_ms)]
        m = _run_of(setting, short if seconds < 2.0 else finalist, p99, p50)
        m.seconds, m.restore_measured = seconds, measure_restore
        return m

    monkeypatch.setattr(search_module, "measure", fake_measure)
    space = {"buffer_size": (1024, 4096, 16384), "interval_ms": (500, 2000), "unaligned": (False,)}
    result = pe.tune("keyed-count", budget_s=60, trial_s=1.0, space=space)  # finalists run 2 s

    chosen = result.measurement
    assert (result.recommended.buffer_size, result.recommended.interval_ms) == (16384, 2000), result.messages
    shown = latest(result.trials)  # what the table and the chart show, one per setting
    assert not any(dominates(m, chosen) for m in shown), "a setting on the chart beats it on both axes"
    assert not back_to_back(chosen)
    assert _rows(result)[0].setting == result.recommended and _rows(result)[0] is chosen
    assert not any("recommended interval" in x for x in result.messages)
    why = [x for x in result.messages if x.startswith("It beats the runner-up")]
    assert why == [
        "It beats the runner-up (buf=4096 timeout=100ms cap=auto interval=500ms aligned) on both axes: "
        "148,000 against 100,000 records/s at p99 953 against 1,500 ms."
    ], result.messages
    assert any("not considered" in x and "buf=16384" in x and "interval=500ms" in x for x in result.messages)


def test_recommend_picks_from_the_frontier_and_says_why_in_one_sentence() -> None:
    fast = _run_of(Setting(buffer_size=16384, interval_ms=2000), 3e6, 900.0, 100.0)
    quick = _run_of(Setting(buffer_size=1024, interval_ms=2000), 1e6, 80.0, 100.0)
    tied = _run_of(Setting(buffer_size=4096, interval_ms=2000), 3e6, 950.0, 100.0)  # fast's throughput, worse p99
    best, _, messages = recommend([tied, quick, fast], "throughput")
    assert best is fast, "a tie on the goal goes to the better p99"
    assert (
        "It beats the runner-up (buf=4096 timeout=100ms cap=auto interval=2000ms aligned) on both axes" in messages[0]
    )
    best, _, messages = recommend([fast, quick], "latency")
    assert best is quick
    assert (
        messages[0].startswith("It beats the runner-up (buf=16384")
        and "on p99 latency, the goal: 80 against 900 ms" in messages[0]
    )
    best, _, messages = recommend([fast, quick], "throughput")
    assert "on throughput, the goal: 3,000,000 against 1,000,000 records/s at p99 900 against 80 ms" in messages[0]
    # a later measurement of a setting replaces its earlier one: a setting counts by its latest run
    again = _run_of(fast.setting, 0.5e6, 900.0, 100.0)
    assert recommend([fast, quick, again], "throughput")[0] is quick
    assert recommend([fast], "throughput")[2][0] == "It is the only setting measured."


def test_the_report_draws_the_frontier_the_recommendation_is_on(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from pyengine.tune import TuneResult
    from pyengine.tune.report import write_report

    good = _run_of(Setting(buffer_size=16384, interval_ms=2000), 148e3, 953.0, 300.0)
    warned = _run_of(Setting(buffer_size=16384, interval_ms=500), 160e3, 700.0, 1100.0)
    best, honoured, messages = recommend([warned, good], "throughput")
    assert best is good
    result = TuneResult(
        "throughput", best.setting, best, [warned, good], honoured, messages, 2, finalists=[best.setting]
    )
    files = write_report(result, str(tmp_path))
    assert "frontier" in files
    page = (tmp_path / "report.html").read_text()
    assert "not considered, as their checkpoints ran back to back" in page
