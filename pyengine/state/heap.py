"""The heap keyed state backend: state in dictionaries, one per key group.

Per state there is one dict per key group (user key -> value), so a snapshot can
freeze state at key-group granularity: the synchronous part of a snapshot only
marks every key group *shared* (O(number of key groups), never O(state)), and
the first write to a shared key group copies that key group's dict. Containers
the backend owns (the lists of list state, the dicts of map state) are copied
the first time they are changed after a freeze, and a mutable value read from a
shared key group is deep-copied before the caller gets it, so nothing a job
does after the synchronous part can change what the snapshot writes.

This module is the backend: the current key, the states by name, TTL's clock,
snapshot and restore. What it stores lives beside it: ``table`` (the dicts and
their copy-on-write bookkeeping), ``values``, ``lists`` and ``maps`` (the state
handles user code calls), ``ttl`` (expiry and its cleanup).
"""

from __future__ import annotations

import collections
import functools
import gc
import threading
import time
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterator,
    List,
    Optional,
    Set,
    Tuple,
    overload,
)

import numpy as np
import pyarrow as pa

from .._native import StampedList
from .._native import int_key_group as _int_key_group
from .descriptors import (
    IN,
    OUT,
    AggregatingStateDescriptor,
    K,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateDescriptorError,
    StateNameConflictError,
    StateTypeError,
    T,
    V,
    ValueStateDescriptor,
)
from .keygroups import DEFAULT_MAX_PARALLELISM, KeyGroupRange, assign_to_key_group, check_parallelism
from .lists import ListState, _TtlListState
from .maps import MapState, _TtlMapState
from .serializers import TYPED_LIST, list_typecode
from .table import StateTable, _validator
from .ttl import _int_clock, _migrate_ttl, _Ttl, _without_expired
from .values import AggregatingState, ReducingState, ValueState, _TtlValueState

__all__ = ["HeapKeyedStateBackend"]


_TTL_STATE_CLASSES = {"value": _TtlValueState, "list": _TtlListState, "map": _TtlMapState}


_STATE_CLASSES = {
    "value": ValueState,
    "list": ListState,
    "map": MapState,
    "reducing": ReducingState,
    "aggregating": AggregatingState,
}


_time_ns = time.time_ns


def _wall_clock_ms() -> int:
    return _time_ns() // 1_000_000


