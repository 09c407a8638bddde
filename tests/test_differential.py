"""The native gate against the pure-Python reference: the same random event
sequences through both must give identical outputs, listener calls, in-flight
data and errors."""

from __future__ import annotations

import random
from typing import Any, Callable, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyengine.io import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointedInputGate,
    CheckpointOptions,
    CheckpointType,
    EndOfPartition,
)
from pyengine.testing import ManualClock, RecordingListener

CONFIGS = [
    {"mode": "at_least_once"},
    {"mode": "exactly_once"},
    {"mode": "exactly_once", "unaligned": True},
    {"mode": "exactly_once", "unaligned": True, "aligned_timeout_ms": 5},
]


def _outcome(fn, *args) -> Tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # compared, not swallowed: both sides must fail alike
        return ("error", type(exc).__name__, str(exc))


class Pair:
    """Drives a native and a reference gate in lockstep."""

    def __init__(self, num_channels: int, capacity: int, config: dict) -> None:
        self.clock = ManualClock()
        self.listeners = (RecordingListener(), RecordingListener())
        self.gates = [
            CheckpointedInputGate(
                num_channels, listener, implementation=impl, capacity=capacity, clock=self.clock, **config
            )
            for impl, listener in zip(("native", "reference"), self.listeners, strict=True)
        ]
        self.trace: List[Any] = []

    def both(self, method: str, *args) -> None:
        native, reference = (
            _outcome(getattr(g, method), *(a() if isinstance(a, Fresh) else a for a in args)) for g in self.gates
        )
        assert native == reference, (method, args, self.trace[-20:])
        self.trace.append((method, args, native))

    def check_state(self) -> None:
        native, reference = self.gates
        for attr in (
            "latest_checkpoint_id",
            "blocked_channels",
            "is_finished",
            "last_alignment_duration_ns",
            "last_checkpoint_start_delay_ns",
            "bytes_processed_during_alignment",
        ):
            assert getattr(native, attr) == getattr(reference, attr), attr
        assert self.listeners[0].log == self.listeners[1].log
        assert self.listeners[0].triggered == self.listeners[1].triggered


class Fresh:
    """An argument made anew for each gate: an iterator can be consumed once."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def __call__(self) -> Any:
        return self.make()


def make_item(rng: random.Random, kind: str, serial: int, max_id: int, clock: ManualClock) -> Any:
    if kind == "data":
        return rng.choice([serial, b"x" * (serial % 7), f"s{serial}"])
    if kind == "barrier":
        ctype = CheckpointType.SAVEPOINT if rng.random() < 0.15 else CheckpointType.CHECKPOINT
        ts = clock.now_ms - rng.randrange(0, 50)
        return CheckpointBarrier(rng.randrange(0, max_id), ts, CheckpointOptions(ctype))
    if kind == "cancel":
        return CancelCheckpointMarker(rng.randrange(0, max_id))
    return EndOfPartition()


def run_random(seed: int, num_channels: int, capacity: int, config: dict, steps: int, max_id: int) -> Pair:
    rng = random.Random(seed)
    pair = Pair(num_channels, capacity, config)
    weights = {"data": 60, "barrier": 12, "cancel": 3, "eop": 1}
    for serial in range(steps):
        r = rng.random()
        if r < 0.5:
            kind = rng.choices(list(weights), list(weights.values()))[0]
            ch = rng.randrange(-1 if rng.random() < 0.01 else 0, num_channels + (1 if rng.random() < 0.01 else 0))
            pair.both("push", ch, make_item(rng, kind, serial, max_id, pair.clock))
        elif r < 0.53:
            ch = rng.randrange(num_channels)
            # Mostly data, sometimes an event inside the run; a list or tuple takes
            # the native bulk path, any other iterable the item-by-item one.
            kinds = rng.choices(list(weights), [300, *list(weights.values())[1:]], k=rng.randrange(1, 6))
            items = [make_item(rng, k, serial * 100 + i, max_id, pair.clock) for i, k in enumerate(kinds)]
            container = rng.choice((list, tuple, iter))
            pair.both("push_many", ch, Fresh(lambda c=container, i=items: c(i)))
        elif r < 0.85:
            pair.both("poll_next")
        elif r < 0.92:
            pair.both("poll_batch", rng.randrange(1, 8))
        elif r < 0.95:
            pair.both("poll_priority")
        else:
            pair.clock.advance(rng.randrange(0, 3_000_000))
        if serial % 50 == 0:
            pair.check_state()
    # Drain what is left (only possible once nothing is blocked forever).
    for _ in range(num_channels * (capacity + 6) + 10):
        pair.both("poll_next")
    pair.check_state()
    return pair


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("seed", range(12))
def test_thousands_of_random_events(config: dict, seed: int) -> None:
    rng = random.Random(seed)
    num_channels = rng.choice([1, 2, 3, 8, 64])
    run_random(seed, num_channels, rng.choice([1, 2, 4, 16]), config, steps=3000, max_id=rng.choice([3, 8, 40]))


op = st.one_of(
    st.tuples(st.just("data"), st.integers(0, 63)),
    st.tuples(st.just("many"), st.integers(0, 63), st.integers(1, 9), st.integers(-1, 8)),
    st.tuples(st.just("barrier"), st.integers(0, 63), st.integers(0, 6), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 63), st.integers(0, 6)),
    st.tuples(st.just("eop"), st.integers(0, 63)),
    st.tuples(st.just("poll")),
    st.tuples(st.just("priority")),
    st.tuples(st.just("batch"), st.integers(1, 5)),
    st.tuples(st.just("tick"), st.integers(0, 6_000_000)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(CONFIGS),
    num_channels=st.integers(1, 64),
    capacity=st.integers(1, 6),
    ops=st.lists(op, max_size=300),
)
def test_hypothesis_sequences(config: dict, num_channels: int, capacity: int, ops: list) -> None:
    pair = Pair(num_channels, capacity, config)
    for serial, o in enumerate(ops):
        if o[0] == "data":
            pair.both("push", o[1] % num_channels, serial)
        elif o[0] == "many":
            # A run of data through push_many with, at o[3], a barrier in it (-1: none).
            run = [serial * 10 + i for i in range(o[2])]
            if 0 <= o[3] < len(run):
                run[o[3]] = CheckpointBarrier(serial % 7, 0, CheckpointOptions(CheckpointType.CHECKPOINT))
            pair.both("push_many", o[1] % num_channels, Fresh(lambda r=run: list(r)))
        elif o[0] == "barrier":
            ctype = CheckpointType.SAVEPOINT if o[3] and serial % 3 == 0 else CheckpointType.CHECKPOINT
            pair.both("push", o[1] % num_channels, CheckpointBarrier(o[2], 0, CheckpointOptions(ctype)))
        elif o[0] == "cancel":
            pair.both("push", o[1] % num_channels, CancelCheckpointMarker(o[2]))
        elif o[0] == "eop":
            pair.both("push", o[1] % num_channels, EndOfPartition())
        elif o[0] == "poll":
            pair.both("poll_next")
        elif o[0] == "priority":
            pair.both("poll_priority")
        elif o[0] == "batch":
            pair.both("poll_batch", o[1])
        else:
            pair.clock.advance(o[1])
    for _ in range(num_channels * (capacity + 6) + 10):
        pair.both("poll_next")
    pair.check_state()
