"""Checkpoint storage on any ``pyarrow.fs`` filesystem, or in memory.

Layout under the storage URI (see DESIGN.md, "Files")::

    <uri>/<job-id>/chk-<n>/_metadata     a completed checkpoint (written last, atomically)
    <uri>/<job-id>/chk-<n>/<files>       state owned by checkpoint n
    <uri>/<job-id>/shared/<files>        incremental files used by several checkpoints
    <uri>/<job-id>/taskowned/            state that tasks own

Every file is written under a temporary name and moved into place when complete,
so a crash never leaves a file that looks whole and is not; every file's xxh3-64
is recorded in its handle and checked when it is read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import uuid
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from .handles import (
    ByteStreamStateHandle,
    StateHandle,
    StreamStateHandle,
    checksum_hex,
    parse_checksum,
)
from .paths import relocatable

__all__ = [
    "METADATA_FILE",
    "delete_state_file",
    "open_input_file",
    "read_bytes",
    "read_range",
    "resolve",
    "INLINE_THRESHOLD",
    "CheckpointStateOutputStream",
    "CheckpointStorage",
    "CheckpointStorageLocation",
    "CorruptStateError",
    "StorageError",
    "checkpoint_storage",
]

METADATA_FILE = "_metadata"
_CHK_DIR = re.compile(r"^chk-(\d+)$")
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MEMORY_STORES: Dict[str, pafs.FileSystem] = {}
_MEMORY_LOCK = threading.Lock()


class StorageError(OSError):
    """Checkpoint storage cannot be used (bad URI, unreachable, not writable)."""


class CorruptStateError(ValueError):
    """A state or metadata file is damaged: truncated, altered or unreadable."""


def resolve(uri: str) -> Tuple[pafs.FileSystem, str, str]:
    """(filesystem, path in it, URI prefix) for a storage URI or a state file's path.

    The prefix turns a filesystem path back into a self-sufficient URI: state
    handles carry full URIs, so restoring needs nothing but the handles."""
    if not isinstance(uri, str) or not uri:
        raise StorageError(f"checkpoint storage must be a URI string, got {uri!r}")
    if uri.startswith("memory://"):
        name, _, path = uri[len("memory://") :].partition("/")
        name = name or "default"
        with _MEMORY_LOCK:
            fs = _MEMORY_STORES.get(name)
            if fs is None:
                fs, _ = pafs.FileSystem.from_uri("mock:///")
                _MEMORY_STORES[name] = fs
        return fs, path.strip("/"), f"memory://{name}/"
    if uri.startswith("file://"):
        uri = uri[len("file://") :] or "/"
    if "://" not in uri:
        # One spelling per local file ("./ckpt/x" and "ckpt/x" alike): paths are compared as
        # strings when deciding what a checkpoint still uses.
        return pafs.LocalFileSystem(), os.path.abspath(uri), ""
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        raise StorageError(f"cannot use checkpoint storage {uri!r}: {exc}") from None
    return fs, path.rstrip("/") or "/", uri.split("://", 1)[0] + "://"


@contextlib.contextmanager
def guarded(fs: Any, guard_path: str) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``guard_path`` (created if missing) on a local
    disk, so that a read-judge-write of a small control file (a lock, a job's run
    record) by two processes is never interleaved. Elsewhere (no ``flock`` on object
    stores), nothing: callers there check what they wrote, then verify."""
    if not isinstance(fs, pafs.LocalFileSystem):
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(guard_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p != "")


INLINE_THRESHOLD = 20 * 1024  # as Flink's state.storage.fs.memory-threshold
_COALESCE_BYTES = 64 * 1024


