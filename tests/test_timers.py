"""Timers in ``KeyedProcessFunction``: keyed state deduplicated per (key, time),
fired in order, snapshotted copy-on-write, restored and rescaled by key group,
exactly once across failures; processing-time timers from the mailbox."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from typing import Any, ClassVar, Dict, List, Tuple

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyengine as pe
from pyengine.connectors.base import Source
from pyengine.state import ValueStateDescriptor, create_keyed_backend, key_group_range_for_subtask, read_keyed_state
from pyengine.state.timers import InternalTimerService
from pyengine.storage import checkpoint_storage
from pyengine.time import MIN_WATERMARK, TimeDomain

# -- the timer queue over a keyed backend --------------------------------------------------------


def _register(service: InternalTimerService, backend: Any, key: Any, ts: int) -> None:
    backend.set_current_key(key)
    service.event.register(ts)


def test_timers_are_deduplicated_per_key_and_time_and_fire_in_order() -> None:
    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    for key, ts in [(1, 30), (2, 10), (1, 30), (1, 20), (3, 10), (2, 15)]:
        _register(service, backend, key, ts)
    backend.set_current_key(2)
    assert service.event.timestamps() == (10, 15)
    service.event.delete(15)
    service.event.delete(99)  # not there: nothing happens
    assert list(service.advance_watermark(25)) == [(2, 10), (3, 10), (1, 20)]
    assert service.current_watermark == 25
    assert list(service.advance_watermark(30)) == [(1, 30)], "registered twice, fired once"
    assert list(service.advance_watermark(1000)) == []


def test_a_timer_registered_while_firing_fires_in_the_same_advance_if_due() -> None:
    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    _register(service, backend, "a", 5)
    fired = []
    for key, ts in service.advance_watermark(10):
        fired.append((key, ts))
        if ts == 5:
            service.event.register(8)  # the current key is the firing one
            service.event.register(50)
    assert fired == [("a", 5), ("a", 8)]
    assert list(service.advance_watermark(50)) == [("a", 50)]


def test_a_deleted_then_registered_timer_fires_once() -> None:
    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    _register(service, backend, 7, 100)
    service.event.delete(100)
    service.event.register(100)
    assert list(service.advance_watermark(100)) == [(7, 100)]


@pytest.mark.parametrize("kind", ["heap", "incremental"])
@pytest.mark.parametrize("keys", ["int", "str"])
def test_timers_are_snapshotted_copy_on_write_and_rescaled_by_key_group(tmp_path: Any, kind: str, keys: str) -> None:
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    backend = create_keyed_backend(kind)
    service = InternalTimerService(backend, MIN_WATERMARK)
    expected: Dict[Any, List[int]] = {}
    for i in range(2000):
        key = i if keys == "int" else f"k{i}"
        times = [1000 + i] if i % 5 else [1000 + i, 5000 + i, 9000 + i]  # every fifth key has several
        for ts in times:
            _register(service, backend, key, ts)
        expected[key] = times
    snapshot = backend.snapshot(1, storage.location(1))  # the synchronous part
    fired_after = list(service.advance_watermark(1500))  # fired (and removed) after it: not in the snapshot's view
    assert fired_after
    _register(service, backend, -1 if keys == "int" else "late", 1)
    handles = snapshot.run().handles
    fired: List[Tuple[Any, int]] = []
    for sub in range(3):
        part = create_keyed_backend(kind, key_group_range=key_group_range_for_subtask(128, 3, sub))
        part.restore(handles)
        restored = InternalTimerService(part, MIN_WATERMARK)
        got = list(restored.advance_watermark(10**9))
        for key, _ in got:
            assert key in expected
        fired.extend(got)
    assert sorted(fired, key=str) == sorted(((k, t) for k, ts in expected.items() for t in ts), key=str)


def test_timers_are_one_set_of_key_timestamp_pairs_per_key_group() -> None:
    """A domain's timers are one table of the backend, a set of (key, timestamp) pairs
    per key group (Flink's HeapPriorityQueueSet): a key with many pending timers has no
    per-key slots to walk, and the table is empty once they all fired."""
    from pyengine.state.timers import TimerTable

    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    _register(service, backend, 1, 10)
    for ts in [*range(100, 140), 120]:  # 120 twice: one timer
        _register(service, backend, 2, ts)
    tables = backend._tables
    assert sorted(n for n in tables if n.startswith("_timer_state/")) == [
        "_timer_state/event_timers",
        "_timer_state/processing_timers",
    ]
    table = tables["_timer_state/event_timers"]
    assert isinstance(table, TimerTable) and table.native is not None
    assert len(service.event) == 41
    backend.set_current_key(2)
    assert service.event.delete(100)
    assert not service.event.delete(100)
    assert service.event.timestamps() == tuple(range(101, 140))
    backend.set_current_key(1)
    assert service.event.timestamps() == (10,)
    assert list(service.advance_watermark(10**6)) == [(1, 10)] + [(2, t) for t in range(101, 140)]
    assert len(table) == 0 and len(service.event) == 0


@pytest.mark.parametrize("kind", ["heap", "incremental"])
@pytest.mark.parametrize("keys", ["int", "str"])
def test_a_hot_key_with_thousands_of_pending_timers_against_a_set_model(tmp_path: Any, kind: str, keys: str) -> None:
    """One key with ~2,000 pending timers (its overflow, past the slots, is a TimerSet), two
    cold keys beside it: random registrations (duplicates among them), deletions and
    firings against a set per key; a snapshot taken midway and then changed under
    (registered, deleted, fired after it) restores what the model held at it."""
    import random

    rng = random.Random(11)
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    backend = create_keyed_backend(kind)
    service = InternalTimerService(backend, MIN_WATERMARK)
    hot, cold = (7, [8, 9]) if keys == "int" else ("hot", ["c1", "c2"])
    model: Dict[Any, set] = {hot: set(), cold[0]: set(), cold[1]: set()}

    def register(key: Any, ts: int) -> None:
        _register(service, backend, key, ts)
        model[key].add(ts)

    def delete(key: Any, ts: int) -> None:
        backend.set_current_key(key)
        assert service.event.delete(ts) == (ts in model[key])
        model[key].discard(ts)

    def fire(upto: int) -> None:
        got = list(service.advance_watermark(upto))
        expected = sorted((t, k) for k, times in model.items() for t in times if t <= upto)
        assert sorted((t, k) for k, t in got) == expected
        assert [t for _, t in got] == sorted(t for _, t in got), "fired in timestamp order"
        for t, k in expected:
            model[k].discard(t)

    for i in range(3000):
        register(hot, rng.randrange(10_000, 14_000))  # ~2,000 distinct: duplicates deduplicated
        if i % 50 == 0:
            register(cold[i % 100 // 50], 10_000 + i)
    for ts in rng.sample(range(10_000, 14_000), 400):
        delete(hot, ts)
    backend.set_current_key(hot)
    assert service.event.timestamps() == tuple(sorted(model[hot]))
    assert len(model[hot]) > 1500
    at_snapshot = {k: set(v) for k, v in model.items()}
    snapshot = backend.snapshot(1, storage.location(1))
    fire(11_000)  # after the snapshot: its view must keep them
    for ts in rng.sample(range(11_000, 14_000), 300):
        delete(hot, ts)
    register(hot, 20_000)
    handles = snapshot.run().handles
    fire(12_500)
    fire(10**9)
    assert all(not v for v in model.values())

    restored_backend = create_keyed_backend(kind)
    restored_backend.restore(handles)
    restored = InternalTimerService(restored_backend, MIN_WATERMARK)
    for key, times in at_snapshot.items():
        restored_backend.set_current_key(key)
        assert restored.event.timestamps() == tuple(sorted(times))
    got = list(restored.advance_watermark(10**9))
    assert sorted((t, k) for k, t in got) == sorted((t, k) for k, v in at_snapshot.items() for t in v)


def test_the_current_key_is_written_in_place_only_into_the_slots_of_a_real_instance() -> None:
    """The native timers and typed value state read and write the backend's current key
    and the context's fields at their slots' offsets. An object that only claims the
    class (a spec'd mock: ``isinstance`` believes its ``__class__``) is refused, not
    written into; a context subclass that makes ``current_key`` a property gets it set
    as an attribute (its setter runs)."""
    from unittest import mock

    from pyengine import _native
    from pyengine.runtime.keyed import KeyedContext
    from pyengine.state.heap import HeapKeyedStateBackend

    fake = mock.MagicMock(spec=HeapKeyedStateBackend)
    assert isinstance(fake, HeapKeyedStateBackend)
    with pytest.raises(TypeError, match="_CurrentKey"):
        _native.TimerSets(fake, 1, print)
    with pytest.raises(TypeError, match="_CurrentKey"):
        _native.ColumnarValueCalls(fake, [], 0, None, True)

    seen: List[Any] = []

    class Watching(KeyedContext):
        @property  # type: ignore[override]
        def current_key(self) -> Any:
            return seen[-1] if seen else None

        @current_key.setter
        def current_key(self, key: Any) -> None:
            seen.append(key)

    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    for key in (3, 4):
        _register(service, backend, key, 10 * key)
    ctx = Watching.__new__(Watching)
    ctx._timer_ts = None
    keys: List[Any] = []
    service.event.fire(100, ctx, lambda ts, c: keys.append((c.current_key, c._timer_ts)), [])
    assert keys == [(3, 30), (4, 40)] and seen == [3, 4]
    spoofed = mock.MagicMock(spec=KeyedContext)  # no slots of its own: plain attribute writes
    _register(service, backend, 5, 50)
    service.event.fire(100, spoofed, lambda ts, c: keys.append((c.current_key, c._timer_ts)), [])
    assert keys[-1] == (5, 50)


EDGE_TIMESTAMPS = [-(2**63) + 1, -1, 0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 1_700_000_000_123, 2**63 - 1]


@pytest.mark.parametrize("kind", ["heap", "incremental"])
@pytest.mark.parametrize("keys", ["int", "str"])
def test_timer_timestamps_are_written_split_and_come_back_whole(tmp_path: Any, kind: str, keys: str) -> None:
    """A timers state's timestamps are written as their high and low 32 bits (format
    version 4: LZ4 spends ~1.6 ns a byte on int64 columns of nearby values, and the high
    halves are one value); every int64 comes back, at each end and across the halves'
    boundaries, restored and read from the files. Files without timers keep the
    version they had, so an older pyengine still reads them."""
    from pyengine.snapshot.reader import read_keyed_state as read_file
    from pyengine.state import KeyGroupRange

    def read(handles: Any) -> Tuple[List[bool], List[Tuple[Any, int]]]:
        split, timers = [], []
        for h in handles:
            info, entries = read_file(h, KeyGroupRange(h.key_group_start, h.key_group_end))
            for _, spec, keys, timestamps in entries:  # per key group: its keys, their values
                if spec.kind == "timers":
                    timers += zip(keys, timestamps, strict=True)
            split.append(info.split_timers)
        return split, timers

    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    k = (lambda i: i) if keys == "int" else (lambda i: f"k{i}")
    backend = create_keyed_backend(kind)
    count = backend.get_state(ValueStateDescriptor("count", 0, pa.int64()))
    service = InternalTimerService(backend, MIN_WATERMARK)
    for i, ts in enumerate(EDGE_TIMESTAMPS):
        _register(service, backend, k(i), ts)
        count.update(i)
    handles = backend.snapshot(1, storage.location(1)).run().handles
    split, timers = read(handles)
    assert split and all(split)
    assert sorted(timers, key=str) == sorted(((k(i), ts) for i, ts in enumerate(EDGE_TIMESTAMPS)), key=str)

    restored = create_keyed_backend(kind)
    restored.restore(handles)
    fired = list(InternalTimerService(restored, MIN_WATERMARK).advance_watermark(2**63 - 1))
    assert fired == [(k(i), ts) for i, ts in enumerate(EDGE_TIMESTAMPS)]  # in timestamp order

    plain = create_keyed_backend(kind)
    plain.get_state(ValueStateDescriptor("count", 0, pa.int64())).update_many([1, 2], [3, 4])
    split, timers = read(plain.snapshot(2, storage.location(2)).run().handles)
    assert split and not any(split) and not timers


def test_key_groups_without_timers_hold_no_slots() -> None:
    """A key group's set gets its slots at its first timer: each started with 16 (256
    bytes) per domain, 16 MB for an operator at 32768 key groups before any timer."""
    import tracemalloc

    backend = create_keyed_backend("heap", max_parallelism=32768)
    tracemalloc.start()
    try:
        service = InternalTimerService(backend, MIN_WATERMARK)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 4 * 2**20, f"{held:,} bytes for no timer"
    _register(service, backend, 7, 70)
    _register(service, backend, 8, 80)
    assert list(service.advance_watermark(75)) == [(7, 70)]
    assert list(service.advance_watermark(100)) == [(8, 80)]


def test_a_copied_context_keeps_its_fields_and_a_copied_service_is_refused() -> None:
    """KeyedContext's and TimerService's bases are C types; Cython's generated pickling
    copied their C fields and ``__dict__`` but not the subclasses' slots, so a copy
    lost ``current_key`` silently (a review). A context copies as any object does; a
    service, bound to its operator's queues, is refused."""
    import copy

    from pyengine.runtime.keyed import KeyedContext
    from pyengine.time.service import TimerService

    ctx = KeyedContext(None)  # type: ignore[arg-type]
    ctx.current_key, ctx._timer_ts = "k", 5
    copied = copy.copy(ctx)
    assert (copied.current_key, copied._timer_ts, copied._service) == ("k", 5, None)
    service = TimerService(InternalTimerService(create_keyed_backend("heap"), MIN_WATERMARK))
    with pytest.raises(TypeError, match="cannot pickle"):
        copy.copy(service)


