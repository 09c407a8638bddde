"""The incremental keyed state backend: the heap backend plus a log of what changed.

A checkpoint writes only the entries changed since the snapshot of its *base*
(the chain of a checkpoint known to have completed), as a delta file under
``shared/`` (an upsert per changed entry, a tombstone per deleted one), and
references the files that came before it: a chain of one full base and its
deltas, applied in order on restore. Every ``max_chain`` deltas the next
checkpoint writes a full base instead (a materialisation, done by the
asynchronous part like any write), so restore never replays an unbounded chain.

The completed-checkpoint store deletes a shared file once no retained checkpoint
(and no pending one that acknowledged it) uses it, so a delta may build only on
files that will outlive it. The base therefore moves by these rules, whatever
order barriers and notifications arrive in (an unaligned barrier is handled
straight from the gate, before the mailbox delivers the notification of the
checkpoint before it):

* ``notify_checkpoint_complete(C)`` makes C's chain the base only when no snapshot
  newer than C is still pending here. A newer pending snapshot P was built on the
  old base; when P completes, the store discards C and with it C's files that P
  does not use, so C's chain may not be built on. C is remembered and becomes the
  base once the newer snapshots are aborted, or the newer one becomes it on its
  own notification. The base never moves backwards.
* Once a snapshot on the current base is full (a materialisation), every later
  snapshot on that base is full too, until the base moves: when the full one
  completes, the store deletes the old chain, which no later delta may then use.
* The first snapshot after a restore is full unless every file of the restored
  chain lives in this job's own ``shared/`` directory (a failover in the same
  directory): a new run's checkpoints never depend on another run's directory
  (Flink's NO_CLAIM restore).

Deltas cover every change since the base's snapshot (the change logs of all the
snapshots taken since, those that failed included), so nothing is lost when the
base stays behind.

TTL state: what expired by the time the asynchronous part writes is left out, as
by the heap backend's full snapshots (Flink's cleanup in full snapshots): a base
holds only live entries, and a delta writes a changed key whose entry expired as a
tombstone (a list or map: its live elements), so a restore does not bring an older
version back from the chain's earlier files. A key left unchanged since a file of
the chain was written keeps its entry there until a base is written again (every
``max_chain`` deltas); reads leave it out once expired, and the incremental
cleanup removes it after a restore.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import uuid
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from ..snapshot import pacing
from ..snapshot.columns import GrowingLists
from ..snapshot.format import TOMBSTONE
from ..snapshot.strategies import SnapshotResult, column_of
from ..snapshot.writer import ColumnarChanges, write_keyed_state
from ..storage.filesystem import INLINE_THRESHOLD, CheckpointStorageLocation
from ..storage.handles import KeyGroupsStateHandle, StreamStateHandle
from ..storage.store import owns_path
from .columnar import ColumnarValueTable
from .heap import HeapKeyedStateBackend, growing, release_frozen, tail_generation
from .timers import TIMERS_KIND
from .ttl import _ExpiringGroups, _without_expired

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
        self._base: List[KeyGroupsStateHandle] = []  # the chain later deltas build on
        self._base_id = 0  # the checkpoint whose chain the base is (0: none, or restored)
        self._log: List[Tuple[int, Taken]] = []  # change logs of the snapshots taken since the base's
        self._pending: Set[int] = set()  # snapshots taken here, neither completed nor aborted
        self._aborted: Set[int] = set()  # aborted checkpoints newer than the base
        self._confirmed = 0  # the newest completed checkpoint, waiting to become the base
        self._materialising = False  # a full snapshot was taken on this base: later ones are full too
        self._results: Dict[int, List[KeyGroupsStateHandle]] = {}  # chains written, by checkpoint
        self._results_lock = threading.Lock()  # snapshot threads write _results

    def _track(self, table: Any) -> Any:
        if getattr(table, "whole_in_deltas", False):  # timers: written whole, no change log
            return table
        if isinstance(table, ColumnarValueTable):
            if not table.tracking:
                table.track_changes()
        else:
            if table.changes is None:
                table.changes = [set() for _ in table.groups]
            table.keep_tainted = True  # list tails: see StateTable.keep_tainted
        return table

    def get_state(self, descriptor: Any) -> Any:
        state = super().get_state(descriptor)
        self._track(self._tables[descriptor.name])
        return state

    def _columnar_table_to_dict(self, name: str) -> Any:
        table = super()._columnar_table_to_dict(name)
        self._track(table)
        return table

    def _retyped(self, name: str) -> None:
        """A state changed type: the next snapshots are full until one completes as the
        new base, so no delta of the new type builds on a base of the old (and no
        removal logged by the replaced table is lost)."""
        self._track(self._tables[name])
        self._materialising = True

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation) -> IncrementalSnapshot:
        """Synchronous part: freezes state (copy-on-write) and takes the change log;
        the asynchronous part writes a delta on the last completed chain, or a full base."""
        self.apply_pending_writes()
        names = sorted(self._tables)
        full = self._materialising or not self._base or len(self._base) > self.max_chain or not self._base_in(location)
        self._materialising = full
        touched: Optional[Changes] = None
        with self._freeze_lock:
            tables = [self._track(self._tables[n]) for n in names]
            # each typed list's tails since the last freeze: where its keys' new elements start
            previous_tails = [getattr(t, "tails", None) for t in tables]
            taken: Taken = {}
            for name, table in zip(names, tables, strict=True):
                if isinstance(table, ColumnarValueTable):
                    taken[name] = table.take_changes()
                elif getattr(table, "whole_in_deltas", False):
                    taken[name] = []
                else:
                    taken[name] = table.changes
                    table.changes = [set() for _ in table.groups]
            self._log.append((checkpoint_id, taken))
            if checkpoint_id not in self._aborted:
                self._pending.add(checkpoint_id)
            # TTL states: expired entries stay out of what the asynchronous part
            # writes (Flink's cleanup in full snapshots, here for deltas too).
            clock = self._ttl_clock
            if full:
                frozen = [_without_expired(t, t.freeze(), clock) for t in tables]
            elif len(self._log) == 1:
                # The usual case: the base is the previous snapshot's chain, so the delta
                # is exactly this change log. Columnar tables took the entries already.
                touched = {n: c for n, c in taken.items() if not isinstance(c, ColumnarChanges)}
                frozen = []
                for n, t in zip(names, tables, strict=True):
                    change_log = taken[n]
                    columnar = isinstance(t, ColumnarValueTable) and isinstance(change_log, ColumnarChanges)
                    frozen.append(t.freeze_taken(change_log) if columnar else _without_expired(t, t.freeze(), clock))
            else:  # snapshots since the base's: the delta covers their changes too
                touched = {name: [set() for _ in self.key_group_range] for name in names}
                for _, changes in self._log:
                    for name, per_group in changes.items():
                        if name in touched:
                            for i, keys in enumerate(_key_sets(per_group)):
                                touched[name][i] |= keys
                frozen = [
                    t.freeze_changes(touched[n])
                    if isinstance(t, ColumnarValueTable)
                    else _without_expired(t, t.freeze(), clock)
                    for n, t in zip(names, tables, strict=True)
                ]
                previous_tails = [None] * len(tables)  # the delta covers several logs: lists written whole
            generations = [tail_generation(t) for t in tables]
            frozen = [growing(t, f, g) for t, f, g in zip(tables, frozen, generations, strict=True)]
            if full:
                previous_tails = [None] * len(tables)

        def release() -> None:
            release_frozen(self._freeze_lock, tables, generations)

        return IncrementalSnapshot(
            backend=self,
            checkpoint_id=checkpoint_id,
            location=location,
            base=[] if full else list(self._base),
            columns=[column_of(t.descriptor) for t in tables],
            names=names,
            frozen=frozen,
            touched=touched,
            release=release,
            tails=previous_tails,
        )

    def _base_in(self, location: CheckpointStorageLocation) -> bool:
        """Whether every file of the base lives in the ``shared/`` directory of the
        storage this snapshot writes to (inline state lives in ``_metadata``)."""
        return all(
            not isinstance(h.stream, StreamStateHandle) or owns_path(location.storage, h.stream.path)
            for h in self._base
        )

    def _written(self, checkpoint_id: int, chain: List[KeyGroupsStateHandle]) -> None:
        with self._results_lock:
            if checkpoint_id > self._base_id:
                self._results[checkpoint_id] = chain

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: snapshots older than it are over
        (completed or subsumed), and its chain becomes the base once no newer
        snapshot of this backend is pending (see the module docstring)."""
        if checkpoint_id <= self._base_id:
            return  # the base never moves backwards
        self._pending = {c for c in self._pending if c > checkpoint_id}
        with self._results_lock:
            known = checkpoint_id in self._results
        if known:
            self._confirmed = max(self._confirmed, checkpoint_id)
        elif checkpoint_id > self._confirmed:
            # Completed without a chain of ours (never seen here): the checkpoints it
            # subsumed, and their files, may be gone, so no delta builds on anything
            # older. Full snapshots until a newer one of ours completes.
            self._confirmed = 0
            self._materialising = True
        self._move_base()

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """Its changes stay in the log and go into the next delta."""
        if checkpoint_id <= self._base_id:
            return
        self._pending.discard(checkpoint_id)
        self._aborted.add(checkpoint_id)
        with self._results_lock:
            self._results.pop(checkpoint_id, None)
        self._move_base()

    def _move_base(self) -> None:
        """Moves the base to the confirmed checkpoint's chain, if no newer snapshot
        is pending (one that, completing, would discard that chain's newest files)."""
        confirmed = self._confirmed
        if confirmed <= self._base_id or any(c > confirmed for c in self._pending):
            return
        with self._results_lock:
            chain = self._results.get(confirmed)
            if chain is None:
                return
            self._results = {c: h for c, h in list(self._results.items()) if c > confirmed}
        self._prune_local(confirmed)
        self._base = chain
        self._base_id = confirmed
        self._materialising = False
        self._log = [(c, t) for c, t in self._log if c > confirmed]
        self._aborted = {c for c in self._aborted if c > confirmed}

    def start_new_chain(self) -> None:
        """The next checkpoint is a full one: no delta builds on the files written or
        restored so far (the timers moved out of the slot states of an older checkpoint)."""
        self._base = []

    def _prune_local(self, checkpoint_id: int) -> None:
        """Local copies are kept for the new base and the snapshots newer than it."""
        if self._local is None or checkpoint_id not in self._local_results:
            return
        recorded = [(c, h) for c, h in list(self._local_results.items()) if c >= checkpoint_id]
        self._local.keep_only([h for _, hs in recorded for h in hs])
        self._local_results = dict(recorded)

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
        self._base = handles if reusable else []
        self._base_id = 0
        self._log = []
        self._pending = set()
        self._aborted = set()
        self._confirmed = 0
        self._materialising = False
        with self._results_lock:
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
        tails: Optional[Sequence[Optional[List[Dict[Any, int]]]]] = None,
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
        self._tails = list(tails) if tails is not None else [None] * len(self._names)

    @property
    def is_full(self) -> bool:
        return self._touched is None

    def run(self) -> SnapshotResult:
        # paced: this thread's Python work leaves the task the interpreter (snapshot.pacing)
        with pacing.paced():
            return self._run()

    def _run(self) -> SnapshotResult:
        try:
            if not self._columns:
                self._backend._written(self.checkpoint_id, [])
                return SnapshotResult()
            columns = list(self._columns)
            if self._touched is None:
                groups = list(self._frozen)
            else:
                groups = []
                tail_groups = []
                for name, column, frozen_table, tails in zip(
                    self._names, self._columns, self._frozen, self._tails, strict=True
                ):
                    if isinstance(frozen_table, ColumnarChanges) or column.kind == TIMERS_KIND:
                        groups.append(frozen_table)  # columnar: already the delta; timers: whole in every delta
                    elif isinstance(frozen_table, GrowingLists):
                        rewritten, appended = _list_delta(frozen_table, self._touched[name], tails)
                        groups.append(rewritten)
                        if appended is not None:  # a column of tails after the states' own
                            columns.append(dataclasses.replace(column, appends=True))
                            tail_groups.append(appended)
                    else:
                        groups.append(_delta(frozen_table, self._touched[name]))
                groups.extend(tail_groups)
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
                columns=columns,
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


