from __future__ import annotations

import os

import pyarrow as pa
import pytest

from pyengine.state import ValueStateDescriptor, create_keyed_backend
from pyengine.storage import checkpoint_storage
from pyengine.storage.filesystem import resolve

COUNT = ValueStateDescriptor("count", 0, pa.int64())


def filled(kind, local_dir, n=5000):
    b = create_keyed_backend(kind, max_parallelism=16, local_recovery_dir=str(local_dir))
    c = b.get_state(COUNT)
    for k in range(n):
        b.set_current_key(k)
        c.update(k)
    return b


def values(backend):
    c = backend.get_state(COUNT)
    out = {}
    for k in backend.keys("count"):
        backend.set_current_key(k)
        out[k] = c.value()
    return out


def break_primary(handles):
    for h in handles:
        fs, path, _ = resolve(h.stream.path)
        fs.delete_file(path)


@pytest.mark.parametrize("kind", ["heap", "incremental"])
def test_restore_prefers_the_local_copy(tmp_path, kind) -> None:
    storage = checkpoint_storage(str(tmp_path / "primary"), "job")
    b = filled(kind, tmp_path / "local")
    result = b.snapshot(1, storage.location(1)).run()
    assert [h.stream.path for h in result.local_handles] == [
        str(tmp_path / "local" / os.path.basename(h.stream.path)) for h in result.handles
    ]
    break_primary(result.handles)  # only the local copy is left
    r = create_keyed_backend(kind, max_parallelism=16, local_recovery_dir=str(tmp_path / "local"))
    r.restore(result.handles)
    assert values(r) == values(b)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_local_copy_falls_back_to_primary(tmp_path, damage) -> None:
    storage = checkpoint_storage(str(tmp_path / "primary"), "job")
    b = filled("heap", tmp_path / "local")
    result = b.snapshot(1, storage.location(1)).run()
    local = result.local_handles[0].stream.path
    if damage == "missing":
        os.remove(local)
    else:
        data = bytearray(open(local, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(local, "wb").write(bytes(data))
    r = create_keyed_backend("heap", max_parallelism=16, local_recovery_dir=str(tmp_path / "local"))
    r.restore(result.handles)
    assert values(r) == values(b)


def test_a_failing_local_copy_never_fails_the_checkpoint(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path / "primary"), "job")
    b = filled("heap", tmp_path / "local")
    os.rmdir(tmp_path / "local")
    (tmp_path / "local").write_text("now a file: the local directory is unusable")
    result = b.snapshot(1, storage.location(1)).run()
    assert result.handles and result.local_handles == []
    r = create_keyed_backend("heap", max_parallelism=16)
    r.restore(result.handles)
    assert values(r) == values(b)


def test_local_copies_of_checkpoints_no_longer_needed_are_deleted(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path / "primary"), "job")
    b = filled("heap", tmp_path / "local")
    first = b.snapshot(1, storage.location(1)).run()
    b.notify_checkpoint_complete(1)
    second = b.snapshot(2, storage.location(2)).run()
    assert len(os.listdir(tmp_path / "local")) == 2
    b.notify_checkpoint_complete(2)
    assert os.listdir(tmp_path / "local") == [os.path.basename(second.local_handles[0].stream.path)]
    assert not os.path.exists(first.local_handles[0].stream.path)
