"""Completed checkpoints: the retained ones, their discarding, and recovery after a crash.

Rules, as Flink's CompletedCheckpointStore and SharedStateRegistry, made strict:

* A checkpoint is added only after its ``_metadata`` is written; only then are
  older checkpoints beyond ``retained`` discarded. Nothing completed is deleted
  before a newer checkpoint is complete.
* A state file is deleted only when nothing that may still be restored or may
  still complete uses it: the registry counts the references of the retained
  checkpoints *and* of the pending ones (registered as their acknowledgements
  arrive), so discarding a subsumed checkpoint never takes a file that a pending
  checkpoint built on. Every file it deletes is remembered (a bounded record), so
  a checkpoint that refers to one is aborted instead of completing unrestorable.
* The coordinator deletes only inside its own job's directory: files of ``shared/``
  and of the failed checkpoint's own ``chk-<n>/``, never ``_metadata``, never a
  path that leaves the directory, whatever a (possibly forged) acknowledgement says.
* On recovery the store adopts what a dead run left in the same directory:
  the newest ``retained`` restorable checkpoints (a damaged one is skipped, with a
  warning, for the previous intact one), and deletes the rest - older checkpoints,
  ``chk-<n>`` directories without ``_metadata`` and shared files nothing uses.
* Savepoints are never discarded by the store.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections import Counter, OrderedDict
from typing import Dict, Iterable, List, Optional, Set

import pyarrow.fs as pafs

from .filesystem import METADATA_FILE, CheckpointStorage, StorageError, delete_state_file, resolve
from .handles import KeyGroupsStateHandle, StateHandle, StreamStateHandle
from .metadata import CheckpointMetadata, MetadataError

__all__ = [
    "CompletedCheckpointStore",
    "SharedStateRegistry",
    "discard_unreferenced",
    "owns_path",
    "shared_files",
    "stream_paths",
    "stream_paths_of",
]

log = logging.getLogger(__name__)

# How many deleted paths the registry remembers: a pending checkpoint refers to files
# of the last few checkpoints, so this covers thousands of checkpoints of history
# at any parallelism one machine runs, in a few MB at most.
DELETED_MEMORY = 10_000
_CHK_DIR = re.compile(r"^chk-(\d+)$")


class SharedStateRegistry:
    """Which state files checkpoints use, so that none is deleted while something
    that may be restored, or may still complete, uses it.

    References come in two kinds: those of retained completed checkpoints (and of
    savepoints' files in the job's directory, held until a newer checkpoint
    completes), registered with ``register``, and those of pending checkpoints,
    added per acknowledgement with ``register_pending``. A file is in use while
    either kind refers to it."""

    def __init__(self, deleted_memory: int = DELETED_MEMORY) -> None:
        self._counts: Counter[str] = Counter()
        self._by_checkpoint: Dict[int, List[str]] = {}
        self._pending_counts: Counter[str] = Counter()
        self._pending: Dict[int, Set[str]] = {}
        self._deleted: OrderedDict[str, None] = OrderedDict()
        self._deleted_memory = deleted_memory

    def register(self, checkpoint_id: int, paths: Iterable[str]) -> None:
        """References of a completed checkpoint (registering one twice is a no-op)."""
        if checkpoint_id in self._by_checkpoint:
            return
        unique = sorted(set(paths))
        self._by_checkpoint[checkpoint_id] = unique
        self._counts.update(unique)

    def unregister(self, checkpoint_id: int) -> List[str]:
        """Drops a completed checkpoint's references; returns the files nothing uses any more."""
        unused = []
        for path in self._by_checkpoint.pop(checkpoint_id, []):
            self._counts[path] -= 1
            if self._counts[path] <= 0:
                del self._counts[path]
                if not self._pending_counts[path]:
                    unused.append(path)
        return unused

    def register_pending(self, checkpoint_id: int, paths: Iterable[str]) -> None:
        """References of a pending checkpoint, as its acknowledgements bring them."""
        mine = self._pending.setdefault(checkpoint_id, set())
        new = set(paths) - mine
        mine |= new
        self._pending_counts.update(new)

    def release_pending(self, checkpoint_id: int) -> List[str]:
        """Drops a pending checkpoint's references (it completed, and ``register``
        holds what it keeps; or it failed); returns the files nothing uses any more."""
        unused = []
        for path in self._pending.pop(checkpoint_id, set()):
            self._pending_counts[path] -= 1
            if self._pending_counts[path] <= 0:
                del self._pending_counts[path]
                if not self._counts[path]:
                    unused.append(path)
        return sorted(unused)

    def is_used(self, path: str) -> bool:
        return self._counts[path] > 0 or self._pending_counts[path] > 0

    def record_deleted(self, path: str) -> None:
        """Remembers a deleted file, so a checkpoint that refers to it never completes."""
        self._deleted[path] = None
        self._deleted.move_to_end(path)
        while len(self._deleted) > self._deleted_memory:
            self._deleted.popitem(last=False)

    def was_deleted(self, path: str) -> bool:
        return path in self._deleted

    @property
    def referenced(self) -> List[str]:
        """Files the retained checkpoints use."""
        return sorted(p for p, n in self._counts.items() if n > 0)

    @property
    def pending_ids(self) -> List[int]:
        return sorted(self._pending)


