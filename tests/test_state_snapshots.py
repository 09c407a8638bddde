"""Heap snapshots: the state file format, restore, rescaling, integrity checks."""

from __future__ import annotations

import random
import threading

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from pyengine.state import (
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    PickleNotAllowedError,
    ReducingStateDescriptor,
    ValueStateDescriptor,
    assign_to_key_group,
    create_keyed_backend,
    key_group_range_for_subtask,
)
from pyengine.storage import (
    ByteStreamStateHandle,
    CorruptStateError,
    StreamStateHandle,
    checkpoint_storage,
)
from pyengine.storage.filesystem import resolve

COUNT = ValueStateDescriptor("count", 0, pa.int64())
TAGS = ListStateDescriptor("tags", pa.string())
ATTRS = MapStateDescriptor("attrs")
TOTAL = ReducingStateDescriptor("total", lambda a, b: a + b)
ANY = ValueStateDescriptor("any")


@pytest.fixture
def storage(tmp_path):
    return checkpoint_storage(str(tmp_path / "ckpt"), "job-1")


def fill(backend, keys, scale=1):
    states = [backend.get_state(d) for d in (COUNT, TAGS, ATTRS, TOTAL, ANY)]
    count, tags, attrs, total, anything = states
    for k in keys:
        backend.set_current_key(k)
        count.update(scale * (hash(str(k)) % 1000))
        tags.add_all([f"t{k}", "x"])
        attrs.put(("a", k), {"nested": [k, None]})
        total.add(k if isinstance(k, int) else 1)
        anything.update((k, b"\x00", 2.5, [1, {"z": True}]))
    return states


def contents(backend):
    states = [backend.get_state(d) for d in (COUNT, TAGS, ATTRS, TOTAL, ANY)]
    out = {}
    for k in set(backend.keys("count")):
        backend.set_current_key(k)
        out[k] = (states[0].value(), states[1].get(), states[2].items(), states[3].get(), states[4].value())
    return out


KEYS = list(range(300)) + [f"user-{i}" for i in range(100)] + [(i, "t") for i in range(50)] + [2**70, None, b"k"]


def test_snapshot_round_trip_of_every_state_kind(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=32)
    fill(b, KEYS)
    expected = contents(b)
    result = b.snapshot(1, storage.location(1)).run()
    assert result.checkpointed_size == result.full_size > 0
    restored = create_keyed_backend("heap", max_parallelism=32)
    restored.restore(result.handles)
    assert contents(restored) == expected


def test_writes_after_the_synchronous_part_are_not_in_the_snapshot(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=16)
    count, tags, attrs, *_ = fill(b, range(50))
    expected = contents(b)
    snapshot = b.snapshot(1, storage.location(1))  # synchronous part
    for k in range(50):
        b.set_current_key(k)
        count.update(-1)
        tags.get()  # read, then change in place what was read
        attrs.get(("a", k))["nested"].append("later")
        tags.add("later")
    for k in range(50, 60):
        b.set_current_key(k)
        count.update(7)
    result = snapshot.run()  # asynchronous part, after the changes
    restored = create_keyed_backend("heap", max_parallelism=16)
    restored.restore(result.handles)
    assert contents(restored) == expected


def test_snapshot_written_on_another_thread_while_the_task_keeps_writing(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=64)
    count = b.get_state(COUNT)
    for k in range(5000):
        b.set_current_key(k)
        count.update(k)
    snapshot = b.snapshot(1, storage.location(1))
    results = []
    t = threading.Thread(target=lambda: results.append(snapshot.run()))
    t.start()
    for k in range(5000):
        b.set_current_key(k)
        count.update(count.value() + 1_000_000)
    t.join()
    restored = create_keyed_backend("heap", max_parallelism=64)
    restored.restore(results[0].handles)
    c = restored.get_state(COUNT)
    for k in range(0, 5000, 97):
        restored.set_current_key(k)
        assert c.value() == k


@pytest.mark.parametrize("old, new", [(4, 3), (2, 5), (3, 1), (1, 4)])
def test_rescaling_keeps_every_key_exactly_once(storage, old, new) -> None:
    max_p = 128
    keys = list(range(2000)) + [f"k{i}" for i in range(500)]
    expected = {}
    handles = []
    for i in range(old):
        r = key_group_range_for_subtask(max_p, old, i)
        b = create_keyed_backend("heap", max_parallelism=max_p, key_group_range=r)
        mine = [k for k in keys if assign_to_key_group(k, max_p) in r]
        fill(b, mine)
        expected.update(contents(b))
        handles += b.snapshot(1, storage.location(1)).run().handles
    seen = {}
    for i in range(new):
        r = key_group_range_for_subtask(max_p, new, i)
        b = create_keyed_backend("heap", max_parallelism=max_p, key_group_range=r)
        b.restore(handles)
        got = contents(b)
        assert not set(got) & set(seen), "a key was restored by two subtasks"
        assert all(assign_to_key_group(k, max_p) in r for k in got)
        seen.update(got)
    assert seen == expected


