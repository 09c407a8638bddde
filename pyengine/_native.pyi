"""Type stubs for the compiled module built from bindings/_native.pyx.

Use the gate through ``pyengine.io.CheckpointedInputGate``; this module is the
implementation detail behind ``implementation="native"``.
"""

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, overload

def bind(
    barrier_type: type,
    cancel_type: type,
    eop_type: type,
    metrics_type: type,
    checkpoint_member: Any,
    subsumed: Any,
    on_cancellation: Any,
    end_of_stream: Any,
    channel_index_error: type,
    channel_closed_error: type,
    corrupt_stream_error: type,
    nbytes_function: Callable[[Any], int],
) -> None: ...

class InputGate:
    def __init__(self, config: Any, callbacks: Any) -> None: ...
    def push(self, channel: int, item: Any) -> bool: ...
    def push_many(self, channel: int, items: Iterable[Any]) -> int: ...
    def put(self, channel: int, item: Any, timeout: Optional[float] = None) -> bool: ...
    def poll_next(self) -> Optional[Tuple[int, Any]]: ...
    def poll_priority(self) -> Optional[Tuple[int, Any]]: ...
    def poll_batch(self, max_items: int) -> List[Tuple[int, Any]]: ...
    def next(self, timeout: Optional[float] = None) -> Optional[Tuple[int, Any]]: ...
    def queued(self, channel: int) -> int: ...
    @property
    def num_channels(self) -> int: ...
    @property
    def is_finished(self) -> bool: ...
    @property
    def latest_checkpoint_id(self) -> int: ...
    @property
    def blocked_channels(self) -> List[int]: ...
    @property
    def last_alignment_duration_ns(self) -> int: ...
    @property
    def last_checkpoint_start_delay_ns(self) -> int: ...
    @property
    def bytes_processed_during_alignment(self) -> int: ...

class KeyFields:
    """Where a keyed backend keeps its current key: the offsets of its ``_key`` and
    ``_key_index`` slots (``state.heap._CurrentKey``), read and written in place by the
    native state calls and timers. Refuses a backend whose type has no such slots."""

    def __init__(self, backend: Any) -> None: ...

class ColumnarGroup:
    """Typed keyed state of one key group: int64 keys -> positions in dense arrays."""

    shared: bool
    def __init__(self, dtype: Any, capacity: int = 8) -> None: ...
    def __len__(self) -> int: ...
    @property
    def dtype(self) -> Any: ...
    def position(self, key: int) -> int: ...
    def contains(self, key: int) -> bool: ...
    def get(self, key: int, default: Any = None) -> Any: ...
    def put(self, key: int, value: Any) -> None: ...
    def remove(self, key: int) -> bool: ...
    def clear(self) -> None: ...
    def arrays(self) -> Tuple[Any, Any]: ...
    def freeze(self) -> Tuple[Any, Any]: ...
    def track_changes(self) -> None: ...
    def put_many(self, keys: Any, values: Any) -> None: ...
    def merge_many(self, keys: Any, values: Any, how: str) -> Any: ...
    def get_many(self, keys: Any) -> Tuple[Any, Any]: ...

class ColumnarValueCalls:
    """value/update/clear of a columnar value state in C (``state.columnar.ColumnarValueState``)."""

    _fallback: Any
    def __init__(
        self, backend: Any, groups: List[ColumnarGroup], default: Any, check: Any, int64_checked: bool
    ) -> None: ...
    def value(self) -> Any: ...
    def update(self, value: Any) -> None: ...
    def clear(self) -> None: ...

class StateTableBase:
    """The fields of ``state.table.StateTable`` (its methods are Python's), read by the C state calls."""

    descriptor: Any
    groups: List[Dict[Any, Any]]
    shared: List[bool]
    tainted: List[bool]
    owned: List[Set[Any]]
    changes: Optional[List[Set[Any]]]
    active_snapshots: int
    pickled: bool
    tails: Optional[List[Dict[Any, int]]]
    grown: Dict[int, int]

class StateCalls:
    """The fields of every dict-backed keyed state object (``state.heap._KeyedState``)."""

    _backend: Any
    _table: Any
    _ttl: Any
    _check: Optional[Callable[[Any], Any]]  # returns the value to store
    _ttl_ms: Any
    def _use_fast_ttl(self, ttl_ms: Any) -> None:
        """The common TTL configuration: the C calls stamp and check with ``ttl_ms``."""

class ValueCalls(StateCalls):
    """``ValueState.value/update`` in C for the common case; the rest in ``_value_py`` / ``_update_py``."""

    _default: Any
    def value(self) -> Any: ...
    def update(self, value: Any) -> None: ...

class ListCalls(StateCalls):
    """``ListState.add`` in C for the common case; the rest in ``_add_py``."""

    _atomic: bool
    _typecode: Optional[str]  # an array.array typecode (serializers.LIST_TYPECODES): the elements in one array
    def add(self, value: Any) -> None: ...

class MapCalls(StateCalls):
    """``MapState.get/contains/put`` in C for the common case; the rest in the ``_*_py`` methods."""

    _atomic: bool
    _check_key: Optional[Callable[[Any], Any]]  # returns the key to store
    def get(self, user_key: Any) -> Any: ...
    def contains(self, user_key: Any) -> bool: ...
    def put(self, user_key: Any, value: Any) -> None: ...

def merge_groups(groups: List[ColumnarGroup], keys: Any, values: Any, bounds: Any, active: List[int], how: str) -> Any:
    """ColumnarGroup.merge_many on every active key group g for keys[bounds[g]:bounds[g + 1]], in one call
    (int64 or float64 values; how: "add", "min", "max" or "set", which replaces); the new values, in the
    order of keys."""