def test_timers_beside_states_of_four_types_keep_the_sparse_union(tmp_path: Any) -> None:
    """Split, the timers' timestamps are a storage type of their own: beside states of
    four types they made five, past the sparse union's four, and the file fell back to
    a dense union (4 bytes of offset a row; 48% larger for such an operator, found by a
    review). They do not count against it."""
    from pyarrow import ipc

    backend = create_keyed_backend("heap")
    states = [
        backend.get_state(ValueStateDescriptor("n", 0, pa.int64())),
        backend.get_state(ValueStateDescriptor("x", 0.0, pa.float64())),
        backend.get_state(ValueStateDescriptor("name", "", pa.string())),
        backend.get_state(ValueStateDescriptor("seen", False, pa.bool_())),
    ]
    service = InternalTimerService(backend, MIN_WATERMARK)
    for key in range(3000):
        _register(service, backend, key, 1_700_000_000_000 + key)
        for state, value in zip(states, (key, key / 2, f"u{key}", key % 2 == 0), strict=True):
            state.update(value)
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    (handle,) = backend.snapshot(1, storage.location(1)).run().handles
    with open(handle.stream.path, "rb") as f:
        value_type = ipc.open_file(pa.py_buffer(f.read())).schema.field("value").type
    assert value_type.mode == "sparse" and value_type.num_fields == 5
    restored = create_keyed_backend("heap")
    restored.restore([handle])
    restored.set_current_key(2999)
    assert restored.get_state(ValueStateDescriptor("name", "", pa.string())).value() == "u2999"
    fired = list(InternalTimerService(restored, MIN_WATERMARK).advance_watermark(2**62))
    assert fired == [(key, 1_700_000_000_000 + key) for key in range(3000)]