def test_state_file_is_plain_arrow(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=8)
    fill(b, range(2000))
    handle = b.snapshot(3, storage.location(3)).run().handles[0]
    assert isinstance(handle.stream, StreamStateHandle)
    reader = ipc.open_file(handle.stream.path)
    meta = reader.schema.metadata[b"pyengine"].decode()
    # five states of four storage types: a sparse union by type (format version 3)
    assert '"format":"pyengine-keyed-state"' in meta and '"version":3' in meta
    assert [f.name for f in reader.schema] == ["key_group", "state", "key", "value"]
    table = reader.read_all()
    assert table.num_rows == 5 * 2000
    # typed states are real Arrow columns, not opaque bytes
    import json

    states = [c["name"] for c in json.loads(meta)["states"]]
    child = json.loads(meta)["value_children"]
    value_type = reader.schema.field("value").type
    assert value_type.mode == "sparse"
    assert value_type.field(child[states.index("count")]).type == pa.int64()
    assert value_type.field(child[states.index("tags")]).type == pa.list_(pa.string())
    assert value_type.field(child[states.index("any")]).type == pa.binary()


def test_small_state_is_inlined_in_the_handle(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=8)
    c = b.get_state(COUNT)
    b.set_current_key("only")
    c.update(1)
    result = b.snapshot(1, storage.location(1)).run()
    assert isinstance(result.handles[0].stream, ByteStreamStateHandle)
    assert storage.list_files(storage.checkpoint_dir(1)) == []
    restored = create_keyed_backend("heap", max_parallelism=8)
    restored.restore(result.handles)
    restored.set_current_key("only")
    assert restored.get_state(COUNT).value() == 1


def _big_snapshot(storage, checkpoint_id=1):
    b = create_keyed_backend("heap", max_parallelism=8)
    fill(b, range(3000))
    return b.snapshot(checkpoint_id, storage.location(checkpoint_id)).run().handles[0]


