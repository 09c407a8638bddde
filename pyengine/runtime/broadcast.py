"""The broadcast state pattern (Flink's, with PyFlink's names).

``rules.broadcast(descriptor)`` sends every record of ``rules`` to every subtask of
the operator it is connected to; ``stream.connect(rules_bs).process(fn)`` (or
``keyed.connect(rules_bs)``) runs a ``BroadcastProcessFunction`` (or a
``KeyedBroadcastProcessFunction``) with the broadcast records on one side and the
stream's on the other. The broadcast side writes *broadcast state* (a map per
descriptor, operator state kept by every subtask); the other side only reads it.

Why read-only there: every subtask sees every broadcast record, in the same order
per upstream channel, so if only ``process_broadcast_element`` changes the state
(deterministically) every subtask holds the same copy. That is what lets a
checkpoint store it per subtask and a restore, at any parallelism, give every new
subtask one old copy (``pyengine.state.operator``: broadcast mode), as Flink does.
A write from the non-broadcast side would make the copies differ, so it is refused.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Generic, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeAlias

from ..errors import NonRetryableError, not_records, refuse_non_records
from ..state.columnar import NoCurrentKeyError
from ..state.descriptors import K, MapStateDescriptor, StateDescriptor, V
from ..state.operator import BroadcastState
from .base import Operator, OperatorContext, OutputTag, rows_of
from .keyed import KeyedContext, KeyedProcessOperator
from .process import ProcessContext

__all__ = [
    "BroadcastContext",
    "BroadcastProcessFunction",
    "BroadcastProcessOperator",
    "BroadcastStateError",
    "KeyedBroadcastContext",
    "KeyedBroadcastProcessFunction",
    "KeyedBroadcastProcessOperator",
    "KeyedBroadcastReadOnlyContext",
    "ReadOnlyBroadcastContext",
    "ReadOnlyBroadcastState",
    "check_broadcast_descriptors",
]


class BroadcastStateError(NonRetryableError, TypeError):
    """Broadcast state used in a way that would let subtasks' copies differ (a write
    outside ``process_broadcast_element``) or that names a state the stream was not
    broadcast with. A restart cannot fix the program, so the job fails at once."""


def check_broadcast_descriptors(descriptors: Sequence[Any]) -> List[MapStateDescriptor]:
    """``broadcast(...)``'s descriptors: MapStateDescriptors with distinct names."""
    out: List[MapStateDescriptor] = []
    for d in descriptors:
        if not isinstance(d, MapStateDescriptor):
            raise TypeError(
                f"broadcast(...) takes pe.MapStateDescriptor(s) naming the broadcast state, got {d!r} "
                "(broadcast() without arguments sends every record to every subtask, with no state)"
            )
        if any(o.name == d.name for o in out):
            raise ValueError(f"broadcast(...): two descriptors are named {d.name!r}; give each state its own name")
        out.append(d)
    return out


class ReadOnlyBroadcastState(Generic[K, V]):
    """A broadcast state seen from ``process_element`` (or ``on_timer``): every read
    of ``BroadcastState``; ``put``, ``put_all``, ``remove`` and ``clear`` raise
    ``BroadcastStateError`` (only the broadcast side may change it, so that every
    subtask keeps the same copy)."""

    __slots__ = ("_state", "_where")

    def __init__(self, state: BroadcastState, where: Callable[[], str]) -> None:
        self._state = state
        self._where = where

    @property
    def descriptor(self) -> MapStateDescriptor:
        return self._state.descriptor

    def get(self, key: K) -> Optional[V]:
        return self._state.get(key)  # type: ignore[no-any-return]

    def contains(self, key: K) -> bool:
        return self._state.contains(key)

    def __contains__(self, key: object) -> bool:
        return self._state.contains(key)

    def items(self) -> List[Tuple[K, V]]:
        return self._state.items()

    def keys(self) -> List[K]:
        return self._state.keys()

    def values(self) -> List[V]:
        return self._state.values()

    def is_empty(self) -> bool:
        return self._state.is_empty()

    def __iter__(self) -> Iterator[K]:
        return iter(self._state.keys())

    def __len__(self) -> int:
        return len(self._state.keys())

    def _refuse(self, call: str) -> BroadcastStateError:
        return BroadcastStateError(
            f"{self._where()}: broadcast state {self._state.descriptor.name!r} is read-only here ({call} called "
            "outside process_broadcast_element): every subtask must keep the same copy, and only the broadcast "
            "side sees every broadcast record; change it in process_broadcast_element"
        )

    def put(self, key: K, value: V) -> None:
        raise self._refuse("put")

    def put_all(self, entries: Dict[K, V]) -> None:
        raise self._refuse("put_all")

    def remove(self, key: K) -> None:
        raise self._refuse("remove")

    def clear(self) -> None:
        raise self._refuse("clear")


