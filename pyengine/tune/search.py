"""The search: a coordinate search over the settings, each coordinate's values raced by
successive halving (all on short runs, the better half again on runs twice as long),
then the best few measured once more, with their restore, before one is recommended.

Why not a grid: six settings of two to four values each are ~600 points, minutes each
on a real job; the settings interact little enough that one coordinate at a time finds
a point near the best (the test checks it against a grid on a small space), and short
runs are enough to drop a setting that is clearly worse."""

from __future__ import annotations

import importlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import ranking
from .measure import BOUNDED_NOTE, NO_RECOVERY_NOTE, JobBuilder, Measurement, measure
from .ranking import _score, _violations, back_to_back, dominates, frontier, latest, rank
from .settings import DEFAULT_SPACE, Setting, check_space

__all__ = ["GOALS", "TuneResult", "load_job", "rank", "recommend", "tune"]

GOALS = ("throughput", "latency")


@dataclass
class TuneResult:
    """What ``tune`` found: every measurement (``trials``, in the order taken), the
    recommended setting and its measurement, and what the recommendation says about the
    constraints (``honoured``: each one asked for, and whether the recommendation meets
    it; ``messages``: the same in words, including when no setting could).

    ``finalists``: the settings measured again at the end, on the longest runs and with
    their restore; the recommendation is one of them (when the choice over every setting's
    latest measurement fell on another, that one was measured so too, and joined them), or
    the defaults, when their confirming runs of the same length came out ahead. A
    shorter trial's figure is noisier and may top theirs by chance: the table lists the
    recommendation, then the finalists, first."""

    goal: str
    recommended: Setting
    measurement: Measurement
    trials: List[Measurement]
    honoured: Dict[str, bool]
    messages: List[str]
    parallelism: int
    max_latency_ms: Optional[float] = None
    max_recovery_s: Optional[float] = None
    elapsed_s: float = 0.0
    restore_base_s: float = math.nan
    files: Dict[str, str] = field(default_factory=dict)
    finalists: List[Setting] = field(default_factory=list)

    def snippet(self) -> str:
        """The recommended settings, as code to paste into the job."""
        return self.recommended.snippet(self.parallelism)

    def to_json(self) -> Dict[str, Any]:
        return {
            "goal": self.goal,
            "recommended": self.recommended.to_json(),
            "measurement": self.measurement.to_json(),
            "honoured": self.honoured,
            "messages": self.messages,
            "max_latency_ms": self.max_latency_ms,
            "max_recovery_s": self.max_recovery_s,
            "elapsed_s": self.elapsed_s,
            "trials": [m.to_json() for m in self.trials],
            "finalists": [f.to_json() for f in self.finalists],
        }


def load_job(job: Union[str, JobBuilder, None]) -> Tuple[JobBuilder, Optional[str], str]:
    """(build function, its latency field or None, a name) from what the user gave: a
    function, ``"module:function"``, or a built-in job's name (None: ``keyed-count``)."""
    from .jobs import BUILTIN, LATENCY_FIELD

    if job is None:
        job = "keyed-count"
    if callable(job):
        return job, None, getattr(job, "__name__", "job")
    if not isinstance(job, str):
        raise TypeError(f"tune: job must be a function, 'module:function' or a built-in name, got {job!r}")
    if job in BUILTIN:
        return BUILTIN[job](), LATENCY_FIELD, job
    if ":" not in job:
        raise ValueError(f"tune: job {job!r} is neither 'module:function' nor a built-in job ({', '.join(BUILTIN)})")
    module_name, _, attr = job.partition(":")
    build = getattr(importlib.import_module(module_name), attr, None)
    if not callable(build):
        raise ValueError(f"tune: {job!r} names no function in {module_name}")
    return build, None, attr


