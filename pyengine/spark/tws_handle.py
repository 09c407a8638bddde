"""The handle a Spark ``StatefulProcessor`` gets on pyengine (``pyengine.spark.tws``),
and its state and timer shims.

Each shim is a thin layer over one pyengine keyed state: Spark's tuples in and
out, one call into the keyed backend per Spark call (on Spark each is a round trip
to a JVM state server). The timer calls queue on the operator's timer service.
The operator that drives them (``TransformWithStateOperator``) is in ``tws``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa

from ..errors import NonRetryableError
from ..state import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)
from .tws_schema import _key_layout, _layout, evolution, parse_schema, schema_json, tuple_reader

if TYPE_CHECKING:
    from .tws import TransformWithStateOperator

__all__ = [
    "ProcessorUsageError",
    "StateNotFoundError",
    "StateValueError",
]


class StateNotFoundError(NonRetryableError, KeyError):
    """``deleteIfExists`` of a state this operator never had, nor its restored
    checkpoint: more often a typo than an older version's state. Spark does nothing
    there; a processor that means "drop it if an older version left it" catches this
    (it is a ``KeyError``), which runs the same on both."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ProcessorUsageError(NonRetryableError):
    """A processor's call that Spark refuses too (a timer without a time mode, an
    event-time timer not later than the watermark...): the job fails at once, with
    Spark's own exception as the cause."""


class StateValueError(NonRetryableError, TypeError):
    """A value a processor passed to a state that is not the tuple Spark takes (as
    ``update(5)`` for ``update((5,))``): the same call fails after any restart."""


_PLAIN = (int, float, str, bool, bytes)