@pytest.mark.parametrize("kind", ["heap", "incremental"])
@pytest.mark.parametrize("keys", ["int", "str"])
def test_the_timers_of_a_checkpoint_written_before_the_sets_are_restored(tmp_path: Any, kind: str, keys: str) -> None:
    """Checkpoints written before the sets kept a key's timers in slot value states
    (``_timer_state/event_timers``, ``...@1`` and so on, then a list per key in
    ``..._more``): restored, their timers come into the sets and the slot states go;
    the incremental backend's next checkpoint is a full one (a delta on those files
    would bring the slot states back, fired timers and all, at the next restore)."""
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    k = (lambda i: i) if keys == "int" else (lambda i: f"k{i}")
    old = create_keyed_backend(kind)
    slot0 = old.get_state(ValueStateDescriptor("_timer_state/event_timers", None, pa.int64()))
    slot1 = old.get_state(ValueStateDescriptor("_timer_state/event_timers@1", None, pa.int64()))
    more = old.get_state(ValueStateDescriptor("_timer_state/event_timers_more"))
    processing = old.get_state(ValueStateDescriptor("_timer_state/processing_timers", None, pa.int64()))
    old.set_current_key(k(1))
    slot0.update(10)
    old.set_current_key(k(2))
    slot0.update(30)
    slot1.update(20)
    more.update([50, 40])
    old.set_current_key(k(3))
    processing.update(5)
    handles = old.snapshot(1, storage.location(1)).run().handles

    backend = create_keyed_backend(kind)
    backend.restore(handles)
    service = InternalTimerService(backend, MIN_WATERMARK)
    assert [n for n in backend.state_names if n.startswith("_timer_state/")] == [
        "_timer_state/event_timers",
        "_timer_state/processing_timers",
    ]
    backend.set_current_key(k(2))
    assert service.event.timestamps() == (20, 30, 40, 50)
    assert list(service.fire_processing(10)) == [(k(3), 5)]
    snapshot = backend.snapshot(2, storage.location(2))
    if kind == "incremental":
        assert snapshot.is_full, "no delta on the files with the slot states"
    handles = snapshot.run().handles
    expected = [(k(1), 10), (k(2), 20), (k(2), 30), (k(2), 40), (k(2), 50)]
    assert list(service.advance_watermark(100)) == expected

    again = create_keyed_backend(kind)
    again.restore(handles)
    restored = InternalTimerService(again, MIN_WATERMARK)
    assert list(restored.fire_processing(10)) == []
    assert list(restored.advance_watermark(100)) == expected


