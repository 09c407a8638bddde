"""Snapshot strategies: a synchronous part that freezes state, and an
asynchronous part (``run``) that writes it, on any thread.

The synchronous part runs in the task's mailbox between two records and must be
cheap: for the heap backend it only marks key groups copy-on-write. The
asynchronous part writes the frozen state while the task goes on processing.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..state.descriptors import StateDescriptor
from ..state.keygroups import KeyGroupRange
from ..storage.filesystem import INLINE_THRESHOLD, CheckpointStorageLocation
from ..storage.handles import KeyGroupsStateHandle
from ..storage.local import LocalRecoveryDirectory
from . import pacing
from .format import StateColumn
from .writer import write_keyed_state

__all__ = ["FullSnapshot", "SnapshotResult", "column_of"]


@dataclass
class SnapshotResult:
    """What a finished asynchronous part reports with its acknowledgement."""

    handles: List[KeyGroupsStateHandle] = field(default_factory=list)
    checkpointed_size: int = 0  # bytes written for this checkpoint
    full_size: int = 0  # bytes of all state the handles reference
    local_handles: List[KeyGroupsStateHandle] = field(default_factory=list)


def column_of(descriptor: StateDescriptor) -> StateColumn:
    """How a state is laid out in a state file."""
    arrow_type = getattr(descriptor, "type", None)
    map_key_type = None
    if descriptor.kind == "map":  # a MapStateDescriptor, or a restored map state's stand-in
        arrow_type, map_key_type = getattr(descriptor, "value_type", None), getattr(descriptor, "key_type", None)
    return StateColumn(
        name=descriptor.name,
        kind=descriptor.kind,
        arrow_type=arrow_type,
        map_key_type=map_key_type,
        serializer="pickle" if descriptor.allows_pickle else "msgpack",
        # a restored state not declared since keeps its entries' layout (with write times or not)
        ttl=getattr(descriptor, "ttl", None) is not None or getattr(descriptor, "stamped", False),
    )


class FullSnapshot:
    """The asynchronous part of a full snapshot of frozen key-group dicts."""

    def __init__(
        self,
        *,
        checkpoint_id: int,
        location: CheckpointStorageLocation,
        backend: str,
        max_parallelism: int,
        key_group_range: KeyGroupRange,
        columns: Sequence[StateColumn],
        frozen: Sequence[Sequence[Dict[Any, Any]]],
        release: Callable[[], None],
        local: Optional[LocalRecoveryDirectory] = None,
        written: Optional[Callable[[int, SnapshotResult], None]] = None,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self._location = location
        self._backend = backend
        self._max_parallelism = max_parallelism
        self._key_group_range = key_group_range
        self._columns = list(columns)
        self._frozen = list(frozen)
        self._release = release
        self._local = local
        self._written = written
        self._done = threading.Event()
        self._released = False
        self._lock = threading.Lock()

    def run(self) -> SnapshotResult:
        """Writes the snapshot and returns its handles; releases the frozen state
        whether or not writing succeeded."""
        # paced: this thread's Python work leaves the task the interpreter (pacing)
        with pacing.paced():
            return self._run()

    def _run(self) -> SnapshotResult:
        try:
            if not self._columns:
                return SnapshotResult()
            name = f"keyed-{self._key_group_range.start}-{self._key_group_range.end}-{uuid.uuid4().hex[:12]}"
            stream: Any = self._location.create_output_stream(name, inline_threshold=INLINE_THRESHOLD)
            if self._local is not None:
                stream = self._local.open_stream(stream)
            handle = write_keyed_state(
                stream,
                backend=self._backend,
                max_parallelism=self._max_parallelism,
                key_group_range=self._key_group_range,
                columns=self._columns,
                groups=self._frozen,
            )
            size = handle.state_size
            result = SnapshotResult(handles=[handle], checkpointed_size=size, full_size=size)
            if self._local is not None and stream.local_ok:
                local = self._local.local_handle(handle)
                result.local_handles = [local] if local is not None else []
            if self._written is not None:
                self._written(self.checkpoint_id, result)
            return result
        finally:
            self.release()

    def release(self) -> None:
        """Gives the frozen state back (also when the snapshot is cancelled before running)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._frozen = []
        self._release()