def _damage(path: str, how: str) -> None:
    fs, p, _ = resolve(path)
    data = bytearray(fs.open_input_file(p).read())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    with fs.open_output_stream(p) as out:
        out.write(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupted_or_truncated_files_are_refused_with_the_path(storage, how) -> None:
    handle = _big_snapshot(storage)
    _damage(handle.stream.path, how)
    b = create_keyed_backend("heap", max_parallelism=8)
    with pytest.raises(CorruptStateError, match=handle.stream.path.replace(".", r"\.")):
        b.restore([handle])


def test_partial_restore_verifies_only_the_batches_it_reads(storage, monkeypatch) -> None:
    from pyengine.snapshot import writer

    monkeypatch.setattr(writer, "TARGET_ROWS", 1)  # a batch per key group
    handle = _big_snapshot(storage)
    assert len({(e.key_group, e.last_key_group) for e in handle.index}) == 8
    # damage one byte inside a batch of key group 7
    entry = next(e for e in handle.index if e.key_group == 7)
    fs, p, _ = resolve(handle.stream.path)
    data = bytearray(fs.open_input_file(p).read())
    data[entry.offset + entry.length // 2] ^= 0xFF
    with fs.open_output_stream(p) as out:
        out.write(bytes(data))
    ok = create_keyed_backend("heap", max_parallelism=8, key_group_range=KeyGroupRange(0, 3))
    ok.restore([handle])  # key groups 0-3 are intact
    assert ok.num_entries() > 0
    bad = create_keyed_backend("heap", max_parallelism=8, key_group_range=KeyGroupRange(4, 7))
    with pytest.raises(CorruptStateError, match="checksum mismatch"):
        bad.restore([handle])


def test_missing_file_is_refused_with_the_path(storage) -> None:
    handle = _big_snapshot(storage)
    storage.delete_file(resolve(handle.stream.path)[1])
    with pytest.raises(CorruptStateError, match="is missing"):
        create_keyed_backend("heap", max_parallelism=8).restore([handle])


class Point:
    def __init__(self, x):
        self.x = x


def test_pickle_needs_an_opt_in_to_write_and_to_read(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=4)
    safe = b.get_state(ValueStateDescriptor("safe"))
    b.set_current_key(1)
    with pytest.raises(TypeError, match=r"state 'safe'.*Point.*serializer='pickle'"):
        safe.update(Point(1))  # refused where it is written (issue #37), not at the next checkpoint
    safe.update([Point(1)])  # a write does not look into a container: the safe serializer refuses at snapshot
    with pytest.raises(TypeError, match=r"state 'safe'.*serializer='pickle'"):
        b.snapshot(1, storage.location(1)).run()
    b = create_keyed_backend("heap", max_parallelism=4)
    opted = b.get_state(ValueStateDescriptor("points", serializer="pickle"))
    b.set_current_key(1)
    opted.update(Point(7))
    handles = b.snapshot(2, storage.location(2)).run().handles
    restored = create_keyed_backend("heap", max_parallelism=4)
    restored.restore(handles)  # nothing unpickled yet
    with pytest.raises(PickleNotAllowedError, match="'points' was checkpointed with pickle"):
        restored.get_state(ValueStateDescriptor("points"))
    state = restored.get_state(ValueStateDescriptor("points", serializer="pickle"))
    restored.set_current_key(1)
    assert state.value().x == 7


def test_restored_state_keeps_its_kind(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=4)
    fill(b, range(10))
    handles = b.snapshot(1, storage.location(1)).run().handles
    r = create_keyed_backend("heap", max_parallelism=4)
    r.restore(handles)
    with pytest.raises(ValueError, match="'tags' holds list state; it cannot be read as value"):
        r.get_state(ValueStateDescriptor("tags"))


def test_restore_refuses_a_different_max_parallelism(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=128)
    fill(b, range(10))
    handles = b.snapshot(1, storage.location(1)).run().handles
    with pytest.raises(ValueError, match="max_parallelism must not change"):
        create_keyed_backend("heap", max_parallelism=64).restore(handles)


def test_ttl_state_round_trips_with_its_timestamps(storage) -> None:
    clock = [1000]
    b = create_keyed_backend("heap", max_parallelism=4, ttl_clock_ms=lambda: clock[0])
    v = b.get_state(ValueStateDescriptor("v", ttl=100))
    b.set_current_key("k")
    v.update("x")
    handles = b.snapshot(1, storage.location(1)).run().handles
    clock[0] += 150
    r = create_keyed_backend("heap", max_parallelism=4, ttl_clock_ms=lambda: clock[0])
    r.restore(handles)
    r.set_current_key("k")
    assert r.get_state(ValueStateDescriptor("v", ttl=100)).value() is None  # expired across the restore


def test_random_states_round_trip(storage) -> None:
    rng = random.Random(7)
    b = create_keyed_backend("heap", max_parallelism=16)
    anything = b.get_state(ANY)
    values = {}
    for k in range(500):
        v = rng.choice([rng.random(), rng.randrange(-(2**80), 2**80), str(rng.random()), [k, (k,)], {k: [k]}])
        b.set_current_key(k)
        anything.update(v)
        values[k] = v
    r = create_keyed_backend("heap", max_parallelism=16)
    r.restore(b.snapshot(1, storage.location(1)).run().handles)
    got = r.get_state(ANY)
    for k, v in values.items():
        r.set_current_key(k)
        assert got.value() == v


def test_large_state_is_written_in_few_batches_covering_key_group_ranges(storage) -> None:
    import numpy as np

    b = create_keyed_backend("heap", max_parallelism=8)
    b.get_state(COUNT).update_many(np.arange(1_000_000), np.arange(1_000_000))
    handle = b.snapshot(1, storage.location(1)).run().handles[0]
    spans = [(e.key_group, e.last_key_group) for e in handle.index]
    assert 2 <= len(spans) <= 8 and spans[0][0] == 0 and spans[-1][1] == 7
    half = create_keyed_backend("heap", max_parallelism=8, key_group_range=KeyGroupRange(4, 7))
    half.restore([handle])
    full = create_keyed_backend("heap", max_parallelism=8)
    full.restore([handle])
    assert half.num_entries() + create_keyed_backend_restored(handle, 0, 3) == full.num_entries() == 1_000_000


def create_keyed_backend_restored(handle, start, end) -> int:
    b = create_keyed_backend("heap", max_parallelism=8, key_group_range=KeyGroupRange(start, end))
    b.restore([handle])
    return b.num_entries()


def test_damage_outside_every_batch_is_caught_too(storage) -> None:
    handle = _big_snapshot(storage)
    fs, p, _ = resolve(handle.stream.path)
    data = bytearray(fs.open_input_file(p).read())
    last_batch_end = max(e.offset + e.length for e in handle.index)
    assert last_batch_end < len(data) - 16
    data[len(data) - 12] ^= 0x01  # inside the footer, after every batch
    with fs.open_output_stream(p) as out:
        out.write(bytes(data))
    with pytest.raises(CorruptStateError):
        create_keyed_backend("heap", max_parallelism=8).restore([handle])
