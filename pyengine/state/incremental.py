"""The incremental keyed state backend: the heap backend plus a log of what changed.

A checkpoint writes only the entries changed since the last *completed*
checkpoint, as a delta file under ``shared/`` (an upsert per changed entry, a
tombstone per deleted one), and references the files that came before it: a
chain of one full base and its deltas, applied in order on restore. Every
``max_chain`` deltas the next checkpoint writes a full base instead (a
materialisation, done by the asynchronous part like any write), so restore never
replays an unbounded chain.

Deltas build on the chain of the last checkpoint known to have completed
(``notify_checkpoint_complete``), so the changes of a checkpoint that failed are
simply part of the next delta. Files are shared between checkpoints: the
completed-checkpoint store counts references to them (``_metadata`` lists them)
and deletes each when the last retained checkpoint using it is discarded.
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from ..snapshot.format import TOMBSTONE, ColumnarChanges, write_keyed_state
from ..snapshot.strategies import SnapshotResult, column_of
from ..storage.filesystem import INLINE_THRESHOLD, CheckpointStorageLocation
from ..storage.handles import KeyGroupsStateHandle
from .columnar import ColumnarValueTable
from .heap import HeapKeyedStateBackend

__all__ = ["IncrementalKeyedStateBackend", "IncrementalSnapshot"]

Changes = Dict[str, List[Set[Any]]]  # state name -> changed keys per key group
# What one snapshot took from the change log, per state: key sets per key group
# (dict storage), or the changed entries themselves (columnar storage).
Taken = Dict[str, Union[List[Set[Any]], ColumnarChanges]]


def _key_sets(changes: Union[List[Set[Any]], ColumnarChanges]) -> List[Set[Any]]:
    return changes.key_sets() if isinstance(changes, ColumnarChanges) else changes


class IncrementalKeyedStateBackend(HeapKeyedStateBackend):
    """Keyed state in memory, checkpointed as deltas; see the module docstring."""

    kind = "incremental"

    def __init__(self, *, max_chain: int = 8, **options: Any) -> None:
        super().__init__(**options)
        if type(max_chain) is not int or max_chain < 0:
            raise ValueError(f"max_chain must be an int >= 0, got {max_chain!r}")
        self.max_chain = max_chain
        self._confirmed: List[KeyGroupsStateHandle] = []  # the chain of the last completed checkpoint
        self._unconfirmed: List[Tuple[int, Taken]] = []  # change sets of snapshots not yet completed
        self._results: Dict[int, List[KeyGroupsStateHandle]] = {}  # chains written, by checkpoint

    def _track(self, table: Any) -> Any:
        if isinstance(table, ColumnarValueTable):
            if not table.tracking:
                table.track_changes()
        elif table.changes is None:
            table.changes = [set() for _ in table.groups]
        return table

    def get_state(self, descriptor: Any) -> Any:
        state = super().get_state(descriptor)
        self._track(self._tables[descriptor.name])
        return state

    def _columnar_table_to_dict(self, name: str) -> Any:
        table = super()._columnar_table_to_dict(name)
        self._track(table)
        return table

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation) -> IncrementalSnapshot:
        """Synchronous part: freezes state (copy-on-write) and takes the change log;
        the asynchronous part writes a delta on the last completed chain, or a full base."""
        names = sorted(self._tables)
        full = not self._confirmed or len(self._confirmed) > self.max_chain
        touched: Optional[Changes] = None
        with self._freeze_lock:
            tables = [self._track(self._tables[n]) for n in names]
            taken: Taken = {}
            for name, table in zip(names, tables, strict=True):
                if isinstance(table, ColumnarValueTable):
                    taken[name] = table.take_changes()
                else:
                    taken[name] = table.changes
                    table.changes = [set() for _ in table.groups]
            self._unconfirmed.append((checkpoint_id, taken))
            if full:
                frozen = [t.freeze() for t in tables]
            elif len(self._unconfirmed) == 1:
                # The usual case: the previous checkpoint completed, so the delta is
                # exactly this change log. Columnar tables took the entries already.
                touched = {n: c for n, c in taken.items() if not isinstance(c, ColumnarChanges)}
                frozen = []
                for n, t in zip(names, tables, strict=True):
                    change_log = taken[n]
                    columnar = isinstance(t, ColumnarValueTable) and isinstance(change_log, ColumnarChanges)
                    frozen.append(t.freeze_taken(change_log) if columnar else t.freeze())
            else:  # earlier checkpoints still pending: the delta covers their changes too
                touched = {name: [set() for _ in self.key_group_range] for name in names}
                for _, changes in self._unconfirmed:
                    for name, per_group in changes.items():
                        if name in touched:
                            for i, keys in enumerate(_key_sets(per_group)):
                                touched[name][i] |= keys
                frozen = [
                    t.freeze_changes(touched[n]) if isinstance(t, ColumnarValueTable) else t.freeze()
                    for n, t in zip(names, tables, strict=True)
                ]

        def release() -> None:
            with self._freeze_lock:
                for t in tables:
                    t.release()

        return IncrementalSnapshot(
            backend=self,
            checkpoint_id=checkpoint_id,
            location=location,
            base=[] if full else list(self._confirmed),
            columns=[column_of(t.descriptor) for t in tables],
            names=names,
            frozen=frozen,
            touched=touched,
            release=release,
        )

    def _written(self, checkpoint_id: int, chain: List[KeyGroupsStateHandle]) -> None:
        self._results[checkpoint_id] = chain

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """The chain written for ``checkpoint_id`` is now the base of later deltas."""
        chain = self._results.get(checkpoint_id)
        if chain is None:
            return  # not ours, or an older checkpoint than one already confirmed
        self._prune_local(checkpoint_id)
        self._confirmed = chain
        self._results = {c: h for c, h in self._results.items() if c > checkpoint_id}
        self._unconfirmed = [(c, ch) for c, ch in self._unconfirmed if c > checkpoint_id]

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """Its changes stay in the log and go into the next delta."""
        self._results.pop(checkpoint_id, None)

    def restore(self, handles: Any, *, allow_pickle: Any = ()) -> None:
        super().restore(handles, allow_pickle=allow_pickle)
        for table in self._tables.values():
            self._track(table)
        # A chain of this backend's exact key groups can be built on; anything else
        # (another backend, another parallelism) starts over with a full base.
        handles = list(handles)
        reusable = bool(handles) and all(
            isinstance(h, KeyGroupsStateHandle)
            and h.backend == self.kind
            and (h.key_group_start, h.key_group_end) == (self.key_group_range.start, self.key_group_range.end)
            for h in handles
        )
        self._confirmed = handles if reusable else []
        self._unconfirmed = []
        self._results = {}


class IncrementalSnapshot:
    """The asynchronous part of an incremental snapshot."""

    def __init__(
        self,
        *,
        backend: IncrementalKeyedStateBackend,
        checkpoint_id: int,
        location: CheckpointStorageLocation,
        base: List[KeyGroupsStateHandle],
        columns: Sequence[Any],
        names: Sequence[str],
        frozen: Sequence[Sequence[Dict[Any, Any]]],
        touched: Optional[Changes],
        release: Any,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self._backend = backend
        self._location = location
        self._base = base
        self._columns = list(columns)
        self._names = list(names)
        self._frozen = list(frozen)
        self._touched = touched
        self._release = release
        self._released = False

    @property
    def is_full(self) -> bool:
        return self._touched is None

    def run(self) -> SnapshotResult:
        try:
            if not self._columns:
                self._backend._written(self.checkpoint_id, [])
                return SnapshotResult()
            if self._touched is None:
                groups = self._frozen
            else:
                groups = [
                    frozen_table
                    if isinstance(frozen_table, ColumnarChanges)  # columnar: already the delta
                    else [
                        {k: frozen_group.get(k, TOMBSTONE) for k in keys}
                        for frozen_group, keys in zip(frozen_table, self._touched[name], strict=True)
                    ]
                    for name, frozen_table in zip(self._names, self._frozen, strict=True)
                ]
            r = self._backend.key_group_range
            kind = "base" if self._touched is None else "delta"
            stream: Any = self._location.create_output_stream(
                f"{kind}-{r.start}-{r.end}-{self.checkpoint_id}-{uuid.uuid4().hex[:12]}",
                shared=True,
                inline_threshold=INLINE_THRESHOLD,
            )
            local = self._backend._local
            if local is not None:
                stream = local.open_stream(stream)
            handle = write_keyed_state(
                stream,
                backend=self._backend.kind,
                max_parallelism=self._backend.max_parallelism,
                key_group_range=r,
                columns=self._columns,
                groups=groups,
            )
            chain = [*self._base, handle]
            self._backend._written(self.checkpoint_id, chain)
            result = SnapshotResult(
                handles=chain,
                checkpointed_size=handle.state_size,
                full_size=sum(h.state_size for h in chain),
            )
            if local is not None:
                twins = [local.local_handle(h) for h in chain]
                result.local_handles = [t for t in twins if t is not None]
                self._backend._record_local(self.checkpoint_id, result)
            return result
        finally:
            self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._frozen = []
            self._release()