def get_groups(groups: List[ColumnarGroup], keys: Any, bounds: Any, active: List[int]) -> Tuple[Any, Any]:
    """ColumnarGroup.get_many on every active key group g for keys[bounds[g]:bounds[g + 1]], in one call
    (int64 or float64 groups): (found, values), values 0 where not found, in the order of keys."""

def gather_changes(groups: List[ColumnarGroup], touched: List[Set[int]]) -> Tuple[Any, Any, Any, Any, Any]:
    """(keys, values, deleted, upserts, deletes) of many groups' changed keys, in one call."""

def take_changes(groups: List[ColumnarGroup]) -> Tuple[Any, Any, Any, Any, Any]:
    """What changed in many change-tracking groups since their last take (as gather_changes), and resets them."""

def int_key_group(key: Any, max_parallelism: int) -> int: ...
def route_int_keys(
    records: List[Any], get_key: Callable[[Any], Any], max_parallelism: int, buffers: List[List[Any]]
) -> int: ...

class ListViewBase:
    """The fields of ``pyengine.state.lists.ListView``, made in C."""

    _list: Any
    _n: int
    _ttl: Any
    _now: Any
    def __init__(self, stored: Any, n: int, ttl_ms: Any = 0, now: Any = 0) -> None: ...

class StampedList:
    """A TTL list state's elements and their stamps in two parallel lists; to other
    code the sequence of ``(value, stamp)`` tuples it stands for (pickled: that list)."""

    values: List[Any]
    stamps: List[Any]
    def __init__(self, entries: Iterable[Tuple[Any, Any]] = ...) -> None: ...
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, i: int) -> Tuple[Any, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> List[Tuple[Any, Any]]: ...
    def __iter__(self) -> Iterator[Tuple[Any, Any]]: ...
    def append(self, entry: Tuple[Any, Any]) -> None: ...
    def extend(self, entries: Iterable[Tuple[Any, Any]]) -> None: ...

def ttl_values(stored: Sequence[Any], n: int, limit: Any) -> List[Any]:
    """The values of the (value, stamp) entries in ``stored[:n]`` whose stamp is above
    ``limit`` (not yet expired), in order, as a new list: a TTL list state's read, one C pass."""

class TimerOrder:
    """The order of int64-keyed timers: a sorted run for those that come in timestamp
    order and a binary min-heap for the rest, by (timestamp, arrival)."""

class FrozenTimerSet:
    """One key group's timers as a snapshot froze them (``TimerSets.freeze``)."""

    def __len__(self) -> int: ...
    def arrays(self) -> Tuple[Any, Any]:
        """(keys, timestamps): two int64 NumPy arrays, in no particular order."""

class TimerSets(TimerOrder):
    """A keyed operator's pending timers of one domain with int64 keys
    (``pyengine.state.timers``): a (key, timestamp) set per key group of ``backend``
    and their order. Anything that is no int64 goes to ``fallback(ts)``."""

    disabled: bool
    def __init__(self, backend: Any, groups: int, fallback: Callable[[int], None], tables: Any = None) -> None: ...
    def register(self, ts: int) -> None:
        """The backend's current key's timer at ``ts``, applied at the next ``flush()``
        (every reading call flushes first)."""
    def flush(self) -> None:
        """Applies the registrations waiting, their probes prefetched ahead."""
    def freeze(self, i: int) -> FrozenTimerSet:
        """Key group ``i``'s timers as they are now (copy-on-write, O(1))."""
    def load(self, i: int, keys: Any, timestamps: Any) -> None:
        """Adds timers to key group ``i`` (a restore): two int64 arrays."""
    def freeze_all(self) -> List[Optional[FrozenTimerSet]]:
        """Every key group's ``freeze``, None for an empty one."""
    def clear(self) -> None:
        """Drops every timer and the order (frozen sets keep what they share)."""
    def size(self, i: int) -> int: ...
    def __len__(self) -> int:
        """The timers applied so far (registrations still waiting are not counted)."""
    def delete_current(self, ts: int) -> bool: ...
    def contains_current(self, ts: int) -> bool: ...
    def timestamps_of(self, key: int, i: int) -> List[int]: ...
    def peek(self) -> Optional[int]: ...
    def pop_due(self, upto: int) -> Optional[Tuple[int, int]]:
        """The next timer at or before ``upto`` as (key, ts), removed, with the backend's key set."""
    def fire_due(self, upto: int, ctx: Any, on_timer: Callable[[int, Any], Any], out: List[Any]) -> int:
        """Fires every timer at or before ``upto`` in order, calling ``on_timer(ts, ctx)`` with the
        backend's current key and ``ctx`` set, its results into ``out``; returns how many fired."""

class TimerServiceCalls:
    """``pyengine.time.TimerService``'s four timer calls as C methods (a call per
    record specialised by the interpreter); registrations of a ``TimerSets`` go to
    its sets directly."""

    def __init__(
        self,
        register_event: Callable[[int], Any],
        register_processing: Callable[[int], Any],
        delete_event: Callable[[int], Any],
        delete_processing: Callable[[int], Any],
    ) -> None: ...
    def register_event_time_timer(self, ts: int) -> None: ...
    def register_processing_time_timer(self, ts: int) -> None: ...
    def delete_event_time_timer(self, ts: int) -> Any: ...
    def delete_processing_time_timer(self, ts: int) -> Any: ...

class KeyedContextCalls:
    """``KeyedContext.timer_service()`` as a C method: the ``_service`` slot, else the
    operator's ``timer_service()`` (which makes it)."""

    def timer_service(self) -> Any: ...
