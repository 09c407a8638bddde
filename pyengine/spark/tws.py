"""Spark's ``StatefulProcessor`` (``transformWithState``) running unchanged on pyengine.

A user's ``pyspark.sql.streaming.StatefulProcessor`` subclass runs as a keyed
operator: its handle's value, list and map states are pyengine keyed state (so
they are checkpointed, restored, rescaled by key group and readable with
``pe.state.read_keyed_state``), its timers are pyengine timers, and the calls
come in Spark's order:

* ``init(handle)`` once per subtask (and attempt);
* on a job's first run (nothing restored), ``handleInitialState(key, row_or_df,
  timerValues)`` per key of the initial state this subtask owns, before any data;
* per micro-batch, ``handleInputRows(key, rows, timerValues)`` once per key in it,
  that key's rows in arrival order (``micro_batch``: the rows up to a checkpoint, a
  watermark, a due timer or the end of input; off, each input buffer; a DataFrame's
  whole input with ``whole_input``);
* expired timers after the data: ``handleExpiredTimer(key, timerValues,
  expiredTimerInfo)``, each timer deleted once it has fired (while it fires,
  ``listTimers`` still lists it and deleting or re-registering it changes
  nothing, as on Spark, which deletes it after the call);
* ``close()`` at the end.

Spark's semantics kept: values are tuples of the state's schema; keys are
tuples; TTL is processing time, measured at the batch's timestamp, restarted by
every write, and an expired value is never returned (Spark's ``StateTTL``:
expired once ``batch_ts >= written_ts + ttl``); timers outside a time mode raise
``PySparkValueError`` (``UNSUPPORTED_OPERATION``, the type Spark's own ``TwsTester``
raises); an event-time timer at or before the watermark is taken and fires after the
batch's rows (as a Spark run does; ``TwsTester`` refuses it); the watermark shown is
Spark's (``spark_watermark``), and in ``EventTime`` mode rows whose event time is
not later than it are dropped before the processor sees them. A deleted state's
handle raises ``PySparkRuntimeError``; a state's schema is checkpointed and evolved
on restore as Spark evolves it (``tws_schema.evolution``).

Why the state classes are thin: on Spark every state call is a round trip to a
JVM state server; here it is one call into the keyed backend plus a tuple. A
value state of one numeric field is stored unwrapped in its Arrow type (int keys:
columnar, native); other value states, and map keys of several fields, as tuples
through the safe serializer (MessagePack: ``read_keyed_state`` gives them as bytes,
``pyengine.state.serializers.SafeSerializer().loads`` reads one); list elements and
map values in their Arrow type (a struct for several fields).

pyspark is imported only when an operator is made or a schema parsed, so
``import pyengine`` and ``import pyengine.spark`` work without it.

This module is the driver (``TransformWithStateOperator``: grouping rows by key,
firing timers, shaping the output); the handle with its state and timer shims is
in ``tws_handle``, schema parsing in ``tws_schema``, building it into a job in
``tws_build``, grouping a micro-batch by key in bulk in ``tws_grouping``. Their
public names are importable from here as before."""

from __future__ import annotations

from itertools import repeat
from operator import itemgetter
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import pyarrow as pa

from ..errors import NonRetryableError
from ..io.events import MAX_WATERMARK, MIN_WATERMARK
from ..runtime.base import EventTimeOperatorMixin, OperatorContext, UserFunctionError
from ..runtime.keyed import KeyedOperator, NaNKeyError
from ..state import (
    ListStateDescriptor,
    assign_to_key_group,
    create_keyed_backend,
    key_group_range_for_subtask,
)
from ..storage.metadata import OperatorState
from ..time.domain import now_ms
from .tws_grouping import _cut, _frames_by_key, _order, _slices
from .tws_handle import (
    ProcessorUsageError,
    StateNotFoundError,
    StateValueError,
    _Handle,
)
from .tws_output import OutputSchemaError, TwsOutput, exact
from .tws_schema import parse_schema, spark_arrow_schema