class CheckpointStateOutputStream:
    """A file being written into checkpoint storage. Bytes go to a temporary name
    and are hashed on the way; ``close_and_get_handle`` moves the file into place
    and returns its handle, ``abort`` (or an exception in a ``with`` block) removes it.

    With ``inline_threshold``, nothing is written to storage until that many bytes
    have arrived: smaller state comes back as a ``ByteStreamStateHandle`` that lives
    inside ``_metadata`` instead of as a tiny file of its own."""

    def __init__(self, fs: pafs.FileSystem, path: str, prefix: str = "", inline_threshold: int = 0) -> None:
        self._fs = fs
        self.path = path
        self._prefix = prefix
        directory, _, name = path.rpartition("/")
        self._temp = _join(directory, f".{name}.inprogress-{uuid.uuid4().hex[:12]}")
        self._inline_threshold = inline_threshold
        self._pending: Optional[bytearray] = bytearray() if inline_threshold > 0 else None
        self._out: Any = None if self._pending is not None else fs.open_output_stream(self._temp)
        self._small = bytearray()  # small writes not yet passed on to _out
        self._hash = xxhash.xxh3_64()
        self._segment: Optional[Any] = None
        self._segment_start = 0
        self._segmented = False
        self._size = 0
        self.closed = False

    # the file-object protocol pyarrow's writers use
    def _put(self, view: memoryview) -> None:
        if self._pending is not None:
            self._pending += view
            if len(self._pending) > self._inline_threshold:
                self._out = self._fs.open_output_stream(self._temp)
                self._out.write(self._pending)
                self._pending = None
        elif view.nbytes < _COALESCE_BYTES:
            # pyarrow writes a batch as many pieces (lengths, metadata, padding):
            # one call to the filesystem for all the small ones, not one each.
            self._small += view
            if len(self._small) >= _COALESCE_BYTES:
                self._flush_small()
        else:
            self._flush_small()
            self._out.write(view)

    def _flush_small(self) -> None:
        if self._small:
            self._out.write(self._small)
            self._small = bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._put(view)
        # Each byte is hashed once: by its segment's hasher inside one, else by the file's.
        if self._segment is None:
            self._hash.update(view)
        elif self._size >= self._segment_start:
            self._segment.update(view)
        else:  # the segment starts inside (or after) this write
            before = min(self._segment_start - self._size, view.nbytes)
            self._hash.update(view[:before])
            self._segment.update(view[before:])
        self._size += view.nbytes
        return view.nbytes

    def begin_segment(self, start: Optional[int] = None) -> None:
        """Starts hashing a byte range of its own (one record batch of a state file),
        from ``start`` (default: here) - a writer's next call may first emit
        bytes that are not the segment's, such as a file header.
        The file's checksum then covers the segment through the segment's digest:
        ``xxh3s:`` checksums, verified with the segments' index (``read_bytes``)."""
        if start is not None and start < self._size:
            raise ValueError(f"segment start {start} is before the {self._size} bytes already written")
        self._segment = xxhash.xxh3_64()
        self._segment_start = self._size if start is None else start
        self._segmented = True

    def end_segment(self) -> Tuple[int, int, str]:
        """(offset, length, checksum) of the bytes written since ``begin_segment``."""
        if self._segment is None:
            raise ValueError("end_segment() without begin_segment()")
        if self._size < self._segment_start:
            raise ValueError(f"segment from byte {self._segment_start} ended at byte {self._size}")
        value = self._segment.intdigest()
        self._segment = None
        self._hash.update(value.to_bytes(8, "little"))
        return self._segment_start, self._size - self._segment_start, checksum_hex(value)

    def write_segment(self, parts: Sequence[Any], digest: int) -> Tuple[int, int, str]:
        """Writes one segment whose xxh3-64 ``digest`` the caller has computed (on
        the thread that encoded it, so the writing thread only copies bytes), and
        returns its (offset, length, checksum) as ``end_segment`` does."""
        if self._segment is not None:
            raise ValueError("write_segment() inside begin_segment()/end_segment()")
        start = self._size
        for part in parts:
            view = memoryview(part)
            self._put(view)
            self._size += view.nbytes
        self._hash.update(digest.to_bytes(8, "little"))
        self._segmented = True
        return start, self._size - start, checksum_hex(digest)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        """pyarrow writers close their sink when they finish; the handle is taken separately."""

    def close_and_get_handle(self) -> StateHandle:
        if self.closed:
            raise ValueError(f"stream for {self.path} is already closed")
        self.closed = True
        checksum = checksum_hex(self._hash.intdigest())
        if self._segmented:
            checksum = "xxh3s" + checksum[len("xxh3") :]
        if self._pending is not None:
            return ByteStreamStateHandle(self._prefix + self.path, bytes(self._pending), checksum)
        self._flush_small()
        self._out.close()
        self._fs.move(self._temp, self.path)
        return StreamStateHandle(self._prefix + self.path, self._size, checksum)

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._out is None:
            return
        try:
            self._out.close()
        finally:
            _delete_quietly(self._fs, self._temp)

    def __enter__(self) -> CheckpointStateOutputStream:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except (FileNotFoundError, OSError):
        pass