@pytest.mark.parametrize("keys", ["int", "str"])
def test_an_incremental_chain_restores_the_timers_of_its_last_file(tmp_path: Any, keys: str) -> None:
    """Timers are whole in every delta: a timer fired or deleted after the base stays
    gone when the chain is restored, and one registered since comes back."""
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    k = (lambda i: i) if keys == "int" else (lambda i: f"k{i}")
    backend = create_keyed_backend("incremental")
    service = InternalTimerService(backend, MIN_WATERMARK)
    for i in range(1, 6):
        _register(service, backend, k(i), 10 * i)
    assert backend.snapshot(1, storage.location(1)).run().handles
    backend.notify_checkpoint_complete(1)
    assert list(service.advance_watermark(25)) == [(k(1), 10), (k(2), 20)]
    backend.set_current_key(k(5))
    assert service.event.delete(50)
    _register(service, backend, k(6), 60)
    snapshot = backend.snapshot(2, storage.location(2))
    assert not snapshot.is_full
    handles = snapshot.run().handles
    assert len(handles) == 2, "the base and a delta"
    restored_backend = create_keyed_backend("incremental")
    restored_backend.restore(handles)
    restored = InternalTimerService(restored_backend, MIN_WATERMARK)
    assert list(restored.advance_watermark(100)) == [(k(3), 30), (k(4), 40), (k(6), 60)]


def _random_timer_run(
    seed: int, int_keys: bool, nkeys: int
) -> Tuple[List[Tuple[int, int]], Dict[int, Tuple[int, ...]]]:
    """One random sequence of registrations, deletions and watermarks, with an
    ``on_timer`` that registers, deletes and clears a columnar count: int keys take
    the native heap (and its prefetching firing loop), str keys the Python index.
    Returns the firings (key number, timestamp) and each key's pending timers."""
    import random

    rng = random.Random(seed)
    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    count = backend.get_state(COUNT)
    name = (lambda i: i) if int_keys else (lambda i: f"k{i}")
    number = (lambda k: k) if int_keys else (lambda k: int(k[1:]))
    fired: List[Tuple[int, int]] = []

    class Ctx:
        current_key: Any = None
        _timer_ts: Any = None

    def on_timer(ts: int, ctx: Any) -> Any:
        fired.append((number(ctx.current_key), ts))
        assert backend.current_key == ctx.current_key
        count.clear()
        # what it does depends on the timer alone, not on the order among equal timestamps
        h = (number(ctx.current_key) * 7919 + ts * 104729) % 100
        if h < 30:
            service.event.register(ts + 1 + h % 7)  # possibly due in this very advance
        elif h < 50:
            service.event.delete(ts + h % 11)
        return ()

    watermark, clock = MIN_WATERMARK, 0
    for _ in range(3000):
        op = rng.random()
        key = name(rng.randrange(nkeys))
        if op < 0.75:
            clock += rng.randrange(0, 3)
            backend.set_current_key(key)
            count.update(count.value() + 1)
            # mostly in order (the sorted run), sometimes not (the heap), sometimes a key's 2nd..9th+
            due = clock + (rng.randrange(0, 50) if rng.random() < 0.8 else rng.randrange(-30, 5))
            service.event.register(due)
        elif op < 0.85:
            backend.set_current_key(key)
            service.event.delete(clock + rng.randrange(-10, 50))
        else:
            watermark = max(watermark, clock - rng.randrange(0, 30))
            service.current_watermark = watermark
            service.event.fire(watermark, Ctx(), on_timer, [])
    pending = {}
    for i in range(nkeys):
        backend.set_current_key(name(i))
        pending[i] = service.event.timestamps()
    return fired, pending


