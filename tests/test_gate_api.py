"""The gate's contract apart from barrier handling: configuration, bad input,
channel order, backpressure, blocking calls and batches. Every test runs
against both the native and the reference implementation."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from conftest import barrier, cancel, drain, eop

from pyengine.io import (
    ChannelClosedError,
    ChannelIndexError,
    CheckpointedInputGate,
    ReferenceCheckpointedInputGate,
)
from pyengine.testing import RecordingListener


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_channels": 0}, "num_channels must be between 1 and 65536, got 0"),
        ({"num_channels": 65537}, "got 65537"),
        ({"mode": "exactly-once"}, "mode must be"),
        ({"mode": "at_least_once", "unaligned": True}, "unaligned=True needs mode='exactly_once'"),
        ({"aligned_timeout_ms": 10}, "aligned_timeout_ms=10 needs unaligned=True"),
        ({"unaligned": True, "aligned_timeout_ms": -1}, "aligned_timeout_ms must be >= 0, got -1"),
        ({"capacity": 0}, "capacity must be between 1"),
        ({"implementation": "rust"}, "implementation must be 'native' or 'reference', got 'rust'"),
    ],
)
def test_bad_configuration_names_the_setting(kwargs, message) -> None:
    kwargs = {"num_channels": 2, **kwargs}
    n = kwargs.pop("num_channels")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CheckpointedInputGate(n, RecordingListener(), **kwargs)


def test_listener_without_callbacks_is_refused() -> None:
    class Half:
        def trigger_checkpoint_on_barrier(self, barrier, metrics): ...

    with pytest.raises(TypeError, match="abort_checkpoint_on_barrier"):
        CheckpointedInputGate(2, Half())


def test_both_implementations_are_checkpointed_input_gates(make_gate, impl) -> None:
    gate = make_gate(4)
    assert isinstance(gate, CheckpointedInputGate)
    assert isinstance(gate, ReferenceCheckpointedInputGate) == (impl == "reference")
    assert gate.num_channels == 4
    assert "_native" not in type(gate).__module__


def test_channel_out_of_range_is_refused_and_loses_nothing(make_gate) -> None:
    gate = make_gate(3)
    assert gate.push(1, "kept")
    for bad in (3, -1, 100):
        with pytest.raises(ChannelIndexError, match=f"channel {bad} is out of range .* 3 channels"):
            gate.push(bad, "x")
        with pytest.raises(IndexError):
            gate.put(bad, "x", timeout=0)
        with pytest.raises(ValueError):
            gate.push_many(bad, ["x"])
    with pytest.raises(TypeError):
        gate.push("1", "x")
    assert drain(gate) == [(1, "kept")]


def test_push_after_end_of_partition_is_refused(make_gate) -> None:
    gate = make_gate(2)
    gate.push(0, "a")
    gate.push(0, eop())
    with pytest.raises(ChannelClosedError, match="channel 0 already delivered EndOfPartition"):
        gate.push(0, "late")
    with pytest.raises(ChannelClosedError):
        gate.push(0, barrier(1))
    assert drain(gate) == [(0, "a"), (0, eop())]
    assert not gate.is_finished
    gate.push(1, eop())
    assert drain(gate) == [(1, eop())]
    assert gate.is_finished


def test_channels_are_served_round_robin_in_order_of_availability(make_gate) -> None:
    gate = make_gate(4)
    gate.push_many(2, ["c1", "c2", "c3"])
    gate.push_many(0, ["a1", "a2"])
    gate.push(3, "d1")
    assert drain(gate) == [(2, "c1"), (0, "a1"), (3, "d1"), (2, "c2"), (0, "a2"), (2, "c3")]


def test_full_channel_pushes_back_but_events_still_fit(make_gate) -> None:
    gate = make_gate(2, capacity=3)
    assert gate.push_many(0, range(10)) == 3
    assert not gate.push(0, "overflow")
    assert gate.queued(0) == 3
    # Events may use a small reserve beyond the data capacity.
    assert gate.push(0, barrier(1))
    assert gate.push(1, "other channel is independent")
    assert [item for ch, item in drain(gate) if ch == 0][:3] == [0, 1, 2]


def test_put_waits_for_space_and_times_out(make_gate) -> None:
    gate = make_gate(1, capacity=1)
    assert gate.put(0, "first", timeout=0.1)
    start = time.monotonic()
    assert not gate.put(0, "second", timeout=0.05)
    assert time.monotonic() - start >= 0.04

    def consume_later() -> None:
        time.sleep(0.05)
        gate.poll_next()

    t = threading.Thread(target=consume_later)
    t.start()
    assert gate.put(0, "second", timeout=5)
    t.join()
    assert gate.poll_next() == (0, "second")


def test_next_blocks_until_data_arrives_and_ends_when_finished(make_gate) -> None:
    gate = make_gate(2)
    assert gate.next(timeout=0.02) is None

    def produce() -> None:
        time.sleep(0.05)
        gate.push(1, "late")

    t = threading.Thread(target=produce)
    t.start()
    assert gate.next(timeout=5) == (1, "late")
    t.join()
    gate.push(0, eop())
    gate.push(1, eop())
    assert gate.next() == (0, eop())
    assert gate.next() == (1, eop())
    assert gate.is_finished
    assert gate.next() is None  # finished: returns at once, no timeout needed


def test_producer_threads_and_a_blocking_consumer_lose_nothing(make_gate) -> None:
    gate = make_gate(4, capacity=8)
    per_channel = 2000

    def produce(ch: int) -> None:
        for i in range(per_channel):
            gate.put(ch, (ch, i))
        gate.put(ch, eop())

    threads = [threading.Thread(target=produce, args=(ch,)) for ch in range(4)]
    for t in threads:
        t.start()
    seen: dict[int, list[int]] = {ch: [] for ch in range(4)}
    while (r := gate.next(timeout=10)) is not None:
        ch, item = r
        if isinstance(item, tuple):
            seen[ch].append(item[1])
    for t in threads:
        t.join()
    assert gate.is_finished
    assert all(seen[ch] == list(range(per_channel)) for ch in range(4))


def test_poll_batch_holds_data_or_one_event(make_gate) -> None:
    gate = make_gate(2, mode="at_least_once")
    gate.push_many(0, ["a", "b", barrier(1), "c"])
    gate.push_many(1, ["x", barrier(1), "y", eop()])
    batches = []
    while batch := gate.poll_batch(10):
        batches.append(batch)
    kinds = [[type(item).__name__ for _, item in b] for b in batches]
    for batch in kinds:
        assert batch == ["str"] * len(batch) or len(batch) == 1
    flat = [r for b in batches for r in b]
    assert [item for _, item in flat if isinstance(item, str)] == ["a", "x", "b", "y", "c"]
    with pytest.raises(ValueError, match="max_items"):
        gate.poll_batch(0)


def test_poll_batch_equals_repeated_poll_next(impl) -> None:
    def run(batched: bool) -> list:
        gate = CheckpointedInputGate(3, RecordingListener(), implementation=impl)
        for i in range(30):
            gate.push(i % 3, i)
            if i % 7 == 0:
                gate.push(i % 3, barrier(i // 7 + 1))
        out = []
        while True:
            got = gate.poll_batch(4) if batched else [r] if (r := gate.poll_next()) else []
            if not got:
                return out
            out.extend(got)

    assert run(batched=True) == run(batched=False)


def test_batched_paths_keep_exactly_one_reference_per_queued_item(make_gate) -> None:
    """push_many and poll_batch hand the queue's reference on rather than taking
    their own: a miscount frees a buffer still in use, or leaks every buffer."""
    gate = make_gate(2, capacity=8)
    items = [object() for _ in range(12)]

    def counts() -> list:
        # Counted outside any assert (pytest's rewriting keeps what an assert
        # evaluates alive until it ends) and always the same way.
        return [sys.getrefcount(items[i]) for i in range(len(items))]

    before = counts()

    def held_by_gate_or_batch() -> list:
        return [now - then for now, then in zip(counts(), before, strict=True)]

    pushed = gate.push_many(0, items[:10]), gate.push_many(1, tuple(items[10:]))  # a list (8 fit), a tuple
    assert pushed == (8, 2)
    queued = held_by_gate_or_batch()
    assert queued == [1] * 8 + [0, 0] + [1, 1]
    batch = gate.poll_batch(100)
    assert sorted(id(item) for _, item in batch) == sorted(id(o) for o in items[:8] + items[10:])
    in_batch = held_by_gate_or_batch()
    assert in_batch == queued
    del batch
    released = held_by_gate_or_batch()
    assert released == [0] * 12


def test_cancellation_markers_are_consumed(make_gate) -> None:
    gate = make_gate(1)
    gate.push_many(0, ["a", cancel(1), "b"])
    assert drain(gate) == [(0, "a"), (0, "b")]


def test_polling_from_a_callback_is_refused(impl) -> None:
    class Reentrant(RecordingListener):
        def trigger_checkpoint_on_barrier(self, b, m):
            gate.poll_next()

    gate = CheckpointedInputGate(1, Reentrant(), implementation=impl)
    gate.push(0, barrier(1))
    with pytest.raises(RuntimeError, match=r"already being polled.*single consumer"):
        gate.poll_next()


def test_bytes_processed_during_alignment_counts_sized_items(make_gate, listener) -> None:
    gate = make_gate(2)
    gate.push(0, barrier(1))
    gate.push(1, b"12345")
    gate.push(1, bytearray(3))
    gate.push(1, memoryview(b"1234567"))
    gate.push(1, "no size")
    gate.push(1, barrier(1))
    drain(gate)
    assert gate.bytes_processed_during_alignment == 5 + 3 + 7
    assert listener.triggered[0][1].bytes_processed_during_alignment == 15
