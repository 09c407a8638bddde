"""The keyed process operator: ``KeyedProcessFunction`` and its co-process twin, the
``KeyedContext`` they see (state, timers, side outputs), the keyed operator base
that owns a keyed state backend, and ``key_selector`` (how ``key_by`` reads a key)."""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Tuple, TypeAlias, overload

from .._native import KeyedContextCalls
from ..errors import ColumnNotFoundError, NonRetryableError, OutputTypeError, not_records, refuse_non_records
from ..state import ListStateDescriptor, create_keyed_backend, key_group_range_for_subtask
from ..state.descriptors import (
    IN,
    OUT,
    AggregatingStateDescriptor,
    K,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    T,
    V,
    ValueStateDescriptor,
)
from ..state.lists import ListState
from ..state.maps import MapState
from ..state.timers import InvalidTimerError
from ..state.values import AggregatingState, ReducingState, ValueState
from ..storage.filesystem import CheckpointStorageLocation
from ..storage.metadata import OperatorState, SubtaskState
from ..time.domain import TimeDomain
from ..time.service import TimerService
from .base import EventTimeOperatorMixin, Operator, OperatorContext, OutputTag, UserFunctionError, rows_of

_ABSENT_KEY = object()  # no key seen yet (None is a key)
TTL_STEP_RECORDS = 64  # records per TTL clock read in a keyed function (see _process_keyed)

log = logging.getLogger("pyengine.runtime.operators")  # the logger name users configure; kept across the split


class _KeyedContextFields(KeyedContextCalls):
    """``KeyedContext``'s fields that firing timers set, once per timer, and the timer
    service that ``timer_service()`` returns: slots, which the native timer sets write
    and read at their place in the object (see ``bindings/_keycore.pxi``). A subclass
    that makes one a property gets it set or read as an attribute instead."""

    __slots__ = ("_service", "_timer_ts", "current_key")

    def __init__(self) -> None:
        self.current_key: Any = None  # the record's key (or the firing timer's)
        self._timer_ts: Optional[int] = None
        self._service: Optional[TimerService] = None  # the operator's TimerService, once made