def _restore_estimate(m: Measurement, base: Measurement) -> float:
    """Restore of a setting that was not restored: the measured one, scaled by state
    size when the setting's checkpoints are larger (unaligned ones carry in-flight data)."""
    if m.restore_measured:
        return m.restore_s
    if math.isnan(base.restore_s):
        return math.nan
    ratio = (
        m.checkpoint_size / base.checkpoint_size
        if base.checkpoint_size and m.checkpoint_size == m.checkpoint_size
        else 1
    )
    return base.restore_s * max(1.0, ratio)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def _why(best: Measurement, runner: Optional[Measurement], goal: str, excluded: int, inside: bool) -> str:
    """One sentence: why ``best`` beats ``runner``, the next setting in the ranking."""
    if runner is None:
        if excluded:
            return "It is the only setting measured whose checkpoints did not run back to back."
        return "It is the only setting measured."
    head = f"It beats the runner-up ({runner.setting.label})"
    figures = (
        f"{best.throughput:,.0f} against {runner.throughput:,.0f} records/s at p99 "
        f"{_ms(best.latency_p99_ms)} against {_ms(runner.latency_p99_ms)} ms"
    )
    if dominates(best, runner):
        return f"{head} on both axes: {figures}."
    if not inside:
        return f"{head} by missing the constraints by less ({figures})."
    if goal == "throughput":
        return f"{head} on throughput, the goal: {figures}."
    return (
        f"{head} on p99 latency, the goal: {_ms(best.latency_p99_ms)} against {_ms(runner.latency_p99_ms)} ms, "
        f"at {best.throughput:,.0f} against {runner.throughput:,.0f} records/s."
    )


def recommend(
    measurements: Sequence[Measurement],
    goal: str,
    max_latency_ms: Optional[float] = None,
    max_recovery_s: Optional[float] = None,
) -> Tuple[Measurement, Dict[str, bool], List[str]]:
    """The recommendation, whether it honours each constraint, and what to tell the user.

    Each setting counts by its latest measurement (the one the report shows). Settings
    whose checkpoints ran back to back are left out (``ranking.back_to_back``: an interval
    tune warns about is never the one it recommends); of the others, those inside the
    constraints when any is; of those, the frontier (none beaten on both throughput and
    p99 latency by another), best by the goal. The messages say why it beats the runner-up,
    in one sentence. Raises ValueError when every setting ran its checkpoints back to back:
    no interval measured can be recommended, and the message says which to try instead."""
    if not measurements:
        raise ValueError("tune: nothing was measured")
    settings = latest(measurements)
    pool = ranking.candidates(settings, max_latency_ms, max_recovery_s)
    excluded = [m for m in settings if back_to_back(m)]
    if not pool:
        slowest = max(excluded, key=lambda m: m.checkpoint_p50_ms)
        longest = max(excluded, key=lambda m: m.interval_ms)
        suggested = math.ceil(2 * slowest.checkpoint_p50_ms / 100.0) * 100
        raise ValueError(
            f"tune: every setting measured ran its checkpoints back to back (checkpoint p50 over twice the "
            f"interval; the longest interval tried, {longest.interval_ms:,.0f} ms, had a p50 of "
            f"{longest.checkpoint_p50_ms:,.0f} ms), so no interval tried can be recommended: try longer ones, "
            f"from {suggested:,} ms (--intervals-ms, or interval_ms in the space)"
        )
    ranked = rank(frontier(pool), goal, max_latency_ms, max_recovery_s)
    best = ranked[0]
    honoured: Dict[str, bool] = {}
    messages: List[str] = []
    if max_latency_ms is not None:
        ok = best.latency_p99_ms <= max_latency_ms
        honoured["max_latency_ms"] = bool(ok)
        messages.append(
            f"latency p99 {best.latency_p99_ms:,.0f} ms <= {max_latency_ms:,.0f} ms: honoured"
            if ok
            else f"max latency {max_latency_ms:,.0f} ms NOT honoured: no setting tried reached it "
            f"(the closest: p99 {best.latency_p99_ms:,.0f} ms)"
        )
    if max_recovery_s is not None:
        ok = best.recovery_s <= max_recovery_s
        honoured["max_recovery_s"] = bool(ok)
        if math.isnan(best.recovery_s):
            why = (
                ", as no restore of the job produced output (a bounded job restored from the end of its input "
                "has nothing left to read; tune an unbounded version of it)"
                if NO_RECOVERY_NOTE in best.notes
                else " (no run completed a checkpoint and read records to restore and replay)"
            )
            messages.append(f"max recovery {max_recovery_s:,.2f} s NOT honoured: recovery could not be measured{why}")
        else:
            messages.append(
                f"recovery {best.recovery_s:,.2f} s <= {max_recovery_s:,.2f} s: honoured"
                if ok
                else f"max recovery {max_recovery_s:,.2f} s NOT honoured: no setting tried reached it "
                f"(the closest: {best.recovery_s:,.2f} s)"
            )
    inside = _violations(best, max_latency_ms, max_recovery_s) == 0
    runner = next((m for m in rank(pool, goal, max_latency_ms, max_recovery_s) if m is not best), None)
    messages.append(_why(best, runner, goal, len(excluded), inside))
    if excluded:
        shown = ", ".join(
            f"{m.setting.label} (interval {m.interval_ms:,.0f} ms, checkpoint p50 {m.checkpoint_p50_ms:,.0f} ms)"
            for m in excluded[:3]
        )
        more = f" and {len(excluded) - 3} more" if len(excluded) > 3 else ""
        messages.append(
            f"not considered, as their checkpoints ran back to back (p50 over twice the interval, one starting "
            f"as the last ended): {shown}{more}"
        )
    # what a measurement says of the job, not of its setting, said once
    notes = {n for m in measurements for n in m.notes}
    messages.extend(n for n in (BOUNDED_NOTE, NO_RECOVERY_NOTE) if n in notes)
    return best, honoured, messages


