"""Checkpoint storage: locations, state handles, metadata and the completed-checkpoint store."""

from __future__ import annotations

from .filesystem import (
    METADATA_FILE,
    CheckpointStateOutputStream,
    CheckpointStorage,
    CheckpointStorageLocation,
    CorruptStateError,
    StorageError,
    checkpoint_storage,
)
from .handles import (
    BatchIndexEntry,
    ByteStreamStateHandle,
    KeyGroupsStateHandle,
    OperatorStateHandle,
    StateHandle,
    StreamStateHandle,
    handle_from_json,
)

__all__ = [
    "METADATA_FILE",
    "BatchIndexEntry",
    "ByteStreamStateHandle",
    "CheckpointStateOutputStream",
    "CheckpointStorage",
    "CheckpointStorageLocation",
    "CorruptStateError",
    "KeyGroupsStateHandle",
    "OperatorStateHandle",
    "StateHandle",
    "StorageError",
    "StreamStateHandle",
    "checkpoint_storage",
    "handle_from_json",
]