class CompletedCheckpointStore:
    """The newest ``retained`` completed checkpoints of a job, plus its savepoints."""

    def __init__(self, storage: CheckpointStorage, retained: int = 1) -> None:
        if type(retained) is not int or retained < 1:
            raise ValueError(f"retained must be an int >= 1, got {retained!r}")
        self.storage = storage
        self.retained = retained
        self.registry = SharedStateRegistry()
        self._checkpoints: List[CheckpointMetadata] = []
        self._anchors: List[int] = []  # savepoints whose job-directory files are held
        self.highest_checkpoint_id = 0  # the highest chk-<n> recover() found, completed or not

    @property
    def checkpoints(self) -> List[CheckpointMetadata]:
        return list(self._checkpoints)

    def latest(self) -> Optional[CheckpointMetadata]:
        return self._checkpoints[-1] if self._checkpoints else None

    def add(self, metadata: CheckpointMetadata) -> List[CheckpointMetadata]:
        """Adds a checkpoint whose ``_metadata`` is written; discards checkpoints
        beyond retention (oldest first) and returns them."""
        if self._checkpoints and metadata.checkpoint_id <= self._checkpoints[-1].checkpoint_id:
            raise ValueError(
                f"checkpoint {metadata.checkpoint_id} is not newer than the latest completed "
                f"{self._checkpoints[-1].checkpoint_id}"
            )
        self.registry.register(metadata.checkpoint_id, shared_files(metadata))
        self._checkpoints.append(metadata)
        discarded = []
        while sum(1 for c in self._checkpoints if c.type == "checkpoint") > self.retained:
            oldest = next(c for c in self._checkpoints if c.type == "checkpoint")
            self._checkpoints.remove(oldest)
            self._discard(oldest)
            discarded.append(oldest)
        for savepoint_id in [a for a in self._anchors if a < metadata.checkpoint_id]:
            self._anchors.remove(savepoint_id)
            self._delete_shared(self.registry.unregister(savepoint_id))
        return discarded

    def complete(self, metadata: CheckpointMetadata) -> List[CheckpointMetadata]:
        """Writes ``_metadata`` (the moment the checkpoint exists), then adds it."""
        self.storage.write_metadata(metadata.checkpoint_id, metadata.to_json())
        return self.add(metadata)

    def anchor(self, savepoint_id: int, paths: Iterable[str]) -> None:
        """Holds a completed savepoint's files in the job's ``shared/`` until a newer
        checkpoint completes: tasks that heard of the savepoint build their next
        deltas on its chain, so those files must live as a retained checkpoint's do."""
        self.registry.register(savepoint_id, paths)
        self._anchors.append(savepoint_id)

    def _discard(self, metadata: CheckpointMetadata) -> None:
        self._delete_shared(self.registry.unregister(metadata.checkpoint_id))
        self.storage.delete_dir(self.storage.checkpoint_dir(metadata.checkpoint_id))

    def _delete_shared(self, paths: Iterable[str]) -> None:
        for path in paths:
            if owns_path(self.storage, path):  # a file of another directory is never ours to delete
                delete_state_file(path)
                self.registry.record_deleted(path)

    def delete_unused_shared(self) -> List[str]:
        """Deletes the files in ``shared/`` that nothing uses (retained, held or pending)
        and returns them. Only safe when no snapshot that may still complete is being
        written: on failover, with every pending checkpoint aborted, what is left there
        unused is what the failed attempt wrote and never acknowledged (a snapshot that
        failed after writing its delta)."""
        deleted = []
        for path in self.storage.list_files(self.storage.shared_dir):
            uri = self.storage.uri_of(path)
            if not self.registry.is_used(uri):
                delete_state_file(uri)
                self.registry.record_deleted(uri)
                deleted.append(uri)
        return deleted

    def recover(self) -> Optional[CheckpointMetadata]:
        """Adopts what a run before this one left in the job's directory: loads the
        completed checkpoints, keeps the newest ``retained`` restorable ones (a damaged
        ``_metadata`` or a missing state file: skipped with a warning, the previous
        intact checkpoint is used), rebuilds the shared-file references and deletes
        the rest - older checkpoints, ``chk-<n>`` directories without ``_metadata``
        (aborted or half-written), damaged checkpoints, and shared files nothing uses.
        Sets ``highest_checkpoint_id`` to the highest checkpoint id found (completed
        or not), past which new ids must start. Returns the latest usable checkpoint."""
        storage = self.storage
        directories = _checkpoint_directories(storage)
        self.highest_checkpoint_id = max(directories, default=0)
        kept: List[CheckpointMetadata] = []
        doomed: List[int] = []
        unreadable = False  # an I/O error: some file may be in use by what could not be read
        for checkpoint_id in sorted(directories, reverse=True):
            if not directories[checkpoint_id]:
                doomed.append(checkpoint_id)  # never completed: nothing can restore it
                continue
            try:
                path, raw = storage.read_metadata_bytes(checkpoint_id)
                metadata = CheckpointMetadata.loads(
                    raw,
                    where=f"{storage.uri_of(path)} (checkpoint {checkpoint_id})",
                    base=storage.uri_of(storage.checkpoint_dir(checkpoint_id)),  # relative paths resolve here
                )
            except MetadataError as exc:
                log.warning("checkpoint %s is damaged and cannot be restored; deleting it: %s", checkpoint_id, exc)
                doomed.append(checkpoint_id)
                continue
            except OSError as exc:
                log.warning("skipping checkpoint %s: cannot read its _metadata: %s", checkpoint_id, exc)
                unreadable = True
                continue
            if metadata.type != "checkpoint":
                kept.append(metadata)  # a savepoint written here: the store never discards those
                continue
            if sum(1 for m in kept if m.type == "checkpoint") >= self.retained:
                doomed.append(checkpoint_id)  # retention holds after a crash too
                continue
            try:
                missing = _missing_files(metadata)
            except OSError as exc:  # cannot tell: keep it, and delete nothing it might use
                log.warning("skipping checkpoint %s: cannot check its state files: %s", checkpoint_id, exc)
                unreadable = True
                continue
            if missing:
                log.warning(
                    "checkpoint %s cannot be restored: its state file %s is missing; deleting it",
                    checkpoint_id,
                    missing,
                )
                doomed.append(checkpoint_id)
                continue
            kept.append(metadata)
        self._checkpoints = sorted(kept, key=lambda m: m.checkpoint_id)
        self._anchors = []
        self.registry = SharedStateRegistry()
        for metadata in self._checkpoints:
            self.registry.register(metadata.checkpoint_id, shared_files(metadata))
        for checkpoint_id in doomed:
            storage.delete_dir(storage.checkpoint_dir(checkpoint_id))
        if unreadable:
            log.warning("not deleting unused shared files: a checkpoint's _metadata could not be read")
        else:
            self.delete_unused_shared()
        return self.latest()

    def shutdown(self, discard_all: bool = False) -> None:
        """On a job's end: keeps the retained checkpoints (so the job can be restored
        by hand), unless ``discard_all``."""
        if discard_all:
            for metadata in list(self._checkpoints):
                self._checkpoints.remove(metadata)
                self._discard(metadata)
            for savepoint_id in self._anchors:
                self._delete_shared(self.registry.unregister(savepoint_id))
            self._anchors = []