class _BroadcastStates:
    """The broadcast states of one operator subtask, by descriptor name: registered
    in its operator state at setup (so a checkpoint holds each, written or not, and a
    restore finds each copy), handed out writable or read-only."""

    def __init__(self, descriptors: Sequence[MapStateDescriptor]) -> None:
        self.descriptors = list(descriptors)
        self.states: Dict[str, BroadcastState] = {}
        self.read_only: Dict[str, ReadOnlyBroadcastState] = {}

    def register(self, op: Operator) -> None:
        assert op.operator_state is not None
        self.states = {d.name: op.operator_state.get_broadcast_state(d) for d in self.descriptors}
        self.read_only = {name: ReadOnlyBroadcastState(s, op.where) for name, s in self.states.items()}

    def get(self, op: Operator, descriptor: Any, writable: bool) -> Any:
        if not isinstance(descriptor, MapStateDescriptor):
            raise BroadcastStateError(
                f"{op.where()}: get_broadcast_state takes the pe.MapStateDescriptor given to broadcast(...), "
                f"got {descriptor!r}"
            )
        state = self.states.get(descriptor.name)
        if state is None or state.descriptor != descriptor:
            known = ", ".join(repr(d.name) for d in self.descriptors) or "none"
            what = "is not" if state is None else "differs from the descriptor of"
            raise BroadcastStateError(
                f"{op.where()}: {descriptor!r} {what} a broadcast state of this stream (known: {known}); pass the "
                "same descriptor to broadcast(...) and get_broadcast_state(...)"
            )
        return state if writable else self.read_only[descriptor.name]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class ReadOnlyBroadcastContext(ProcessContext):
    """The ``ctx`` of ``BroadcastProcessFunction.process_element`` (PyFlink's
    ``ReadOnlyContext``): broadcast state read-only, the record's event time, side
    outputs (``ctx.output``), the clocks."""

    _writable = False

    def get_broadcast_state(self, descriptor: MapStateDescriptor[K, V]) -> ReadOnlyBroadcastState[K, V]:
        """The broadcast state of ``descriptor`` (one passed to ``broadcast(...)``), read-only."""
        op: Any = self._op
        return op._bstates.get(op, descriptor, self._writable)  # type: ignore[no-any-return]

    def current_processing_time(self) -> int:
        return _now_ms()

    def current_watermark(self) -> int:
        return self._op.current_watermark


class BroadcastContext(ReadOnlyBroadcastContext):
    """The ``ctx`` of ``process_broadcast_element`` (PyFlink's ``Context``): as the
    read-only one, and ``get_broadcast_state`` returns the writable
    ``BroadcastState`` (``put``, ``remove``, ``clear``...)."""

    _writable = True

    def get_broadcast_state(self, descriptor: MapStateDescriptor[K, V]) -> BroadcastState:  # type: ignore[override]
        """The broadcast state of ``descriptor`` (one passed to ``broadcast(...)``), writable."""
        op: Any = self._op
        return op._bstates.get(op, descriptor, True)  # type: ignore[no-any-return]