class CheckpointStorageLocation:
    """Where the state of one checkpoint goes: ``<job>/chk-<n>``."""

    def __init__(self, storage: CheckpointStorage, checkpoint_id: int) -> None:
        self.storage = storage
        self.checkpoint_id = checkpoint_id
        self.directory = _join(storage.root, f"chk-{checkpoint_id}")
        storage.fs.create_dir(self.directory, recursive=True)

    def create_output_stream(
        self, name: str, *, shared: bool = False, inline_threshold: int = 0
    ) -> CheckpointStateOutputStream:
        """A new file of this checkpoint (or, with ``shared``, of the shared directory);
        see CheckpointStateOutputStream for ``inline_threshold``."""
        if "/" in name or not name or name.startswith((".", "_")):
            raise ValueError(f"invalid state file name {name!r}")
        directory = self.storage.shared_dir if shared else self.directory
        return CheckpointStateOutputStream(
            self.storage.fs, _join(directory, name), self.storage.prefix, inline_threshold
        )

    def dispose(self) -> None:
        """Deletes everything written for this checkpoint (an aborted checkpoint)."""
        self.storage.delete_dir(self.directory)

    def __repr__(self) -> str:
        return f"CheckpointStorageLocation({self.storage.uri!r}, chk-{self.checkpoint_id})"


class CheckpointStorage:
    """Checkpoint storage of one job: locations, metadata, reading and deleting state."""

    def __init__(self, uri: str, job_id: str) -> None:
        if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
            raise ValueError(
                f"job_id must be 1-128 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
                f"got {job_id!r}"
            )
        self.uri = uri
        self.job_id = job_id
        self.fs, base, self.prefix = resolve(uri)
        self.root = _join(base, job_id)
        self.shared_dir = _join(self.root, "shared")
        self.taskowned_dir = _join(self.root, "taskowned")
        try:
            for d in (self.root, self.shared_dir, self.taskowned_dir):
                self.fs.create_dir(d, recursive=True)
        except OSError as exc:
            raise StorageError(f"checkpoint storage {uri!r} is not writable: {exc}") from None

    def location(self, checkpoint_id: int) -> CheckpointStorageLocation:
        if type(checkpoint_id) is not int or checkpoint_id < 0:
            raise ValueError(f"checkpoint_id must be an int >= 0, got {checkpoint_id!r}")
        return CheckpointStorageLocation(self, checkpoint_id)

    def checkpoint_dir(self, checkpoint_id: int) -> str:
        return _join(self.root, f"chk-{checkpoint_id}")

    def probe(self) -> None:
        """Writes, reads back and deletes a small file: fails clearly if storage is unusable."""
        path = _join(self.root, f".probe-{uuid.uuid4().hex[:12]}")
        payload = b"pyengine storage probe"
        try:
            with self.fs.open_output_stream(path) as out:
                out.write(payload)
            with self.fs.open_input_stream(path) as inp:
                back = inp.read()
        except OSError as exc:
            raise StorageError(f"checkpoint storage {self.uri!r} is not usable: {exc}") from None
        finally:
            _delete_quietly(self.fs, path)
        if back != payload:
            raise StorageError(f"checkpoint storage {self.uri!r} returned different bytes than were written")

    # -- reading ------------------------------------------------------------------

    def read_bytes(self, handle: StateHandle, *, what: str = "") -> bytes:
        return read_bytes(handle, what=what)

    def uri_of(self, path: str) -> str:
        """The self-sufficient URI of a path in this storage's filesystem."""
        return self.prefix + path

    # -- metadata -----------------------------------------------------------------

    def write_metadata(self, checkpoint_id: int, metadata: Dict[str, Any]) -> str:
        """Writes ``chk-<n>/_metadata`` atomically; the checkpoint exists from then on.
        A checkpoint that already has metadata is never overwritten."""
        directory = self.checkpoint_dir(checkpoint_id)
        path = _join(directory, METADATA_FILE)
        if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
            raise FileExistsError(f"checkpoint {checkpoint_id} of job {self.job_id} is already complete ({path})")
        self.fs.create_dir(directory, recursive=True)
        metadata = relocatable(metadata, self.prefix + directory)
        body = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
        stream = CheckpointStateOutputStream(self.fs, path, self.prefix)
        with stream:
            stream.write(body)
            stream.close_and_get_handle()
        return self.prefix + path

    def read_metadata_bytes(self, checkpoint_id: int) -> Tuple[str, bytes]:
        path = _join(self.checkpoint_dir(checkpoint_id), METADATA_FILE)
        try:
            with self.fs.open_input_stream(path) as f:
                return path, f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint {checkpoint_id} of job {self.job_id} has no {path}") from None

    def completed_checkpoint_ids(self) -> List[int]:
        """Ids of the checkpoints whose ``_metadata`` exists, oldest first."""
        ids = []
        for info in self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True)):
            m = _CHK_DIR.match(info.base_name)
            if m and info.type == pafs.FileType.Directory:
                meta = self.fs.get_file_info(_join(info.path, METADATA_FILE))
                if meta.type == pafs.FileType.File:
                    ids.append(int(m.group(1)))
        return sorted(ids)

    # -- deleting -----------------------------------------------------------------

    def delete_file(self, path: str) -> None:
        _delete_quietly(self.fs, path)

    def delete_dir(self, path: str) -> None:
        try:
            self.fs.delete_dir(path)
        except (FileNotFoundError, OSError):
            pass

    def list_files(self, directory: Optional[str] = None) -> List[str]:
        """Every file under ``directory`` (default: the job's directory), for tests and tools."""
        selector = pafs.FileSelector(directory or self.root, recursive=True, allow_not_found=True)
        return sorted(i.path for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.uri!r}, job_id={self.job_id!r})"


