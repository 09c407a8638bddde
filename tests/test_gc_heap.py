"""The embedded runner and the garbage collector: what the process held when a job
started is frozen while it runs (``gc.freeze``) and unfrozen after, counted across
concurrent jobs and never undoing a freeze of the user's; a job's temporary checkpoint
directory goes when its result does, not at some later collection of reference cycles."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any, Iterator, List

import pytest

import pyengine as pe


def _job(seen: List[int], gate: Any = None, n: int = 10, started: Any = None) -> pe.StreamEnvironment:
    """A job whose map records ``gc.get_freeze_count()`` as it runs; with ``gate``, it
    waits on it first (to hold the job running while another starts and ends), having
    set ``started`` (the job is running, so it has frozen the heap)."""

    def probe(value: Any) -> Any:
        if started is not None:
            started.set()
        if gate is not None:
            assert gate.wait(30), "the test never released the job"
        seen.append(gc.get_freeze_count())
        return value

    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    env.from_collection(list(range(n))).map(probe).sink_to(pe.sinks.DiscardSink())
    return env


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_heap_is_frozen_while_a_job_runs_and_unfrozen_after(unfrozen: None) -> None:
    before = [object() for _ in range(100)]  # objects of the user's, from before the job
    seen: List[int] = []
    assert _job(seen).execute("frozen").status == "FINISHED"
    assert seen and min(seen) >= len(before), f"freeze counts seen in the job: {seen}"
    assert gc.get_freeze_count() == 0


def test_a_freeze_of_the_users_is_left_as_it_is(unfrozen: None) -> None:
    gc.freeze()
    users = gc.get_freeze_count()
    seen: List[int] = []
    _job(seen).execute("user-froze")
    # frozen objects still die of their reference counts (a few do here): not equal, but
    # nowhere near the zero an unfreeze leaves
    assert gc.get_freeze_count() >= users - 100, "the job's end unfroze what the user had frozen"


def test_concurrent_jobs_unfreeze_once_at_the_end_of_the_last(unfrozen: None) -> None:
    gate, started = threading.Event(), threading.Event()
    first_seen: List[int] = []
    first = _job(first_seen, gate, started=started).execute_async("first")
    try:
        assert started.wait(30), "the first job never ran"
        second_seen: List[int] = []
        assert _job(second_seen).execute("second").status == "FINISHED"
        # the first still runs: its heap must still be frozen
        assert gc.get_freeze_count() > 0, "the second job's end unfroze the heap under the first"
    finally:
        gate.set()
    assert first.wait(60).status == "FINISHED"
    assert gc.get_freeze_count() == 0


def test_a_failed_job_unfreezes_too(unfrozen: None) -> None:
    def boom(value: Any) -> Any:
        raise ValueError("boom")

    env = pe.StreamEnvironment(parallelism=1, monitoring=None, restart_attempts=0)
    env.from_collection([1, 2]).map(boom).sink_to(pe.sinks.DiscardSink())
    with pytest.raises(pe.errors.JobFailedError):
        env.execute("fails")
    assert gc.get_freeze_count() == 0


def test_the_temporary_checkpoint_directory_goes_with_the_result() -> None:
    env = pe.StreamEnvironment(parallelism=2, monitoring=None)
    env.from_collection([{"user": i % 3} for i in range(100)]).key_by("user").aggregate(pe.agg.count()).sink_to(
        pe.sinks.DiscardSink()
    )
    gc.disable()  # no collection may clean up for the runner's reference cycles
    try:
        result = env.execute("temp")
        directory = result.checkpoint_dir
        assert directory and os.path.isdir(directory)
        del result
        assert not os.path.exists(directory), "the checkpoint directory outlived its result"
    finally:
        gc.enable()


def test_a_finished_runs_keyed_state_is_released_with_its_run() -> None:
    """The runner and its tasks are reference cycles; a later job freezes them with the
    rest of the heap. Their keyed state must not ride along: it is dropped when the run
    ends, after the tasks' close() (which may read it) has run."""
    import pyarrow as pa

    descriptor = pe.ValueStateDescriptor("count", 0, pa.int64())
    seen: List[Any] = []

    class Count(pe.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.count = ctx.get_state(descriptor)
            seen.append(ctx._backend)

        def process_element(self, value: Any, ctx: Any) -> Any:
            self.count.update(self.count.value() + 1)
            return ()

        def close(self) -> None:
            seen.append(self.count.value() is not None)  # state still readable in close()

    env = pe.StreamEnvironment(parallelism=2, monitoring=None)
    env.from_collection([{"u": i % 50} for i in range(1000)]).key_by("u").process(Count()).sink_to(
        pe.sinks.DiscardSink()
    )
    assert env.execute("released").status == "FINISHED"
    backends = [b for b in seen if not isinstance(b, bool)]
    assert len(backends) == 2 and all(b.num_entries() == 0 for b in backends)
    assert [b for b in seen if isinstance(b, bool)] == [True, True]


def test_tasks_raise_the_young_threshold_counted_and_leave_a_changed_or_disabled_one() -> None:
    """Counted across tasks: raised at the first's start, restored at the last's end;
    a threshold changed while tasks ran, or 0 (the collector off), is left as set."""
    from pyengine.runtime.collector import TASK_GC_THRESHOLD, _YoungGenerationWhileRunning

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        young = _YoungGenerationWhileRunning()
        young.enter()
        young.enter()
        assert gc.get_threshold() == (TASK_GC_THRESHOLD, 10, 10)
        young.exit()
        assert gc.get_threshold() == (TASK_GC_THRESHOLD, 10, 10), "one task still runs"
        young.exit()
        assert gc.get_threshold() == (700, 10, 10)
        young.enter()
        gc.set_threshold(5000, 10, 10)  # the user's, while a task runs
        young.exit()
        assert gc.get_threshold() == (5000, 10, 10)
        gc.set_threshold(0, 10, 10)
        young.enter()
        assert gc.get_threshold() == (0, 10, 10)
        young.exit()
        assert gc.get_threshold() == (0, 10, 10)
    finally:
        gc.set_threshold(*before)
