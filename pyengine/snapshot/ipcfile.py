"""Writes an Arrow IPC file whose record batches are encoded on several threads.

pyarrow's file writer encodes one batch at a time: it compresses a batch's
buffers in parallel, which pays off for one huge batch, but a state file is many
batches (a subtask reads only its own key groups) and per-batch thread hand-offs
then cost more than they save. Here each batch is built, compressed and hashed
into an IPC stream message by one thread: pool threads (one per other core) and
the calling thread, which writes the messages in order and, whenever the next
one is not ready, encodes a later batch itself. Busy threads never outnumber the
cores: with a dedicated writing thread, three threads on two cores ran 20-30%
slower.

The file is byte for byte what ``ipc.new_file`` writes for the same batches:
magic, the schema message, the batch messages, then the footer. The footer,
which names the schema and every batch's (offset, metadata length, body length),
is pyarrow's own, written for the same schema and number of batches and given
the real block positions; so ``pyarrow.ipc.open_file`` reads the result as any
other file.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.ipc as ipc
import xxhash

from . import pacing

__all__ = ["encoding_workers", "write_ipc_file"]

_MAGIC = b"ARROW1\0\0"  # the file's leading magic and its padding to 8 bytes
_CONTINUATION = b"\xff\xff\xff\xff"
_BLOCK = struct.Struct("<qi4xq")  # flatbuffers struct Block: offset, metaDataLength, (pad), bodyLength
_FOOTER_RECORD_BATCHES = 3  # field index of Footer.recordBatches (format/File.fbs)

_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = 0
_pool_lock = threading.Lock()


def encoding_workers() -> int:
    """Pool threads that encode batches besides the writing thread, which encodes
    too: one per other core, at most three (LZ4 outruns the writing beyond that)."""
    return max(0, min(3, (os.cpu_count() or 1) - 1))


def _executor() -> ThreadPoolExecutor:
    """One pool per process: Spark's Python workers are forked, and a pool's
    threads do not survive a fork."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max(1, encoding_workers()), thread_name_prefix="pyengine-encode")
            _pool_pid = os.getpid()
        return _pool


class _Collector:
    """A sink that keeps what pyarrow writes instead of copying it: the body
    buffers arrive as ``pyarrow.Buffer`` objects (the compressed buffers
    themselves), the rest as small ``bytes``."""

    closed = False

    def __init__(self) -> None:
        self.parts: List[Any] = []
        self.size = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.parts.append(data)
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def writable(self) -> bool:
        return True


class _Message:
    """One encoded record batch: its bytes as parts, and its block's lengths."""

    __slots__ = ("body_length", "digest", "metadata_length", "parts", "size")

    def __init__(self, parts: List[Any], size: int, metadata_length: int, digest: int) -> None:
        self.parts = parts
        self.digest = digest
        self.size = size
        self.metadata_length = metadata_length
        self.body_length = size - metadata_length


def _encode(
    schema: pa.Schema,
    schema_size: int,
    options: ipc.IpcWriteOptions,
    build: Callable[[], pa.RecordBatch],
    paced: Optional[bool] = None,
) -> _Message:
    if paced is not None:  # on a pool thread: paced as the thread it works for
        with pacing.paced(paced):
            return _encode(schema, schema_size, options, build)
    batch = build()
    pacing.pace()  # building may have held the interpreter (Python lists to Arrow); writing does not
    sink = _Collector()
    # A stream writer emits the schema message, then the batch's: the same bytes
    # a file writer puts after its magic.
    ipc.new_stream(sink, schema, options=options).write_batch(batch)
    pacing.released()
    parts = _drop_prefix(sink.parts, schema_size)
    head = b"".join(bytes(memoryview(p)[:8]) for p in parts[:2])[:8]
    if head[:4] != _CONTINUATION:
        raise RuntimeError("unexpected IPC message layout from pyarrow: no continuation marker")
    metadata_length = 8 + int.from_bytes(head[4:8], "little")
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return _Message(parts, sink.size - schema_size, metadata_length, hasher.intdigest())


def _drop_prefix(parts: List[Any], n: int) -> List[Any]:
    out: List[Any] = []
    for part in parts:
        view = memoryview(part)
        if n >= view.nbytes:
            n -= view.nbytes
            continue
        out.append(part if n == 0 else view[n:])
        n = 0
    return out


def _file_tail(schema: pa.Schema, options: ipc.IpcWriteOptions, blocks: Sequence[Tuple[int, int, int]]) -> bytes:
    """What follows the last batch message: pyarrow's end-of-stream marker and
    footer for ``schema`` and ``len(blocks)`` batches, with ``blocks`` as the
    footer's record-batch table."""
    empty = pa.record_batch([_empty_array(f.type) for f in schema], schema=schema)
    sink = pa.BufferOutputStream()
    writer = ipc.new_file(sink, schema, options=options)
    for _ in blocks:
        writer.write_batch(empty)
    end = sink.tell()
    writer.close()
    tail = bytearray(sink.getvalue().to_pybytes()[end:])
    footer_length = int.from_bytes(tail[-10:-6], "little")
    footer_start = len(tail) - 10 - footer_length
    vector = _footer_vector(tail, footer_start, _FOOTER_RECORD_BATCHES)
    if vector is None:
        raise RuntimeError("unexpected Arrow IPC footer from pyarrow: no record batch table")
    count = int.from_bytes(tail[vector : vector + 4], "little")
    if count != len(blocks):
        raise RuntimeError(f"unexpected Arrow IPC footer from pyarrow: {count} blocks for {len(blocks)} batches")
    for i, block in enumerate(blocks):
        _BLOCK.pack_into(tail, vector + 4 + i * _BLOCK.size, *block)
    return bytes(tail)