__all__ = [
    "TIME_MODES",
    "OutputSchemaError",
    "ProcessorUsageError",
    "StateNotFoundError",
    "StateValueError",
    "TransformWithStateOperator",
    "check_processor",
    "parse_schema",
    "spark_arrow_schema",
    "time_mode_of",
]

TIME_MODES = ("None", "ProcessingTime", "EventTime")

MICRO_BATCH_MAX_DELAY_MS = 1000
"""With ``micro_batch``: how long gathered rows may wait for a boundary (a checkpoint,
a watermark, a timer, the end of input) before they are a micro-batch of their own,
as a Spark trigger's interval would make them (a stream without checkpoints or
watermarks still moves)."""

ORDER_COLUMN = "__pyengine_row_order"
"""whole_input: the column giving the rows' order in the DataFrame (the DataFrame
path adds it; the processor never sees it)."""

_INPUT_STATE = "_tws_input"
_WHOLE_INPUT_CHUNK = 1 << 16

MICRO_BATCH_MAX_ROWS = 1 << 20
"""With ``micro_batch``: the rows one micro-batch gathers at most in memory (Spark's
``maxRecordsPerTrigger``-like bound; a stream never holds more than this in flight)."""

_SCHEMAS_STATE = ListStateDescriptor("_tws_schemas")
"""Operator state: ``[state name, Spark schema JSON]`` per state the processor
declared, so a restore can evolve a state whose schema changed (``tws_schema.evolution``)."""


# -- the operator ------------------------------------------------------------------------------


def check_processor(processor: Any) -> None:
    """Refuses what is not a Spark ``StatefulProcessor`` instance, with what to pass instead."""
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    if isinstance(processor, type) and issubclass(processor, StatefulProcessor):
        raise TypeError(
            f"transform_with_state takes a StatefulProcessor instance, got the class {processor.__name__}: "
            f"pass {processor.__name__}()"
        )
    if not isinstance(processor, StatefulProcessor):
        raise TypeError(
            "transform_with_state takes an instance of a pyspark.sql.streaming.StatefulProcessor subclass, "
            f"got {type(processor).__name__}"
        )


def time_mode_of(time_mode: Any) -> str:
    """Spark's time mode names, case-insensitive as Spark takes them."""
    if isinstance(time_mode, str):
        for mode in TIME_MODES:
            if mode.lower() == time_mode.lower():
                return mode
    raise ValueError(f"time_mode must be one of {', '.join(TIME_MODES)} (case-insensitive), got {time_mode!r}")