def _delta(frozen: Any, touched: List[Set[Any]]) -> List[Dict[Any, Any]]:
    """A dict state's delta: per key group, each changed key's entry, or a tombstone
    where it was deleted. A TTL state's entries that expired by now are tombstones
    too (a list or map keeps its live elements), so a delta neither writes them nor
    lets the chain's older files bring them back on restore."""
    out: List[Dict[Any, Any]] = []
    if isinstance(frozen, _ExpiringGroups):
        get = frozen.get_live
        for i, keys in enumerate(touched):
            out.append({k: get(i, k, TOMBSTONE) for k in keys})
            pacing.pace()  # a key group at a time: the task gets the interpreter between them
        return out
    for group, keys in zip(frozen, touched, strict=True):
        out.append(dict(zip(keys, map(group.get, keys, itertools.repeat(TOMBSTONE, len(keys))), strict=True)))
        pacing.pace()
    return out


def _list_delta(
    frozen: GrowingLists, touched: List[Set[Any]], tails: Optional[List[Dict[Any, int]]]
) -> Tuple[GrowingLists, Optional[GrowingLists]]:
    """A typed list state's delta: the keys whose list was rewritten or removed since
    the last snapshot (whole, or a tombstone), and, apart, those only appended to since
    (``tails``: the length their list had then), whose new elements alone are written,
    to be appended on restore (None when there are none)."""
    rewritten: List[Dict[Any, Any]] = []
    appended: List[Dict[Any, Any]] = []
    starts: List[Dict[Any, int]] = []
    any_tail = False
    for i, (group, keys) in enumerate(zip(frozen, touched, strict=True)):
        since = tails[i] if tails is not None else None
        # A key in ``since`` was only appended to since its record (a rewrite or removal
        # takes it out), so the frozen dict holds it. Set and map operations in C, no
        # Python step per key.
        tail_keys = keys & since.keys() if since else set()
        rest = keys - tail_keys if tail_keys else keys
        whole = dict(zip(rest, map(group.get, rest, itertools.repeat(TOMBSTONE, len(rest))), strict=True))
        grown = dict(zip(tail_keys, map(group.__getitem__, tail_keys), strict=True))
        first = dict(zip(tail_keys, map(since.__getitem__, tail_keys), strict=True)) if since else {}
        any_tail = any_tail or bool(grown)
        rewritten.append(whole)
        appended.append(grown)
        starts.append(first)
        pacing.pace()
    frozen_lengths = frozen.frozen_lengths
    return (
        GrowingLists(rewritten, frozen_lengths),
        GrowingLists(appended, frozen_lengths, starts) if any_tail else None,
    )