def _empty_array(t: pa.DataType) -> pa.Array:
    """A zero-length array of ``t``: ``pa.array([], t)`` cannot make unions or run-end encoded arrays."""
    if pa.types.is_union(t):
        children = [_empty_array(t.field(i).type) for i in range(t.num_fields)]
        names = [t.field(i).name for i in range(t.num_fields)]
        codes = pa.array([], pa.int8())
        if t.mode == "dense":
            return pa.UnionArray.from_dense(codes, pa.array([], pa.int32()), children, names, list(t.type_codes))
        return pa.UnionArray.from_sparse(codes, children, names, list(t.type_codes))
    if pa.types.is_run_end_encoded(t):
        return pa.RunEndEncodedArray.from_arrays(_empty_array(t.run_end_type), _empty_array(t.value_type), t)
    return pa.array([], t)


def _footer_vector(buf: bytearray, start: int, field: int) -> Optional[int]:
    """Position in ``buf`` of the length word of vector field ``field`` of the
    flatbuffers table at the root of the buffer starting at ``start``."""
    table = start + int.from_bytes(buf[start : start + 4], "little")
    vtable = table - int.from_bytes(buf[table : table + 4], "little", signed=True)
    vtable_size = int.from_bytes(buf[vtable : vtable + 2], "little")
    entry = 4 + 2 * field
    if entry + 2 > vtable_size:
        return None
    offset = int.from_bytes(buf[vtable + entry : vtable + entry + 2], "little")
    if offset == 0:
        return None
    where = table + offset
    return where + int.from_bytes(buf[where : where + 4], "little")


def write_ipc_file(
    stream: Any,
    schema: pa.Schema,
    builds: Sequence[Callable[[], pa.RecordBatch]],
    options: ipc.IpcWriteOptions,
) -> List[Tuple[int, int, str]]:
    """Writes an IPC file of ``schema`` holding the batches ``builds`` return, in
    that order, to ``stream`` (``write`` and ``write_segment``: a checkpoint
    output stream). Builds run on pool threads, a few ahead of the writing, and
    on this thread while the next batch to write is not ready; each batch is
    one segment of the stream, hashed by the thread that encoded it.
    Returns each batch's (offset, length, checksum) from the stream's segments."""
    options = ipc.IpcWriteOptions(
        compression=options.compression, use_threads=False, metadata_version=options.metadata_version
    )
    schema_message = schema.serialize()
    schema_size = schema_message.size
    workers = encoding_workers()
    paced = pacing.is_paced()
    pool = _executor() if workers else None
    # A few batches per encoding thread ahead of the writing: enough that the
    # writer rarely waits, few enough that memory stays a few batches. And at
    # most a quarter of the file: a small state (1M entries is 8 batches) would
    # otherwise be mostly in flight at once, encoded beside itself.
    n = len(builds)
    ahead = max(2, min(3 * (workers + 1), n // 4))
    slots: List[Optional[Future[_Message]]] = [None] * n
    in_pool: Deque[Future[_Message]] = deque()
    next_build = written = 0
    segments: List[Tuple[int, int, str]] = []
    blocks: List[Tuple[int, int, int]] = []
    stream.write(_MAGIC)
    stream.write(schema_message)
    position = len(_MAGIC) + schema_size
    try:
        while written < n:
            while in_pool and in_pool[0].done():
                in_pool.popleft()
            while pool is not None and next_build < min(n, written + ahead) and len(in_pool) < 2 * workers:
                slots[next_build] = future = pool.submit(
                    _encode, schema, schema_size, options, builds[next_build], paced
                )
                in_pool.append(future)
                next_build += 1
            head = slots[written]
            if head is not None and head.done():
                message = head.result()
                slots[written] = None
                segments.append(stream.write_segment(message.parts, message.digest))
                blocks.append((position, message.metadata_length, message.body_length))
                position += message.size
                written += 1
            elif next_build < min(n, written + ahead):
                # Nothing to write yet: this thread encodes the next batch itself
                # rather than wait, so there are never more busy threads than cores.
                slots[next_build] = done = Future[_Message]()
                done.set_result(_encode(schema, schema_size, options, builds[next_build]))
                next_build += 1
            else:
                assert head is not None
                head.result()
    finally:
        for future in in_pool:  # an error: do not leave work running on the state
            future.cancel()
        for future in in_pool:
            if not future.cancelled():
                future.exception()
    stream.write(_file_tail(schema, options, blocks))
    return segments