class _CollectorPause:
    """The cyclic garbage collector off while any restore runs, as it was before
    once the last one ends (counted: subtasks restore on their own threads).

    Why: a restore makes every container of the state at once (a list per key of
    a list state, a dict per key of a map state), and those allocations set off the
    collector's full passes, each of which walks everything made so far, element
    by element. Measured on 10 M float64 list elements over 100,000 keys: a
    restore of 1.4-1.5 s with the collector, 0.55-0.65 s without. A restore makes
    no reference cycles of its own, so nothing is left for it to find; garbage
    other threads make meanwhile is collected once the pause ends. The switch is
    the process's: a ``gc.disable()`` made by other code during a restore is undone
    when the restore ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()


COLLECTOR_PAUSE = _CollectorPause()


class _CurrentKey:
    """The current key of a keyed backend: ``_key``, and ``_key_index``, its key
    group's index in the backend's range (-1: no key). Slots, not instance
    attributes: the native state calls and timers (``_native``, see
    ``bindings/_keycore.pxi``) read and write them at their place in the object,
    once per state call, timer registration and firing timer."""

    __slots__ = ("_key", "_key_index")

    def __init__(self) -> None:
        self._key: Any = None
        self._key_index: int = -1


class HeapKeyedStateBackend(_CurrentKey):
    """Keyed state of one subtask, held in memory; see the module docstring."""

    kind = "heap"

    def __init__(
        self,
        *,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        key_group_range: Optional[KeyGroupRange] = None,
        ttl_clock_ms: Optional[Callable[[], int]] = None,
        local_recovery_dir: Optional[str] = None,
        columnar: bool = True,
    ) -> None:
        check_parallelism(1, max_parallelism)
        if key_group_range is None:
            key_group_range = KeyGroupRange.all(max_parallelism)
        if key_group_range.start < 0 or key_group_range.end >= max_parallelism or not len(key_group_range):
            raise ValueError(f"key_group_range {key_group_range} must be a non-empty part of 0-{max_parallelism - 1}")
        self.max_parallelism = max_parallelism
        self.key_group_range = key_group_range
        self._kg_start, self._kg_count = key_group_range.start, len(key_group_range)  # per-record use
        self._ttl_clock = _int_clock(ttl_clock_ms) if ttl_clock_ms else _wall_clock_ms
        # TTL's processing time (Flink's TtlTimeProvider). The wall clock is read at
        # most once per record (per set_current_key) for TTL stamps and checks:
        # reading it costs a system call on some hosts, and every state call would
        # pay it. A given clock is read on every call. Inside a step (``begin_ttl_step``:
        # the operator processing one buffer) any clock is read once for the step.
        self._ttl_cached = ttl_clock_ms is None
        self._ttl_now: Optional[int] = None
        self._ttl_step = False  # inside begin_ttl_step / end_ttl_step
        # The TTL states (and their tables), for the incremental cleanup, which counts
        # records at the clock's reads: once per record, or per step.
        self._ttl_states: List[Tuple[_Ttl, StateTable]] = []
        self._ttl_countdown = _Ttl.CLEANUP_EVERY  # records until the next cleanup step
        self._ttl_step_now: Optional[int] = None  # what set_current_key leaves in _ttl_now
        # Tables are StateTable (dicts) or columnar.ColumnarValueTable; states likewise.
        self._tables: Dict[str, Any] = {}
        # Every state the restored checkpoint names, with or without an entry in this
        # backend's key groups (state_names has only the latter), and its kind: a
        # state an older job had, though no key of it lands here.
        self.restored_state_kinds: Dict[str, str] = {}
        self._states: Dict[str, Any] = {}
        self._pending_writes: List[Callable[[], None]] = []  # see add_pending_writes
        super().__init__()  # no current key
        # Freezing (task thread) and releasing (a snapshot's thread) must not interleave.
        self._freeze_lock = threading.Lock()
        self._local: Any = None
        self._local_results: Dict[int, List[Any]] = {}
        self._columnar = columnar  # typed value state in columns (see columnar.py)
        if local_recovery_dir is not None:
            from ..storage.local import LocalRecoveryDirectory

            self._local = LocalRecoveryDirectory(local_recovery_dir)

    # -- current key --------------------------------------------------------------

    def set_current_key(self, key: Any) -> None:
        """Makes ``key`` the one every state object of this backend reads and writes."""
        key_group = _int_key_group(key, self.max_parallelism)
        if key_group < 0:
            key_group = assign_to_key_group(key, self.max_parallelism)
        index = key_group - self._kg_start
        if not 0 <= index < self._kg_count:
            raise ValueError(
                f"key {key!r} belongs to key group {key_group}, outside this backend's key groups "
                f"{self.key_group_range}"
            )
        self._key = key
        self._key_index = index
        self._ttl_now = self._ttl_step_now  # None (read the clock afresh) but inside a step

    def _ttl_time(self) -> int:
        """Processing time for TTL, in ms: the clock, read once per record, or once
        per step inside ``begin_ttl_step`` / ``end_ttl_step``."""
        now = self._ttl_now
        if now is None:
            if self._ttl_step:
                now = self._ttl_now = self._ttl_step_now = self._ttl_clock()
            elif self._ttl_cached:  # the wall clock, without a call of _wall_clock_ms
                now = self._ttl_now = _time_ns() // 1_000_000
            else:
                now = self._ttl_clock()
            self._ttl_countdown -= 1  # a record (or a call) that uses TTL: the cleanup's count
            if self._ttl_countdown <= 0:
                self._ttl_cleanup(0, now)
        return now

    def _ttl_cleanup(self, records: int, now: int) -> None:
        """Counts ``records`` more records for the incremental cleanup of the TTL
        states and runs the cleanup steps they are due (one per ``CLEANUP_EVERY``)."""
        every = _Ttl.CLEANUP_EVERY
        countdown = self._ttl_countdown - records
        if countdown > 0:
            self._ttl_countdown = countdown
            return
        steps = (every - countdown) // every
        self._ttl_countdown = countdown + steps * every
        for ttl, table in self._ttl_states:
            if ttl.may_have_expired(now):
                ttl.cleanup(table, _Ttl.CLEANUP_SIZE * steps, now)

    def begin_ttl_step(self, now_ms: Optional[int] = None, records: int = 1) -> None:
        """A step of the task's mailbox begins (an operator processing one buffer):
        until ``end_ttl_step``, every TTL stamp and expiry check uses one processing
        time, ``now_ms`` or else the TTL clock read now, once (Flink's
        ``TtlTimeProvider``, read per mailbox step rather than per state call).

        The granularity of expiry is then the step: an entry expires for a record
        when its TTL has passed as of the moment the record's buffer began to be
        processed (a buffer takes milliseconds), and entries written in the step
        are stamped with that moment. Time never goes back: the steps of a task
        follow each other. A backend without TTL state reads no clock.

        ``records``: how many records the step processes, for the incremental
        cleanup of expired entries, which runs here, once for the step (as much as
        that many records would run one by one), so no state call counts."""
        self._ttl_step = True
        if self._ttl_states:
            if now_ms is None:
                now_ms = self._ttl_clock()
            self._ttl_cleanup(records, now_ms)
        self._ttl_now = self._ttl_step_now = now_ms

    def advance_ttl_step(self) -> None:
        """Within a step, the TTL clock read again, for the next records of a long
        buffer (the cleanup was counted for the whole step when it began)."""
        if self._ttl_states:
            self._ttl_now = self._ttl_step_now = self._ttl_clock()

    def end_ttl_step(self) -> None:
        """The step is over: outside steps TTL reads the clock once per record again."""
        self._ttl_step = False
        self._ttl_now = self._ttl_step_now = None

    @property
    def current_key(self) -> Any:
        return self._key

    @property
    def current_key_group(self) -> int:
        # Derived, not stored: set_current_key and a firing timer set the key and its
        # index only (one attribute write fewer per record and per timer).
        index = self._key_index
        return self._kg_start + index if index >= 0 else -1

    # -- states -------------------------------------------------------------------

    @overload
    def get_state(self, descriptor: ValueStateDescriptor[T]) -> ValueState[T]: ...

    @overload
    def get_state(self, descriptor: ListStateDescriptor[T]) -> ListState[T]: ...

    @overload
    def get_state(self, descriptor: MapStateDescriptor[K, V]) -> MapState[K, V]: ...

    @overload
    def get_state(self, descriptor: ReducingStateDescriptor[T]) -> ReducingState[T]: ...

    @overload
    def get_state(self, descriptor: AggregatingStateDescriptor[IN, OUT]) -> AggregatingState[IN, OUT]: ...

    @overload
    def get_state(self, descriptor: StateDescriptor) -> Any: ...

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The state object for ``descriptor``, created on first use. Asking again
        with an equal descriptor returns the same object; a different descriptor
        under the same name is refused."""
        state = self._states.get(descriptor.name)
        if state is not None:
            if state._table.descriptor != descriptor:
                raise StateNameConflictError(
                    f"state {descriptor.name!r} is already registered as {state._table.descriptor!r}; "
                    f"it cannot also be {descriptor!r}"
                )
            return state
        cls = _STATE_CLASSES.get(descriptor.kind)
        if cls is None:
            raise TypeError(f"not a keyed state descriptor: {descriptor!r}")
        default = getattr(descriptor, "default", None)
        if default is not None:  # a key without a value reads it: it must fit the type as an update must
            check_default = _validator(getattr(descriptor, "type", None), f"value state {descriptor.name!r} default")
            if check_default is not None:
                try:
                    check_default(default)
                except TypeError as exc:
                    raise StateDescriptorError(str(exc)) from None
        from .columnar import ColumnarValueState, ColumnarValueTable, columnar_dtype

        dtype = columnar_dtype(descriptor) if self._columnar else None
        table: Any = self._tables.get(descriptor.name)
        if isinstance(table, ColumnarValueTable) and (dtype is None or dtype != table.dtype):
            table = self._columnar_table_to_dict(descriptor.name)
        if table is None and dtype is not None:
            self._check_room(descriptor)
            table = ColumnarValueTable(descriptor, len(self.key_group_range), dtype)
            self._tables[descriptor.name] = table
        if isinstance(table, ColumnarValueTable):
            if table.descriptor.kind != descriptor.kind:
                raise ValueError(f"state {descriptor.name!r} holds value state; it cannot be read as {descriptor.kind}")
            table.descriptor = descriptor
            check = _validator(getattr(descriptor, "type", None), f"value state {descriptor.name!r}")
            columnar_state = ColumnarValueState(self, table, check)
            self._states[descriptor.name] = columnar_state
            return columnar_state
        if table is None:
            self._check_room(descriptor)
            table = StateTable(descriptor, len(self.key_group_range))
            self._tables[descriptor.name] = table
        elif table.descriptor.kind != descriptor.kind:
            raise ValueError(
                f"state {descriptor.name!r} holds {table.descriptor.kind} state; it cannot be read as {descriptor.kind}"
            )
        else:
            self._adopt(table, descriptor)
        ttl_config = getattr(descriptor, "ttl", None)
        ttl = _Ttl(ttl_config, self._ttl_time, empty=len(table) == 0) if ttl_config is not None else None
        if ttl is not None:
            self._ttl_states.append((ttl, table))
        if ttl is not None and not ttl.on_read and not ttl.return_expired:
            cls = _TTL_STATE_CLASSES.get(descriptor.kind, cls)  # Flink's default TTL: the direct paths
        state = cls(self, table, ttl)
        self._states[descriptor.name] = state
        return state

    def retype_value_state(self, descriptor: ValueStateDescriptor[Any]) -> Any:
        """The value state ``descriptor`` names, with every stored entry converted to the
        descriptor's (wider) type: ``pe.agg.sum`` over a column of whole numbers that now
        holds fractions keeps its sums as int64 no longer but as float64, under the same
        name, so what a reader or a restore finds stays where it was. Columnar storage
        stays columnar (a restored chain across the type change, held as dicts, becomes
        columns again where its keys allow). Values are converted as Arrow casts them
        (``safe``): a conversion that would change a value raises ``StateTypeError``.
        An unfinished snapshot keeps the entries it froze."""
        from .columnar import ColumnarValueTable, columnar_dtype

        name = descriptor.name
        if descriptor.kind != "value" or getattr(descriptor, "ttl", None) is not None:
            raise TypeError(f"retype_value_state takes a value state descriptor without a TTL, got {descriptor!r}")
        old = self._tables.get(name)
        self._states.pop(name, None)
        if old is None:
            return self.get_state(descriptor)
        arrow_type = descriptor.type
        dtype = columnar_dtype(descriptor) if self._columnar else None
        # an incremental backend's change log: the keys written or removed since its last take
        changed: Optional[List[Set[Any]]] = None
        if isinstance(old, ColumnarValueTable):
            parts = [group.arrays() for group in old.groups]
            changed = old.pending_key_sets() if old.tracking else None
        else:
            parts = [(list(group), list(group.values())) for group in old.groups]
            changed = old.changes

        def converted(values: Any) -> pa.Array:
            try:
                return pa.array(values).cast(arrow_type, safe=True) if arrow_type is not None else pa.array(values)
            except (pa.ArrowException, TypeError, ValueError) as exc:
                raise StateTypeError(f"value state {name!r} cannot hold its values as {arrow_type}: {exc}") from None

        int_keys = all(
            isinstance(keys, np.ndarray) or all(type(k) is int and -(1 << 63) <= k < (1 << 63) for k in keys)
            for keys, _ in parts
        )
        new: Any
        if dtype is not None and int_keys:
            new = ColumnarValueTable(descriptor, len(self.key_group_range), dtype)
            if changed is not None:
                new.track_changes()  # every entry is written anew, in the new type
            for index, (group, (keys, values)) in enumerate(zip(new.groups, parts, strict=True)):
                if len(keys):
                    group.put_many(np.asarray(keys, np.int64), converted(values).to_numpy(zero_copy_only=False))
                for key in changed[index] if changed is not None else ():
                    if not group.contains(key):  # removed since the last take: logged as removed again
                        group.put(key, 0)
                        group.remove(key)
        else:
            new = StateTable(descriptor, len(self.key_group_range))
            for group, (keys, values) in zip(new.groups, parts, strict=True):
                if len(keys):
                    keys = keys.tolist() if isinstance(keys, np.ndarray) else keys
                    group.update(zip(keys, converted(values).to_pylist(), strict=True))
            if changed is not None:
                new.changes = [set(c) | set(g) for c, g in zip(changed, new.groups, strict=True)]
        self._tables[name] = new
        self._retyped(name)
        return self.get_state(descriptor)

    def _retyped(self, name: str) -> None:
        """Called when ``retype_value_state`` replaced a state's table (see the
        incremental backend: the next snapshot writes it whole)."""

    def _check_room(self, descriptor: StateDescriptor) -> None:
        """Refuses a new state that one keyed state file could not hold (more than
        32767 states, or past 128 states more than 128 distinct storage types:
        ``pyengine.snapshot.format.check_state_count``) when it is declared, in the
        function's ``open``, rather than at the job's first checkpoint."""
        from ..snapshot.format import MAX_UNION_CHILDREN, check_state_count

        count = len(self._tables) + 1
        if count <= MAX_UNION_CHILDREN:
            return  # one union child per state: always room
        from ..snapshot.strategies import column_of

        descriptors = [t.descriptor for t in self._tables.values()] + [descriptor]
        check_state_count(count, [column_of(d).file_type for d in descriptors], where=f"state {descriptor.name!r}")

    def add_pending_writes(self, flush: Callable[[], None]) -> None:
        """``flush()`` applies writes that a state's owner holds back to batch them
        (the timers' registrations; the owner applies them itself before it reads its
        states): called before a snapshot freezes the states. Only ever on the task's
        thread: a flush changes the timer sets, which the task changes too."""
        self._pending_writes.append(flush)

    def apply_pending_writes(self) -> None:
        for flush in self._pending_writes:
            flush()

    @property
    def restored_state_names(self) -> FrozenSet[str]:
        """The states the restored checkpoint names (``restored_state_kinds``)."""
        return frozenset(self.restored_state_kinds)

    @property
    def state_names(self) -> List[str]:
        return sorted(self._tables)

    def keys(self, state_name: str) -> Iterator[Any]:
        """Every key that has an entry in ``state_name`` (expired ones included until cleaned up)."""
        table = self._tables.get(state_name)
        if table is None:
            raise KeyError(f"no state named {state_name!r}; known: {', '.join(self.state_names) or 'none'}")
        if hasattr(table, "iter_keys"):
            yield from list(table.iter_keys())
            return
        for group in list(table.groups):
            yield from list(group)

    def num_entries(self, state_name: Optional[str] = None) -> int:
        """Entries of one state or of all (read from other threads, by the monitoring: it
        applies no held-back writes, so timers registered since the last flush are not
        counted yet)."""
        tables = list(self._tables.values()) if state_name is None else [self._tables[state_name]]
        return sum(len(t) for t in tables)

    def dispose(self) -> None:
        self._pending_writes.clear()
        self._tables.clear()
        self._states.clear()
        self._ttl_states.clear()
        self._key_index = -1

    # -- snapshots ----------------------------------------------------------------

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        """The synchronous part of a snapshot: freezes every state (copy-on-write,
        O(number of key groups)) and returns the asynchronous part, whose ``run()``
        writes the state file and returns a SnapshotResult."""
        from ..snapshot.strategies import FullSnapshot, column_of

        self.apply_pending_writes()
        names = sorted(self._tables)
        with self._freeze_lock:
            tables = [self._tables[n] for n in names]
            frozen = [_without_expired(t, t.freeze(), self._ttl_clock) for t in tables]
            generations = [tail_generation(t) for t in tables]
            frozen = [growing(t, f, g) for t, f, g in zip(tables, frozen, generations, strict=True)]

        def release() -> None:
            release_frozen(self._freeze_lock, tables, generations)

        return FullSnapshot(
            checkpoint_id=checkpoint_id,
            location=location,
            backend=self.kind,
            max_parallelism=self.max_parallelism,
            key_group_range=self.key_group_range,
            columns=[column_of(t.descriptor) for t in tables],
            frozen=frozen,
            release=release,
            local=self._local,
            written=self._record_local,
        )

    def _record_local(self, checkpoint_id: int, result: Any) -> None:
        if self._local is not None:
            self._local_results[checkpoint_id] = list(result.handles)

    def _prune_local(self, checkpoint_id: int) -> None:
        """Local copies are kept for the latest completed checkpoint only."""
        handles = self._local_results.get(checkpoint_id)
        if self._local is None or handles is None:
            return
        self._local.keep_only(handles)
        self._local_results = {c: h for c, h in self._local_results.items() if c >= checkpoint_id}

    def restore(self, handles: Any, *, allow_pickle: Any = ()) -> None:
        """Replaces all state with the entries of this backend's key groups in
        ``handles`` (written by any backend, at any parallelism; incremental chains
        in order, base first). States come back
        under their names and take their descriptors from ``get_state``; values a
        state pickled stay undecoded until a descriptor that opts in asks for them
        (or the state is named in ``allow_pickle``). The cyclic garbage collector
        is paused meanwhile (``COLLECTOR_PAUSE``). Writes held back for the state it
        replaces (``add_pending_writes``) are dropped with it: their owners (the timer
        queues) are made again over the restored states."""
        with COLLECTOR_PAUSE:
            self._restore(handles, allow_pickle)
        self._pending_writes.clear()  # after: a restore that fails leaves the queues as they were

    def _restore(self, handles: Any, allow_pickle: Any) -> None:
        from ..snapshot.format import TOMBSTONE
        from ..snapshot.reader import read_keyed_state
        from ..storage.handles import KeyGroupsStateHandle
        from .columnar import ColumnarValueTable
        from .timers import TIMERS_KIND, RestoredTimers

        restored: Dict[str, Any] = {}
        named: Dict[str, str] = {}
        if self._local is not None:
            handles = self._local.prefer_local(handles)
        for handle in handles:
            if not isinstance(handle, KeyGroupsStateHandle):
                raise TypeError(f"a keyed backend restores from KeyGroupsStateHandle, got {handle!r}")
            if handle.key_group_end >= self.max_parallelism:
                raise ValueError(
                    f"state written with key groups up to {handle.key_group_end} cannot be restored at "
                    f"max_parallelism {self.max_parallelism}: max_parallelism must not change"
                )
            info, entries = read_keyed_state(
                handle, self.key_group_range, allow_pickle=allow_pickle, defer_pickle=True, arrays=self._columnar
            )
            named.update((column.name, column.kind) for column in info.columns)
            # A file's timers are its key groups' timers whole (a delta's too): what an
            # older file of the chain said of those key groups goes.
            for column in info.columns:
                if column.kind == TIMERS_KIND:
                    timers = restored.get(column.name)
                    if timers is None:
                        timers = restored[column.name] = RestoredTimers(column.name, len(self.key_group_range))
                    overlap = self.key_group_range.intersection(
                        KeyGroupRange(handle.key_group_start, handle.key_group_end)
                    )
                    for key_group in overlap:
                        timers.reset(key_group - self.key_group_range.start)
            for key_group, spec, keys, values in entries:
                table = restored.get(spec.name)
                if spec.kind == TIMERS_KIND:  # its RestoredTimers made above
                    restored[spec.name].add(key_group - self.key_group_range.start, keys, values)
                    continue
                # typed value state with int keys: straight into columns, if NumPy can hold the
                # type (a struct- or string-typed value state restores into dicts, as any other)
                if isinstance(keys, pa.Array) and not (
                    pa.types.is_integer(values.type)
                    or pa.types.is_floating(values.type)
                    or pa.types.is_boolean(values.type)
                ):
                    keys = keys.to_pylist()
                    values = [TOMBSTONE if v is None else v for v in values.to_pylist()]
                if isinstance(keys, pa.Array):  # typed value state with int keys: straight into columns
                    dtype = np.dtype(values.type.to_pandas_dtype())
                    if table is None:
                        table = ColumnarValueTable(_RestoredDescriptor(spec), len(self.key_group_range), dtype)
                        restored[spec.name] = table
                    # another file of another type (a chain across a type change): dict storage
                    # below, not a cast into the first file's columns (1.5 into int64 is 1)
                    if isinstance(table, ColumnarValueTable) and table.dtype == dtype:
                        table.load(key_group - self.key_group_range.start, keys, values)
                        continue
                    keys = keys.to_pylist()
                    values = [TOMBSTONE if v is None else v for v in values.to_pylist()]
                if isinstance(table, ColumnarValueTable):  # mixed key types: dict storage after all
                    dict_table = StateTable(table.descriptor, len(self.key_group_range))
                    dict_table.groups = table.to_dicts()
                    restored[spec.name] = table = dict_table
                if table is None:
                    table = StateTable(_RestoredDescriptor(spec), len(self.key_group_range))
                    table.pickled = spec.serializer == "pickle" and spec.name not in allow_pickle
                    restored[spec.name] = table
                elif table.descriptor.kind != spec.kind:
                    raise ValueError(
                        f"state {spec.name!r} is {table.descriptor.kind} in one file, {spec.kind} in another"
                    )
                else:
                    table.descriptor.refile(spec, table, self._ttl_time())
                group = table.groups[key_group - self.key_group_range.start]
                if spec.appends:  # list tails: appended to what the chain's earlier files left
                    _append_tails(group, keys, values, spec.name, handle)
                    continue
                for k, v in zip(keys, values, strict=True):
                    if v is TOMBSTONE:  # a later delta deleted it
                        group.pop(k, None)
                    else:
                        group[k] = v
        self._tables = restored
        self.restored_state_kinds = named
        self._states = {}
        self._ttl_states = []

    def _columnar_table_to_dict(self, name: str) -> StateTable:
        """Moves a columnar state into dict storage (its first non-int key, or a
        descriptor that does not fit columns)."""
        columnar = self._tables[name]
        table = StateTable(columnar.descriptor, len(self.key_group_range))
        table.groups = columnar.to_dicts()
        table.changes = columnar.pending_key_sets() if columnar.tracking else None
        self._tables[name] = table
        return table

    def _columnar_to_dict(self, name: str) -> Any:
        """As ``_columnar_table_to_dict``, returning a dict-backed state object for it."""
        return ValueState(self, self._columnar_table_to_dict(name), None)

    def _adopt(self, table: StateTable, descriptor: StateDescriptor) -> None:
        """A restored state gets its real descriptor; pickled values are decoded now,
        if and only if the descriptor opts in to pickle."""
        if getattr(table, "pickled", False):
            if not descriptor.allows_pickle:
                from .serializers import PickleNotAllowedError

                raise PickleNotAllowedError(
                    f"state {descriptor.name!r} was checkpointed with pickle, which can run code when read; "
                    "its descriptor must opt in with serializer='pickle'"
                )
            from .serializers import PickleSerializer

            loads = PickleSerializer().loads
            for group in table.groups:
                for k, raw in group.items():
                    group[k] = loads(raw)
            table.pickled = False
        restored = table.descriptor if isinstance(table.descriptor, _RestoredDescriptor) else None
        ttl = getattr(descriptor, "ttl", None) is not None
        if restored is not None and restored.stamped != ttl:
            _migrate_ttl(table, descriptor.kind, ttl, self._ttl_time())
            object.__setattr__(restored, "stamped", ttl)  # done: a declaration refused below does not redo it
        if restored is not None and restored.types != _declared_types(descriptor):
            _check_restored_types(table, descriptor, restored.types, ttl)
            object.__setattr__(restored, "types", _declared_types(descriptor))
        if descriptor.kind == "list":
            _retype_lists(table, list_typecode(descriptor))
        table.descriptor = descriptor

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Full snapshots keep nothing between checkpoints but local copies."""
        self._prune_local(checkpoint_id)


def _append_tails(group: Dict[Any, Any], keys: List[Any], tails: List[Any], name: str, handle: Any) -> None:
    """A delta's list tails (format version 5) appended to the restored lists, which a
    restore made and nothing else holds (so in place). A tail of a key without a list
    means the chain lost a file: refused, not restored as a shorter list."""
    stored = list(map(group.get, keys))  # lookups and extends in C, no Python step per key
    if None in stored:
        from ..storage.filesystem import CorruptStateError

        k = keys[stored.index(None)]
        raise CorruptStateError(
            f"list state {name!r}: {handle} appends to key {k!r}, which no earlier file of its chain holds; "
            "restore from another checkpoint"
        )
    kinds = set(map(type, stored))
    extend: Any = TYPED_LIST.extend if kinds == {TYPED_LIST} else list.extend if kinds == {list} else _extend
    collections.deque(map(extend, stored, tails), maxlen=0)


def _extend(stored: Any, tail: Any) -> None:
    stored.extend(tail)


def tail_generation(table: Any) -> Optional[int]:
    """The generation a table with copy-on-write by tail froze at (read right after
    its ``freeze``), or None for any other table."""
    return table.generation if getattr(table, "tails", None) is not None else None


def growing(table: Any, frozen: Any, generation: Optional[int]) -> Any:
    """A frozen table as its snapshot writes it: a typed list state's key groups as
    ``GrowingLists``, whose arrays the writer reads up to their length at the freeze."""
    if generation is None:
        return frozen
    from ..snapshot.columns import GrowingLists

    return GrowingLists(frozen, functools.partial(table.frozen_lengths, generation))


def release_frozen(lock: Any, tables: List[Any], generations: List[Optional[int]]) -> None:
    """A snapshot is done with the tables it froze (each at its generation, if any)."""
    with lock:
        for t, g in zip(tables, generations, strict=True):
            if g is None:
                t.release()
            else:
                t.release(g)


def _declared_types(descriptor: Any) -> Tuple[Optional[str], Optional[str]]:
    """A descriptor's declared types as a state file's column records them
    (``StateColumn.declared``: map key type, value or element type, as text)."""
    if descriptor.kind == "map":
        key, value = descriptor.key_type, descriptor.value_type
    else:
        key, value = None, getattr(descriptor, "type", None)
    return (None if key is None else str(key), None if value is None else str(value))


def _check_restored_types(table: StateTable, descriptor: Any, written: Tuple[Any, Any], stamped: bool) -> None:
    """A restored state declared with other types than it was checkpointed with: every
    value must pass the check a write of it would (and is stored as that check gives
    it: an int as a float for a float type), or the state is refused at once, naming
    both types. Before, a float64 state declared int64 handed out floats and
    truncated them in the next checkpoint, silently."""
    kind = descriptor.kind
    what = f"{kind} state {descriptor.name!r}"
    value_type = descriptor.value_type if kind == "map" else getattr(descriptor, "type", None)
    check = _validator(value_type, what)
    check_key = _validator(descriptor.key_type, f"{what} key") if kind == "map" else None
    if check is None and check_key is None:
        return  # untyped now: any value goes

    def value(v: Any) -> Any:
        return v if check is None else check(v)

    def key(k: Any) -> Any:
        return k if check_key is None else check_key(k)

    try:
        for index, group in enumerate(table.groups):
            for k, stored in list(group.items()):
                if kind == "list":
                    if stamped:
                        new: Any = StampedList([(value(e), st) for e, st in stored])
                    else:
                        new = [value(e) for e in stored]
                elif kind == "map":
                    if stamped:
                        new = {key(u): (None if e[0] is None else value(e[0]), e[1]) for u, e in stored.items()}
                    else:
                        new = {key(u): None if v is None else value(v) for u, v in stored.items()}
                else:
                    new = (value(stored[0]), stored[1]) if stamped else value(stored)
                table.restamp(index, k, new)
    except (StateTypeError, TypeError, ValueError) as exc:
        raise StateTypeError(
            f"{what} was checkpointed {_types_name(written, kind)} and is declared "
            f"{_types_name(_declared_types(descriptor), kind)}, and a restored value does not fit: {exc}. Declare it "
            "as it was checkpointed, or under a new name to start that state empty"
        ) from None


_SEVERAL_TYPES = ("several types", "several types")  # files of one state that disagree: checked when declared


def _types_name(types: Tuple[Any, Any], kind: str) -> str:
    if types == (None, None):
        return "untyped"
    if types == _SEVERAL_TYPES:
        return "in files of different types"
    if kind != "map":
        return f"as {types[1]}"
    return f"as {'any key' if types[0] is None else types[0]} -> {'any value' if types[1] is None else types[1]}"


def _retype_lists(table: StateTable, typecode: Optional[str]) -> None:
    """A restored list state's elements in the containers its descriptor asks for: an
    array.array of ``typecode``, or lists (a restore makes arrays of a typed list
    column's elements; the descriptor may since have changed its type or added a TTL).
    Every key is looked at: a chain of incremental files may mix typed and untyped ones."""
    for index, group in enumerate(table.groups):
        for k, stored in list(group.items()):
            if type(stored) is TYPED_LIST:
                if stored.typecode != typecode:
                    retyped = stored.tolist() if typecode is None else _retyped(stored.tolist(), typecode)
                    table.restamp(index, k, retyped)  # copy-on-write: a pending snapshot keeps its dict
            elif typecode is not None and type(stored) is list:
                table.restamp(index, k, _retyped(stored, typecode))


def _retyped(elements: List[Any], typecode: str) -> Any:
    """``elements`` in an array.array of ``typecode``, or left a list when one does not
    fit (the state's check refuses it at its next write, as before)."""
    try:
        return TYPED_LIST(typecode, elements)
    except (TypeError, OverflowError):
        return elements


class _RestoredDescriptor(StateDescriptor):
    """Stands in for a restored state's descriptor until get_state provides the real
    one: made from the state file's column (``spec``), so a checkpoint taken before
    the state is declared again writes it as it was written (its types, serializer
    and TTL layout)."""

    stamped: bool
    types: Tuple[Optional[str], Optional[str]]

    def __init__(self, spec: Any) -> None:
        object.__setattr__(self, "name", spec.name)
        object.__setattr__(self, "kind", spec.kind)  # shadows the class attribute of the kind
        # written with a TTL: its entries carry write times (snapshots keep the layout)
        object.__setattr__(self, "stamped", spec.ttl)
        # the types its writes were checked against (text; None: none), kept in the file even
        # where its values are serialized (a TTL, pickle)
        object.__setattr__(self, "types", spec.declared)
        object.__setattr__(self, "serializer", "pickle" if spec.serializer == "pickle" else "safe")
        if spec.kind == "map":
            object.__setattr__(self, "key_type", spec.map_key_type)
            object.__setattr__(self, "value_type", spec.arrow_type)
        else:
            object.__setattr__(self, "type", spec.arrow_type)

    def refile(self, spec: Any, table: Any, now: int) -> None:
        """Another file of this state (a later one of an incremental chain, or another
        old subtask's on a rescale): its entries go into the same table, so the table
        takes their TTL layout (converting what it holds), and differing declared
        types leave the check to the state's declaration."""
        if spec.ttl != self.stamped:
            _migrate_ttl(table, self.kind, spec.ttl, now)
            object.__setattr__(self, "stamped", spec.ttl)
        if spec.declared != self.types:
            object.__setattr__(self, "types", _SEVERAL_TYPES)