def _what(what: str) -> str:
    return f" ({what})" if what else ""


def _segmented_digest(data: bytes, segments: Sequence[Tuple[int, int, str]], subject: str, what: str) -> int:
    """The checksum of a file written with segments: each segment verified against
    its own checksum, everything else and the segment digests hashed in order."""
    hasher = xxhash.xxh3_64()
    view = memoryview(data)
    position = 0
    for offset, length, checksum in sorted(segments):
        hasher.update(view[position:offset])
        piece = view[offset : offset + length]
        _verify(piece, checksum, f"bytes {offset}-{offset + length} of {subject}", what)
        hasher.update(xxhash.xxh3_64_intdigest(piece).to_bytes(8, "little"))
        position = offset + length
    hasher.update(view[position:])
    return hasher.intdigest()


def _verify(data: Any, checksum: str, subject: str, what: str) -> None:
    expected = parse_checksum(checksum)
    if expected is None:
        raise CorruptStateError(f"{subject}{_what(what)} has no usable checksum ({checksum!r})")
    actual = xxhash.xxh3_64_intdigest(data)
    if actual != expected:
        raise CorruptStateError(
            f"checksum mismatch in {subject}{_what(what)}: recorded {checksum}, found {checksum_hex(actual)}"
        )


def open_input_file(path: str, *, what: str = "") -> Any:
    """A random-access file for a state file's URI (as state handles record them)."""
    fs, fs_path, _ = resolve(path)
    try:
        return fs.open_input_file(fs_path)
    except FileNotFoundError:
        raise CorruptStateError(f"state file {path} is missing{_what(what)}") from None


def read_bytes(
    handle: StateHandle, *, what: str = "", segments: Optional[Sequence[Tuple[int, int, str]]] = None
) -> bytes:
    """The whole content behind ``handle``, checksum verified; content written with
    segments (an ``xxh3s:`` checksum) needs their (offset, length, checksum) to verify."""
    if isinstance(handle, ByteStreamStateHandle):
        data, subject = handle.data, f"inline state {handle.name!r}"
    elif isinstance(handle, StreamStateHandle):
        with open_input_file(handle.path, what=what) as f:
            data = f.read()
        subject = f"state file {handle.path}"
        if len(data) != handle.size:
            raise CorruptStateError(
                f"{subject}{_what(what)} has {len(data)} bytes where {handle.size} were written: truncated?"
            )
    else:
        raise TypeError(f"cannot read bytes of {handle!r}")
    if handle.checksum.startswith("xxh3s:"):
        if segments is None:
            raise CorruptStateError(f"{subject}{_what(what)} needs its batch index to be verified")
        actual = checksum_hex(_segmented_digest(data, segments, subject, what))
        if actual[len("xxh3:") :] != handle.checksum[len("xxh3s:") :]:
            raise CorruptStateError(f"checksum mismatch in {subject}{_what(what)}: recorded {handle.checksum}")
    else:
        _verify(data, handle.checksum, subject, what)
    return data


def read_range(path: str, offset: int, length: int, checksum: str, *, what: str = "") -> bytes:
    """Bytes ``offset .. offset+length`` of a state file, checksum verified."""
    with open_input_file(path, what=what) as f:
        data = f.read_at(length, offset)
    if len(data) != length:
        raise CorruptStateError(f"state file {path}{_what(what)} is shorter than recorded: truncated?")
    _verify(data, checksum, f"bytes {offset}-{offset + length} of state file {path}", what)
    return data


def delete_state_file(path: str) -> None:
    """Deletes a state file by its URI; a file already gone is fine."""
    fs, fs_path, _ = resolve(path)
    _delete_quietly(fs, fs_path)


def checkpoint_storage(uri: str, job_id: str) -> CheckpointStorage:
    """Checkpoint storage for ``job_id`` under ``uri``: a path or ``file://`` URI,
    ``memory://<name>`` (one store per name, for tests), or any URI ``pyarrow.fs``
    understands (``s3://``, ``gs://``, ``hdfs://``)."""
    return CheckpointStorage(uri, job_id)