def _numeric(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _plain(v: Any) -> Any:
    """A value a processor passed (NumPy / pandas scalars from the pandas flavour
    included) as the plain Python value state stores, as Spark normalises it."""
    if v.__class__ in _PLAIN or v is None:
        return v
    item = getattr(v, "item", None)  # numpy scalars
    if item is not None and not isinstance(v, (tuple, list, dict)):
        return item()
    if hasattr(v, "to_pydatetime"):
        return v.to_pydatetime()
    if isinstance(v, list):  # an array field: Spark hands it back as a list
        return [_plain(x) for x in v]
    if isinstance(v, tuple):  # a struct field (a Row is a tuple)
        return tuple(_plain(x) for x in v)
    return v


def _tuple(v: Any) -> Any:
    """A stored struct value as the tuple Spark hands out (restored ones are dicts)."""
    if v is None or v.__class__ is tuple:
        return v
    if isinstance(v, dict):
        return tuple(v.values())
    return tuple(v)


def _store_tuple(v: Any, what: str) -> Tuple[Any, ...]:
    if not isinstance(v, (tuple, list)):
        raise StateValueError(f"{what}: Spark state values are tuples, got {v!r}")
    return tuple(_plain(x) for x in v)


def _hashable(v: Any) -> Any:
    """A map key with an array field: its lists as tuples (a dict key must hash)."""
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    return v


def _key_tuple(v: Any, what: str) -> Tuple[Any, ...]:
    """A map key of several fields as stored: ``_store_tuple``'s, hashable (the second
    pass only for a key with a nested field, rare)."""
    t = _store_tuple(v, what)
    for x in t:
        if x.__class__ is list or x.__class__ is tuple:
            return _hashable(t)  # type: ignore[no-any-return]
    return t


def _one(v: Any, what: str) -> Any:
    """The single field of a one-field tuple (a Row is a tuple too)."""
    if v.__class__ is tuple and len(v) == 1:
        x = v[0]
        return x if x.__class__ in _PLAIN else _plain(x)
    if isinstance(v, (tuple, list)) and len(v) == 1:
        return _plain(v[0])
    raise StateValueError(f"{what}: Spark state values are tuples of the schema's one field, got {v!r}")


# -- state variables ---------------------------------------------------------------------------
# One class per layout so a call is one backend call and a tuple, no branching on the schema.


class _ScalarValueState:
    """``ValueState`` of a one-field schema: the field is stored alone."""

    __slots__ = ("_s", "_what", "exists", "get", "update")

    def __init__(self, state: Any, what: str) -> None:
        self._s = state
        self._what = what
        value, put = state.value, state.update
        # Closures over the backend state's bound methods: a call per state call
        # saved (these run once per key per buffer).

        def get() -> Optional[Tuple[Any]]:
            v = value()
            return None if v is None else (v,)

        def exists() -> bool:
            return value() is not None

        def update(newValue: Any) -> None:
            if newValue.__class__ is tuple and len(newValue) == 1 and newValue[0].__class__ in _PLAIN:
                put(newValue[0])  # the common case, without a call to _one
            else:
                put(_one(newValue, what))

        self.get = get
        self.exists = exists
        self.update = update

    def clear(self) -> None:
        self._s.clear()


class _TupleValueState:
    __slots__ = ("_read", "_s", "_what")

    def __init__(self, state: Any, what: str, read: Optional[Callable[[Any], Any]] = None) -> None:
        self._s = state
        self._what = what
        self._read = read or _tuple  # nested structs as Row (tws_schema.tuple_reader)

    def exists(self) -> bool:
        return self._s.value() is not None

    def get(self) -> Optional[Tuple[Any, ...]]:
        return self._read(self._s.value())  # type: ignore[no-any-return]

    def update(self, newValue: Any) -> None:
        self._s.update(_store_tuple(newValue, self._what))

    def clear(self) -> None:
        self._s.clear()


class _ListState:
    """``ListState``: ``get`` is an iterator of tuples, as Spark's."""

    __slots__ = ("_read", "_s", "_scalar", "_what")

    def __init__(self, state: Any, scalar: bool, what: str, read: Optional[Callable[[Any], Any]] = None) -> None:
        self._s = state
        self._scalar = scalar
        self._what = what
        self._read = read or _tuple

    def _in(self, values: Any) -> List[Any]:
        if self._scalar:
            return [_one(v, self._what) for v in values]
        return [_store_tuple(v, self._what) for v in values]

    def exists(self) -> bool:
        return not not self._s.get()

    def get(self) -> Iterator[Tuple[Any, ...]]:
        if self._scalar:
            return iter([(v,) for v in self._s.get()])
        read = self._read
        return iter([read(v) for v in self._s.get()])

    def put(self, newState: Sequence[Any]) -> None:
        self._s.update(self._in(newState))

    def appendValue(self, newState: Any) -> None:
        self._s.add(_one(newState, self._what) if self._scalar else _store_tuple(newState, self._what))

    def appendList(self, newState: Sequence[Any]) -> None:
        self._s.add_all(self._in(newState))

    def clear(self) -> None:
        self._s.clear()


class _MapState:
    """``MapState``: user keys and values are tuples, as Spark's."""

    __slots__ = ("_key", "_read", "_s", "_scalar_key", "_scalar_value", "_what")

    def __init__(
        self,
        state: Any,
        scalar_key: bool,
        scalar_value: bool,
        what: str,
        read: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        self._s = state
        self._scalar_key = scalar_key
        self._scalar_value = scalar_value
        self._what = what
        self._read = read or _tuple
        self._key: Callable[[Any], Any] = (
            (lambda k: k if k.__class__ in _PLAIN else _one(k, what + " key"))  # Spark takes '0' for ('0',)
            if scalar_key
            else (lambda k: _key_tuple(k, what + " key"))
        )

    def _out_value(self, v: Any) -> Any:
        return (v,) if self._scalar_value else self._read(v)

    def _out_key(self, k: Any) -> Any:
        return (k,) if self._scalar_key else _tuple(k)

    def exists(self) -> bool:
        return not self._s.is_empty()

    def getValue(self, key: Any) -> Optional[Tuple[Any, ...]]:
        v = self._s.get(self._key(key))
        return None if v is None else self._out_value(v)

    def containsKey(self, key: Any) -> bool:
        return bool(self._s.contains(self._key(key)))

    def updateValue(self, key: Any, value: Any) -> None:
        v = _one(value, self._what) if self._scalar_value else _store_tuple(value, self._what)
        self._s.put(self._key(key), v)

    def iterator(self) -> Iterator[Tuple[Tuple[Any, ...], Tuple[Any, ...]]]:
        return iter([(self._out_key(k), self._out_value(v)) for k, v in self._s.items()])

    def keys(self) -> Iterator[Tuple[Any, ...]]:
        return iter([self._out_key(k) for k in self._s.keys()])

    def values(self) -> Iterator[Tuple[Any, ...]]:
        return iter([self._out_value(v) for v in self._s.values()])

    def removeKey(self, key: Any) -> None:
        self._s.remove(self._key(key))

    def clear(self) -> None:
        self._s.clear()


# -- a deleted state's handle ------------------------------------------------------------------
# After ``deleteIfExists(name)`` Spark's handle for ``name`` fails on its next call: its state
# server no longer has the column family and the client raises ``PySparkRuntimeError``. The
# shims become these subclasses (same slots, so ``__class__`` can change in place: the
# processor keeps the object it holds), whose every call raises Spark's message.


def _deleted(message: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        from pyspark.errors import PySparkRuntimeError

        raise _usage(
            PySparkRuntimeError(
                f"{message}: {self._what} was deleted by deleteIfExists; get it again from the handle "
                "(getValueState, getListState, getMapState) to use that name once more"
            )
        )

    return call


def _dead_class(base: type, messages: Dict[str, str]) -> type:
    body: Dict[str, Any] = {"__slots__": ()}
    for method, message in messages.items():
        body[method] = _deleted(message)
    return type("Deleted" + base.__name__.lstrip("_"), (base,), body)


_VALUE_MESSAGES = {
    "exists": "Error checking value state exists",
    "get": "Error getting value state",
    "update": "Error updating value state",
    "clear": "Error clearing value state",
}
_LIST_MESSAGES = {
    "exists": "Error checking value state exists",
    "get": "Error getting value state",
    "put": "Error updating value state",
    "appendValue": "Error updating value state",
    "appendList": "Error updating value state",
    "clear": "Error clearing value state",
}
_MAP_MESSAGES = {
    "exists": "Error checking map state exists",
    "getValue": "Error getting value",
    "containsKey": "Error checking map state contains key",
    "updateValue": "Error updating map state value",
    "iterator": "Error getting map state iterator",
    "keys": "Error getting map state keys",
    "values": "Error getting map state values",
    "removeKey": "Error removing key from map state",
    "clear": "Error clearing map state",
}
_DEAD = {
    _ScalarValueState: _dead_class(_ScalarValueState, _VALUE_MESSAGES),
    _TupleValueState: _dead_class(_TupleValueState, _VALUE_MESSAGES),
    _ListState: _dead_class(_ListState, _LIST_MESSAGES),
    _MapState: _dead_class(_MapState, _MAP_MESSAGES),
}


def _kill(shim: Any) -> None:
    """The shim a processor holds fails from now on, as Spark's deleted handle."""
    dead = _DEAD.get(type(shim))
    if dead is not None:
        shim.__class__ = dead


def _ttl(ttlDurationMs: Any, name: str) -> Optional[int]:
    if ttlDurationMs is None:
        return None
    if type(ttlDurationMs) is not int or ttlDurationMs <= 0:
        raise ValueError(f"state {name!r}: ttlDurationMs must be a positive int of milliseconds, got {ttlDurationMs!r}")
    return ttlDurationMs


def _usage(exc: BaseException, hint: str = "") -> BaseException:
    """Marks ``exc`` as the processor's misuse (not retried); ``hint``: the way out,
    added to the message the job fails with."""
    exc._pyengine_usage = True  # type: ignore[attr-defined]
    exc._pyengine_hint = hint  # type: ignore[attr-defined]
    return exc


class _Handle:
    """The ``StatefulProcessorHandle`` a processor's ``init`` gets."""

    def __init__(self, op: TransformWithStateOperator) -> None:
        self._op = op
        self._kinds: Dict[str, str] = {}
        self._shims: Dict[str, List[Any]] = {}  # the state objects handed out, by name
        self._timer_queue: Any = None  # the time mode's TimerQueue, once a timer call made it

    def _declare(self, name: str, kind: str) -> None:
        if not isinstance(name, str) or not name or name.startswith("_timer_state/"):
            raise ValueError(f"a state name must be a non-empty string not starting with '_timer_state/', got {name!r}")
        known = self._kinds.get(name)
        if known is not None and known != kind:
            raise ValueError(f"state {name!r} is already a {known} state; it cannot also be a {kind} state")
        self._kinds[name] = kind

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: Optional[int] = None) -> Any:
        self._declare(stateName, "value")
        what = f"value state {stateName!r}"
        struct = parse_schema(schema, what)
        t, scalar = _layout(struct, what)
        # Typed only where a restore takes the type back: the backends restore typed
        # value state of int keys into NumPy columns, which hold numbers and booleans
        # only (patch h2-restore-typed-values.patch); other values stay untyped.
        vt = t if scalar and _numeric(t) else None
        state = self._op.backend.get_state(ValueStateDescriptor(stateName, None, vt, _ttl(ttlDurationMs, stateName)))
        self._evolve(stateName, struct, what, state, "value", scalar)
        shim = _ScalarValueState(state, what) if scalar else _TupleValueState(state, what, tuple_reader(struct))
        return self._keep(stateName, shim)

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: Optional[int] = None) -> Any:
        self._declare(stateName, "list")
        what = f"list state {stateName!r}"
        struct = parse_schema(schema, what)
        t, scalar = _layout(struct, what)
        state = self._op.backend.get_state(ListStateDescriptor(stateName, t, _ttl(ttlDurationMs, stateName)))
        self._evolve(stateName, struct, what, state, "list", scalar)
        return self._keep(stateName, _ListState(state, scalar, what, tuple_reader(struct)))

    def getMapState(
        self, stateName: str, userKeySchema: Any, valueSchema: Any, ttlDurationMs: Optional[int] = None
    ) -> Any:
        self._declare(stateName, "map")
        what = f"map state {stateName!r}"
        kt, scalar_key = _key_layout(userKeySchema, f"{what} key")
        struct = parse_schema(valueSchema, what)
        vt, scalar_value = _layout(struct, what)
        state = self._op.backend.get_state(MapStateDescriptor(stateName, kt, vt, _ttl(ttlDurationMs, stateName)))
        self._evolve(stateName, struct, what, state, "map", scalar_value)
        return self._keep(stateName, _MapState(state, scalar_key, scalar_value, what, tuple_reader(struct)))

    def _keep(self, name: str, shim: Any) -> Any:
        """Remembers the shim handed out, so ``deleteIfExists(name)`` can make it fail."""
        self._shims.setdefault(name, []).append(shim)
        return shim

    def _evolve(self, name: str, struct: Any, what: str, state: Any, kind: str, scalar: bool) -> None:
        """Records the state's schema (checkpointed with the operator) and, when the
        restored checkpoint recorded another one, converts every restored entry to the
        new schema as Spark evolves state (``tws_schema.evolution``): at once, here, so
        the processor's calls stay one backend call each. A checkpoint written before
        schemas were recorded has none: its values are taken as they are (as before)."""
        op = self._op
        new = schema_json(struct)
        old = op.restored_schemas.get(name)
        op.state_schemas[name] = new
        if old is None or old == new:
            return
        evolve = evolution(old, struct, what)
        op.restored_schemas[name] = new  # converted once, even if init asks again
        if evolve is None:
            return
        backend = op.backend
        previous = backend.current_key
        for key in list(backend.keys(name)):
            backend.set_current_key(key)
            if kind == "value":
                v = evolve(state.value())
                state.update(v[0] if scalar else v)
            elif kind == "list":
                state.update([(v[0] if scalar else v) for v in map(evolve, state.get())])
            else:
                for k, v in list(state.items()):
                    nv = evolve(v)
                    state.put(k, nv[0] if scalar else nv)
        if previous is not None:
            backend.set_current_key(previous)

    # -- timers ------------------------------------------------------------------------------

    def _queue(self, operation: str) -> Any:
        queue = self._timer_queue
        if queue is not None:
            return queue
        op = self._op
        if op.time_mode == "None":
            from pyspark.errors import PySparkValueError

            raise _usage(
                PySparkValueError(
                    errorClass="UNSUPPORTED_OPERATION",
                    messageParameters={"operation": f"{operation} with TimeMode.None"},
                ),
                hint="timers need a time mode: pass time_mode='ProcessingTime' or 'EventTime' to "
                "transform_with_state (timeMode= on a DataFrame)",
            )
        timers = op.timers()
        queue = self._timer_queue = timers.event if op.time_mode == "EventTime" else timers.processing
        return queue

    def registerTimer(self, expiryTimestampMs: int) -> None:
        queue = self._timer_queue
        if queue is None:
            queue = self._queue("Timers")
        op = self._op
        if expiryTimestampMs.__class__ is not int:  # before comparing: None or a str fails at once, not retried
            from ..state.timers import _timestamp

            expiryTimestampMs = _timestamp(expiryTimestampMs)
        # A time at or before the watermark is taken, as Spark takes it (its TwsTester
        # refuses it): it fires after the rows being handled, in the same batch.
        if op._firing == expiryTimestampMs and op._firing_key == op.backend.current_key:
            return  # Spark deletes the firing timer after its call: registering it again is undone
        queue.register(expiryTimestampMs)

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        queue = self._queue("Timers")
        op = self._op
        if op._firing == expiryTimestampMs and op._firing_key == op.backend.current_key:
            return  # it is deleted once its call returns
        queue.delete(expiryTimestampMs)

    def listTimers(self) -> Iterator[int]:
        queue = self._queue("Timers")
        times = queue.timestamps()
        op = self._op
        if op._firing is not None and op._firing_key == op.backend.current_key:
            times = tuple(sorted((*times, op._firing)))
        return iter(times)

    def deleteIfExists(self, stateName: str) -> None:
        """Purges a state for every key (Spark drops its column family): for a state
        a new version of a processor no longer uses. A name the operator never had
        (registered now or restored from a checkpoint) is refused, where Spark (and
        its ``TwsTester``) does nothing: the issue this adapter answers asks for the
        error, as such a name is more often a typo than a state of an older version.
        A name the restored checkpoint has, though no key of it lands in this
        subtask, has nothing to purge here; it is kept (empty) for the next
        checkpoint, so the same call after the next restore is accepted too."""
        backend = self._op.backend
        kind = getattr(backend, "restored_state_kinds", {}).get(stateName)
        if stateName not in backend.state_names and kind is not None:
            _keep_empty(backend, stateName, kind)
            self._kinds.pop(stateName, None)
            self._forget(stateName)
            return
        if stateName not in backend.state_names:
            known = ", ".join(n for n in backend.state_names if not n.startswith("_timer_state/")) or "none"
            raise StateNotFoundError(
                f"deleteIfExists({stateName!r}): there is no state {stateName!r}; states: {known}. Spark does "
                "nothing here; pyengine refuses a name its job never had, as it is most often a typo. To drop "
                "a state an older version of the processor may have left, wrap the call in "
                "`try: ... except KeyError: pass` (this error is a KeyError; Spark never raises it)"
            )
        _purge(backend, stateName)
        self._kinds.pop(stateName, None)
        self._forget(stateName)

    def _forget(self, name: str) -> None:
        """Spark's deleted state: the objects handed out fail on their next call, and
        its schema is no longer recorded (a new state of that name starts afresh)."""
        for shim in self._shims.pop(name, []):
            _kill(shim)
        self._op.state_schemas.pop(name, None)
        self._op.restored_schemas.pop(name, None)


def _descriptor_of(name: str, kind: str, like: Any = None) -> Any:
    """A descriptor of state ``name`` of ``kind``, with the types of ``like`` (a stored
    table's descriptor) if given: what ``_purge`` and ``_keep_empty`` register."""
    if kind == "value":
        return ValueStateDescriptor(name, None, getattr(like, "type", None))
    if kind == "list":
        return ListStateDescriptor(name, getattr(like, "type", None))
    if kind == "map":
        return MapStateDescriptor(name, getattr(like, "key_type", None), getattr(like, "value_type", None))
    raise ValueError(f"deleteIfExists({name!r}): a {kind} state is not a Spark state")


def _keep_empty(backend: Any, name: str, kind: str) -> None:
    """Registers state ``name`` with no entries (checkpointed by name, as ``_purge``
    leaves a purged state), then forgets the state object, so the name can be
    registered again with another schema."""
    backend.get_state(_descriptor_of(name, kind))
    backend._states.pop(name, None)


def _purge(backend: Any, name: str) -> None:
    """Clears every key's entry of state ``name`` through a state object of its own
    kind (so incremental checkpoints record the deletions), then forgets that
    object, so the name can be registered again with another schema.

    The backend has no public "drop state" yet (patch h2-drop-state.patch proposes
    ``drop_state``); until then this reads two attributes of the heap backend."""
    table = backend._tables[name]
    descriptor = _descriptor_of(name, table.descriptor.kind, table.descriptor)
    backend._states.pop(name, None)
    state = backend.get_state(descriptor)
    previous = backend.current_key
    for key in list(backend.keys(name)):
        backend.set_current_key(key)
        state.clear()
    if previous is not None:
        backend.set_current_key(previous)
    backend._states.pop(name, None)
