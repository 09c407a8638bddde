"""Completed checkpoints: the retained ones, their discarding, and recovery after a crash.

Rules, as Flink's CompletedCheckpointStore and SharedStateRegistry:

* A checkpoint is added only after its ``_metadata`` is written; only then are
  older checkpoints beyond ``retained`` discarded. Nothing completed is deleted
  before a newer checkpoint is complete.
* Files in ``shared/`` are reference-counted by the retained checkpoints that use
  them and deleted when the last of those is discarded. On recovery the counts are
  rebuilt from the retained checkpoints' metadata, and shared files none of them
  uses (left by checkpoints that never completed) are deleted: no orphans.
* Savepoints are never discarded by the store.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Dict, Iterable, List, Optional

from .filesystem import CheckpointStorage, delete_state_file
from .handles import KeyGroupsStateHandle, StateHandle, StreamStateHandle
from .metadata import CheckpointMetadata, MetadataError

__all__ = ["CompletedCheckpointStore", "SharedStateRegistry", "discard_unreferenced", "shared_files"]

log = logging.getLogger(__name__)


class SharedStateRegistry:
    """Reference counts of shared state files across retained checkpoints."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._by_checkpoint: Dict[int, List[str]] = {}

    def register(self, checkpoint_id: int, paths: Iterable[str]) -> None:
        if checkpoint_id in self._by_checkpoint:
            return
        unique = sorted(set(paths))
        self._by_checkpoint[checkpoint_id] = unique
        self._counts.update(unique)

    def unregister(self, checkpoint_id: int) -> List[str]:
        """Drops a checkpoint's references; returns the files no retained checkpoint uses any more."""
        unused = []
        for path in self._by_checkpoint.pop(checkpoint_id, []):
            self._counts[path] -= 1
            if self._counts[path] <= 0:
                del self._counts[path]
                unused.append(path)
        return unused

    def is_used(self, path: str) -> bool:
        return path in self._counts

    @property
    def referenced(self) -> List[str]:
        return sorted(self._counts)


class CompletedCheckpointStore:
    """The newest ``retained`` completed checkpoints of a job, plus its savepoints."""

    def __init__(self, storage: CheckpointStorage, retained: int = 1) -> None:
        if type(retained) is not int or retained < 1:
            raise ValueError(f"retained must be an int >= 1, got {retained!r}")
        self.storage = storage
        self.retained = retained
        self.registry = SharedStateRegistry()
        self._checkpoints: List[CheckpointMetadata] = []

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
        return discarded

    def complete(self, metadata: CheckpointMetadata) -> List[CheckpointMetadata]:
        """Writes ``_metadata`` (the moment the checkpoint exists), then adds it."""
        self.storage.write_metadata(metadata.checkpoint_id, metadata.to_json())
        return self.add(metadata)

    def _discard(self, metadata: CheckpointMetadata) -> None:
        for path in self.registry.unregister(metadata.checkpoint_id):
            delete_state_file(path)
        self.storage.delete_dir(self.storage.checkpoint_dir(metadata.checkpoint_id))

    def recover(self) -> Optional[CheckpointMetadata]:
        """After a crash: loads the completed checkpoints found in storage (skipping
        damaged ones, with a warning), keeps the newest ``retained``, rebuilds the
        shared-state references and deletes shared files nothing uses. Returns the
        latest usable checkpoint, or None."""
        good: List[CheckpointMetadata] = []
        for checkpoint_id in reversed(self.storage.completed_checkpoint_ids()):
            path, raw = self.storage.read_metadata_bytes(checkpoint_id)
            try:
                metadata = CheckpointMetadata.loads(
                    raw,
                    where=f"{path} (checkpoint {checkpoint_id})",
                    base=self.storage.uri_of(self.storage.checkpoint_dir(checkpoint_id)),
                )
            except MetadataError as exc:
                log.warning("skipping checkpoint %s: %s", checkpoint_id, exc)
                continue
            if len(good) < self.retained or metadata.type != "checkpoint":
                good.append(metadata)
            else:
                # Retention holds after a crash too; what it drops must not keep shared files alive.
                self.storage.delete_dir(self.storage.checkpoint_dir(checkpoint_id))
        self._checkpoints = sorted(good, key=lambda m: m.checkpoint_id)
        self.registry = SharedStateRegistry()
        for metadata in self._checkpoints:
            self.registry.register(metadata.checkpoint_id, shared_files(metadata))
        for path in self.storage.list_files(self.storage.shared_dir):
            uri = self.storage.uri_of(path)
            if not self.registry.is_used(uri):
                delete_state_file(uri)
        return self.latest()

    def shutdown(self, discard_all: bool = False) -> None:
        """On a job's end: keeps the retained checkpoints (so the job can be restored
        by hand), unless ``discard_all``."""
        if discard_all:
            for metadata in list(self._checkpoints):
                self._checkpoints.remove(metadata)
                self._discard(metadata)


def shared_files(metadata: CheckpointMetadata) -> List[str]:
    """The shared files a checkpoint uses: those ``_metadata`` lists, and the files
    of its incremental handles (which live in ``shared/``)."""
    paths = set(metadata.shared)
    for handle in metadata.handles():
        if isinstance(handle, KeyGroupsStateHandle) and handle.backend == "incremental":
            if isinstance(handle.stream, StreamStateHandle):
                paths.add(handle.stream.path)
    return sorted(paths)


def discard_unreferenced(handles: Iterable[StateHandle], registry: SharedStateRegistry) -> None:
    """Deletes the files of a failed checkpoint's handles that no retained checkpoint
    uses (the chain it built on stays)."""
    for handle in handles:
        stream = getattr(handle, "stream", handle)
        if isinstance(stream, StreamStateHandle) and not registry.is_used(stream.path):
            delete_state_file(stream.path)


def stream_paths(metadata: CheckpointMetadata) -> List[str]:
    """Every state file a checkpoint's handles point to (for tools and tests)."""
    paths = []
    for handle in metadata.handles():
        stream = getattr(handle, "stream", handle)
        if isinstance(stream, StreamStateHandle):
            paths.append(stream.path)
    return paths
