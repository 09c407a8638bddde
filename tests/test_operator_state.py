from __future__ import annotations

import pytest

from pyengine.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    OperatorStateBackend,
    PickleNotAllowedError,
    read_operator_state,
)
from pyengine.storage import checkpoint_storage
from pyengine.storage.metadata import CheckpointMetadata, OperatorState, SubtaskState
from pyengine.storage.store import CompletedCheckpointStore

OFFSETS = ListStateDescriptor("offsets")
SEEN = ListStateDescriptor("seen")
RULES = MapStateDescriptor("rules")


def run_old(storage, parallelism, checkpoint_id=1):
    handles = []
    for i in range(parallelism):
        b = OperatorStateBackend(subtask_index=i, parallelism=parallelism)
        b.get_list_state(OFFSETS).add_all([(i, j) for j in range(i + 2)])
        b.get_union_list_state(SEEN).add(f"from-{i}")
        b.get_broadcast_state(RULES).put_all({"limit": 10, "mode": ["strict"]})
        handles.append(b.snapshot(checkpoint_id, storage.location(checkpoint_id)).run().handles)
    return handles


@pytest.mark.parametrize("old, new", [(3, 2), (2, 5), (1, 3), (4, 4)])
def test_redistribution_on_rescale(tmp_path, old, new) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    handles = [h for hs in run_old(storage, old) for h in hs]
    all_offsets = sorted((i, j) for i in range(old) for j in range(i + 2))
    restored_offsets = []
    for i in range(new):
        b = OperatorStateBackend(subtask_index=i, parallelism=new)
        b.restore(handles)
        restored_offsets += b.get_list_state(OFFSETS).get()
        assert sorted(b.get_union_list_state(SEEN).get()) == sorted(f"from-{k}" for k in range(old))
        assert dict(b.get_broadcast_state(RULES).items()) == {"limit": 10, "mode": ["strict"]}
    assert sorted(restored_offsets) == all_offsets  # each element exactly once


def test_restored_state_must_be_registered_with_the_same_mode(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    handles = [h for hs in run_old(storage, 1) for h in hs]
    b = OperatorStateBackend()
    b.restore(handles)
    with pytest.raises(ValueError, match="'seen' was checkpointed as union state, not split"):
        b.get_list_state(SEEN)


def test_unregistered_restored_state_is_carried_to_the_next_checkpoint(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    b = OperatorStateBackend()
    b.restore([h for hs in run_old(storage, 1) for h in hs])
    b.get_list_state(OFFSETS).add((9, 9))  # only this one is used after the restore
    again = b.snapshot(2, storage.location(2)).run().handles
    c = OperatorStateBackend()
    c.restore(again)
    assert c.get_union_list_state(SEEN).get() == ["from-0"]
    assert (9, 9) in c.get_list_state(OFFSETS).get()


def test_pickled_operator_state_needs_an_opt_in(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    b = OperatorStateBackend()
    b.get_list_state(ListStateDescriptor("txns", serializer="pickle")).add(frozenset({1}))
    handles = b.snapshot(1, storage.location(1)).run().handles
    c = OperatorStateBackend()
    c.restore(handles)
    with pytest.raises(PickleNotAllowedError):
        c.get_list_state(ListStateDescriptor("txns"))
    assert c.get_list_state(ListStateDescriptor("txns", serializer="pickle")).get() == [frozenset({1})]


def test_read_operator_state(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    per_subtask = run_old(storage, 2)
    op = OperatorState(2, 128, {i: SubtaskState(operator=hs) for i, hs in enumerate(per_subtask)})
    CompletedCheckpointStore(storage).complete(CheckpointMetadata("job", 1, 0, operators={"src": op}))
    path = storage.uri_of(storage.checkpoint_dir(1))
    offsets = read_operator_state(path, "src", "offsets")
    assert offsets.column_names == ["subtask", "value"] and offsets.num_rows == 2 + 3
    rules = read_operator_state(path, "src", "rules")
    assert rules.column_names == ["subtask", "key", "value"] and rules.num_rows == 4
    with pytest.raises(KeyError, match="no operator state 'nope'"):
        read_operator_state(path, "src", "nope")
