"""The non-keyed process operator: ``ProcessFunction`` / ``CoProcessFunction`` and the
``ProcessContext`` they see (timestamps and side outputs; keyed state is refused)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Tuple, TypeAlias

from ..errors import NonRetryableError, not_records, refuse_non_records
from .base import Operator, OutputTag, UserFunctionError, rows_of


class ProcessContext:
    """The ``ctx`` of a ``ProcessFunction``'s or ``CoProcessFunction``'s
    ``process_element``: the record's event time and side outputs."""

    def __init__(self, operator: Operator) -> None:
        self._op = operator
        self._record: Any = None
        self._timestamps: Any = None

    def timestamp(self) -> Optional[int]:
        """The event time of the record being processed (None when the stream has none)."""
        if self._timestamps is None or self._record is None:
            return None
        return int(self._timestamps.of_record(self._record))

    def output(self, tag: OutputTag, value: Any) -> None:
        """Sends ``value`` to the side output ``tag`` (``stream.get_side_output(tag)``)."""
        self._op.emit_side(tag, value)

    @property
    def subtask(self) -> int:
        assert self._op.ctx is not None
        return self._op.ctx.subtask

    def _keyed_only(self, what: str) -> NonRetryableError:
        return NonRetryableError(
            f"{self._op.where()}: ctx.{what} needs a keyed stream (keyed state and timers are per key): "
            "key_by(...).process(pe.KeyedProcessFunction), or for two inputs "
            "a.key_by(k1).connect(b.key_by(k2)).process(pe.KeyedCoProcessFunction)"
        )

    # Keyed-only calls, refused with the way out (not an AttributeError, nor retried: no
    # restart makes a stream keyed).
    def get_state(self, descriptor: Any) -> Any:
        raise self._keyed_only("get_state")

    def get_list_state(self, descriptor: Any) -> Any:
        raise self._keyed_only("get_list_state")

    def get_map_state(self, descriptor: Any) -> Any:
        raise self._keyed_only("get_map_state")

    def timer_service(self) -> Any:
        raise self._keyed_only("timer_service()")

    @property
    def current_key(self) -> Any:
        raise self._keyed_only("current_key")


class ProcessFunction:
    """Per-record logic on a stream that is not keyed (PyFlink's ``ProcessFunction``):
    ``process_element(value, ctx)`` yields outputs; ``ctx.output(tag, value)`` sends
    to a side output; ``ctx.timestamp()`` is the record's event time. Keyed state and
    timers need a keyed stream (``key_by(...).process(KeyedProcessFunction)``)."""

    Context: TypeAlias = ProcessContext

    def open(self, ctx: ProcessContext) -> None:
        pass

    def process_element(self, value: Any, ctx: ProcessContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CoProcessFunction:
    """Logic over two connected streams that are not keyed (PyFlink's
    ``CoProcessFunction``): ``a.connect(b).process(fn)`` calls
    ``process_element1(value, ctx)`` for the first stream's records and
    ``process_element2(value, ctx)`` for the second's, in the order they arrive.
    ``ctx`` is a ``ProcessContext`` (``ctx.output`` for side outputs)."""

    Context: TypeAlias = ProcessContext

    def open(self, ctx: ProcessContext) -> None:
        pass

    def process_element1(self, value: Any, ctx: ProcessContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def process_element2(self, value: Any, ctx: ProcessContext) -> Optional[Iterable[Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ProcessOperator(Operator):
    """Runs a ``ProcessFunction`` (one input) or a ``CoProcessFunction`` (two)."""

    def __init__(self, uid: str, name: str, fn: Any, timestamps: Tuple[Any, Any] = (None, None)) -> None:
        super().__init__(uid, name)
        self.fn = fn
        self.timestamps1, self.timestamps2 = timestamps
        self._pctx = ProcessContext(self)

    def open(self) -> None:
        self._call(self.fn.open, self._pctx)

    def _run(self, records: Any, element: Callable[[Any, Any], Any], timestamps: Any) -> List[Any]:
        out: List[Any] = []
        pctx = self._pctx
        pctx._timestamps = timestamps
        try:
            for r in rows_of(records):
                pctx._record = r
                produced = element(r, pctx)
                if produced is not None:
                    if produced.__class__ is dict or produced.__class__ is str:
                        raise not_records(produced, self.where(), "process_element")
                    try:
                        out.extend(produced)
                    except TypeError:
                        refuse_non_records(produced, self.where(), "process_element")
                        raise
        except NonRetryableError:
            raise
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc
        finally:
            pctx._record = None
        return out

    def process(self, records: Any) -> List[Any]:
        element = self.fn.process_element1 if isinstance(self.fn, CoProcessFunction) else self.fn.process_element
        return self._run(records, element, self.timestamps1)

    def process2(self, records: Any) -> List[Any]:
        return self._run(records, self.fn.process_element2, self.timestamps2)

    def close(self) -> None:
        self._call(self.fn.close)


CoProcessOperator = ProcessOperator  # the same operator; its function says how many inputs