@pytest.mark.parametrize("seed", range(6))
def test_the_native_timer_sets_fire_as_the_python_ones(seed: int) -> None:
    """The native sets (prefetching ahead while they fire) against Python's on
    the same random sequence: the same timers fire, in the same timestamp order (the
    order among equal timestamps is not defined), and the same ones stay pending."""
    nkeys = 20 if seed % 2 else 300  # 20: keys with tens of pending timers each
    native_fired, native_pending = _random_timer_run(seed, True, nkeys)
    python_fired, python_pending = _random_timer_run(seed, False, nkeys)
    assert len(native_fired) > 300
    assert [ts for _, ts in native_fired] == [ts for _, ts in python_fired]
    assert sorted(native_fired) == sorted(python_fired)
    assert native_pending == python_pending


# -- timers in jobs ------------------------------------------------------------------------------

BUCKETS = ValueStateDescriptor("buckets")  # {bucket end: records}
COUNT = ValueStateDescriptor("count", 0, pa.int64())


class Buckets(pe.KeyedProcessFunction):
    """Counts each key's records per ``size`` ms of event time with timers: one
    timer per record at its bucket's end (deduplicated: one per bucket), the
    bucket's count emitted and cleared when it fires."""

    def __init__(self, size: int) -> None:
        self.size = size

    def open(self, ctx: Any) -> None:
        self.buckets = ctx.get_state(BUCKETS)

    def process_element(self, value: Any, ctx: Any) -> Any:
        end = ctx.timestamp() // self.size * self.size + self.size - 1
        buckets = self.buckets.value() or {}
        buckets[end] = buckets.get(end, 0) + 1
        self.buckets.update(buckets)
        ctx.timer_service().register_event_time_timer(end)
        return []

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        assert ctx.time_domain() is TimeDomain.EVENT_TIME
        assert ctx.timestamp() == timestamp
        assert ctx.timer_service().current_watermark() >= timestamp
        buckets = self.buckets.value()
        yield (ctx.current_key, timestamp, buckets.pop(timestamp))
        self.buckets.update(buckets or None)


def buckets_reference(records: List[Dict[str, Any]], size: int) -> List[Tuple[Any, int, int]]:
    counts: Dict[Tuple[Any, int], int] = defaultdict(int)
    for r in records:
        counts[(r["k"], r["ts"] // size * size + size - 1)] += 1
    return sorted((k, end, n) for (k, end), n in counts.items())


def make_records(n: int, keys: int, jitter: int, seed: int) -> List[Dict[str, Any]]:
    import random

    rng = random.Random(seed)
    out = []
    t = 0
    for _ in range(n):
        t += rng.choice([1, 2, 3, 40])  # now and then a pause
        out.append({"k": rng.randrange(keys), "ts": t + rng.randrange(jitter + 1)})
    return out


class FailOnce:
    def __init__(self, at: int) -> None:
        self.at, self.seen, self.fired, self.lock = at, 0, False, threading.Lock()

    def __call__(self, record: Any) -> Any:
        with self.lock:
            self.seen += 1
            if not self.fired and self.seen >= self.at:
                self.fired = True
                raise RuntimeError("injected failure")
        return record


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    parallelism=st.integers(1, 4),
    backend=st.sampled_from(["heap", "incremental"]),
    unaligned=st.booleans(),
    seed=st.integers(0, 10**6),
    fail_at=st.sampled_from([0, 50, 200, 350]),
)
def test_timer_buckets_equal_the_reference_across_failures(
    tmp_path_factory: Any, parallelism: int, backend: str, unaligned: bool, seed: int, fail_at: int
) -> None:
    """A firing a completed checkpoint committed never repeats; one after it does,
    and the restarted attempt's output replaces it: the committed output is exact."""
    jitter, size = 10, 25
    records = make_records(400, keys=9, jitter=jitter, seed=seed)
    tmp = tmp_path_factory.mktemp("t")
    env = pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=unaligned),
        state_backend=backend,
        checkpoint_storage=str(tmp / "ckpt"),
        buffer_size=16,
        buffer_timeout_ms=1,
        channel_capacity=2,
        restart_attempts=2,
        auto_watermark_interval_ms=1,
    )
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(jitter).with_timestamp_assigner("ts")
    stream = env.from_generator(lambda i: records[i], len(records), watermark_strategy=strategy)
    if fail_at:
        stream = stream.map(FailOnce(fail_at))
    sink = pe.sinks.CollectSink()
    stream.key_by("k").process(Buckets(size)).uid("buckets").sink_to(sink)
    result = env.execute("timer-buckets")
    assert result.status == "FINISHED"
    assert result.restarts == (1 if fail_at else 0)
    assert sorted(result.records) == buckets_reference(records, size)


class Held(Source):
    """``records`` dealt to the splits of the first run (``i % count == index``);
    ``hold``: from that many records of a split on, nothing now until ``release``."""

    def __init__(self, records: List[Dict[str, Any]], hold: int, release: threading.Event) -> None:
        self.records, self.hold, self.release = records, hold, release

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        mine = self.records[subtask::parallelism]
        if position >= self.hold and not self.release.is_set():
            return []
        if position >= len(mine):
            return None
        end = len(mine) if self.release.is_set() else min(len(mine), self.hold)
        return mine[position : min(end, position + n)]


