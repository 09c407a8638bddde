"""``JobClient``: a job started with ``StreamEnvironment.execute_async``, as Flink's
``JobClient``: savepoints while it runs, and ``wait()`` for its result, which raises
``JobFailedError`` for a failed run as ``execute`` does."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

from ..errors import JobFailedError, KeySelectorError, NonRetryableError, UnhashableKeyError
from ..monitoring.console import checkpoint_summary_html
from ..runners.result import JobResult
from ..runtime.base import UserFunctionError
from ..runtime.statistics import EventTimeStatistics, event_time_statistics


def _raise_if_failed(result: JobResult) -> JobResult:
    if result.status != "FAILED":
        return result
    cause = result.cause
    user = cause.__cause__ if cause is not None and cause.__cause__ is not None else cause
    # the user's exception, with where it was raised when the runner wrapped it
    # (UserFunctionError, KeySelectorError: their messages name the operator and repeat it)
    what = f"{type(user).__name__}: {user}" if user is not None else "unknown cause"
    if isinstance(cause, UserFunctionError) and user is not cause and str(cause):
        what = str(cause)  # "operator 'x' (subtask 0): KeyError: ..."
    elif isinstance(cause, (KeySelectorError, UnhashableKeyError, NonRetryableError)) and user is not cause:
        # "key_by into 'x': ...", or the engine's own refusal, which names the operator and the way out
        what = f"{type(cause).__name__}: {cause}"
    raise JobFailedError(
        f"job {result.name!r} (run {result.job_id}) failed after {result.restarts} restart(s): {what}",
        result,
        user,
    ) from user


class JobClient:
    """A running job: ``trigger_savepoint(dir)``, ``stop_with_savepoint(dir)``, ``wait()``."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self._result: Any = None
        self._error: Optional[BaseException] = None
        # Set when the job's thread is done. Not Thread.is_alive(): a Ctrl-C that lands
        # inside Thread.join can leave a running thread marked stopped (CPython 3.11),
        # and the job would be left running while wait() reported it over.
        self._done = threading.Event()
        runner.start_monitoring()  # before the job's thread, so monitoring_url is there at once
        self._thread = threading.Thread(target=self._run, name=f"job-{runner.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._runner.run()
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    def _wait_running(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._runner.all_running():
            if self._done.is_set():
                raise RuntimeError(f"job {self._runner.name!r} is not running: {self._ended()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {self._runner.name!r} is not running after {timeout_s:g} s")
            time.sleep(0.005)

    def _ended(self) -> str:
        """How the job's run ended, for an error about a job no longer running."""
        if self._error is not None:
            return f"it failed: {type(self._error).__name__}: {self._error}"
        result = self._result
        status = getattr(result, "status", None)
        cause = getattr(result, "cause", None)
        if status == "FAILED" and cause is not None:
            return f"it FAILED: {cause}"
        return f"it ended {status}" if status else "it ended"

    def trigger_savepoint(self, directory: str, timeout_s: float = 600) -> str:
        self._wait_running(timeout_s)
        return str(self._runner.trigger_savepoint(directory, timeout_s))

    def stop_with_savepoint(self, directory: str, timeout_s: float = 600) -> str:
        """Takes a savepoint in ``directory`` and stops the job (status FINISHED); returns
        the savepoint's path, for ``execute(name, resume=path)``. As Flink's synchronous
        savepoint, nothing is output past it: the sources emit nothing after its barrier.
        If it fails, this raises and the job goes on. If ``timeout_s`` passes first, this
        raises TimeoutError and the savepoint goes on: the job stops once it completes."""
        self._wait_running(timeout_s)
        return str(self._runner.stop_with_savepoint(directory, timeout_s))

    @property
    def checkpoints(self) -> Any:
        """The live ``CheckpointStatsTracker`` (None until the job has started)."""
        coordinator = self._runner.coordinator
        return None if coordinator is None else coordinator.stats

    @property
    def restarts(self) -> int:
        """Restarts so far."""
        return int(self._runner.restarts)

    def event_time(self) -> EventTimeStatistics:
        """Event time now, live: each subtask's watermarks and the late records
        dropped so far (``pyengine.runtime.statistics.EventTimeStatistics``): the embedded
        runner's tasks read directly; on Spark, as the tasks last reported them with
        their poll (about once a second: ``_SparkJob.event_time_statistics``)."""
        reported = getattr(self._runner, "event_time_statistics", None)
        if callable(reported):
            return reported()  # type: ignore[no-any-return]
        return event_time_statistics(list(getattr(self._runner, "_tasks", [])))

    def watermarks(self) -> Dict[str, List[int]]:
        """Each vertex's subtasks' current input watermark (``event_time().watermarks``)."""
        return self.event_time().watermarks

    @property
    def monitoring_url(self) -> Optional[str]:
        """Where the job's monitoring server answers (None when monitoring is off or
        could not listen; ``pyengine.monitoring`` says why)."""
        monitor = self._runner.monitor
        return None if monitor is None else monitor.url

    def _repr_html_(self) -> str:
        stats = self.checkpoints
        if stats is None:
            return f"<p>job <b>{self._runner.name}</b> starting</p>"
        status = "DONE" if self.done() else "RUNNING"
        return checkpoint_summary_html(
            stats, name=self._runner.name, status=status, restarts=self.restarts, url=self.monitoring_url
        )

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Ends the job without a savepoint (an unbounded one runs until this or
        ``stop_with_savepoint``); ``wait()`` then returns its result, status
        ``CANCELED``. What completed checkpoints committed stays; running the job
        again resumes from the latest one."""
        cancel = getattr(self._runner, "cancel", None)
        if cancel is None:
            raise NotImplementedError(f"{type(self._runner).__name__} cannot cancel a job")
        cancel()

    def wait(self, timeout_s: Optional[float] = None, *, raise_failure: bool = True) -> JobResult:
        """The job's result once it ends; raises ``JobFailedError`` if it failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._done.is_set():  # short waits: Ctrl-C reaches the waiting thread
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._done.wait(0.1 if left is None else min(0.1, left))
        if not self._done.is_set():
            raise TimeoutError(f"job {self._runner.name!r} still running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        return _raise_if_failed(self._result) if raise_failure else self._result