class KeyedContext(_KeyedContextFields):
    """The ``ctx`` of a ``KeyedProcessFunction``'s ``open``, ``process_element`` and
    ``on_timer`` (PyFlink's ``KeyedProcessFunction.Context`` and, for state, its
    ``RuntimeContext``): keyed state, the current key, timers, the record's time.

    ``get_state`` is typed by its descriptor: with
    ``ValueStateDescriptor[int]("n")`` a type checker knows ``value()`` is
    ``Optional[int]``; ``get_list_state``, ``get_map_state``... are PyFlink's
    names for the same call."""

    def __init__(self, operator: KeyedProcessOperator) -> None:
        super().__init__()
        self._op = operator
        self._backend: Any = None  # the operator's keyed backend, once state is asked for
        self._record: Any = None
        self._time_domain: Any = None

    @property
    def _domain(self) -> Any:
        return self._time_domain

    @_domain.setter
    def _domain(self, domain: Any) -> None:
        # Set as timers start and stop firing: TTL reads the clock afresh (the backend
        # reads it once per record, at set_current_key, which firing timers skip).
        # Once per batch of timers, not per record: current_key stays a plain attribute.
        self._time_domain = domain
        backend = self._backend
        if backend is not None:
            backend._ttl_now = None

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

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The keyed state of ``descriptor`` (created on first use; the same object
        for an equal descriptor), scoped to the current key on every call."""
        backend = self._backend if self._backend is not None else self._op.backend
        assert backend is not None, "keyed state is available from open() on"
        self._backend = backend
        return backend.get_state(descriptor)

    def get_list_state(self, descriptor: ListStateDescriptor[T]) -> ListState[T]:
        """``get_state`` for a list state (PyFlink's name)."""
        return self.get_state(descriptor)

    def get_map_state(self, descriptor: MapStateDescriptor[K, V]) -> MapState[K, V]:
        """``get_state`` for a map state (PyFlink's name)."""
        return self.get_state(descriptor)

    def get_reducing_state(self, descriptor: ReducingStateDescriptor[T]) -> ReducingState[T]:
        """``get_state`` for a reducing state (PyFlink's name)."""
        return self.get_state(descriptor)

    def get_aggregating_state(self, descriptor: AggregatingStateDescriptor[IN, OUT]) -> AggregatingState[IN, OUT]:
        """``get_state`` for an aggregating state (PyFlink's name)."""
        return self.get_state(descriptor)

    def get_current_key(self) -> Any:
        return self.current_key

    if TYPE_CHECKING:  # the method is KeyedContextCalls' (C): a timer per record calls it per record

        def timer_service(self) -> TimerService:
            """Register and delete the current key's timers; read the clocks."""
            ...

    def timestamp(self) -> Optional[int]:
        """The event time of the record being processed (None when the stream has
        no timestamps), or in ``on_timer`` the timer's timestamp."""
        if self._timer_ts is not None:
            return self._timer_ts
        assigner = self._op.timestamps
        if assigner is None or self._record is None:
            return None
        return int(assigner.of_record(self._record))

    def time_domain(self) -> Any:
        """In ``on_timer``: ``TimeDomain.EVENT_TIME`` or ``TimeDomain.PROCESSING_TIME``."""
        return self._domain

    def output(self, tag: OutputTag, value: Any) -> None:
        """Sends ``value`` to the side output ``tag`` (``stream.get_side_output(tag)``)."""
        self._op.emit_side(tag, value)

    @property
    def subtask(self) -> int:
        assert self._op.ctx is not None
        return self._op.ctx.subtask


_KeyedContext = KeyedContext  # the name it had while private


class KeyedProcessFunction:
    """Per-key logic with keyed state and timers (PyFlink's names).

    ``open(ctx)`` gets state through ``ctx.get_state(descriptor)``;
    ``process_element(value, ctx)`` yields outputs, with ``ctx.current_key`` the
    record's key, ``ctx.timestamp()`` its event time (None when the stream has no
    timestamps) and ``ctx.timer_service()`` to register timers for the key.
    ``on_timer(timestamp, ctx)`` runs when one fires: ``ctx.time_domain()`` says
    which clock, ``ctx.current_key`` whose timer it is; what it yields goes
    downstream like the output of ``process_element``. ``ctx`` is a
    ``KeyedContext`` (also ``KeyedProcessFunction.Context``, PyFlink's name)."""

    Context: TypeAlias = KeyedContext  # PyFlink's name: ``ctx: KeyedProcessFunction.Context``

    def open(self, ctx: KeyedContext) -> None:
        pass

    def process_element(self, value: Any, ctx: KeyedContext) -> Iterable[Any]:
        raise NotImplementedError

    def on_timer(self, timestamp: int, ctx: KeyedContext) -> Optional[Iterable[Any]]:
        """A timer of ``ctx.current_key`` fired (override it to use timers)."""
        return None

    def close(self) -> None:
        pass


def overrides_on_timer(fn: Any) -> bool:
    """Whether a ``KeyedProcessFunction`` has timers to fire (its class defines ``on_timer``)."""
    return type(fn).on_timer is not KeyedProcessFunction.on_timer


class KeyedOperator(Operator):
    """An operator with keyed state: a backend over its subtask's key groups."""

    def __init__(self, uid: str, name: str) -> None:
        super().__init__(uid, name)
        self.backend: Any = None

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        super().setup(ctx, restored)
        key_groups = key_group_range_for_subtask(ctx.max_parallelism, ctx.parallelism, ctx.subtask)
        self.backend = create_keyed_backend(
            ctx.state_backend,
            max_parallelism=ctx.max_parallelism,
            key_group_range=key_groups,
            local_recovery_dir=ctx.local_recovery_dir,
        )
        if restored is not None:
            self.backend.restore(restored.keyed_handles())

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation) -> Callable[[], SubtaskState]:
        keyed = self.backend.snapshot(checkpoint_id, location)
        operator_part = super().snapshot(checkpoint_id, location)

        def write() -> SubtaskState:
            result = keyed.run()
            state = operator_part()
            state.keyed = list(result.handles)
            return state

        return write

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        self.backend.notify_checkpoint_complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        aborted = getattr(self.backend, "notify_checkpoint_aborted", None)
        if aborted is not None:
            aborted(checkpoint_id)


