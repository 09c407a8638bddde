"""Checkpoint storage, _metadata, the completed-checkpoint store and read_keyed_state."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from pyengine.state import MapStateDescriptor, ValueStateDescriptor, create_keyed_backend
from pyengine.state.reader import read_keyed_state
from pyengine.storage import StorageError, checkpoint_storage
from pyengine.storage.metadata import (
    CheckpointMetadata,
    MetadataError,
    OperatorState,
    SubtaskState,
    load_metadata,
)
from pyengine.storage.store import CompletedCheckpointStore

COUNT = ValueStateDescriptor("count", 0, pa.int64())


@pytest.fixture(params=["file", "memory"])
def storage(request, tmp_path):
    uri = str(tmp_path / "ckpt") if request.param == "file" else f"memory://{tmp_path.name}"
    return checkpoint_storage(uri, "job-7")


def checkpoint(storage, checkpoint_id, n=3000, state="count"):
    b = create_keyed_backend("heap", max_parallelism=16)
    s = b.get_state(ValueStateDescriptor(state, 0, pa.int64()))
    for k in range(n):
        b.set_current_key(k)
        s.update(k * checkpoint_id)
    result = b.snapshot(checkpoint_id, storage.location(checkpoint_id)).run()
    return CheckpointMetadata(
        "job-7", checkpoint_id, 1_700_000_000_000,
        operators={"counter": OperatorState(1, 16, {0: SubtaskState(keyed=result.handles)})},
    )  # fmt: skip


def test_metadata_round_trip(storage) -> None:
    md = checkpoint(storage, 1)
    again = CheckpointMetadata.loads(md.dumps(), where="test")
    assert again == md
    assert json.loads(md.dumps())["version"] == 1


def test_unknown_metadata_version_is_refused_naming_file_and_version(storage) -> None:
    md = checkpoint(storage, 1).to_json()
    md["version"] = 99
    storage.write_metadata(1, md)
    with pytest.raises(MetadataError, match=r"chk-1/_metadata.*version 99; this pyengine reads version 1"):
        load_metadata(storage.uri_of(storage.checkpoint_dir(1)))


def test_damaged_metadata_is_detected_by_its_checksum(storage) -> None:
    md = checkpoint(storage, 1).to_json()
    md["metadata"]["checkpoint_id"] = 2  # still valid JSON, but altered
    storage.write_metadata(1, md)
    with pytest.raises(MetadataError, match="damaged"):
        load_metadata(storage.uri_of(storage.checkpoint_dir(1)))


def test_completed_metadata_is_never_overwritten(storage) -> None:
    store = CompletedCheckpointStore(storage)
    store.complete(checkpoint(storage, 1))
    with pytest.raises(FileExistsError, match="already complete"):
        storage.write_metadata(1, checkpoint(storage, 1).to_json())


def test_retention_discards_only_after_a_newer_checkpoint_completes(storage) -> None:
    store = CompletedCheckpointStore(storage, retained=2)
    for cid in (1, 2):
        assert store.complete(checkpoint(storage, cid)) == []
    pending = checkpoint(storage, 3)  # files written, not complete yet
    assert storage.completed_checkpoint_ids() == [1, 2]
    assert storage.list_files(storage.checkpoint_dir(1))  # still there
    discarded = store.complete(pending)
    assert [d.checkpoint_id for d in discarded] == [1]
    assert storage.completed_checkpoint_ids() == [2, 3]
    assert storage.list_files(storage.checkpoint_dir(1)) == []


def test_a_checkpoint_without_complete_metadata_does_not_exist(storage) -> None:
    store = CompletedCheckpointStore(storage)
    store.complete(checkpoint(storage, 1))
    checkpoint(storage, 2)  # state written, crashed before _metadata
    fs = storage.fs
    with fs.open_output_stream(storage.checkpoint_dir(2) + "/._metadata.inprogress-x") as out:
        out.write(b'{"format": "pyengine-checkp')  # a torn write under the temporary name
    assert storage.completed_checkpoint_ids() == [1]
    assert CompletedCheckpointStore(storage).recover().checkpoint_id == 1


def test_recovery_skips_a_damaged_checkpoint_and_finds_the_previous_good_one(storage) -> None:
    store = CompletedCheckpointStore(storage, retained=3)
    store.complete(checkpoint(storage, 1))
    store.complete(checkpoint(storage, 2))
    bad = checkpoint(storage, 3).to_json()
    bad["version"] = 2
    storage.write_metadata(3, bad)
    recovered = CompletedCheckpointStore(storage, retained=3).recover()
    assert recovered is not None and recovered.checkpoint_id == 2


def test_recovery_enforces_retention_and_deletes_shared_orphans(storage) -> None:
    store = CompletedCheckpointStore(storage, retained=3)
    for cid in (1, 2, 3):
        store.complete(checkpoint(storage, cid))
    with storage.location(4).create_output_stream("orphan", shared=True) as out:
        out.write(b"left by a checkpoint that never completed")
        out.close_and_get_handle()
    fresh = CompletedCheckpointStore(storage, retained=1)
    assert fresh.recover().checkpoint_id == 3
    assert storage.completed_checkpoint_ids() == [3]
    assert storage.list_files(storage.shared_dir) == []


def test_read_keyed_state_returns_a_typed_table(storage) -> None:
    CompletedCheckpointStore(storage).complete(checkpoint(storage, 5, n=1000))
    table = read_keyed_state(storage.uri_of(storage.checkpoint_dir(5)), "counter", "count")
    assert table.column_names == ["key", "value", "key_group"]
    assert table.schema.field("value").type == pa.int64()
    rows = {r["key"]: r["value"] for r in table.to_pylist()}
    assert rows == {k: 5 * k for k in range(1000)}
    with pytest.raises(KeyError, match="no operator 'nope'; its operators: counter"):
        read_keyed_state(storage.uri_of(storage.checkpoint_dir(5)), "nope", "count")
    with pytest.raises(KeyError, match="no keyed state 'missing'; its keyed states: count"):
        read_keyed_state(storage.uri_of(storage.checkpoint_dir(5)), "counter", "missing")


def test_read_keyed_state_of_untyped_and_pickled_state(storage) -> None:
    b = create_keyed_backend("heap", max_parallelism=4)
    m = b.get_state(MapStateDescriptor("m"))
    p = b.get_state(ValueStateDescriptor("p", serializer="pickle"))
    for k in range(100):
        b.set_current_key(f"k{k}")
        m.put("seen", k)
        p.update(frozenset([k]))
    result = b.snapshot(1, storage.location(1)).run()
    md = CheckpointMetadata(
        "job-7", 1, 0, operators={"op": OperatorState(1, 4, {0: SubtaskState(keyed=result.handles)})}
    )
    CompletedCheckpointStore(storage).complete(md)
    path = storage.uri_of(storage.checkpoint_dir(1))
    assert read_keyed_state(path, "op", "m").num_rows == 100
    from pyengine.state import PickleNotAllowedError

    with pytest.raises(PickleNotAllowedError):
        read_keyed_state(path, "op", "p")
    assert read_keyed_state(path, "op", "p", allow_pickle=True).num_rows == 100


def test_bad_storage_settings_are_refused_clearly(tmp_path) -> None:
    with pytest.raises(ValueError, match="job_id"):
        checkpoint_storage(str(tmp_path), "../escape")
    with pytest.raises(StorageError, match="nosuchscheme://x"):
        checkpoint_storage("nosuchscheme://x", "job")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="not writable"):
        checkpoint_storage(str(blocker), "job")


def test_probe_round_trips_through_storage(storage) -> None:
    storage.probe()
    assert [p for p in storage.list_files() if ".probe" in p] == []


def test_read_keyed_state_applies_an_incremental_chain(storage) -> None:
    """A delta's entries replace the base's and its deletions remove them: the
    table is the state as of the checkpoint, each key once."""
    store = CompletedCheckpointStore(storage)
    b = create_keyed_backend("incremental", max_parallelism=4)
    count = b.get_state(ValueStateDescriptor("count", 0, pa.int64()))
    tags = b.get_state(MapStateDescriptor("tags"))
    expected_count = {}
    expected_tags = {}
    for k in range(200):
        b.set_current_key(k)
        count.update(k)
        tags.put("first", k)
        expected_count[k], expected_tags[k] = k, {"first": k}
    for checkpoint_id in (1, 2, 3):
        result = b.snapshot(checkpoint_id, storage.location(checkpoint_id)).run()
        op = OperatorState(1, 4, {0: SubtaskState(keyed=result.handles)})
        store.complete(CheckpointMetadata("job", checkpoint_id, 0, operators={"op": op}))
        b.notify_checkpoint_complete(checkpoint_id)
        for k in range(checkpoint_id * 10, checkpoint_id * 10 + 10):  # changed after the checkpoint
            b.set_current_key(k)
            count.update(-k)
            tags.clear()
        for k in range(100 + checkpoint_id * 5, 105 + checkpoint_id * 5):
            b.set_current_key(k)
            count.clear()
        if checkpoint_id < 3:
            for k in range(checkpoint_id * 10, checkpoint_id * 10 + 10):
                expected_count[k] = -k
                expected_tags.pop(k, None)
            for k in range(100 + checkpoint_id * 5, 105 + checkpoint_id * 5):
                expected_count.pop(k, None)
    assert len(result.handles) == 3  # the base and two deltas
    path = storage.uri_of(storage.checkpoint_dir(3))
    table = read_keyed_state(path, "op", "count")
    assert table.num_rows == len(expected_count)
    assert {r["key"]: r["value"] for r in table.to_pylist()} == expected_count
    assert {r["key"]: dict(r["value"]) for r in read_keyed_state(path, "op", "tags").to_pylist()} == expected_tags


def test_a_printed_inline_handle_shows_its_size_not_its_bytes() -> None:
    from pyengine.storage.handles import ByteStreamStateHandle

    handle = ByteStreamStateHandle("op", b"\x00\x01" * 4_000, "xxh3:0102")
    assert repr(handle) == "ByteStreamStateHandle(name='op', 8,000 bytes, checksum='xxh3:0102')"
