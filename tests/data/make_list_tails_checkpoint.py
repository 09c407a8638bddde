"""Writes ``tests/data/checkpoint-list-tails`` for test_state_list_tails: an incremental
chain of a typed list state whose delta holds list tails (state file format version 5,
written first at the commit that added it). Run from the repository's root with that
pyengine first on ``PYTHONPATH``: ``python tests/data/make_list_tails_checkpoint.py``.

60 keys, max_parallelism 8; checkpoint 1 (the base) holds ``[0.0, 1.0]`` for even keys
and ``[0.0]`` for odd ones, checkpoint 2 (a delta) appends up to ``k % 5 + 3`` elements
(list tails), rewrites key 7 and deletes and re-adds key 9 (whole lists)."""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import pyarrow as pa

from pyengine.state import ListStateDescriptor, create_keyed_backend
from pyengine.storage import checkpoint_storage
from pyengine.storage.metadata import CheckpointMetadata, OperatorState, SubtaskState
from pyengine.storage.store import CompletedCheckpointStore

TARGET = Path(__file__).parent / "checkpoint-list-tails"

if __name__ == "__main__":
    if TARGET.exists():
        shutil.rmtree(TARGET)
    storage = checkpoint_storage(str(TARGET), "job")
    store = CompletedCheckpointStore(storage, retained=1)
    b = create_keyed_backend("incremental", max_parallelism=8)
    amounts = b.get_state(ListStateDescriptor("amounts", pa.float64()))
    for k in range(60):
        b.set_current_key(k)
        amounts.add_all([0.0, 1.0] if k % 2 == 0 else [0.0])
    for checkpoint_id in (1, 2):
        if checkpoint_id == 2:
            for k in range(60):
                b.set_current_key(k)
                if k == 7:
                    amounts.update([float(i) for i in range(k % 5 + 3)])
                    continue
                if k == 9:
                    amounts.clear()
                    amounts.add_all([float(i) for i in range(k % 5 + 3)])
                    continue
                have = len(list(amounts.get()))
                for i in range(have, k % 5 + 3):
                    amounts.add(float(i))
        result = b.snapshot(checkpoint_id, storage.location(checkpoint_id)).run()
        op = OperatorState(1, 8, {0: SubtaskState(keyed=result.handles)})
        store.complete(CheckpointMetadata("job", checkpoint_id, 0, operators={"op": op}))
        b.notify_checkpoint_complete(checkpoint_id)
    print("written", TARGET)