def _checkpoint_directories(storage: CheckpointStorage) -> Dict[int, bool]:
    """Every ``chk-<n>`` directory of the job: id -> whether its ``_metadata`` exists."""
    found = {}
    for info in storage.fs.get_file_info(pafs.FileSelector(storage.root, allow_not_found=True)):
        m = _CHK_DIR.match(info.base_name)
        if m and info.type == pafs.FileType.Directory:
            meta = storage.fs.get_file_info(f"{info.path}/{METADATA_FILE}")
            found[int(m.group(1))] = meta.type == pafs.FileType.File
    return found


def _missing_files(metadata: CheckpointMetadata) -> Optional[str]:
    """The first state file a checkpoint uses that does not exist (None when all do)."""
    for path in stream_paths(metadata):
        try:
            fs, fs_path, _ = resolve(path)
            if fs.get_file_info(fs_path).type != pafs.FileType.File:
                return path
        except FileNotFoundError:
            return path
        # Any other error (storage unreachable for a moment) says nothing about the file:
        # the caller must not delete a checkpoint for it, so it propagates.
    return None


def shared_files(metadata: CheckpointMetadata) -> List[str]:
    """The shared files a checkpoint uses: those ``_metadata`` lists, and the files
    of its incremental handles (which live in ``shared/``)."""
    paths = set(metadata.shared)
    for handle in metadata.handles():
        if isinstance(handle, KeyGroupsStateHandle) and handle.backend == "incremental":
            if isinstance(handle.stream, StreamStateHandle):
                paths.add(handle.stream.path)
    return sorted(paths)