class _Search:
    def __init__(
        self,
        run: Callable[[Setting, float, bool], Measurement],
        space: Dict[str, Tuple[Any, ...]],
        goal: str,
        max_latency_ms: Optional[float],
        max_recovery_s: Optional[float],
        budget_s: float,
        trial_s: float,
        progress: Optional[Callable[[str, float], None]],
    ) -> None:
        self.run = run
        self.space = space
        self.goal = goal
        self.max_latency_ms = max_latency_ms
        self.max_recovery_s = max_recovery_s
        self.budget_s = budget_s
        self.trial_s = trial_s
        self.progress = progress
        self.started = time.monotonic()
        self.trials: List[Measurement] = []
        self.cache: Dict[Tuple[Setting, float], Measurement] = {}
        self.base: Optional[Measurement] = None

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def seconds(self, setting: Setting, rung_s: float) -> float:
        # long enough for a few checkpoints at this interval, or they are not measured
        return max(rung_s, 2.5 * setting.nominal_interval_ms / 1000 + 0.2)

    def measure(self, setting: Setting, rung_s: float, restore: bool = False) -> Measurement:
        key = (setting, self.seconds(setting, rung_s))
        if key in self.cache and not restore:
            return self.cache[key]
        m = self.run(setting, key[1], restore)
        if self.base is not None and not m.restore_measured:
            m.restore_s = _restore_estimate(m, self.base)
        self.cache[key] = m
        self.trials.append(m)
        if self.progress is not None:
            self.progress(setting.label, min(1.0, (time.monotonic() - self.started) / self.budget_s))
        return m

    def ranked(self, ms: Sequence[Measurement]) -> List[Measurement]:
        return rank(ms, self.goal, self.max_latency_ms, self.max_recovery_s)

    def race(self, candidates: List[Setting]) -> Setting:
        """Successive halving: every candidate on a short run, the better half on a run
        twice as long, until one is left (or the budget is)."""
        rung_s = self.trial_s
        while len(candidates) > 1:
            measured = []
            for c in candidates:
                if self.left() <= 0:
                    break
                measured.append(self.measure(c, rung_s))
            if not measured:
                return candidates[0]
            ranked = [m.setting for m in self.ranked(measured)]
            candidates = ranked[: max(1, len(ranked) // 2)]
            rung_s *= 2
        return candidates[0]

    def coordinates(self, current: Setting) -> List[List[Setting]]:
        """The candidates of each coordinate around ``current``; unaligned and its
        aligned timeout are one coordinate (the timeout means nothing without it)."""
        out: List[List[Setting]] = []
        for name in ("buffer_size", "channel_capacity", "buffer_timeout_ms", "interval_ms", "buffer_debloat"):
            values = self.space.get(name)
            if values and len(values) > 1:
                out.append([self._point(current, name, v) for v in values])
        modes: List[Setting] = []
        for unaligned in self.space.get("unaligned", (current.unaligned,)):
            timeouts = self.space.get("aligned_timeout_ms", (current.aligned_timeout_ms,)) if unaligned else (0,)
            modes += [current.with_(unaligned=unaligned, aligned_timeout_ms=t) for t in timeouts]
        modes = list(dict.fromkeys(modes))
        if len(modes) > 1:
            out.append(modes)
        return out

    def _point(self, current: Setting, name: str, value: Any) -> Setting:
        """``current`` with ``name`` set to ``value``; ``interval_ms="auto"`` gets the
        search's own recovery goal (``max_recovery_s``) when it has one."""
        if name == "interval_ms" and value == "auto":
            return current.with_(interval_ms="auto", max_recovery_s=self.max_recovery_s)
        return current.with_(**{name: value})

    def search(self, start: Setting) -> Setting:
        self.base = self.measure(start, self.trial_s, restore=True)
        current = start
        for _pass in range(2):  # a second pass when the budget allows: a later coordinate can move an earlier one
            before = current
            for candidates in self.coordinates(current):
                if self.left() <= 0:
                    return current
                candidates = list(dict.fromkeys([current, *candidates]))
                current = self.race(candidates)
            if current == before:
                break
        return current


def _finalists(search: _Search, trial_s: float, count: int) -> List[Setting]:
    """The finalists measured again on the longest runs, each with its restore; then, while
    the recommendation over every setting's latest measurement (``recommend``) is one not
    measured so, that one too: a short trial's figure is noisier, and the recommendation
    must stand on a run as long as its rivals'. Ends, as each setting is measured so at most
    once. Returns the settings measured so, in order."""
    top = search.ranked(latest(search.trials))[: max(1, count)]
    final = [m.setting for m in top]
    for setting in final:
        search.measure(setting, trial_s * 2, restore=True)
    while True:
        try:
            pick = recommend(search.trials, search.goal, search.max_latency_ms, search.max_recovery_s)[0]
        except ValueError:
            return final  # every setting ran back to back: recommend says so, to the user
        if pick.setting in final:
            return final
        final.append(pick.setting)
        search.measure(pick.setting, trial_s * 2, restore=True)


CONFIRMING_RUNS = 3  # runs each of the recommendation and the defaults, alternately


def _against_the_defaults(
    run: Callable[[Setting, float, bool], Measurement],
    goal: str,
    recommended: Setting,
    start: Setting,
    seconds_of: Callable[[Setting], float],
) -> Tuple[Optional[str], Optional[Measurement]]:
    """The recommendation against the defaults (the search's start) on runs of their
    own, alternately, as many of each: whether it is ahead by more than this machine's
    noise (the spread of each setting's own runs), within it, or behind. A search picks
    the best of single short runs, which on a shared machine can be a lucky one (a user
    measured the recommendation 7% ahead where the same setting's runs differed by
    20-40%). Returns what to say, and the defaults' best run when they came out ahead."""
    runs: Dict[Setting, List[Measurement]] = {start: [], recommended: []}
    for _ in range(CONFIRMING_RUNS):
        for setting in (start, recommended):
            runs[setting].append(run(setting, seconds_of(setting), False))
    scores = {s: [v for v in (_score(m, goal) for m in ms) if math.isfinite(v)] for s, ms in runs.items()}
    if any(len(v) < 2 for v in scores.values()):
        return None, None
    best = {s: max(v) for s, v in scores.items()}
    spread = max([(max(v) - min(v)) / abs(max(v)) for v in scores.values() if max(v)] or [0.0])
    if goal == "throughput":
        if best[start] <= 0:
            return None, None
        gain = best[recommended] / best[start] - 1
        figures = f"{best[recommended]:,.0f} against {best[start]:,.0f} records/s"
    else:  # scores are -p99: lower latency is better
        gain = best[start] / best[recommended] - 1 if best[recommended] else 0.0
        figures = f"p99 {-best[recommended]:,.0f} against {-best[start]:,.0f} ms"
    counts = f"best of {CONFIRMING_RUNS} runs each"
    if gain > spread:
        return (
            f"against the defaults ({start.label}): {figures}, {counts}, {gain:+.0%}, more than the "
            f"{spread:.0%} that runs of one setting differed by here"
        ), None
    if gain < -spread:
        ahead = max(runs[start], key=lambda m: _score(m, goal))
        return (
            f"the defaults ({start.label}) came out ahead of the search's pick ({recommended.label}) on runs "
            f"of their own: {figures}, {counts}, {gain:+.0%}, beyond the {spread:.0%} that runs of one setting "
            "differed by here: the defaults are the recommendation"
        ), ahead
    return (
        f"within this machine's noise: the recommendation against the defaults ({start.label}) measured "
        f"{figures}, {counts}, {gain:+.0%}, where runs of one setting differed by up to {spread:.0%}; "
        "the defaults are as good on this evidence (a longer --trial-s, on a quieter machine, resolves more)"
    ), None


_AUTO_AS = {"buffer_size": 1024, "channel_capacity": 8}  # what None ("auto") is on threads


def _start(space: Dict[str, Tuple[Any, ...]]) -> Setting:
    """The engine's defaults, each moved to the nearest value the space allows."""
    base = Setting()
    changes: Dict[str, Any] = {}
    for name, values in space.items():
        default = getattr(base, name)
        if default is None and None not in values and name in _AUTO_AS:
            # "auto" is not in the space: it moves to the value nearest to what it means on
            # threads (1,024 Python records a buffer, 8 buffers a channel), that value too
            default = _AUTO_AS[name]
            if default in values:
                changes[name] = default
        if default not in values:
            numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            changes[name] = min(numeric, key=lambda v: abs(v - default)) if numeric else values[0]
    return base.with_(**changes)


def tune(
    job: Union[str, JobBuilder, None] = None,
    *,
    goal: str = "throughput",
    max_latency_ms: Optional[float] = None,
    max_recovery_s: Optional[float] = None,
    budget_s: float = 120.0,
    trial_s: float = 1.0,
    parallelism: int = 2,
    space: Optional[Mapping[str, Sequence[Any]]] = None,
    latency_field: Optional[str] = None,
    input_rate_per_s: Optional[float] = None,
    report_dir: Optional[str] = None,
    benchmark_json: Optional[str] = None,
    progress: bool = False,
    finalists: int = 2,
) -> TuneResult:
    """Measures ``job`` across buffer and checkpoint settings and recommends one.

    ``job``: ``build(env)`` (adds the job's pipeline to the environment it is given),
    ``"module:function"`` naming one, or a built-in job (``"keyed-count"``, the default).
    A job runs ``trial_s`` seconds per trial (longer where an interval needs it), so an
    unbounded job is what to give it; a bounded one that ends sooner runs all of its input
    each trial, its recovery cannot be measured (restored at its end, it has nothing left
    to read), and the result's messages say so. ``goal``: ``"throughput"`` (records/s) or ``"latency"``
    (end-to-end p99); ``max_latency_ms`` and ``max_recovery_s`` are constraints, honoured
    when a setting tried meets them, and reported as not honoured when none does.
    ``budget_s`` bounds the search (the finalists' runs come after it, and, when the
    recommendation is not the defaults, two more runs of each, alternately, that say
    whether it beats them by more than the runs' spread). ``space``: the
    values to try per setting (default ``pyengine.tune.settings.DEFAULT_SPACE``).
    ``latency_field``: a column/key with each record's creation time (s since the
    epoch) carried to the sink, for measured latency (else it is derived from checkpoint
    completions). ``input_rate_per_s``: the job's production input rate, for recovery's
    replay (default: at capacity). ``report_dir``: write ``report.html`` with its
    figures there; ``benchmark_json``: write the trials as pytest-benchmark JSON."""
    if goal not in GOALS:
        raise ValueError(f"tune: goal must be one of {', '.join(GOALS)}, got {goal!r}")
    for name, value in (("max_latency_ms", max_latency_ms), ("max_recovery_s", max_recovery_s)):
        if value is not None and not value > 0:
            raise ValueError(f"tune: {name} must be > 0, got {value!r}")
    if not budget_s > 0 or not trial_s > 0:
        raise ValueError("tune: budget_s and trial_s must be > 0")
    checked = check_space(DEFAULT_SPACE if space is None else space)
    build, builtin_field, name = load_job(job)
    field_ = latency_field if latency_field is not None else builtin_field
    started = time.monotonic()

    def run(setting: Setting, seconds: float, restore: bool) -> Measurement:
        return measure(
            build,
            setting,
            parallelism=parallelism,
            seconds=seconds,
            latency_field=field_,
            input_rate_per_s=input_rate_per_s,
            measure_restore=restore,
            name=f"tune-{name}",
        )

    bar = _Progress(budget_s) if progress else None
    try:
        search = _Search(
            run,
            checked,
            goal,
            max_latency_ms,
            max_recovery_s,
            budget_s,
            trial_s,
            bar.update if bar is not None else None,
        )
        search.search(_start(checked))
        final = _finalists(search, trial_s, finalists)
    finally:
        if bar is not None:
            bar.close()
    assert search.base is not None
    best, honoured, messages = recommend(search.trials, goal, max_latency_ms, max_recovery_s)
    start = _start(checked)
    if best.setting != start and all(honoured.values()):
        message, ahead = _against_the_defaults(
            run, goal, best.setting, start, lambda setting: search.seconds(setting, trial_s * 2)
        )
        if ahead is not None and max_latency_ms is None and max_recovery_s is None:
            # the defaults' best run becomes their latest measurement, and the choice is made
            # again over every setting: the recommendation stays on the frontier the report draws
            ahead.restore_s = _restore_estimate(ahead, search.base)
            search.trials.append(ahead)
            best, honoured, messages = recommend(search.trials, goal, max_latency_ms, max_recovery_s)
            if message is not None and best.setting != start:
                message = message.replace(
                    "the defaults are the recommendation",
                    f"but {best.setting.label} beats their best run, and is the recommendation",
                )
        if message is not None:
            messages.append(message)
        if ahead is not None and (max_latency_ms is not None or max_recovery_s is not None):
            messages.append("the pick stays, as the defaults' runs were not measured against the constraints")
    result = TuneResult(
        goal,
        best.setting,
        best,
        search.trials,
        honoured,
        messages,
        parallelism,
        max_latency_ms,
        max_recovery_s,
        time.monotonic() - started,
        search.base.restore_s,
        finalists=final,
    )
    if report_dir is not None:
        from .report import write_report

        result.files.update(write_report(result, report_dir))
    if benchmark_json is not None:
        from .report import write_benchmark_json

        result.files["benchmark_json"] = write_benchmark_json(result, benchmark_json)
    return result


class _Progress:
    """A progress bar through the search's budget (rich, on stderr)."""

    def __init__(self, budget_s: float) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("tune"),
            BarColumn(),
            TextColumn("{task.completed:>3.0f}%"),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=Console(stderr=True),
            transient=False,
        )
        self.task = self.progress.add_task("", total=100)
        self.progress.start()

    def update(self, label: str, fraction: float) -> None:
        self.progress.update(self.task, completed=100 * fraction, description=label)

    def close(self) -> None:
        self.progress.update(self.task, completed=100)
        self.progress.stop()
