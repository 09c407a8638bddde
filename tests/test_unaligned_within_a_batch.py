"""An unaligned barrier overtakes the rest of a batch of buffers the task took from
its gate, not only what is still queued there.

A task takes buffers from its gate in batches (up to 64, sized to about 2 ms of
work). Before, a barrier that arrived while a batch was being processed waited for
the whole batch: with a slow middle task that was most of its queued input (an
unaligned checkpoint took as long as an aligned one). Now the task looks for a
priority barrier within the batch, and a checkpoint it triggers there persists the
batch's unprocessed buffers as in-flight input, ahead of what the gate hands over.
These tests check that the path runs, and that it is exactly once: state, in-flight
data and output agree after failures."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, List

import pytest

import pyengine as pe
from pyengine.runtime.task import StreamTask

RECORDS = 3000


class Chaos:
    """Fails once, at the n-th call."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.fired = at, 0, False
        self.lock = threading.Lock()

    def hit(self) -> None:
        with self.lock:
            self.calls += 1
            if self.fired or self.calls < self.at:
                return
            self.fired = True
        raise RuntimeError("injected failure")


class Uneven(pe.ProcessFunction):
    """Slow on one record in 64 (8 ms), fast otherwise: batches of several buffers of
    which one takes long, so a barrier comes up in the middle of a batch."""

    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos

    def __deepcopy__(self, memo: Any) -> Uneven:
        return Uneven(self.chaos)  # one chaos for every subtask and attempt

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.chaos.hit()
        if value % 64 == 0:
            time.sleep(0.008)
        yield value


class Count(pe.KeyedProcessFunction):
    """A running count per key: a replayed or lost record changes a later count."""

    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(pe.ValueStateDescriptor("count", 0))

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield (value % 7, n)


@pytest.fixture
def held_triggers(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """How many checkpoints each trigger saw taken with part of a batch still held."""
    seen: List[int] = []
    original = StreamTask.perform_checkpoint

    def perform(self: StreamTask, checkpoint_id: int, timestamp: int, options: Any, metrics: Any) -> None:
        if self._held:
            seen.append(len(self._held))
        original(self, checkpoint_id, timestamp, options, metrics)

    monkeypatch.setattr(StreamTask, "perform_checkpoint", perform)
    return seen


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_a_barrier_within_a_batch_persists_the_rest_of_it_exactly_once(
    tmp_path: Any, held_triggers: List[int], backend: str
) -> None:
    chaos = Chaos(RECORDS)  # fails once, well into the run (each record passes once or more)
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=5, unaligned=True),
        checkpoint_storage=str(tmp_path / "ckpt"),
        state_backend=backend,
        buffer_size=8,
        buffer_timeout_ms=1,
        channel_capacity=8,
        restart_attempts=2,
        monitoring=None,
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"))
    (
        env.from_generator(lambda i: i, count=RECORDS)
        .rebalance()
        .process(Uneven(chaos))
        .key_by(lambda v: v % 7)
        .process(Count())
        .uid("count")
        .sink_to(sink)
    )
    result = env.execute(f"within-a-batch-{backend}")
    assert chaos.fired and result.restarts == 1
    assert held_triggers, "no checkpoint was triggered within a batch: the path under test did not run"
    got = Counter(tuple(r) for r in sink.read_committed())
    per_key = Counter(v % 7 for v in range(RECORDS))
    assert got == Counter({(k, n): 1 for k, total in per_key.items() for n in range(1, total + 1)})