def owns_path(storage: CheckpointStorage, path: str, checkpoint_id: Optional[int] = None) -> bool:
    """Whether ``path`` (a state handle's URI) is a file this job's checkpoint storage
    may delete: directly in its ``shared/`` directory, or, with ``checkpoint_id``,
    directly in that checkpoint's ``chk-<n>/`` - never ``_metadata``, never a path that
    is not in its plain form (``..``, ``//``), never another filesystem's or directory's."""
    if not isinstance(path, str):
        return False
    try:
        _, fs_path, prefix = resolve(path)
    except StorageError:
        return False
    if prefix != storage.prefix or posixpath.normpath(fs_path) != fs_path:
        return False
    directory, name = posixpath.split(fs_path)
    if not name or name == METADATA_FILE:
        return False
    if directory == storage.shared_dir:
        return True
    return checkpoint_id is not None and directory == storage.checkpoint_dir(checkpoint_id)


def discard_unreferenced(
    handles: Iterable[StateHandle],
    registry: SharedStateRegistry,
    *,
    storage: Optional[CheckpointStorage] = None,
    checkpoint_id: Optional[int] = None,
) -> None:
    """Deletes the files of a failed checkpoint's handles that nothing uses (the
    chain it built on stays). With ``storage``, only files that storage owns for
    ``checkpoint_id`` (see ``owns_path``); the coordinator always passes it."""
    for path in stream_paths_of(handles):
        if registry.is_used(path):
            continue
        if storage is not None and not owns_path(storage, path, checkpoint_id):
            log.warning("not deleting %s: not a state file of %s", path, storage)
            continue
        delete_state_file(path)
        registry.record_deleted(path)


def stream_paths_of(handles: Iterable[StateHandle]) -> List[str]:
    """The files behind some handles (inline state has none)."""
    paths = []
    for handle in handles:
        stream = getattr(handle, "stream", handle)
        if isinstance(stream, StreamStateHandle):
            paths.append(stream.path)
    return paths


def stream_paths(metadata: CheckpointMetadata) -> List[str]:
    """Every state file a checkpoint's handles point to (for tools and tests)."""
    return stream_paths_of(metadata.handles())
