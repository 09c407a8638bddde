"""The incremental backend: deltas, chains, materialisation, file lifecycle."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from pyengine.state import (
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
    create_keyed_backend,
    key_group_range_for_subtask,
)
from pyengine.storage import checkpoint_storage
from pyengine.storage.metadata import CheckpointMetadata, OperatorState, SubtaskState
from pyengine.storage.store import CompletedCheckpointStore, discard_unreferenced, shared_files

COUNT = ValueStateDescriptor("count", 0, pa.int64())
TAGS = ListStateDescriptor("tags")
ATTRS = MapStateDescriptor("attrs")


def snapshot_of(backend):
    out = {}
    states = [backend.get_state(d) for d in (COUNT, TAGS, ATTRS)]
    for name in ("count", "tags", "attrs"):
        for k in backend.keys(name):
            backend.set_current_key(k)
            out[(name, k)] = {"count": states[0].value, "tags": states[1].get, "attrs": states[2].items}[name]()
    return out


def complete(store, backend, checkpoint_id, result, max_p):
    op = OperatorState(1, max_p, {0: SubtaskState(keyed=result.handles)})
    store.complete(CheckpointMetadata("job", checkpoint_id, 0, operators={"op": op}))
    backend.notify_checkpoint_complete(checkpoint_id)


def referenced_files(store):
    return sorted({p for md in store.checkpoints for p in shared_files(md)})


def test_a_delta_holds_only_the_changes(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    store = CompletedCheckpointStore(storage)
    b = create_keyed_backend("incremental", max_parallelism=16)
    count = b.get_state(COUNT)
    for k in range(50_000):
        b.set_current_key(k)
        count.update(k)
    first = b.snapshot(1, storage.location(1)).run()
    complete(store, b, 1, first, 16)
    for k in range(0, 50_000, 100):  # 1% of the keys change
        b.set_current_key(k)
        count.update(-k)
    second = b.snapshot(2, storage.location(2)).run()
    assert len(second.handles) == 2  # base + delta
    assert second.checkpointed_size < 0.05 * first.checkpointed_size
    assert second.full_size == first.full_size + second.checkpointed_size


@pytest.mark.parametrize("seed", range(6))
def test_chains_with_deletes_aborts_materialisation_and_retention(tmp_path, seed) -> None:
    rng = random.Random(seed)
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    store = CompletedCheckpointStore(storage, retained=2)
    b = create_keyed_backend("incremental", max_parallelism=8, max_chain=3)
    count, tags, attrs = (b.get_state(d) for d in (COUNT, TAGS, ATTRS))
    expected = {}  # checkpoint id -> state at its synchronous part
    files_seen = 0
    for checkpoint_id in range(1, 25):
        for _ in range(rng.randrange(50, 400)):
            k = rng.randrange(3000)
            b.set_current_key(k)
            op = rng.random()
            if op < 0.5:
                count.update(rng.randrange(1000))
            elif op < 0.65:
                count.clear()
            elif op < 0.8:
                tags.add(rng.randrange(10))
            elif op < 0.9:
                attrs.put(rng.randrange(5), [k])
            else:
                rng.choice((tags, attrs)).clear()
        if checkpoint_id == 1:
            for k in range(3000):  # enough data that bases are real files
                b.set_current_key(k)
                count.update(k)
        snapshot = b.snapshot(checkpoint_id, storage.location(checkpoint_id))
        expected[checkpoint_id] = snapshot_of(b)
        result = snapshot.run()
        if rng.random() < 0.2:  # declined: never completes; its new files go
            b.notify_checkpoint_aborted(checkpoint_id)
            discard_unreferenced(result.handles, store.registry)
            storage.location(checkpoint_id).dispose()
        else:
            complete(store, b, checkpoint_id, result, 8)
        files_seen += len(storage.list_files(storage.shared_dir))
        assert storage.list_files(storage.shared_dir) == sorted(
            storage.fs.normalize_path(p) for p in referenced_files(store)
        ), "shared/ must hold exactly the files retained checkpoints use"
        latest = store.latest()
        if latest is not None:
            r = create_keyed_backend("heap", max_parallelism=8)
            r.restore(latest.operators["op"].keyed_handles())
            assert snapshot_of(r) == expected[latest.checkpoint_id]
            assert len(latest.operators["op"].keyed_handles()) <= 1 + 3  # a base and at most max_chain deltas
    assert files_seen > 0  # the accounting above is about real files


def test_heap_and_incremental_restore_each_other(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    heap = create_keyed_backend("heap", max_parallelism=16)
    c = heap.get_state(COUNT)
    for k in range(500):
        heap.set_current_key(k)
        c.update(k)
    inc = create_keyed_backend("incremental", max_parallelism=16)
    inc.restore(heap.snapshot(1, storage.location(1)).run().handles)
    assert snapshot_of(inc) == snapshot_of(heap)
    inc.set_current_key(3)
    inc.get_state(COUNT).update(-3)
    result = inc.snapshot(2, storage.location(2)).run()
    assert len(result.handles) == 1  # restored from a heap snapshot: starts with a full base
    back = create_keyed_backend("heap", max_parallelism=16)
    back.restore(result.handles)
    assert snapshot_of(back) == snapshot_of(inc)


def test_restored_chain_is_built_on_only_at_the_same_key_groups(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    store = CompletedCheckpointStore(storage)
    b = create_keyed_backend("incremental", max_parallelism=8, key_group_range=KeyGroupRange(0, 7))
    c = b.get_state(COUNT)
    for k in range(5000):
        b.set_current_key(k)
        c.update(k)
    result = b.snapshot(1, storage.location(1)).run()
    complete(store, b, 1, result, 8)
    same = create_keyed_backend("incremental", max_parallelism=8)
    same.restore(result.handles)
    assert len(same.snapshot(2, storage.location(2)).run().handles) == 2  # continues the chain
    half = create_keyed_backend("incremental", max_parallelism=8, key_group_range=key_group_range_for_subtask(8, 2, 0))
    half.restore(result.handles)
    assert len(half.snapshot(3, storage.location(3)).run().handles) == 1  # rescaled: a fresh base


class _Clock:
    def __init__(self) -> None:
        self.ms = 1_000

    def __call__(self) -> int:
        return self.ms


def _file_entries(handle, key_groups):
    """What one state file holds: {(state, key): entry as written} (TTL entries with their stamps)."""
    from pyengine.snapshot.reader import read_keyed_state

    _, entries = read_keyed_state(handle, key_groups)
    return {(spec.name, k): v for _, spec, keys, values in entries for k, v in zip(keys, values, strict=True)}


def test_snapshots_leave_expired_entries_out_of_bases_and_deltas(tmp_path) -> None:
    """Flink's cleanup in full snapshots, for the incremental backend: a base leaves out
    what expired by the time it is written, and a delta writes a changed key whose entry
    expired since as a tombstone (a list or map: its live elements), so a restore does
    not bring an older version back from the chain's earlier files."""
    from pyengine.snapshot.format import TOMBSTONE

    ttl = 100
    clock = _Clock()
    storage = checkpoint_storage(str(tmp_path), "job")
    store = CompletedCheckpointStore(storage)
    b = create_keyed_backend("incremental", max_parallelism=8, ttl_clock_ms=clock)
    v = b.get_state(ValueStateDescriptor("v", ttl=ttl))
    lst = b.get_state(ListStateDescriptor("l", ttl=ttl))
    mp = b.get_state(MapStateDescriptor("m", ttl=ttl))
    for k in range(10):
        b.set_current_key(k)
        v.update(k)
        lst.add(k)
        mp.put("old", k)
    clock.ms += 60
    for k in range(5):
        b.set_current_key(k)
        lst.add(100 + k)
        mp.put("new", 100 + k)
    clock.ms += 50  # the first writes expired (110 ms ago), the second ones live (50 ms)
    first = b.snapshot(1, storage.location(1)).run()
    assert len(first.handles) == 1  # a full base
    base = _file_entries(first.handles[0], b.key_group_range)
    assert not [k for k in base if k[0] == "v"]
    assert {k: [e[0] for e in entry] for (name, k), entry in base.items() if name == "l"} == {
        k: [100 + k] for k in range(5)
    }
    assert {k: {u: e[0] for u, e in entry.items()} for (name, k), entry in base.items() if name == "m"} == {
        k: {"new": 100 + k} for k in range(5)
    }
    complete(store, b, 1, first, 8)

    # Changes after the base: some expire before the next snapshot, some do not.
    b.set_current_key(20)
    v.update(20)  # expires
    lst.add(20)  # expires
    b.set_current_key(0)
    lst.add(200)  # expires; the key's element from before the base (100) too
    mp.put("newer", 200)  # expires; "new" (100) too
    clock.ms += 60
    b.set_current_key(1)
    lst.add(301)  # lives; the key's 101 expires
    b.set_current_key(21)
    v.update(21)  # lives
    clock.ms += 50
    second = b.snapshot(2, storage.location(2)).run()
    assert len(second.handles) == 2  # base + delta
    delta = _file_entries(second.handles[-1], b.key_group_range)
    assert delta[("v", 20)] is TOMBSTONE and delta[("l", 20)] is TOMBSTONE
    assert delta[("l", 0)] is TOMBSTONE and delta[("m", 0)] is TOMBSTONE
    assert [e[0] for e in delta[("l", 1)]] == [301]
    assert delta[("v", 21)][0] == 21

    restored = create_keyed_backend("incremental", max_parallelism=8, ttl_clock_ms=clock)
    restored.restore(second.handles)
    assert restored.num_entries("v") == 1  # key 21
    v2 = restored.get_state(ValueStateDescriptor("v", ttl=ttl))
    lst2 = restored.get_state(ListStateDescriptor("l", ttl=ttl))
    mp2 = restored.get_state(MapStateDescriptor("m", ttl=ttl))
    restored.set_current_key(21)
    assert v2.value() == 21
    restored.set_current_key(1)
    assert lst2.get() == [301]
    restored.set_current_key(0)
    assert lst2.get() == [] and mp2.items() == []