class TransformWithStateOperator(TwsOutput, EventTimeOperatorMixin, KeyedOperator):
    """Runs a Spark ``StatefulProcessor``; see the module docstring.

    ``flavour`` is ``"row"`` (``transformWithState``: ``Iterator[Row]`` in and out)
    or ``"pandas"`` (``transformWithStateInPandas``: ``Iterator[DataFrame]``). The
    output goes on as one Arrow ``RecordBatch`` per input buffer, checked against
    ``output_schema``. ``clock`` (ms) is the batch timestamp source (tests drive it)."""

    def __init__(
        self,
        uid: str,
        name: str,
        key_selector: Callable[[Any], Any],
        processor: Any,
        output_schema: Any,
        *,
        flavour: str = "row",
        time_mode: str = "None",
        event_time: Optional[Callable[[Any], int]] = None,
        initial_state: Optional[Callable[[], Iterable[Tuple[Any, Any]]]] = None,
        clock: Optional[Callable[[], int]] = None,
        micro_batch: bool = False,
        micro_batch_max_delay_ms: Optional[int] = MICRO_BATCH_MAX_DELAY_MS,
        whole_input: bool = False,
    ) -> None:
        super().__init__(uid, name)
        check_processor(processor)
        if flavour not in ("row", "pandas"):
            raise ValueError(f"flavour must be 'row' or 'pandas', got {flavour!r}")
        self.key_selector = key_selector
        self.key_column: Optional[str] = getattr(key_selector, "column", None)
        self.processor = processor
        self.output_struct = parse_schema(output_schema, "output schema")
        self.output_schema = spark_arrow_schema(self.output_struct)
        self.output_names = list(self.output_schema.names)
        self._exact = {f.name: exact(f.type) for f in self.output_schema}
        self.flavour = flavour
        self.time_mode = time_mode_of(time_mode)
        self.event_time = event_time
        self.initial_state = initial_state
        self.clock = clock or now_ms
        self.batch_ts = -1
        self._first_run = True
        self._timers: Any = None
        self._firing: Optional[int] = None
        self._firing_key: Any = None
        self._handle: Optional[_Handle] = None
        self._opened = False
        self._row_classes: Dict[Tuple[str, ...], Any] = {}
        self._final_watermark = MIN_WATERMARK  # what Spark's processors see once the input ended
        self.state_schemas: Dict[str, str] = {}  # state name -> its Spark schema (JSON), checkpointed
        self.micro_batch = micro_batch
        self.micro_batch_max_delay_ms = micro_batch_max_delay_ms
        self._pending: List[Any] = []  # the buffers of the micro-batch being gathered
        self._pending_rows = 0
        self._pending_due: Optional[int] = None  # wall-clock ms by which they are handled
        self.whole_input = whole_input
        self._input_state: Any = None  # whole_input: the rows so far, per key (keyed list state)
        self.restored_schemas: Dict[str, str] = {}  # what the restored checkpoint recorded

    # -- lifecycle -----------------------------------------------------------------------------

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        # As KeyedOperator.setup, with TTL measured on the batch timestamp (Spark's
        # TTL clock), not on the wall clock at the moment of each call.
        from ..runtime.base import Operator

        Operator.setup(self, ctx, restored)
        self.backend = create_keyed_backend(
            ctx.state_backend,
            max_parallelism=ctx.max_parallelism,
            key_group_range=key_group_range_for_subtask(ctx.max_parallelism, ctx.parallelism, ctx.subtask),
            local_recovery_dir=ctx.local_recovery_dir,
            ttl_clock_ms=self._ttl_now,
        )
        if restored is not None:
            self.backend.restore(restored.keyed_handles())
        self._first_run = restored is None
        self._restore_watermark(restored)
        schemas = self.operator_state.get_union_list_state(_SCHEMAS_STATE)  # type: ignore[union-attr]
        if restored is not None:
            self.restored_schemas = {str(name): str(schema) for name, schema in schemas.get()}
        if any(n.startswith("_timer_state/") for n in self.backend.state_names):
            self.timers()  # restored timers: rebuild the index now, so due ones fire

    def _ttl_now(self) -> int:
        return self.batch_ts if self.batch_ts >= 0 else self.clock()

    def timers(self) -> Any:
        """The operator's InternalTimerService, made on first use."""
        if self._timers is None:
            from ..state.timers import InternalTimerService

            key = self.backend.current_key
            self._timers = InternalTimerService(self.backend, self.current_watermark)
            if key is not None:
                self.backend.set_current_key(key)
        return self._timers

    def spark_watermark(self) -> int:
        """The watermark as Spark shows it. pyengine's watermark W is Flink's (every
        timestamp up to W has been seen: a bounded-out-of-orderness generator emits
        ``max - delay - 1``), Spark's is ``max - delay`` (a row at or before it is
        late): Spark's is W + 1, so ``for_bounded_out_of_orderness(d)`` shows what
        ``withWatermark(col, d)`` shows. 0 before the first one (Spark starts at 0 and
        never goes below); at the end of a bounded input (pyengine's maximum
        watermark, which Spark never shows) the final one the firing uses
        (``process_watermark``)."""
        wm = self.current_watermark
        if wm >= MAX_WATERMARK:
            return self._final_watermark
        return 0 if wm <= MIN_WATERMARK else max(0, int(wm) + 1)

    def _timer_values(self) -> Any:
        from pyspark.sql.streaming.stateful_processor import TimerValues

        if self.time_mode == "None":
            return TimerValues(-1, -1)
        if self.time_mode == "ProcessingTime":
            return TimerValues(self.batch_ts, -1)
        return TimerValues(self.batch_ts, self.spark_watermark())

    def open(self) -> None:
        import pyspark.sql.streaming.stateful_processor as sp

        self._Row: Any = __import__("pyspark.sql.types", fromlist=["Row"]).Row
        self._ExpiredTimerInfo = sp.ExpiredTimerInfo
        self._handle = _Handle(self)
        self._user(self.processor.init, self._handle)
        self._opened = True
        if self._first_run and self.initial_state is not None:
            self.batch_ts = self.clock()
            self._initial(self.initial_state())

    def close(self) -> None:
        if self._opened:
            self._opened = False
            self._user(self.processor.close)

    def _user(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except NonRetryableError:
            raise
        except Exception as exc:
            raise self._wrap(exc, getattr(fn, "__name__", "")) from exc

    def _wrap(self, exc: BaseException, where: str) -> Exception:
        message = f"{self.where()}: {where}: {type(exc).__name__}: {exc}"
        if getattr(exc, "_pyengine_usage", False):
            hint = getattr(exc, "_pyengine_hint", "")
            return ProcessorUsageError(f"{message} ({hint})" if hint else message)
        return UserFunctionError(message)

    def _initial(self, entries: Iterable[Tuple[Any, Any]]) -> None:
        """``handleInitialState`` for the keys of this subtask (others are another's)."""
        backend = self.backend
        kg = backend.key_group_range
        tv = self._timer_values()
        handle = self.processor.handleInitialState
        for key, value in entries:
            if not kg.start <= assign_to_key_group(key, backend.max_parallelism) <= kg.end:
                continue
            backend.set_current_key(key)
            self._user(handle, key if key.__class__ is tuple else (key,), value, tv)

    # -- data ----------------------------------------------------------------------------------

    def process(self, records: Any) -> Any:
        if self.whole_input:
            if len(records):
                self._keep_input(records)
            return []
        if not self.micro_batch:
            out: List[Any] = []
            self._batch(records, out)
            return self._output(out)
        if not len(records):
            return []
        if not self._pending and self.micro_batch_max_delay_ms is not None:
            self._pending_due = now_ms() + self.micro_batch_max_delay_ms
        self._pending.append(records)
        self._pending_rows += len(records)
        if self._pending_rows >= MICRO_BATCH_MAX_ROWS:
            return self._flush()
        return []

    def _batch(self, records: Any, out: List[Any]) -> None:
        """One micro-batch, as Spark runs one: ``handleInputRows`` once per key with all
        its rows (in arrival order), then the timers it makes due (processing time: at
        the batch's timestamp; event time: at or before the watermark)."""
        self.batch_ts = self.clock()
        if len(records):
            if self.flavour == "row":
                self._input_rows(records, out)
            else:
                self._input_frames(records, out)
        if self._timers is not None:
            if self.time_mode == "ProcessingTime":
                self._fire(self._timers.processing, self.batch_ts, out)
            elif self.time_mode == "EventTime":
                # A timer at or before the watermark, set while the rows were handled,
                # fires now, after them, as Spark fires it in the same micro-batch.
                self._fire(self._timers.event, self.spark_watermark(), out)

    def _flush_into(self, out: List[Any]) -> None:
        """The micro-batch gathered so far, handled now (a boundary: a checkpoint
        barrier, a watermark, a processing-time timer, the end of input, or the
        gathered rows' deadline); nothing when none is gathered."""
        if not self._pending:
            return
        buffers = self._pending
        self._pending, self._pending_rows, self._pending_due = [], 0, None
        self._batch(_concat(buffers), out)

    def _flush(self) -> Any:
        out: List[Any] = []
        self._flush_into(out)
        return self._output(out)

    def prepare_snapshot_pre_barrier(self, checkpoint_id: int) -> Any:
        # A checkpoint ends a micro-batch: its rows are handled (and their output goes
        # out) before the barrier, so the snapshot holds no row in flight.
        return self._flush()

    def end_input(self) -> Any:
        if self.whole_input:
            return self._whole_input()
        return self._flush()

    def _keep_input(self, records: Any) -> None:
        """whole_input: a buffer's rows appended to their keys' lists in keyed state."""
        if isinstance(records, (pa.RecordBatch, pa.Table)):
            if self._input_state is None:
                self._input_state = self.backend.get_state(
                    ListStateDescriptor(_INPUT_STATE, pa.struct(list(records.schema)))
                )
            rows = records.to_pylist()
        else:
            if self._input_state is None:
                self._input_state = self.backend.get_state(ListStateDescriptor(_INPUT_STATE, None))
            rows = [r if isinstance(r, dict) else r.asDict() for r in records]
        groups: Dict[Any, List[Any]] = {}
        select = self.key_selector
        for r in rows:
            key = select(r)
            bucket = groups.get(key)
            if bucket is None:
                self._check_key(key)
                groups[key] = [r]
            else:
                bucket.append(r)
        set_key, state = self.backend.set_current_key, self._input_state
        for key, bucket in groups.items():
            set_key(key)
            state.add_all(bucket)

    def _whole_input(self) -> Any:
        """whole_input, at the end of input: each key's rows (in the DataFrame's order)
        in one call, keys taken in batches of about ``_WHOLE_INPUT_CHUNK`` rows."""
        backend = self.backend
        if self._input_state is None:
            table = backend._tables.get(_INPUT_STATE)
            if table is None:
                return []
            self._input_state = backend.get_state(ListStateDescriptor(_INPUT_STATE, table.descriptor.type))
        state = self._input_state
        out: List[Any] = []
        chunk: List[Any] = []
        for key in list(backend.keys(_INPUT_STATE)):
            backend.set_current_key(key)
            rows = list(state.get())
            state.clear()
            if rows and ORDER_COLUMN in rows[0]:
                rows.sort(key=itemgetter(ORDER_COLUMN))
                for r in rows:
                    del r[ORDER_COLUMN]
            chunk.extend(rows)
            if len(chunk) >= _WHOLE_INPUT_CHUNK:
                self._batch(chunk, out)
                chunk = []
        if chunk:
            self._batch(chunk, out)
        return self._output(out)

    def _input_rows(self, records: Any, out: List[Any]) -> None:
        """``handleInputRows`` per key, its output values appended to ``out`` (flat:
        one row's values after another's, see ``_take``).

        Why it is shaped like this: with ~1 record per key per buffer (many keys),
        every object made per record and kept until the buffer ends survives the
        garbage collector's young generation, and enough of them trigger full
        collections of the whole heap (pyspark, pandas and pyarrow's objects
        included): that, not the calls, was most of the adapter's cost. So the input
        Rows are made only when the processor iterates (the buffer holds the records
        it was given anyway), a key with one record gets no list, and an output Row
        is taken apart as soon as it is yielded and freed at once."""
        groups, cls, values = self._group_rows(records)
        set_key, fn, tv = self.backend.set_current_key, self.processor.handleInputRows, self._timer_values()
        new = tuple.__new__
        names, width = self.output_names, len(self.output_names)
        add, fit = out.extend, self._fit_row
        try:
            for key, bucket in groups:
                set_key(key)
                if cls is None:  # ready Rows, in a list
                    rows: Iterator[Any] = iter(bucket)
                elif bucket.__class__ is list:
                    rows = map(new, repeat(cls), bucket if values is None else map(values, bucket))
                else:
                    rows = iter((new(cls, bucket if values is None else values(bucket)),))
                produced = fn(key if key.__class__ is tuple else (key,), rows, tv)
                if produced is not None:
                    for row in produced:  # as _take, inline: this runs per key
                        try:
                            if len(row) == width and (row.__class__ is tuple or row.__fields__ == names):
                                add(row)
                                continue
                        except (AttributeError, TypeError):
                            pass
                        add(fit(row))
        except NonRetryableError:
            raise
        except Exception as exc:
            raise self._wrap(exc, "handleInputRows") from exc

    def _take(self, produced: Iterable[Any], out: List[Any]) -> None:
        """A processor's output rows into ``out``, flat: a Row whose fields are the
        output schema's, in its order, or a plain tuple of its width (by position),
        gives its values as they are; any other row is matched by name or refused
        (``_fit_row``)."""
        names, width = self.output_names, len(self.output_names)
        add = out.extend
        for row in produced:
            try:
                if len(row) == width and (row.__class__ is tuple or row.__fields__ == names):
                    add(row)
                    continue
            except (AttributeError, TypeError):
                pass
            add(self._fit_row(row))

    def _input_frames(self, records: Any, out: List[Any]) -> None:
        groups = self._group_frames(records)
        set_key, fn, tv = self.backend.set_current_key, self.processor.handleInputRows, self._timer_values()
        extend = out.extend
        try:
            for key, frames in groups:
                set_key(key)
                produced = fn(key if key.__class__ is tuple else (key,), iter(frames), tv)
                if produced is not None:
                    extend(produced)
        except NonRetryableError:
            raise
        except Exception as exc:
            raise self._wrap(exc, "handleInputRows") from exc

    def _late(self, records: List[Any]) -> List[Any]:
        """EventTime: rows not later than the watermark are dropped, as Spark drops them;
        before the first watermark that is Spark's 0 (rows at or before the epoch)."""
        wm = self.spark_watermark()
        if self.event_time is None:
            return records
        ts = self.event_time
        kept = [r for r in records if ts(r) > wm]
        self.late_records_dropped += len(records) - len(kept)
        return kept

    def _group_rows(self, records: Any) -> Tuple[Iterable[Tuple[Any, Any]], Any, Any]:
        """The buffer per key, in arrival order, keys in order of first arrival, as
        ``(groups, cls, values)``: each group is ``(key, bucket)``, a bucket one record
        or a list of them (a key's second record makes the list). ``cls`` is the Row
        class the records become (``None``: the buckets are lists of ready Rows) and
        ``values`` what gives a record's values (``None``: it is its values' tuple).

        The common shapes get C-level passes over the whole buffer: a buffer of dicts
        with the same fields in the same order (one Row class for all), and an Arrow
        batch. An Arrow batch with int keys (``_order``) is sorted by key in Arrow
        (``take``) and each key's rows are a slice; the rest get one Python loop that
        only groups (``_bucket``)."""
        if isinstance(records, (pa.RecordBatch, pa.Table)):
            if self.time_mode != "EventTime" and self.key_column in records.schema.names:
                cls = self._row_class(tuple(records.schema.names))
                keys = records.column(self.key_column).to_pylist()
                order = _order(keys)
                if order is not None:  # sorted by key once, in Arrow, then transposed
                    ordered = records.take(pa.array(order[0], type=pa.int64()))
                    rows = list(zip(*[c.to_pylist() for c in ordered.columns], strict=True))
                    return _slices(rows, *order[1:]), cls, None
                values = zip(*[c.to_pylist() for c in records.columns], strict=True)
                return self._bucket(keys, values), cls, None
            records = records.to_pylist()
        if self.time_mode == "EventTime":
            records = self._late(records)
        if not records:
            return (), None, None
        column = self.key_column
        first = records[0]
        if column is not None and first.__class__ is dict and column in first:
            fields = tuple(first)
            # Every record a dict of exactly these fields, in this order (a Row's
            # values are taken in dict order, so the order must be the same too).
            if all(map(fields.__eq__, map(_shape, records))):  # lazily: no tuple per record kept
                keys = list(map(itemgetter(column), records))
                # A dict per key, not the bulk sort: the Rows are made lazily from the
                # records as they are; building every Row's values up front (a sort, an
                # object array per field) measured slower in whole jobs, though faster
                # in the operator alone (more objects alive at once).
                return self._bucket(keys, records), self._row_class(fields), dict.values
        return self._group_any(records), None, None

    def _bucket(self, keys: List[Any], records: Iterable[Any]) -> Iterable[Tuple[Any, Any]]:
        groups: Dict[Any, Any] = {}
        get = groups.get
        for key, record in zip(keys, records, strict=False):  # records may be a lazy zip of the same length
            bucket = get(key)
            if bucket is None:
                if key.__class__ is float and key != key:
                    self._check_key(key)
                groups[key] = record
            elif bucket.__class__ is list:
                bucket.append(record)
            else:
                groups[key] = [bucket, record]
        return groups.items()

    def _group_any(self, records: Iterable[Any]) -> Iterable[Tuple[Any, List[Any]]]:
        """Records of any shape: dicts of varying fields, Rows, tuples."""
        new = tuple.__new__
        row_class = self._row_class
        groups: Dict[Any, List[Any]] = {}
        select = self.key_selector
        column = self.key_column
        for r in records:
            if r.__class__ is dict:
                key = r[column] if column is not None and column in r else select(r)
                row = new(row_class(tuple(r)), r.values())
            else:
                key = select(r)
                row = r
            bucket = groups.get(key)
            if bucket is None:
                self._check_key(key)
                groups[key] = [row]
            else:
                bucket.append(row)
        return groups.items()

    def _row_class(self, fields: Tuple[str, ...]) -> Any:
        """A ``Row`` subclass whose field names are a class attribute. A Row made by
        pyspark keeps its names in a per-row ``__dict__``; a dict per input row was
        most of the adapter's cost (its allocation and the garbage collector's
        scans of it). Rows of these classes are Rows (``isinstance``, ``row["v"]``,
        ``row.v``, ``asDict``) with no dict of their own."""
        cls = self._row_classes.get(fields)
        if cls is None:
            cls = type("Row", (self._Row,), {"__slots__": (), "__fields__": list(fields)})
            self._row_classes[fields] = cls
        return cls

    def _check_key(self, key: Any) -> None:
        if key.__class__ is float and key != key:
            raise NaNKeyError(f"{self.where()}: a key is NaN")

    def _group_frames(self, records: Any) -> Iterable[Tuple[Any, List[Any]]]:
        """One pandas DataFrame per key (its rows in arrival order), in an iterator as Spark passes it."""
        import pandas as pd

        column = self.key_column
        if isinstance(records, (pa.RecordBatch, pa.Table)) and self.time_mode != "EventTime":
            if column is not None and column in records.schema.names:
                keys = records.column(column).to_pylist()
                order = _order(keys)
                if order is not None:  # sorted in Arrow, converted once
                    return _cut(records.take(pa.array(order[0], type=pa.int64())).to_pandas(), *order[1:])
            else:
                keys = [self.key_selector(r) for r in records.to_pylist()]
            df = records.to_pandas()
        else:
            rows = records.to_pylist() if isinstance(records, (pa.RecordBatch, pa.Table)) else list(records)
            if self.time_mode == "EventTime":
                rows = self._late(rows)
            if not rows:
                return []
            first = rows[0]
            fields = tuple(first) if first.__class__ is dict else ()
            if column in fields and all(map(fields.__eq__, map(_shape, rows))):
                keys = list(map(itemgetter(column), rows))
                order = _order(keys)
                if order is not None:
                    # Dicts of one shape: sorted, then a column list per field (what
                    # from_records infers, without its per-dict pass).
                    df = pd.DataFrame({f: list(map(itemgetter(f), rows)) for f in fields})
                    return _cut(df.take(order[0]), *order[1:])
            else:
                keys = [self.key_selector(r) for r in rows]
            df = pd.DataFrame.from_records([r if isinstance(r, dict) else r.asDict() for r in rows])
        if len(keys) >= 64 and set(map(type, keys)) <= _FACTORIZABLE:
            return _frames_by_key(df, keys)
        positions: Dict[Any, List[int]] = {}
        for i, key in enumerate(keys):
            bucket = positions.get(key)
            if bucket is None:
                self._check_key(key)
                positions[key] = [i]
            else:
                bucket.append(i)
        if len(positions) == 1:
            ((key, _),) = positions.items()
            return [(key, [df.reset_index(drop=True)])]
        return [(key, [df.take(idx).reset_index(drop=True)]) for key, idx in positions.items()]

    # -- timers --------------------------------------------------------------------------------

    def _fire(self, queue: Any, upto: int, out: List[Any]) -> None:
        """Fires ``queue``'s timers up to ``upto``, after the data (Spark's order)."""
        tv = self._timer_values()
        fn, info = self.processor.handleExpiredTimer, self._ExpiredTimerInfo
        backend = self.backend
        take = self._take if self.flavour == "row" else _extend
        try:
            for key, ts in queue.due(upto):
                self._firing, self._firing_key = ts, key
                produced = fn(key if key.__class__ is tuple else (key,), tv, info(ts))
                if produced is not None:  # consumed while the timer counts as firing
                    take(produced, out)
                self._firing = self._firing_key = None
                if backend.current_key != key:
                    backend.set_current_key(key)
        except NonRetryableError:
            raise
        except Exception as exc:
            raise self._wrap(exc, "handleExpiredTimer") from exc
        finally:
            self._firing = self._firing_key = None

    def process_watermark(self, watermark: int) -> Any:
        if watermark <= self.current_watermark:
            return []
        out: List[Any] = []
        # Spark moves its watermark between micro-batches: the rows gathered so far are
        # a batch under the watermark they came with, then the new one fires timers.
        self._flush_into(out)
        if watermark >= MAX_WATERMARK and self.time_mode == "EventTime":
            # The end of a bounded input: every timer still pending fires, but Spark never
            # shows a watermark of Long.MAX (a processor re-arming a timer at the watermark
            # plus a delay would overflow). The final watermark is the latest pending
            # timer's time: the ones pending fire, a timer set later while they fire stays
            # pending, as on Spark when a query ends, and nothing fires without end.
            last = self._timers.event.last_time() if self._timers is not None else None
            current = self.spark_watermark()
            self._final_watermark = current if last is None else max(last, current)
        self.current_watermark = watermark
        if self._timers is not None:
            self._timers.current_watermark = watermark
            if self.time_mode == "EventTime":
                self.batch_ts = self.clock()
                self._fire(self._timers.event, self.spark_watermark(), out)
        return self._output(out)

    def next_processing_time(self) -> Optional[int]:
        due = self._pending_due
        if self._timers is not None and self.time_mode == "ProcessingTime":
            timer = self._timers.next_processing_time()
            if timer is not None and (due is None or timer < due):
                due = timer
        return due

    def on_processing_time(self, now_ms: int) -> Any:
        out: List[Any] = []
        if self._pending:  # a timer or the rows' deadline is due: the batch so far, then its timers
            self._flush_into(out)
        if self._timers is not None and self.time_mode == "ProcessingTime":
            self.batch_ts = self.clock()  # with no rows gathered: Spark's no-data batch
            self._fire(self._timers.processing, max(now_ms, self.batch_ts), out)
        return self._output(out)

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        if self._pending:  # never silently: a row gathered here would be in no checkpoint
            raise RuntimeError(
                f"{self.where()}: a snapshot with {self._pending_rows} rows of a micro-batch gathered; "
                "prepare_snapshot_pre_barrier hands them to the processor before every checkpoint"
            )
        self._save_watermark()
        # Every subtask records the same names (its processor declared them): a union
        # list state, so each subtask restores them whatever the new parallelism.
        schemas = self.operator_state.get_union_list_state(_SCHEMAS_STATE)  # type: ignore[union-attr]
        recorded = {**self.restored_schemas, **self.state_schemas}
        schemas.update([[name, recorded[name]] for name in sorted(recorded)])
        return super().snapshot(checkpoint_id, location)


_FACTORIZABLE = {int, str}
_shape = tuple  # a dict record's fields, in order


def _concat(buffers: List[Any]) -> Any:
    """The buffers of one micro-batch as one: Arrow batches of one schema as a Table
    (no copy), lists of records as one list, anything mixed as records."""
    if len(buffers) == 1:
        return buffers[0]
    if all(isinstance(b, pa.RecordBatch) for b in buffers):
        schema = buffers[0].schema
        if all(b.schema.equals(schema) for b in buffers):
            return pa.Table.from_batches(buffers, schema=schema)
    rows: List[Any] = []
    for b in buffers:
        rows.extend(b.to_pylist() if isinstance(b, (pa.RecordBatch, pa.Table)) else b)
    return rows


def _extend(produced: Iterable[Any], out: List[Any]) -> None:
    out.extend(produced)
