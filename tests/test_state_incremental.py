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