@pytest.mark.parametrize("kind", ["heap", "incremental"])
@pytest.mark.parametrize("ttl", [None, 3_600_000])
@pytest.mark.parametrize("seed", range(4))
def test_values_changed_in_place_after_a_read_are_in_the_next_checkpoint(tmp_path, kind, ttl, seed) -> None:
    """A mutable value read from state is the state's own object (as in Flink's heap
    backend), so user code may change it without a write. The incremental backend's
    delta held only written keys: a restore brought back the old value while the job
    had gone on with the new one. Random reads-then-mutations of every state kind,
    checkpoints between them, and a restore of the last: equal to the live state."""
    import random

    from pyengine.state import (
        AggregatingStateDescriptor,
        ListStateDescriptor,
        MapStateDescriptor,
        ReducingStateDescriptor,
        ValueStateDescriptor,
    )

    class Merge:
        def create_accumulator(self):
            return {"n": 0}

        def add(self, value, acc):
            acc["n"] += value
            return acc

        def get_result(self, acc):
            return acc

    def merge(a, b):
        return {**a, **b}

    descriptors = [
        ValueStateDescriptor("value", ttl=ttl),
        MapStateDescriptor("map", ttl=ttl),
        ListStateDescriptor("list", ttl=ttl),
        ReducingStateDescriptor("reducing", merge, ttl=ttl),
        AggregatingStateDescriptor("aggregating", Merge(), ttl=ttl),
    ]
    rng = random.Random(seed)
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "in-place")
    backend = create_keyed_backend(kind, max_parallelism=8)
    value, mapped, listed, reducing, aggregating = (backend.get_state(d) for d in descriptors)
    keys = list(range(12))
    for key in keys:
        backend.set_current_key(key)
        value.update({"n": 0})
        mapped.put("a", [0])
        listed.add({"x": 0})
        reducing.add({"r": 0})
        aggregating.add(1)
    result = None
    for step in range(1, 200):
        backend.set_current_key(rng.choice(keys))
        op = rng.randrange(6)
        if op == 0:
            value.value()["n"] += 1
        elif op == 1:
            mapped.get("a").append(step)
        elif op == 2:
            mapped.values()[0].append(-step)
        elif op == 3:
            listed.get()[0]["x"] = step
        elif op == 4:
            reducing.get()["r"] = step
        else:
            aggregating.get()["n"] += 10
        if rng.random() < 0.1:
            result = backend.snapshot(step, storage.location(step)).run()
            backend.notify_checkpoint_complete(step)
    result = backend.snapshot(1000, storage.location(1000)).run()
    restored = create_keyed_backend(kind, max_parallelism=8)
    restored.restore(result.handles)
    again = [restored.get_state(d) for d in descriptors]

    def contents(states):
        out = []
        for key in keys:
            for b in (backend, restored):
                b.set_current_key(key)
            v, m, li, r, a = states
            out.append((v.value(), m.items(), li.get(), r.get(), a.get()))
        return out

    assert contents(again) == contents([value, mapped, listed, reducing, aggregating])


@pytest.mark.parametrize("kind", ["heap", "incremental"])
def test_a_mutable_default_is_copied_for_each_read(kind) -> None:
    """A key without a value reads the descriptor's default; changing that in place
    changed every other key's default (a review finding). Flink copies it too."""
    from pyengine.state import ValueStateDescriptor

    backend = create_keyed_backend(kind, max_parallelism=8)
    state = backend.get_state(ValueStateDescriptor("d", {"n": 0}))
    backend.set_current_key("a")
    state.value()["n"] += 1
    backend.set_current_key("b")
    assert state.value() == {"n": 0}
    assert backend.get_state(ValueStateDescriptor("d", {"n": 0})).value() is not state.value()