def _wait_for_watermark(client: Any, vertex: str, at_least: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        marks = client.watermarks().get(vertex, [])
        if marks and min(marks) >= at_least:
            return
        time.sleep(0.02)
    raise AssertionError(f"{vertex} never reached watermark {at_least}: {client.watermarks()}")


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_savepoint_at_2_with_pending_timers_resumed_at_3(tmp_path: Any, backend: str) -> None:
    size, jitter = 25, 10
    records = make_records(600, keys=13, jitter=jitter, seed=3)
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(jitter).with_timestamp_assigner("ts")

    # One sink for both runs: what the savepoint covers is committed by the resumed run's
    # recover() if the stopped run was ended before its commit ran.
    sink = pe.sinks.CollectSink()

    def job(parallelism: int, release: threading.Event) -> Tuple[Any, Any]:
        env = pe.StreamEnvironment(
            parallelism=parallelism,
            checkpointing=pe.CheckpointConfig(interval_ms=20),
            state_backend=backend,
            checkpoint_storage=str(tmp_path / f"ckpt{parallelism}"),
            auto_watermark_interval_ms=1,
        )
        env.from_source(Held(records, 150, release), watermark_strategy=strategy).key_by("k").process(
            Buckets(size)
        ).uid("buckets").sink_to(sink)
        return env, sink

    held = threading.Event()
    env, _ = job(2, held)
    client = env.execute_async("sp")
    first_half = sorted(r["ts"] for r in records[0::2][:150] + records[1::2][:150])
    _wait_for_watermark(client, "v1", first_half[len(first_half) // 2])
    savepoint = client.stop_with_savepoint(str(tmp_path / "savepoint"))
    client.wait(30)
    pending = read_keyed_state(savepoint, "buckets", "_timer_state/event_timers")
    assert pending.num_rows > 0, "the savepoint has no pending timers: the test would prove nothing"
    released = threading.Event()
    released.set()
    env, _ = job(3, released)
    after = env.execute("sp", restore_from=savepoint)
    assert sorted(after.records) == buckets_reference(records, size)


class Deadline(pe.KeyedProcessFunction):
    """One processing-time timer per key, ``delay_ms`` after its first record. The
    class lists record what happened, across the copies each subtask gets."""

    registered: ClassVar[List[Any]] = []
    fired: ClassVar[List[Tuple[Any, int, int]]] = []  # (key, timer ts, processing time when it fired)

    def __init__(self, delay_ms: int) -> None:
        self.delay_ms = delay_ms

    def open(self, ctx: Any) -> None:
        self.seen = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        if not self.seen.value():
            self.seen.update(1)
            service = ctx.timer_service()
            service.register_processing_time_timer(service.current_processing_time() + self.delay_ms)
            Deadline.registered.append(ctx.current_key)
        return []

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        assert ctx.time_domain() is TimeDomain.PROCESSING_TIME
        Deadline.fired.append((ctx.current_key, timestamp, ctx.timer_service().current_processing_time()))
        yield (ctx.current_key, timestamp)


def _until(condition: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.005)


def test_processing_time_timers_fire_from_the_mailbox_and_when_due_at_restore(tmp_path: Any) -> None:
    Deadline.registered, Deadline.fired = [], []
    records = [{"k": k} for k in range(8)] * 10

    sink = pe.sinks.CollectSink()

    def job(parallelism: int, gate: threading.Event, delay_ms: int) -> Any:
        env = pe.StreamEnvironment(
            parallelism=parallelism,
            checkpointing=pe.CheckpointConfig(interval_ms=20),
            checkpoint_storage=str(tmp_path / f"ckpt{parallelism}"),
        )
        env.from_source(Held(records, 20, gate)).key_by("k").process(Deadline(delay_ms)).uid("deadline").sink_to(sink)
        return env

    # 1. the source is held after its first records: only the timers can make output, from the mailbox
    client = job(2, threading.Event(), 30).execute_async("proc")
    _until(lambda: len(Deadline.fired) == 8)
    assert sorted(k for k, _, _ in Deadline.fired) == list(range(8))
    assert all(now >= ts for _, ts, now in Deadline.fired), "a timer fired before its time"
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp1"))
    client.wait(30)
    first = sorted((k, ts) for k, ts, _ in Deadline.fired)

    # 2. new keys register timers due in a second; the job stops before then
    Deadline.registered, Deadline.fired = [], []
    records.extend([{"k": k} for k in range(100, 106)] * 10)
    gate = threading.Event()
    client = job(2, gate, 1000).execute_async("proc", restore_from=savepoint)
    client._wait_running(30)
    gate.set()
    _until(lambda: len(Deadline.registered) == 6)
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp2"))
    client.wait(30)
    assert not Deadline.fired
    pending = read_keyed_state(savepoint, "deadline", "_timer_state/processing_timers")
    assert sorted(pending.column("key").to_pylist()) == list(range(100, 106))
    due = max(pending.column("value").to_pylist())

    # 3. restored (at another parallelism) once they are past due, reading nothing: they fire at once
    _until(lambda: time.time() * 1000 > due + 10)
    records.extend([{"k": 999}] * 4)  # something left to read, held: the job stays up
    hold = threading.Event()
    started = time.monotonic()
    client = job(3, hold, 1000).execute_async("proc", restore_from=savepoint)
    _until(lambda: len(Deadline.fired) == 6)
    assert time.monotonic() - started < 10
    assert sorted(k for k, _, _ in Deadline.fired) == list(range(100, 106))
    hold.set()
    last = client.wait(30)
    assert sorted(last.records) == sorted(first + [(k, ts) for k, ts, _ in Deadline.fired])


def test_timers_need_no_watermark_strategy_to_fire_at_the_end(tmp_path: Any) -> None:
    """Without timestamps an event-time timer still fires: at the end of input."""

    class AtEnd(pe.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            assert ctx.timestamp() is None
            ctx.timer_service().register_event_time_timer(123)
            return []

        def on_timer(self, timestamp: int, ctx: Any) -> Any:
            yield (ctx.current_key, timestamp)

    env = pe.StreamEnvironment(parallelism=2)
    sink = pe.sinks.CollectSink()
    env.from_collection([{"k": k} for k in range(4)]).key_by("k").process(AtEnd()).sink_to(sink)
    assert sorted(env.execute("end").records) == [(k, 123) for k in range(4)]


def test_on_timer_errors_name_the_operator(tmp_path: Any) -> None:
    class Boom(pe.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            ctx.timer_service().register_event_time_timer(1)
            return []

        def on_timer(self, timestamp: int, ctx: Any) -> Any:
            raise KeyError("nope")

    env = pe.StreamEnvironment(restart_attempts=0)
    env.from_collection([{"k": 1}]).key_by("k").process(Boom()).sink_to(pe.sinks.CollectSink())
    with pytest.raises(pe.JobFailedError, match="KeyError") as failed:
        env.execute("boom")
    assert isinstance(failed.value.cause, KeyError)
    assert "operator '2-process'" in str(failed.value.result.cause) and "on_timer: KeyError" in str(
        failed.value.result.cause
    )


def test_timer_state_is_readable_from_a_checkpoint(tmp_path: Any) -> None:
    class Later(pe.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> Any:
            ctx.timer_service().register_event_time_timer(ctx.timestamp() + 10**9)
            return []

        def on_timer(self, timestamp: int, ctx: Any) -> Any:
            return []

    release = threading.Event()
    records = [{"k": k, "ts": k} for k in range(20)]
    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=20), checkpoint_storage=str(tmp_path / "c")
    )
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    env.from_source(Held(records, 10, release), watermark_strategy=strategy).key_by("k").process(Later()).uid(
        "later"
    ).sink_to(pe.sinks.CollectSink())
    client = env.execute_async("readable")
    _wait_for_watermark(client, "v1", 17)  # every record is in (monotonous: the splits' last ts - 1)
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    client.wait(30)
    table = read_keyed_state(savepoint, "later", "_timer_state/event_timers")
    assert sorted(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True)) == [
        (k, k + 10**9) for k in range(20)
    ]
    with pytest.raises(KeyError, match=r"keyed state '_timer_state/event_timer'; its keyed states: .*event_timers"):
        read_keyed_state(savepoint, "later", "_timer_state/event_timer")  # a name misspelt
    # no processing-time timer pending: an empty table, not the KeyError of a name the
    # operator does not have (which listed this very name: a new-user trial)
    none = read_keyed_state(savepoint, "later", "_timer_state/processing_timers")
    assert none.num_rows == 0 and none.schema.field("value").type == pa.int64()
    assert none.schema.field("key").type == pa.int64()
    assert os.path.isdir(savepoint)


# -- registrations held back in the native sets (TimerSets.flush) -------------------------------


@pytest.mark.parametrize("odd", [True, 1.0], ids=["bool", "float"])
def test_a_held_back_registration_is_applied_under_its_own_key(odd: Any) -> None:
    """Registrations held back for int keys are applied under their own keys when a key
    that merely equals one (``True``, ``1.0``) moves the timers to Python: none is lost
    or filed under the other key."""
    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    for key, ts in ((1, 10), (1, 20), (2, 30)):
        backend.set_current_key(key)
        service.event.register(ts)
    backend.set_current_key(odd)  # equal to 1, in the same key group, no int: flushes, then Python
    service.event.register(40)
    fired = list(service.advance_watermark(100))
    assert [(type(k), k, t) for k, t in fired] == [(int, 1, 10), (int, 1, 20), (int, 2, 30), (type(odd), odd, 40)]


def test_a_restore_drops_the_writes_held_back_for_the_state_it_replaces(tmp_path: Any) -> None:
    """The queues of the state a restore replaces are let go (each snapshot would
    still flush them, and they held the old states alive)."""
    import gc
    import weakref

    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    backend.set_current_key(1)
    service.event.register(10)
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    handles = backend.snapshot(1, storage.location(1)).run().handles
    backend.set_current_key(2)
    service.event.register(20)  # held back, then the state it was for is replaced
    old = weakref.ref(service.event)
    backend.restore(handles)
    del service
    gc.collect()
    assert old() is None
    restored = InternalTimerService(backend, MIN_WATERMARK)
    backend.snapshot(2, storage.location(2)).run()
    assert list(restored.advance_watermark(100)) == [(1, 10)]


def test_counting_entries_leaves_held_back_timers_alone() -> None:
    """The monitoring counts entries from its own thread: applying held-back timers
    there would change the sets from two threads at once (and, when they were slot
    states, the task's state calls went to other keys meanwhile: found by a review,
    999 of 200k values written under another key). Counting applies nothing."""
    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    backend.set_current_key(1)
    service.event.register(10)
    counted: List[int] = []
    sampler = threading.Thread(target=lambda: counted.append(backend.num_entries("_timer_state/event_timers")))
    sampler.start()
    sampler.join()
    assert counted == [0]  # held back: not applied by the count
    assert service.event.timestamps() == (10,)  # the queue's own read applies it
    assert backend.num_entries("_timer_state/event_timers") == 1


@pytest.mark.parametrize("keys", ["int", "str"])
def test_delete_checks_its_timestamp_as_register_does(keys: str) -> None:
    """A float given to delete was cut to an int on int keys: delete(1500.5) removed the
    timer at 1500 (found by a new-user trial). It is refused, as register refuses it."""
    from pyengine.state.timers import InvalidTimerTypeError

    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    backend.set_current_key(1 if keys == "int" else "a")
    service.event.register(1500)
    service.event.register(1)
    for wrong in (1500.5, 1500.0, True, "1500"):
        with pytest.raises(InvalidTimerTypeError, match="int milliseconds"):
            service.event.delete(wrong)
    assert service.event.delete(2**70) is False  # beyond int64: no timer there
    assert service.event.timestamps() == (1, 1500)
    import numpy as np

    assert service.event.delete(np.int64(1500)) is True
    assert service.event.timestamps() == (1,)


@pytest.mark.parametrize("columnar", [True, False])
def test_timers_of_mixed_keys_are_restored(tmp_path: Any, columnar: bool) -> None:
    """A key group whose restored rows come as lists (a batch with a key that is no
    int64, or a backend without columnar storage) while the timers are still native:
    int keys go into the native sets, anything else moves them to Python (found by a
    review: the restore failed, so such a job restarted for ever)."""
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    backend = create_keyed_backend("heap", columnar=columnar)
    service = InternalTimerService(backend, MIN_WATERMARK)
    keys: List[Any] = [*range(50), "a"] if columnar else list(range(50))
    for i, key in enumerate(keys):
        _register(service, backend, key, 100 + i)
    handles = backend.snapshot(1, storage.location(1)).run().handles
    again = create_keyed_backend("heap", columnar=columnar)
    again.restore(handles)
    restored = InternalTimerService(again, MIN_WATERMARK)
    assert list(restored.advance_watermark(10**6)) == [(key, 100 + i) for i, key in enumerate(keys)]


def test_moving_to_python_while_firing_fires_each_timer_once_and_frees_the_native_sets() -> None:
    """``on_timer`` that registers under a key that is no int64 moves the timers to
    Python's storage in the middle of the native firing loop: the rest fire from Python,
    once each, and the native sets and order are emptied (TimerService still holds
    their register; they held every timer pending at the switch)."""
    from pyengine.runtime.keyed import KeyedContext

    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    for key in (1, 2, 3):
        _register(service, backend, key, 10 * key)
    native = service.event._native
    fired: List[Tuple[Any, int]] = []

    def on_timer(ts: int, ctx: Any) -> Any:
        fired.append((ctx.current_key, ts))
        if ts == 10:
            backend.set_current_key("x")
            service.event.register(10**6)
        return ()

    ctx = KeyedContext.__new__(KeyedContext)
    ctx.current_key = ctx._timer_ts = None
    service.event.fire(100, ctx, on_timer, [])
    assert fired == [(1, 10), (2, 20), (3, 30)]
    assert service.event._native is None and len(native) == 0 and native.peek() is None
    assert list(service.advance_watermark(10**6)) == [("x", 10**6)]


@pytest.mark.parametrize("other", [1.0, True], ids=["float", "bool"])
def test_a_key_equal_to_an_int_key_finds_its_timers(other: Any) -> None:
    """As in every keyed state, 1.0 and True are the key 1: ``timestamps()`` and
    ``delete`` under them see key 1's timers while those are in the native sets."""
    backend = create_keyed_backend("heap")
    service = InternalTimerService(backend, MIN_WATERMARK)
    _register(service, backend, 1, 100)
    _register(service, backend, 1, 200)
    backend.set_current_key(other)
    assert service.event.timestamps() == (100, 200)
    assert service.event.delete(100)
    assert list(service.advance_watermark(10**6)) == [(1, 200)]


def test_restored_timers_not_yet_taken_are_written_back_whatever_their_keys(tmp_path: Any) -> None:
    """An operator that makes no timers, restored from two subtasks' files (one with
    int keys only, one with str keys: the key groups come back as arrays and as pairs),
    writes them back unchanged at its snapshot (the writer takes neighbouring key groups
    in one batch: all arrays or all pairs; a mix failed, found by a review)."""
    from pyengine.state import assign_to_key_group

    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    handles: List[Any] = []
    expected: List[Tuple[Any, int]] = []
    for sub, make in ((0, lambda i: i), (1, lambda i: f"s{i}")):
        kg_range = key_group_range_for_subtask(128, 2, sub)
        backend = create_keyed_backend("heap", key_group_range=kg_range)
        service = InternalTimerService(backend, MIN_WATERMARK)
        for i in range(400):
            key = make(i)
            if assign_to_key_group(key, 128) in kg_range:
                _register(service, backend, key, 100 + i)
                expected.append((key, 100 + i))
        handles += backend.snapshot(1, storage.location(1)).run().handles
    untouched = create_keyed_backend("heap")
    untouched.restore(handles)  # no TimerQueue takes them
    handles = untouched.snapshot(2, storage.location(2)).run().handles
    again = create_keyed_backend("heap")
    again.restore(handles)
    restored = InternalTimerService(again, MIN_WATERMARK)
    assert sorted(restored.advance_watermark(10**6), key=str) == sorted(expected, key=str)
