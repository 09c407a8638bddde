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


def _job(seen: List[int], gate: Any = None, n: int = 10) -> pe.StreamEnvironment:
    """A job whose map records ``gc.get_freeze_count()`` as it runs; with ``gate``, it
    waits on it first (to hold the job running while another starts and ends)."""

    def probe(value: Any) -> Any:
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
    gate = threading.Event()
    first_seen: List[int] = []
    first = _job(first_seen, gate).execute_async("first")
    try:
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
