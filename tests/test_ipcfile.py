"""The IPC file assembled from batches encoded on worker threads is the file
pyarrow's own writer makes, and failures in a batch leave nothing behind."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import xxhash

from pyengine.snapshot import ipcfile
from pyengine.snapshot.ipcfile import write_ipc_file
from pyengine.state import ValueStateDescriptor, create_keyed_backend
from pyengine.storage import checkpoint_storage
from pyengine.storage.filesystem import CheckpointStateOutputStream, resolve
from pyengine.storage.local import DuplicatingOutputStream

_RUNS = pa.run_end_encoded(pa.int32(), pa.int16())
_UNION = pa.dense_union([pa.field("i", pa.int64()), pa.field("s", pa.string())])
SCHEMA = pa.schema(
    [pa.field("kg", _RUNS), pa.field("key", _UNION), pa.field("value", pa.list_(pa.float64()))],
    metadata={"what": "a test"},
)


def _batch(seed: int, n: int) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    ends = [n] if n else []
    runs = pa.RunEndEncodedArray.from_arrays(pa.array(ends, pa.int32()), pa.array([seed] * len(ends), pa.int16()))
    ints = pa.array(rng.integers(0, 1 << 40, n))
    codes, offsets = pa.array(np.zeros(n, np.int8)), pa.array(np.arange(n, dtype=np.int32))
    keys = pa.UnionArray.from_dense(codes, offsets, [ints, pa.array([], pa.string())], ["i", "s"])
    values = pa.array([[float(x)] * (x % 3) for x in rng.integers(0, 100, n)], pa.list_(pa.float64()))
    return pa.record_batch([runs, keys, values], schema=SCHEMA)


def _stream(tmp_path, name="f.arrow") -> CheckpointStateOutputStream:
    fs, root, _ = resolve(str(tmp_path))
    return CheckpointStateOutputStream(fs, f"{root}/{name}")


@pytest.mark.parametrize("compression", ["lz4", None])
@pytest.mark.parametrize("sizes", [[1], [5, 0, 7], [3000, 1, 20000, 17, 4096, 9, 2, 30000]])
@pytest.mark.parametrize("workers", [0, 1, 3])  # 0: one core, the writing thread encodes everything
def test_the_file_is_byte_for_byte_what_pyarrow_writes(tmp_path, monkeypatch, compression, sizes, workers) -> None:
    monkeypatch.setattr(ipcfile, "encoding_workers", lambda: workers)
    batches = [_batch(i, n) for i, n in enumerate(sizes)]
    options = ipc.IpcWriteOptions(compression=compression)
    expected = pa.BufferOutputStream()
    with ipc.new_file(expected, SCHEMA, options=options) as writer:
        for batch in batches:
            writer.write_batch(batch)
    stream = _stream(tmp_path)
    segments = write_ipc_file(stream, SCHEMA, [lambda b=b: b for b in batches], options)
    handle = stream.close_and_get_handle()
    data = open(handle.path, "rb").read()
    assert data == expected.getvalue().to_pybytes()
    # Each batch is one checksummed segment, at the offset the footer gives it.
    reader = ipc.open_file(pa.py_buffer(data))
    assert reader.num_record_batches == len(batches)
    for i, (offset, length, checksum) in enumerate(segments):
        assert checksum == f"xxh3:{xxhash.xxh3_64_intdigest(data[offset : offset + length]):016x}"
        message = ipc.read_message(pa.py_buffer(data[offset : offset + length]))
        assert ipc.read_record_batch(message, SCHEMA).equals(batches[i])
        assert reader.get_batch(i).equals(batches[i])


def test_a_failing_batch_fails_the_write_and_the_rest_is_not_written(tmp_path) -> None:
    built = []

    def build(i: int) -> pa.RecordBatch:
        built.append(i)
        if i == 3:
            raise ValueError("batch 3 cannot be built")
        return _batch(i, 100)

    stream = _stream(tmp_path)
    with pytest.raises(ValueError, match="batch 3"):
        with stream:
            write_ipc_file(stream, SCHEMA, [lambda i=i: build(i) for i in range(40)], ipc.IpcWriteOptions())
    assert max(built) < 39  # stopped early, not after encoding everything
    assert os.listdir(tmp_path) == []  # the temporary file was removed


def test_a_local_copy_of_a_many_batch_state_file_is_identical(tmp_path) -> None:
    backend = create_keyed_backend("heap", max_parallelism=128, local_recovery_dir=str(tmp_path / "local"))
    backend.get_state(ValueStateDescriptor("count", 0, pa.int64())).update_many(np.arange(600_000), np.arange(600_000))
    storage = checkpoint_storage(str(tmp_path / "primary"), "job")
    result = backend.snapshot(1, storage.location(1)).run()
    (handle,) = result.handles
    assert len(handle.index) > 1
    assert open(handle.stream.path, "rb").read() == open(result.local_handles[0].stream.path, "rb").read()


def test_a_failing_local_copy_during_a_many_batch_write_only_drops_the_copy(tmp_path) -> None:
    fs, root, _ = resolve(str(tmp_path))
    primary = CheckpointStateOutputStream(fs, f"{root}/f.arrow")
    stream = DuplicatingOutputStream(primary, str(tmp_path / "local.arrow"))

    class Full:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    stream._local.close()
    stream._local = Full()
    batches = [_batch(i, 50) for i in range(6)]
    write_ipc_file(stream, SCHEMA, [lambda b=b: b for b in batches], ipc.IpcWriteOptions(compression="lz4"))
    handle = stream.close_and_get_handle()
    assert not stream.local_ok and not os.path.exists(tmp_path / "local.arrow")
    assert ipc.open_file(handle.path).read_all().num_rows == 300