class KeyedProcessOperator(EventTimeOperatorMixin, KeyedOperator):
    """Runs a ``KeyedProcessFunction``; its timers are keyed state (``pyengine.state.timers``)."""

    def __init__(
        self,
        uid: str,
        name: str,
        key_selector: Callable[[Any], Any],
        fn: KeyedProcessFunction,
        timestamps: Any = None,
    ) -> None:
        super().__init__(uid, name)
        self.key_selector = key_selector
        self.fn = fn
        self.timestamps = timestamps  # the stream's TimestampAssigner, for ctx.timestamp()
        self._kctx = KeyedContext(self)
        self._timers: Any = None  # InternalTimerService, made on first use or at restore
        self._timer_service: Any = None

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        super().setup(ctx, restored)
        self._restore_watermark(restored)
        if any(name.startswith("_timer_state/") for name in self.backend.state_names):
            self._make_timers()  # restored timers: the index is rebuilt now, so due ones fire

    def _make_timers(self) -> Any:
        from ..state.timers import InternalTimerService
        from ..time.service import TimerService

        key = self.backend.current_key
        self._timers = InternalTimerService(self.backend, self.current_watermark)
        self._timer_service = self._kctx._service = TimerService(self._timers)
        if key is not None:
            self.backend.set_current_key(key)
        return self._timer_service

    def timer_service(self) -> Any:
        return self._timer_service if self._timer_service is not None else self._make_timers()

    def open(self) -> None:
        self._call(self.fn.open, self._kctx)

    def process(self, records: List[Any]) -> List[Any]:
        return self._process_keyed(records, self.key_selector, self.fn.process_element)

    def _process_keyed(
        self, records: Any, select: Callable[[Any], Any], element: Callable[[Any, Any], Any]
    ) -> List[Any]:
        out: List[Any] = []
        records = rows_of(records)
        backend, kctx = self.backend, self._kctx
        set_current_key = backend.set_current_key
        # key_by(field): the field read in C (operator.itemgetter); a record without
        # it is found below and refused by the selector itself, as before
        fast = getattr(select, "fast", None)
        get_key = select if fast is None else fast
        # One processing time for a step's TTL checks and stamps (Flink's
        # TtlTimeProvider): a clock read per TTL_STEP_RECORDS records, not per record.
        # Per buffer, a stamp could be a whole buffer's processing old when written
        # (a second for 1,024 records of 1 ms each) and the entry expire that early.
        # Always in steps: a TTL state may be made by the first record of a buffer.
        steps = (
            [records[i : i + TTL_STEP_RECORDS] for i in range(0, len(records), TTL_STEP_RECORDS)]
            if len(records) > TTL_STEP_RECORDS
            else (records,)
        )
        backend.begin_ttl_step(records=len(records))
        try:
            for n, step in enumerate(steps):
                if n:
                    backend.advance_ttl_step()
                for r in step:
                    key = get_key(r)
                    if key.__class__ is float and key != key:
                        raise NaNKeyError(f"{self.where()}: the key of record {r!r} is NaN")
                    set_current_key(key)
                    kctx.current_key = key
                    kctx._record = r
                    produced = element(r, kctx)
                    if produced is not None:
                        if produced.__class__ is dict or produced.__class__ is str:
                            raise not_records(produced, self.where(), getattr(element, "__name__", "process_element"))
                        try:
                            out.extend(produced)
                        except TypeError:
                            refuse_non_records(produced, self.where(), getattr(element, "__name__", "process_element"))
                            raise
        except InvalidTimerError as exc:  # a timer call of the function's: which operator's, on which record
            exc.args = (f"{self.where()}: {self._on_record(r)}: {exc}",)  # the traceback to the user's line kept
            raise
        except NonRetryableError:
            raise
        except Exception as exc:
            if fast is not None and isinstance(exc, (KeyError, IndexError, TypeError)):
                select(r)  # a record without the key's field: ColumnNotFoundError (else the function raised)
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc
        finally:
            kctx._record = None
            backend.end_ttl_step()
        return out

    def _on_record(self, record: Any) -> str:
        """A record as a refused timer's message names it: with its event time and the
        field it came from (a timer is often the record's time plus something)."""
        from ..time.strategy import _short

        said = f"record {_short(record)}"
        if self.timestamps is not None:
            try:
                said += f", event time {self.timestamps.of_record(record)} from {self.timestamps.describe()}"
            except NonRetryableError:
                pass
        return said

    def _fire(self, queue: Any, upto: int, domain: Any) -> List[Any]:
        out: List[Any] = []
        kctx = self._kctx
        kctx._domain = domain
        try:
            queue.fire(upto, kctx, self.fn.on_timer, out)
        except OutputTypeError as exc:
            raise OutputTypeError(f"{self.where()}: {exc}") from None
        except InvalidTimerError as exc:  # on_timer set a timer at no int64
            exc.args = (f"{self.where()}: on_timer: {exc}",)
            raise
        except NonRetryableError:
            raise
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: on_timer: {type(exc).__name__}: {exc}") from exc
        finally:
            kctx._timer_ts = None
            kctx._domain = None
        return out

    def process_watermark(self, watermark: int) -> List[Any]:
        if watermark <= self.current_watermark:
            return []
        self.current_watermark = watermark
        if self._timers is None:
            return []
        self._timers.current_watermark = watermark
        return self._fire(self._timers.event, watermark, TimeDomain.EVENT_TIME)

    def next_processing_time(self) -> Optional[int]:
        return self._timers.next_processing_time() if self._timers is not None else None

    def on_processing_time(self, now_ms: int) -> List[Any]:
        if self._timers is None:
            return []
        return self._fire(self._timers.processing, now_ms, TimeDomain.PROCESSING_TIME)

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation) -> Callable[[], SubtaskState]:
        self._save_watermark()
        return super().snapshot(checkpoint_id, location)

    def close(self) -> None:
        self._call(self.fn.close)


