"""A job in the terminal and in notebooks: the live progress line (through
``rich``, on a terminal only) and the checkpoint summary ``JobResult`` and
``JobClient`` render in Jupyter (``_repr_html_``)."""

from __future__ import annotations

import html
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, TextIO

if TYPE_CHECKING:
    from .metrics import JobSample
    from .monitor import JobMonitor

__all__ = ["ProgressLine", "checkpoint_summary_html", "human_bytes", "progress_text"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop returns


def progress_text(monitor: JobMonitor, sample: JobSample, now_ms: Optional[float] = None) -> str:
    """One line: state, records read and their rates, the latest checkpoint, failures, restarts."""
    vertices = monitor.vertices()
    first = vertices[0].id if vertices else ""
    last = vertices[-1].id if vertices else ""
    read = sum(s.records_in for (v, _), s in sample.subtasks.items() if v == first)
    rate_in = sum(s.records_in_per_s for (v, _), s in sample.subtasks.items() if v == first)
    rate_out = sum(s.records_in_per_s for (v, _), s in sample.subtasks.items() if v == last)
    tracker = monitor.tracker()
    counts = dict(tracker.counts)
    latest = tracker.latest_completed
    now = time.time() * 1000 if now_ms is None else now_ms
    if latest is not None:
        done = float(latest.trigger_timestamp) + float(latest.end_to_end_duration_ms)
        checkpoint = (
            f"checkpoint {latest.id} {max(0.0, now - done) / 1000:.1f}s ago "
            f"({float(latest.end_to_end_duration_ms):.0f} ms, {human_bytes(latest.checkpointed_size)})"
        )
    else:
        checkpoint = "no checkpoint yet"
    state = monitor.state()
    if monitor.end_ms > 0:  # ended: the run's average, not the last interval's (which is idle)
        seconds = max(0.001, (monitor.end_ms - monitor.start_ms) / 1000)
        rates = f"{read / seconds:,.0f}/s on average over {seconds:.1f} s"
    else:
        rates = f"{rate_in:,.0f}/s in, {rate_out:,.0f}/s at the sink"
    return (
        f"{monitor.name} {state} | {read:,} records read ({rates})"
        f" | {checkpoint} | {counts.get('failed', 0)} failed | {monitor.restarts} restart(s)"
    )


class ProgressLine:
    """A live line under ``execute`` on a terminal (never in a pipe or a log file)."""

    def __init__(self, monitor: JobMonitor, stream: Optional[TextIO] = None) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        self._text = Text
        self.monitor = monitor
        self._live = Live(
            Text(f"{monitor.name} starting"),
            console=Console(file=stream or sys.stderr),
            refresh_per_second=4,
            transient=False,
        )
        self._live.start()
        monitor.on_sample.append(self.update)

    @staticmethod
    def wanted(stream: Optional[TextIO] = None) -> bool:
        target = stream or sys.stderr
        try:
            return bool(target.isatty())
        except (AttributeError, ValueError):
            return False

    def update(self, monitor: JobMonitor, sample: JobSample) -> None:
        self._live.update(self._text(progress_text(monitor, sample)))

    def close(self) -> None:
        try:
            self.monitor.on_sample.remove(self.update)
        except ValueError:
            pass
        self.update(self.monitor, self.monitor.latest())
        self._live.stop()


def checkpoint_summary_html(
    tracker: Any,
    *,
    name: str,
    status: str,
    restarts: int,
    url: Optional[str] = None,
    duration_s: Optional[float] = None,
) -> str:
    """An HTML summary of a job's checkpoints (for Jupyter): counts, the latest
    completed one, durations and sizes over all completed ones, the history."""
    e = html.escape
    counts = dict(tracker.counts)
    summary = tracker.summary()
    latest = tracker.latest_completed
    failed = tracker.latest_failed
    head = f"<b>{e(name)}</b> &mdash; {e(status)}"
    if duration_s is not None:
        head += f" in {duration_s:.1f} s"
    head += f", {restarts} restart(s)"
    if url:
        head += f' &mdash; <a href="{e(url)}" target="_blank">monitoring</a>'
    rows = [
        (
            "checkpoints",
            f"{counts.get('completed', 0)} completed, {counts.get('failed', 0)} failed, "
            f"{counts.get('in_progress', 0)} in progress, {counts.get('restored', 0)} restored",
        ),
    ]
    if latest is not None:
        rows.append(
            (
                "latest completed",
                f"#{latest.id}: {float(latest.end_to_end_duration_ms):.0f} ms, "
                f"{human_bytes(latest.checkpointed_size)} written, {human_bytes(latest.full_size)} full state",
            )
        )
    duration = summary.get("end_to_end_duration_ms", {})
    if counts.get("completed", 0):
        rows.append(
            (
                "duration (ms)",
                f"min {float(duration.get('min', 0)):.0f} / avg {float(duration.get('avg', 0)):.0f} / "
                f"p99 {float(duration.get('p99', 0)):.0f} / max {float(duration.get('max', 0)):.0f}",
            )
        )
    if failed is not None:
        rows.append(("latest failed", f"#{failed.id}: {failed.failure_message or ''}"))
    body = "".join(f"<tr><th style='text-align:left'>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows)
    history = "".join(
        f"<tr><td>{s.id}</td><td>{e(s.type)}</td><td>{e(s.status)}</td>"
        f"<td>{float(s.end_to_end_duration_ms):.0f}</td><td>{e(human_bytes(s.checkpointed_size))}</td>"
        f"<td>{e(human_bytes(s.full_size))}</td></tr>"
        for s in list(tracker.history)
    )
    table = (
        "<table><tr><th>id</th><th>type</th><th>status</th><th>duration (ms)</th><th>written</th>"
        f"<th>full state</th></tr>{history}</table>"
        if history
        else ""
    )
    return f"<div class='pyengine-job'><p>{head}</p><table>{body}</table>{table}</div>"
