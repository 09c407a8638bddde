"""What ``tune`` shows: a table on the terminal, an HTML report with its figures (the
throughput/latency frontier, checkpoint duration against the interval, recovery against
the interval) and the recommended settings as a snippet, and pytest-benchmark JSON so a
benchmark suite can compare settings over time (``pytest-benchmark compare``)."""

from __future__ import annotations

import datetime
import html
import json
import math
import os
import platform
import statistics
from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from .measure import Measurement
    from .search import TuneResult

__all__ = ["benchmark_entry", "print_table", "write_benchmark_json", "write_report"]


def _fmt(value: float, spec: str = ",.0f", suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def _rows(result: TuneResult) -> List[Measurement]:
    """One row per setting: its latest (longest) measurement, the one the recommendation
    was chosen by; the recommendation first, then the other finalists (measured on the
    longest runs), then the rest, each part best first. Ranked all together, a short
    trial's lucky figure could sit above the recommendation and make it look wrong."""
    from .ranking import latest, rank

    ranked = rank(latest(result.trials), result.goal, result.max_latency_ms, result.max_recovery_s)
    final = set(result.finalists)
    first = [m for m in ranked if m.setting == result.recommended]
    return (
        first
        + [m for m in ranked if m.setting in final and m.setting != result.recommended]
        + [m for m in ranked if m.setting not in final and m.setting != result.recommended]
    )


COLUMNS = (
    "setting",
    "records/s",
    "latency p50/p99",
    "checkpoint p50/p99",
    "start delay p99",
    "alignment p99",
    "size",
    "in-flight persisted",
    "recovery",
)


def _cells(m: Measurement) -> List[str]:
    restore = "" if m.restore_measured else " (est.)"
    return [
        m.setting.label,
        _fmt(m.throughput),
        f"{_fmt(m.latency_p50_ms)} / {_fmt(m.latency_p99_ms, suffix=' ms')}",
        f"{_fmt(m.checkpoint_p50_ms)} / {_fmt(m.checkpoint_p99_ms, suffix=' ms')}",
        _fmt(m.start_delay_p99_ms, suffix=" ms"),
        _fmt(m.alignment_p99_ms, ",.1f", " ms"),
        _fmt(m.checkpoint_size / 1024 if m.checkpoint_size == m.checkpoint_size else math.nan, ",.0f", " KiB"),
        _fmt(m.persisted_max / 1024 if m.persisted_max == m.persisted_max else math.nan, ",.1f", " KiB"),
        _fmt(m.recovery_s, ",.2f", f" s{restore}"),
    ]


def print_table(result: TuneResult, console: Any = None, limit: int = 15) -> None:
    """The settings tried, best first, and the recommendation (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"pyengine tune: goal {result.goal}, {len(result.trials)} runs in {result.elapsed_s:.0f} s")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c == "setting" else "right")
    final = set(result.finalists)
    for m in _rows(result)[:limit]:
        cells = _cells(m)
        # marked in words too: a table printed to a pipe or a file has no colour
        if m.setting == result.recommended:
            cells[0] = f"{cells[0]} (recommended)"
        elif m.setting in final:
            cells[0] = f"{cells[0]} (finalist)"
        style = "bold green" if m.setting == result.recommended else None
        table.add_row(*cells, style=style)
    console.print(table)
    console.print(f"[bold]recommended[/bold]: {result.recommended.label}")
    for line in result.messages:
        console.print(f"  {line}", markup=False, highlight=False)  # plain text: "[tune]" is no markup tag
    console.print(result.snippet(), markup=False, highlight=False)


def _legend(ax: Any) -> None:
    """A legend when the figure has labelled data (matplotlib warns on an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _figures(result: TuneResult, directory: str) -> Dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    rows = _rows(result)
    best = result.measurement
    out: Dict[str, str] = {}

    def save(fig: Any, name: str) -> None:
        path = os.path.join(directory, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out[name.rsplit(".", 1)[0]] = path

    # throughput against latency: the frontier of the settings the recommendation was chosen
    # among (ranking.candidates), the same one it is on; back-to-back intervals marked apart
    from .ranking import back_to_back, candidates, frontier

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pool = {id(m) for m in candidates(rows, result.max_latency_ms, result.max_recovery_s)}
    points = [m for m in rows if not math.isnan(m.latency_p99_ms)]
    shown = [m for m in points if not back_to_back(m)]
    if shown:
        px, py = [m.latency_p99_ms for m in shown], [m.throughput for m in shown]
        ax.scatter(px, py, color="#8aa", label="settings tried")
    apart = [m for m in points if back_to_back(m)]
    if apart:
        ax.scatter(
            [m.latency_p99_ms for m in apart],
            [m.throughput for m in apart],
            marker="x",
            color="#999",
            label="checkpoints back to back (not considered)",
        )
    line = sorted(frontier([m for m in points if id(m) in pool]), key=lambda m: m.latency_p99_ms)
    if line:
        ax.plot([m.latency_p99_ms for m in line], [m.throughput for m in line], "-o", color="#1f6feb", label="frontier")
    if not math.isnan(best.latency_p99_ms):
        ax.scatter([best.latency_p99_ms], [best.throughput], s=160, marker="*", color="#d73a49", label="recommended")
    if result.max_latency_ms is not None:
        ax.axvline(result.max_latency_ms, color="#d73a49", ls="--", lw=1, label="max latency")
    ax.set_xlabel("end-to-end latency p99 (ms)")
    ax.set_ylabel("throughput (records/s)")
    ax.set_title("throughput against latency")
    _legend(ax)
    save(fig, "frontier.png")

    # by the interval the run used: interval_ms="auto" sits where the coordinator put it
    by_interval: Dict[int, List[Measurement]] = {}
    for m in rows:
        used = m.interval_ms if not math.isnan(m.interval_ms) else m.setting.nominal_interval_ms
        by_interval.setdefault(round(used), []).append(m)
    intervals = sorted(by_interval)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pick in (("aligned", False), ("unaligned", True)):
        xs, p50, p99 = [], [], []
        for i in intervals:
            ms = [m for m in by_interval[i] if m.setting.unaligned == pick and m.checkpoints]
            if ms:
                xs.append(i)
                p50.append(statistics.median(m.checkpoint_p50_ms for m in ms))
                p99.append(statistics.median(m.checkpoint_p99_ms for m in ms))
        if xs:
            ax.plot(xs, p50, "-o", label=f"{label} p50")
            ax.plot(xs, p99, "--o", label=f"{label} p99")
    ax.set_xlabel("checkpoint interval (ms)")
    ax.set_ylabel("checkpoint duration (ms)")
    ax.set_title("checkpoint duration against interval")
    _legend(ax)
    save(fig, "checkpoint_duration.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [i for i in intervals if any(not math.isnan(m.recovery_s) for m in by_interval[i])]
    restore = [statistics.median(m.restore_s for m in by_interval[i] if not math.isnan(m.restore_s)) for i in xs]
    replay = [statistics.median(m.replay_s for m in by_interval[i] if not math.isnan(m.replay_s)) for i in xs]
    if xs:
        ax.bar([str(i) for i in xs], restore, color="#8aa", label="restore")
        ax.bar([str(i) for i in xs], replay, bottom=restore, color="#1f6feb", label="replay of one interval")
    if result.max_recovery_s is not None:
        ax.axhline(result.max_recovery_s, color="#d73a49", ls="--", lw=1, label="max recovery")
    ax.set_xlabel("checkpoint interval (ms)")
    ax.set_ylabel("recovery time (s)")
    ax.set_title("recovery time against interval")
    _legend(ax)
    save(fig, "recovery.png")
    return out


def write_report(result: TuneResult, directory: str) -> Dict[str, str]:
    """``report.html`` and its figures (PNG, beside it) in ``directory``; their paths."""
    os.makedirs(directory, exist_ok=True)
    try:
        files = _figures(result, directory)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        # an optional extra: the search's results must not be lost for want of figures
        files = {}
        result.messages.append('the report has no figures: they need matplotlib (pip install "pyengine[tune]")')
    rows = "\n".join(
        "<tr{}>{}</tr>".format(
            ' class="best"' if m.setting == result.recommended else "",
            "".join(f"<td>{html.escape(c)}</td>" for c in _cells(m)),
        )
        for m in _rows(result)
    )
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    images = "\n".join(
        f'<figure><img src="{os.path.basename(path)}" alt="{name}"><figcaption>{name.replace("_", " ")}</figcaption>'
        "</figure>"
        for name, path in files.items()
    )
    messages = "".join(f"<li>{html.escape(m)}</li>" for m in result.messages) or "<li>no constraints given</li>"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>pyengine tune: {html.escape(result.goal)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }} table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 6px; text-align: right; }} td:first-child {{ text-align: left; }}
tr.best {{ background: #e6ffed; font-weight: bold; }} figure {{ display: inline-block; margin: 1em; }}
pre {{ background: #f6f8fa; padding: 1em; }}
</style></head><body>
<h1>pyengine tune — goal: {html.escape(result.goal)}</h1>
<p>{len(result.trials)} runs in {result.elapsed_s:.0f} s, parallelism {result.parallelism}.
Recommended: <b>{html.escape(result.recommended.label)}</b></p>
<ul>{messages}</ul>
<h2>Recommended settings</h2>
<pre id="snippet">{html.escape(result.snippet())}</pre>
<h2>Figures</h2>
{images or "<p>none: matplotlib is not installed (pip install &quot;pyengine[tune]&quot;)</p>"}
<h2>Settings tried (best first)</h2>
<table><tr>{head}</tr>
{rows}
</table>
<p>Recovery is restore (measured where not marked "est."; the others scale the measured one by state size)
plus the replay of one interval and one checkpoint's duration at the measured throughput.</p>
</body></html>
"""
    path = os.path.join(directory, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    files["html"] = path
    return files


def benchmark_entry(
    name: str, group: str, seconds: List[float], extra_info: Dict[str, Any], params: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """One benchmark in pytest-benchmark's JSON shape, from the seconds of its rounds."""
    data = sorted(seconds)
    n = len(data)
    q = statistics.quantiles(data, n=4) if n > 1 else [data[0]] * 3
    iqr = q[2] - q[0]
    mean = statistics.fmean(data)
    return {
        "group": group,
        "name": name,
        "fullname": f"pyengine-tune::{name}",
        "params": params,
        "param": None,
        "extra_info": extra_info,
        "options": {"disable_gc": False, "timer": "time.time", "min_rounds": n, "max_time": 0, "warmup": False},
        "stats": {
            "min": data[0],
            "max": data[-1],
            "mean": mean,
            "stddev": statistics.stdev(data) if n > 1 else 0.0,
            "rounds": n,
            "median": statistics.median(data),
            "iqr": iqr,
            "q1": q[0],
            "q3": q[2],
            "iqr_outliers": 0,
            "stddev_outliers": 0,
            "outliers": "0;0",
            "ld15iqr": data[0],
            "hd15iqr": data[-1],
            "ops": 1 / mean if mean else 0.0,
            "total": sum(data),
            "data": data,
            "iterations": 1,
        },
    }


def write_benchmark_json(result: TuneResult, path: str) -> str:
    """The settings tried as pytest-benchmark JSON: one benchmark per setting, timed as
    the seconds a million records take at its measured throughput (so a lower row is
    a faster setting, as pytest-benchmark reads it), the other figures in extra_info."""
    from .. import __version__

    by_setting: Dict[Any, List[Measurement]] = {}
    for m in result.trials:
        if m.throughput > 0:
            by_setting.setdefault(m.setting, []).append(m)
    benchmarks = []
    for setting, ms in by_setting.items():
        extra = ms[-1].to_json()
        extra["recommended"] = setting == result.recommended
        benchmarks.append(
            benchmark_entry(
                setting.label, f"tune-{result.goal}", [1e6 / m.throughput for m in ms], extra, setting.to_json()
            )
        )
    doc = {
        "machine_info": {
            "node": platform.node(),
            "processor": platform.processor(),
            "machine": platform.machine(),
            "python_implementation": platform.python_implementation(),
            "python_version": platform.python_version(),
            "system": platform.system(),
            "release": platform.release(),
            "cpu": {"count": os.cpu_count()},
        },
        "commit_info": {"id": None, "dirty": None, "project": "pyengine", "branch": None},
        "benchmarks": benchmarks,
        "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": "pyengine-tune " + __version__,
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str)
    return path