class BroadcastProcessFunction:
    """The broadcast state pattern on a stream that is not keyed (PyFlink's
    ``BroadcastProcessFunction``): ``stream.connect(rules.broadcast(desc)).process(fn)``.
    ``process_element(value, ctx)`` gets the stream's records and reads the broadcast
    state (``ctx.get_broadcast_state(desc)``, read-only); ``process_broadcast_element
    (value, ctx)`` gets every broadcast record, on every subtask, and may change it.
    Both yield outputs; ``ctx.output(tag, value)`` sends to a side output."""

    ReadOnlyContext: TypeAlias = ReadOnlyBroadcastContext
    Context: TypeAlias = BroadcastContext

    def open(self, ctx: ReadOnlyBroadcastContext) -> None:
        pass

    def process_element(self, value: Any, ctx: ReadOnlyBroadcastContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def process_broadcast_element(self, value: Any, ctx: BroadcastContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class BroadcastProcessOperator(Operator):
    """Runs a ``BroadcastProcessFunction``: input 0 the stream, input 1 the broadcast one."""

    def __init__(
        self,
        uid: str,
        name: str,
        fn: BroadcastProcessFunction,
        descriptors: Sequence[MapStateDescriptor],
        timestamps: Tuple[Any, Any] = (None, None),
    ) -> None:
        super().__init__(uid, name)
        self.fn = fn
        self._bstates = _BroadcastStates(descriptors)
        self.timestamps1, self.timestamps2 = timestamps
        self._rctx = ReadOnlyBroadcastContext(self)
        self._wctx = BroadcastContext(self)

    def setup(self, ctx: OperatorContext, restored: Any) -> None:
        super().setup(ctx, restored)
        self._bstates.register(self)

    def open(self) -> None:
        self._call(self.fn.open, self._rctx)

    def _run(self, records: Any, element: Callable[[Any, Any], Any], pctx: ProcessContext, timestamps: Any) -> Any:
        out: List[Any] = []
        pctx._timestamps = timestamps
        try:
            for r in rows_of(records):
                pctx._record = r
                produced = element(r, pctx)
                if produced is not None:
                    if produced.__class__ is dict or produced.__class__ is str:
                        raise not_records(produced, self.where(), getattr(element, "__name__", "process_element"))
                    try:
                        out.extend(produced)
                    except TypeError:
                        refuse_non_records(produced, self.where(), getattr(element, "__name__", "process_element"))
                        raise
        except NonRetryableError:
            raise
        except Exception as exc:
            raise _user_error(self, exc) from exc
        finally:
            pctx._record = None
        return out

    def process(self, records: Any) -> List[Any]:
        return self._run(records, self.fn.process_element, self._rctx, self.timestamps1)  # type: ignore[no-any-return]

    def process2(self, records: Any) -> List[Any]:
        return self._run(  # type: ignore[no-any-return]
            records, self.fn.process_broadcast_element, self._wctx, self.timestamps2
        )

    def close(self) -> None:
        self._call(self.fn.close)


def _user_error(op: Operator, exc: Exception) -> Exception:
    from .base import UserFunctionError

    return UserFunctionError(f"{op.where()}: {type(exc).__name__}: {exc}")


class KeyedBroadcastReadOnlyContext(KeyedContext):
    """The ``ctx`` of ``KeyedBroadcastProcessFunction``'s ``open``,
    ``process_element`` and ``on_timer`` (PyFlink's ``ReadOnlyContext`` and
    ``OnTimerContext``): a ``KeyedContext`` (keyed state of the current key, timers,
    ``current_key``, ``timestamp()``, side outputs) whose ``get_broadcast_state``
    is read-only."""

    def get_broadcast_state(self, descriptor: MapStateDescriptor[K, V]) -> ReadOnlyBroadcastState[K, V]:
        """The broadcast state of ``descriptor`` (one passed to ``broadcast(...)``), read-only."""
        op: Any = self._op
        return op._bstates.get(op, descriptor, False)  # type: ignore[no-any-return]

    def current_processing_time(self) -> int:
        return _now_ms()

    def current_watermark(self) -> int:
        return self._op.current_watermark


class KeyedBroadcastContext:
    """The ``ctx`` of ``KeyedBroadcastProcessFunction.process_broadcast_element``
    (PyFlink's ``Context``): writable broadcast state, and
    ``apply_to_keyed_state(descriptor, fn)`` to visit every key of this subtask that
    has that keyed state. A broadcast record belongs to no key, so there is no
    current key, keyed state or timer here."""

    def __init__(self, operator: KeyedBroadcastProcessOperator) -> None:
        self._op = operator
        self._record: Any = None
        self._timestamps: Any = None

    def get_broadcast_state(self, descriptor: MapStateDescriptor[K, V]) -> BroadcastState:
        """The broadcast state of ``descriptor`` (one passed to ``broadcast(...)``), writable."""
        return self._op._bstates.get(self._op, descriptor, True)  # type: ignore[no-any-return]

    def apply_to_keyed_state(self, descriptor: StateDescriptor, function: Callable[[Any, Any], None]) -> None:
        """Calls ``function(key, state)`` for every key of this subtask that has an
        entry in the keyed state of ``descriptor`` (PyFlink's ``applyToKeyedState``),
        with ``state`` scoped to that key: it may read, update or clear it. Every
        subtask runs it over its own keys, so together they visit every key once."""
        if not isinstance(descriptor, StateDescriptor):
            raise TypeError(f"apply_to_keyed_state takes a state descriptor, got {descriptor!r}")
        backend = self._op.backend
        state = backend.get_state(descriptor)
        try:
            for key in list(backend.keys(descriptor.name)):
                backend.set_current_key(key)
                function(key, state)
        finally:
            _unset_key(backend)  # key-less again for the rest of process_broadcast_element

    def timestamp(self) -> Optional[int]:
        """The event time of the broadcast record (None when its stream has none)."""
        if self._timestamps is None or self._record is None:
            return None
        return int(self._timestamps.of_record(self._record))

    def current_processing_time(self) -> int:
        return _now_ms()

    def current_watermark(self) -> int:
        return self._op.current_watermark

    def output(self, tag: OutputTag, value: Any) -> None:
        """Sends ``value`` to the side output ``tag`` (``stream.get_side_output(tag)``)."""
        self._op.emit_side(tag, value)

    @property
    def subtask(self) -> int:
        assert self._op.ctx is not None
        return self._op.ctx.subtask

    def _no_key(self, what: str) -> BroadcastStateError:
        return BroadcastStateError(
            f"{self._op.where()}: ctx.{what} in process_broadcast_element: a broadcast record belongs to no key; "
            "reach keyed state with ctx.apply_to_keyed_state(descriptor, fn), or keep what the keyed side needs "
            "in broadcast state"
        )

    def get_state(self, descriptor: Any) -> Any:
        raise self._no_key("get_state")

    def timer_service(self) -> Any:
        raise self._no_key("timer_service()")

    @property
    def current_key(self) -> Any:
        raise self._no_key("current_key")


class KeyedBroadcastProcessFunction:
    """The broadcast state pattern on a keyed stream (PyFlink's
    ``KeyedBroadcastProcessFunction``): ``keyed.connect(rules.broadcast(desc))
    .process(fn)``. ``process_element(value, ctx)`` gets the keyed stream's records
    with keyed state (``ctx.get_state``), timers (``ctx.timer_service()``) and the
    broadcast state read-only (``ctx.get_broadcast_state(desc)``);
    ``process_broadcast_element(value, ctx)`` gets every broadcast record on every
    subtask, writes broadcast state and reaches keyed state through
    ``ctx.apply_to_keyed_state(desc, fn(key, state))`` only (it runs with no current
    key: a keyed state object used there directly raises ``BroadcastStateError``
    rather than read some other record's key); ``on_timer(timestamp, ctx)``
    runs when a timer fires, as in a ``KeyedProcessFunction``."""

    ReadOnlyContext: TypeAlias = KeyedBroadcastReadOnlyContext
    OnTimerContext: TypeAlias = KeyedBroadcastReadOnlyContext
    Context: TypeAlias = KeyedBroadcastContext

    def open(self, ctx: KeyedBroadcastReadOnlyContext) -> None:
        pass

    def process_element(self, value: Any, ctx: KeyedBroadcastReadOnlyContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def process_broadcast_element(self, value: Any, ctx: KeyedBroadcastContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def on_timer(self, timestamp: int, ctx: KeyedBroadcastReadOnlyContext) -> Optional[Iterable[Any]]:
        """A timer of ``ctx.current_key`` fired (override it to use timers)."""
        return None

    def close(self) -> None:
        pass


def _unset_key(backend: Any) -> None:
    """No current key (the backend's state before its first ``set_current_key``): every
    keyed state call raises ``NoCurrentKeyError`` until a key is set again. So keyed
    state kept from ``open`` and used in ``process_broadcast_element`` fails, naming
    ``apply_to_keyed_state``, instead of reading whichever key came last."""
    backend._key = None
    backend._key_index = -1


def overrides_broadcast_on_timer(fn: Any) -> bool:
    """Whether a ``KeyedBroadcastProcessFunction`` has timers to fire."""
    return type(fn).on_timer is not KeyedBroadcastProcessFunction.on_timer


class KeyedBroadcastProcessOperator(KeyedProcessOperator):
    """Runs a ``KeyedBroadcastProcessFunction``: input 0 the keyed stream (keyed
    state, timers: a ``KeyedProcessOperator``'s), input 1 the broadcast one."""

    def __init__(
        self,
        uid: str,
        name: str,
        key_selector: Callable[[Any], Any],
        fn: KeyedBroadcastProcessFunction,
        descriptors: Sequence[MapStateDescriptor],
        timestamps: Tuple[Any, Any] = (None, None),
    ) -> None:
        super().__init__(uid, name, key_selector, fn, timestamps[0])  # type: ignore[arg-type]
        self.bfn = fn
        self._bstates = _BroadcastStates(descriptors)
        self.timestamps1, self.timestamps2 = timestamps
        self._kctx = KeyedBroadcastReadOnlyContext(self)
        self._bctx = KeyedBroadcastContext(self)

    def setup(self, ctx: OperatorContext, restored: Any) -> None:
        super().setup(ctx, restored)
        self._bstates.register(self)

    def process(self, records: List[Any]) -> List[Any]:
        self.timestamps = self.timestamps1
        return self._process_keyed(records, self.key_selector, self.bfn.process_element)

    def process2(self, records: Any) -> List[Any]:
        out: List[Any] = []
        bctx = self._bctx
        bctx._timestamps = self.timestamps2
        backend = self.backend
        rows = rows_of(records)
        backend.begin_ttl_step(records=len(rows))
        _unset_key(backend)
        try:
            for r in rows:
                bctx._record = r
                produced = self.bfn.process_broadcast_element(r, bctx)
                if produced is not None:
                    if produced.__class__ is dict or produced.__class__ is str:
                        raise not_records(produced, self.where(), "process_broadcast_element")
                    try:
                        out.extend(produced)
                    except TypeError:
                        refuse_non_records(produced, self.where(), "process_broadcast_element")
                        raise
        except NoCurrentKeyError as exc:  # before NonRetryableError, which it is
            raise BroadcastStateError(
                f"{self.where()}: keyed state used in process_broadcast_element ({exc}): a broadcast record "
                "belongs to no key; reach keyed state with ctx.apply_to_keyed_state(descriptor, fn)"
            ) from None  # this message is the one to report (a JobFailedError names the innermost cause)
        except NonRetryableError:
            raise
        except Exception as exc:
            raise _user_error(self, exc) from exc
        finally:
            bctx._record = None
            backend.end_ttl_step()
        return out