class KeyedCoProcessFunction:
    """Per-key logic over two connected keyed streams (PyFlink's
    ``KeyedCoProcessFunction``): ``a.key_by(k1).connect(b.key_by(k2)).process(fn)``.
    ``process_element1(value, ctx)`` gets the first stream's records,
    ``process_element2(value, ctx)`` the second's; both see the same keyed state
    (``ctx.get_state``) and timers (``ctx.timer_service()``) for the record's key, and
    ``on_timer(timestamp, ctx)`` runs when a timer fires. ``ctx`` is a
    ``KeyedContext``: ``ctx.output(tag, value)`` sends to a side output."""

    Context: TypeAlias = KeyedContext

    def open(self, ctx: KeyedContext) -> None:
        pass

    def process_element1(self, value: Any, ctx: KeyedContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def process_element2(self, value: Any, ctx: KeyedContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def on_timer(self, timestamp: int, ctx: KeyedContext) -> Optional[Iterable[Any]]:
        """A timer of ``ctx.current_key`` fired (override it to use timers)."""
        return None

    def close(self) -> None:
        pass


class KeyedCoProcessOperator(KeyedProcessOperator):
    """Runs a ``KeyedCoProcessFunction``: two inputs, each keyed by its own selector
    into one key space, one keyed backend and one timer service."""

    def __init__(
        self,
        uid: str,
        name: str,
        key_selectors: Tuple[Callable[[Any], Any], Callable[[Any], Any]],
        fn: KeyedCoProcessFunction,
        timestamps: Tuple[Any, Any] = (None, None),
    ) -> None:
        super().__init__(uid, name, key_selectors[0], fn, timestamps[0])  # type: ignore[arg-type]
        self.key_selector2 = key_selectors[1]
        self.timestamps1, self.timestamps2 = timestamps
        self.cofn = fn
        # each input's first key, until both are seen (then None)
        self._first_keys: Optional[List[Any]] = [_ABSENT_KEY, _ABSENT_KEY]

    def process(self, records: List[Any]) -> List[Any]:
        self.timestamps = self.timestamps1  # for ctx.timestamp()
        if self._first_keys is not None and type(records) is list and records:
            self._first_key(0, records[0], self.key_selector)
        return self._process_keyed(records, self.key_selector, self.cofn.process_element1)

    def process2(self, records: Any) -> List[Any]:
        self.timestamps = self.timestamps2
        if self._first_keys is not None and type(records) is list and records:
            self._first_key(1, records[0], self.key_selector2)
        return self._process_keyed(records, self.key_selector2, self.cofn.process_element2)

    def _first_key(self, side: int, record: Any, select: Callable[[Any], Any]) -> None:
        """Notes an input's first key; once both inputs have one, warns (once) when their
        types differ: an int key and a str key ("1") never meet in keyed state, and the
        job would run on as if the other input had no such key (Flink refuses key types
        that differ when the streams are connected; here types are only known from the
        data)."""
        keys = self._first_keys
        assert keys is not None
        if keys[side] is not _ABSENT_KEY:
            return
        try:
            keys[side] = select(record)
        except Exception:
            return  # the record's own processing reports it
        a, b = keys
        if a is _ABSENT_KEY or b is _ABSENT_KEY:
            return
        self._first_keys = None  # both seen: nothing more to check
        numeric = (int, float, bool)
        if a is None or b is None:  # an optional key: says nothing of the other's type
            return
        if type(a) is not type(b) and not (isinstance(a, numeric) and isinstance(b, numeric)):
            log.warning(
                "%s: the first input's keys are %s (the first: %r) and the second input's %s (the first: %r): "
                "keys of different types never meet in keyed state; make both key_by functions return one type",
                self.where(),
                type(a).__name__,
                a,
                type(b).__name__,
                b,
            )


def overrides_co_on_timer(fn: Any) -> bool:
    """Whether a ``KeyedCoProcessFunction`` has timers to fire."""
    return type(fn).on_timer is not KeyedCoProcessFunction.on_timer


class NaNKeyError(NonRetryableError, ValueError):
    """A record keyed by NaN. NaN equals nothing, itself included, so each such record
    would get state of its own (4,000 NaN records, 4,000 states of one): refused, at
    once and without restarts. Map NaN to a real key (None, or a sentinel) before
    ``key_by``."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}; NaN cannot be a key (it equals nothing): map it to a key first, e.g. None")


def key_selector(key: Any) -> Callable[[Any], Any]:
    """``key_by``'s argument as a function: a callable, or a column/field name."""
    if callable(key):
        return key  # type: ignore[no-any-return]
    if isinstance(key, (str, int)):
        name = key

        def select(record: Any) -> Any:
            try:
                return record[name]
            except (KeyError, IndexError, TypeError):
                hint = ""
                if isinstance(name, str) and hasattr(record, name):  # a dataclass, a namedtuple's attribute...
                    hint = (
                        f": key_by({name!r}) reads record[{name!r}] (a dict's key, an Arrow column); for "
                        f"an attribute, key_by(lambda r: r.{name})"
                        if name.isidentifier()
                        else ""
                    )
                raise ColumnNotFoundError(f"key_by({name!r}): record {record!r} has no field {name!r}{hint}") from None

        select.column = name  # type: ignore[attr-defined]  # lets Arrow batches be partitioned by column
        select.fast = operator.itemgetter(name)  # type: ignore[attr-defined]  # the same read, in C
        return select
    raise TypeError(f"key_by takes a function or a field name, got {key!r}")
