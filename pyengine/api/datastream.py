"""The stream builders users write jobs with: ``DataStream``, ``KeyedStream``,
``ConnectedStreams``, ``BroadcastStream`` and ``BroadcastConnectedStream`` (Flink's
``api/datastream``). Each call records a step of the job graph and checks its arguments
while the job is built; the operators themselves live in ``pyengine.runtime``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Sequence, Union, overload

from ..agg import Aggregation
from ..connectors.base import Sink, check_columns
from ..joins import IntervalJoin, JoinedStreams
from ..runtime.aggregate import AggregateOperator, check_aggregate
from ..runtime.base import Operator, OutputTag
from ..runtime.broadcast import (
    BroadcastProcessFunction,
    BroadcastProcessOperator,
    KeyedBroadcastProcessFunction,
    KeyedBroadcastProcessOperator,
    check_broadcast_descriptors,
    overrides_broadcast_on_timer,
)
from ..runtime.copies import per_subtask
from ..runtime.keyed import (
    KeyedCoProcessFunction,
    KeyedCoProcessOperator,
    KeyedProcessFunction,
    KeyedProcessOperator,
    key_selector,
    overrides_co_on_timer,
    overrides_on_timer,
)
from ..runtime.process import CoProcessFunction, ProcessFunction, ProcessOperator
from ..runtime.sink_operator import SinkOperator
from ..runtime.stateless import (
    FilterOperator,
    FlatMapOperator,
    MapBatchesOperator,
    MapOperator,
    TimestampsAndWatermarksOperator,
)
from ..state.descriptors import MapStateDescriptor
from ..time.strategy import TimestampAssigner, WatermarkStrategy
from ..windows import WindowAssigner, WindowedStream
from .graph import _Step

if TYPE_CHECKING:
    from .environment import StreamEnvironment


def _check_overrides(fn: Any, base: type, names: Sequence[str]) -> None:
    """Refuses, while the job is built, a function whose class leaves one of
    ``names`` to ``base`` (which raises NotImplementedError per record): a misspelt
    ``process_element`` otherwise failed the running job with an empty
    NotImplementedError, after every restart."""
    import difflib

    cls = type(fn)
    for name in names:
        if getattr(cls, name, None) is getattr(base, name) and name not in getattr(fn, "__dict__", {}):
            own = [m for c in cls.__mro__ if c is not base and c not in base.__mro__ for m in vars(c)]
            close = difflib.get_close_matches(name, own, n=1, cutoff=0.7)
            hint = f" ({cls.__name__} defines {close[0]!r}: rename it to {name!r})" if close else ""
            raise TypeError(
                f"{cls.__name__} does not define {name}(self, value, ctx), which a {base.__name__} runs for "
                f"every record{hint}"
            )


def _named(obj: Any) -> str:
    """An object as a message names it: an instance by its class (a repr with an address
    says nothing to the user who wrote the class)."""
    if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__")):
        return str(getattr(obj, "__qualname__", obj))
    return f"a {type(obj).__qualname__} object"


def _check_strategy(strategy: Any, where: str) -> Optional[WatermarkStrategy]:
    if strategy is None:
        return None
    if not isinstance(strategy, WatermarkStrategy):
        raise TypeError(f"{where} takes a pe.WatermarkStrategy, got {strategy!r}")
    strategy.require_timestamps(where)
    return strategy


def _check_timestamp_column(schema: Any, assigner: Any, where: str) -> None:
    if schema is not None and assigner is not None and isinstance(assigner.column, str):
        check_columns(schema, [assigner.column], f"{where} (timestamp column)")


def _call_of(step: _Step) -> str:
    """The call a user made for ``step``, for messages."""
    name = step.name.split("-", 1)[-1]
    calls = {"hash": "key_by", "sink": "sink_to", "timestamps": "assign_timestamps_and_watermarks"}
    return calls.get(name, name) + "()"


# KeyedStream's methods that a stream must be keyed for (``DataStream.__getattr__``)
_KEYED_ONLY = frozenset(
    {"aggregate", "interval_join", "transform_with_state", "transform_with_state_in_pandas", "window"}
)


class DataStream:
    """A stream at one point of its job's graph: each transformation returns a new
    handle after it. A handle may be continued more than once (fan-out: each branch
    gets every record; records are shared, not copied, so a function must not change
    a record in place), joined with others (``union``, ``connect``), and end in any
    number of sinks (``sink_to``), all committed by the same checkpoints."""

    def __init__(self, env: StreamEnvironment, node: _Step) -> None:
        self._env = env
        self._node = node

    if not TYPE_CHECKING:  # at run time only: a type checker must still flag a misspelt name

        def __getattr__(self, name: str) -> Any:
            """A keyed stream's method called on a stream that is not keyed: says so
            and how to key it, where Python would only say the attribute is missing."""
            if name in _KEYED_ONLY:
                raise AttributeError(
                    f"{name}() is a keyed stream's: key the stream first, stream.key_by(key).{name}(...) "
                    "(key: a field name or a function of the record)"
                )
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def _steps(self) -> List[_Step]:
        """The line of nodes from a source to this one (first inputs), this one last."""
        path = []
        node: Optional[_Step] = self._node
        while node is not None:
            path.append(node)
            node = node.inputs[0] if node.inputs else None
        return path[::-1]

    @property
    def _schema(self) -> Any:
        return self._node.schema

    @_schema.setter
    def _schema(self, schema: Any) -> None:
        self._node.schema = schema

    @property
    def _timestamps(self) -> Optional[TimestampAssigner]:
        return self._node.timestamps

    @_timestamps.setter
    def _timestamps(self, timestamps: Optional[TimestampAssigner]) -> None:
        self._node.timestamps = timestamps

    @property
    def _sink(self) -> Optional[Sink]:
        return self._node.sink

    def _check_open(self, what: str) -> None:
        if self._node.sink is not None:
            raise ValueError(
                f"{what}: this stream is the end of a sink_to(); continue the stream that went into the sink "
                "instead (a stream may be continued more than once: s.sink_to(a); s.map(...).sink_to(b))"
            )

    def _new(self, step: _Step, inputs: List[_Step]) -> _Step:
        step.inputs = inputs
        step.seq = self._env._next_seq()
        return step

    def _then(self, step: _Step) -> DataStream:
        self._check_open(_call_of(step))
        step.schema, step.timestamps = self._node.schema, self._node.timestamps
        return DataStream(self._env, self._new(step, [self._node]))

    def _op(
        self,
        name: str,
        factory: Callable[[str, str, bool], Operator],
        keeps_schema: bool = False,
        *,
        side_outputs: bool = True,
    ) -> DataStream:
        out = self._then(_Step("op", f"{len(self._steps)}-{name}", factory, side_outputs=side_outputs))
        if not keeps_schema:
            out._schema = None
        return out

    def _last_op(self, what: str) -> _Step:
        node: Optional[_Step] = self._node
        while node is not None and node.kind != "op":
            if node.kind == "side":  # the operator before it is the producer's, not this stream's
                raise ValueError(
                    f"{what} names an operator, and a side output has none of its own (naming the operator "
                    "that produces it would rename that one's state): name the producer before "
                    "get_side_output, or the operator you apply to the side output"
                )
            node = node.inputs[0] if len(node.inputs) == 1 else None
        if node is None:
            raise ValueError(f"{what} names an operator: call it right after one (map, process, window, ...)")
        return node

    def uid(self, uid: str) -> DataStream:
        """Names the last operator's state, so checkpoints match it across job versions."""
        if not isinstance(uid, str) or not uid:
            raise ValueError(f"uid must be a non-empty string, got {uid!r}")
        self._last_op(f"uid({uid!r})").uid = uid
        return self

    def name(self, name: str) -> DataStream:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        op = self._last_op(f"name({name!r})")
        op.name = name
        op.named = True
        return self

    def map(self, fn: Callable[[Any], Any]) -> DataStream:
        return self._op("map", lambda uid, n, _c: MapOperator(uid, n, fn), side_outputs=False)

    def filter(self, fn: Callable[[Any], bool]) -> DataStream:
        return self._op("filter", lambda uid, n, _c: FilterOperator(uid, n, fn), keeps_schema=True, side_outputs=False)

    def flat_map(self, fn: Callable[[Any], Iterable[Any]]) -> DataStream:
        return self._op("flat_map", lambda uid, n, _c: FlatMapOperator(uid, n, fn), side_outputs=False)

    def map_batches(self, fn: Callable[[Any], Any]) -> DataStream:
        return self._op("map_batches", lambda uid, n, _c: MapBatchesOperator(uid, n, fn), side_outputs=False)

    def process(self, fn: ProcessFunction) -> DataStream:
        """Runs a ``pe.ProcessFunction`` on every record of this (not keyed) stream:
        ``process_element(value, ctx)`` yields outputs, ``ctx.output(tag, value)``
        sends to a side output (``get_side_output``). Keyed state and timers need
        ``key_by(...).process(pe.KeyedProcessFunction)``."""
        if isinstance(fn, KeyedProcessFunction):
            raise TypeError(
                "process(KeyedProcessFunction) needs a keyed stream: key_by(...).process(fn); "
                "on a stream that is not keyed, use a pe.ProcessFunction"
            )
        if isinstance(fn, type) and issubclass(fn, ProcessFunction):
            raise TypeError(f"process takes an instance of a ProcessFunction: pass {fn.__name__}(), not the class")
        if not isinstance(fn, ProcessFunction):
            raise TypeError(f"process takes a pe.ProcessFunction, got {fn!r}")
        _check_overrides(fn, ProcessFunction, ["process_element"])

        timestamps = self._timestamps
        return self._op("process", lambda uid, n, _c: ProcessOperator(uid, n, per_subtask(fn, n), (timestamps, None)))

    def get_side_output(self, tag: OutputTag) -> DataStream:
        """The records this stream's operator sent to the side output ``tag`` (with
        ``ctx.output(tag, value)``, or a window's ``side_output_late_data(tag)``), as a
        stream of their own (PyFlink's name). Side output nobody asks for is dropped."""
        if not isinstance(tag, OutputTag):
            raise TypeError(f"get_side_output takes a pe.OutputTag, got {tag!r}: make one with pe.OutputTag('name')")
        if self._node.kind != "op" or self._node.source is not None:
            raise ValueError(
                f"get_side_output({tag.name!r}) reads an operator's side output: call it on what process(...) or "
                "window(...)... returned, not on a source, key_by, union or another side output"
            )
        self._check_open(f"get_side_output({tag.name!r})")
        if not self._node.side_outputs:
            raise ValueError(
                f"get_side_output({tag.name!r}): the last step here, {_call_of(self._node)}, sends nothing to a side "
                "output, so this stream would always be empty; call get_side_output on what process(...) (whose "
                "function calls ctx.output) or a window with side_output_late_data returned"
            )
        node = self._new(_Step("side", f"side-{tag.name}", tag=tag), [self._node])
        return DataStream(self._env, node)

    def union(self, *others: DataStream) -> DataStream:
        """One stream of this one's records and ``others``' (fan-in; PyFlink's name):
        records of each input keep their order, the inputs interleave as they come. The
        watermark is the least of the inputs'."""
        if not others:
            raise ValueError("union needs at least one other stream: a.union(b) or a.union(b, c)")
        streams = [self, *others]
        for o in others:
            if not isinstance(o, DataStream):
                hint = " (a KeyedStream: union the streams before key_by)" if isinstance(o, KeyedStream) else ""
                raise TypeError(f"union takes DataStreams, got {o!r}{hint}")
            if o._env is not self._env:
                raise ValueError("union: the streams belong to different StreamEnvironments; build a job in one")
        for st in streams:
            st._check_open("union()")
        node = self._new(_Step("union", "union"), [st._node for st in streams])
        schemas = [st._schema for st in streams]
        node.schema = schemas[0] if all(sc is not None and sc.equals(schemas[0]) for sc in schemas) else None
        stamps = [st._timestamps for st in streams]
        node.timestamps = stamps[0] if all(t == stamps[0] for t in stamps) else None
        return DataStream(self._env, node)

    def join(self, other: DataStream) -> JoinedStreams:
        """A window join (PyFlink's): ``a.join(b).where(k1).equal_to(k2)
        .window(pe.windows.tumbling(...)).apply(fn)`` calls ``fn(left, right)`` for
        every pair of records with equal keys in the same window."""
        return JoinedStreams(self, other)

    @overload
    def connect(self, other: DataStream) -> ConnectedStreams: ...

    @overload
    def connect(self, other: BroadcastStream) -> BroadcastConnectedStream: ...

    def connect(self, other: Union[DataStream, BroadcastStream]) -> Union[ConnectedStreams, BroadcastConnectedStream]:
        """Two streams into one operator with an input for each (PyFlink's name):
        ``.process(pe.CoProcessFunction)``, or ``.key_by(k1, k2).process(
        pe.KeyedCoProcessFunction)`` for keyed state and timers shared by both.
        With a ``BroadcastStream`` (``rules.broadcast(descriptor)``), the broadcast
        state pattern: ``.process(pe.BroadcastProcessFunction)``."""
        if isinstance(other, BroadcastStream):
            return BroadcastConnectedStream(self, other)
        if isinstance(other, KeyedStream):
            raise TypeError(
                "connect: this stream is not keyed and the other is; key both "
                "(a.key_by(k1).connect(b.key_by(k2))) or neither; to send one stream to every subtask with "
                "state, connect its broadcast: a.connect(b.broadcast(pe.MapStateDescriptor(...)))"
            )
        if not isinstance(other, DataStream):
            raise TypeError(f"connect takes a DataStream, got {other!r}")
        return ConnectedStreams(self, other)

    def assign_timestamps_and_watermarks(self, strategy: WatermarkStrategy) -> DataStream:
        """Event time for this stream: each record's timestamp by the strategy's
        assigner, and watermarks generated by each subtask from what it sees (they
        replace any from upstream). Prefer ``watermark_strategy=`` on the source: per
        split, a source's watermarks are more exact than after records interleave."""
        checked = _check_strategy(strategy, "assign_timestamps_and_watermarks")
        assert checked is not None
        _check_timestamp_column(self._schema, checked.timestamps, "assign_timestamps_and_watermarks")
        out = self._op(
            "timestamps",
            lambda uid, n, _c: TimestampsAndWatermarksOperator(uid, n, checked),
            keeps_schema=True,
            side_outputs=False,
        )
        out._steps[-1].event_time = True
        out._timestamps = checked.timestamps
        return out

    def rebalance(self) -> DataStream:
        return self._then(_Step("exchange", "rebalance", exchange="rebalance"))

    @overload
    def broadcast(self) -> DataStream: ...

    @overload
    def broadcast(self, descriptor: MapStateDescriptor, /, *descriptors: MapStateDescriptor) -> BroadcastStream: ...

    def broadcast(self, *descriptors: MapStateDescriptor) -> Union[DataStream, BroadcastStream]:
        """Every record to every subtask of the next operator (PyFlink's name).

        With descriptors (``pe.MapStateDescriptor``), the broadcast state pattern: a
        ``BroadcastStream`` to ``connect`` to a stream (``stream.connect(bs)`` or
        ``keyed.connect(bs)``), whose ``process`` function keeps these broadcast
        states, written by ``process_broadcast_element`` and read by
        ``process_element`` (see ``pe.BroadcastProcessFunction``,
        ``pe.KeyedBroadcastProcessFunction``)."""
        exchange = self._then(_Step("exchange", "broadcast", exchange="broadcast"))
        if not descriptors:
            return exchange
        return BroadcastStream(exchange, check_broadcast_descriptors(descriptors))

    def key_by(self, key: Any) -> KeyedStream:
        if isinstance(key, str):
            check_columns(self._schema, [key], f"key_by({key!r})")
        select = key_selector(key)
        return KeyedStream(self._then(_Step("exchange", "hash", exchange="hash", key=select)), select)

    def sink_to(self, sink: Sink) -> DataStream:
        """Ends this stream in ``sink``. A job may have several sinks (call it on
        several streams, or on one stream several times): every checkpoint commits
        all of them."""
        if not isinstance(sink, Sink):
            raise TypeError(f"sink_to takes a pyengine sink, got {sink!r}")
        if any(st._sink is sink for st in self._env._streams):
            raise ValueError(
                f"sink_to: this {type(sink).__name__} already ends another stream of the job; give each sink_to "
                "a sink of its own (a sink takes one stream: union the streams first to write them to one sink)"
            )
        out = self._op("sink", lambda uid, n, c: SinkOperator(uid, n, sink, c), side_outputs=False)
        out._node.sink = sink
        self._env._streams.append(out)
        return out


class ConnectedStreams:
    """``a.connect(b)``: two streams for one two-input operator. ``process`` takes a
    ``pe.CoProcessFunction`` (neither keyed) or a ``pe.KeyedCoProcessFunction``
    (both keyed: ``a.key_by(k1).connect(b.key_by(k2))``, or ``.key_by(k1, k2)``
    here). Both inputs go into one task's one input gate, so a checkpoint's
    barriers align across both (or overtake both, unaligned)."""

    def __init__(self, first: Union[DataStream, KeyedStream], second: Union[DataStream, KeyedStream]) -> None:
        self._first: Any = first
        self._second: Any = second

    def key_by(self, key1: Any, key2: Any) -> ConnectedStreams:
        """Keys both streams (PyFlink's name): ``key1`` the first's, ``key2`` the second's."""
        if isinstance(self._first, KeyedStream) or isinstance(self._second, KeyedStream):
            raise ValueError("key_by: these connected streams are keyed already")
        return ConnectedStreams(self._first.key_by(key1), self._second.key_by(key2))

    def process(self, fn: Union[CoProcessFunction, KeyedCoProcessFunction]) -> DataStream:
        """Runs ``fn`` with an input for each stream: ``process_element1`` gets the
        first's records, ``process_element2`` the second's."""

        first, second = self._first, self._second
        keyed = isinstance(first, KeyedStream)
        a: DataStream = first._stream if keyed else first
        b: DataStream = second._stream if keyed else second
        if a._env is not b._env:
            raise ValueError("connect: the streams belong to different StreamEnvironments; build a job in one")
        a._check_open("connect()")
        b._check_open("connect()")
        stamps = (a._timestamps, b._timestamps)
        if keyed:
            if not isinstance(fn, KeyedCoProcessFunction):
                raise TypeError(
                    f"process on keyed connected streams takes a pe.KeyedCoProcessFunction, got {fn!r}"
                    + (
                        " (a CoProcessFunction has no keyed state: connect streams that are not keyed)"
                        if isinstance(fn, CoProcessFunction)
                        else ""
                    )
                )
            _check_overrides(fn, KeyedCoProcessFunction, ["process_element1", "process_element2"])
            selectors = (first._select, second._select)

            def factory(uid: str, n: str, _c: bool) -> Operator:
                return KeyedCoProcessOperator(uid, n, selectors, per_subtask(fn, n), stamps)

            event_time = overrides_co_on_timer(fn)
        else:
            if not isinstance(fn, CoProcessFunction):
                raise TypeError(
                    f"process on connected streams takes a pe.CoProcessFunction, got {_named(fn)}"
                    + (
                        " (for keyed state, key both: a.key_by(k1).connect(b.key_by(k2)))"
                        if isinstance(fn, KeyedCoProcessFunction)
                        else ""
                    )
                )
            _check_overrides(fn, CoProcessFunction, ["process_element1", "process_element2"])

            def factory(uid: str, n: str, _c: bool) -> Operator:
                return ProcessOperator(uid, n, per_subtask(fn, n), stamps)

            event_time = False
        step = _Step("op", f"{len(a._steps)}-co_process", factory, event_time=event_time)
        node = a._new(step, [first._stream._node if keyed else a._node, second._stream._node if keyed else b._node])
        return DataStream(a._env, node)


class BroadcastStream:
    """``stream.broadcast(descriptor, ...)``: a stream whose every record goes to
    every subtask of the operator it is connected to, with the broadcast states those
    descriptors name (PyFlink's ``BroadcastStream``). It is only connected:
    ``other.connect(bs)`` or ``keyed.connect(bs)``, then ``.process(fn)``. One
    broadcast stream may be connected to several streams."""

    def __init__(self, stream: DataStream, descriptors: Sequence[MapStateDescriptor]) -> None:
        self._stream = stream
        self.descriptors: List[MapStateDescriptor] = list(descriptors)

    def __repr__(self) -> str:
        return f"BroadcastStream({', '.join(repr(d.name) for d in self.descriptors)})"


class BroadcastConnectedStream:
    """A stream (keyed or not) connected to a ``BroadcastStream`` (PyFlink's
    ``BroadcastConnectedStream``). ``process`` takes a ``pe.BroadcastProcessFunction``
    when the stream is not keyed, a ``pe.KeyedBroadcastProcessFunction`` when it is.
    The operator reads both through one input gate, so a checkpoint's barriers align
    across the broadcast input too; its broadcast state is checkpointed by every
    subtask, and a restore at any parallelism gives each new subtask a copy (from an
    unaligned checkpoint, only at the parallelism it was taken at: see the graphs
    guide)."""

    def __init__(self, first: Union[DataStream, KeyedStream], broadcast: BroadcastStream) -> None:
        self._first: Any = first
        self._broadcast = broadcast

    def process(self, fn: Union[BroadcastProcessFunction, KeyedBroadcastProcessFunction]) -> DataStream:
        """Runs ``fn``: ``process_element`` gets the stream's records,
        ``process_broadcast_element`` every broadcast record (on every subtask)."""

        first, bs = self._first, self._broadcast
        keyed = isinstance(first, KeyedStream)
        a: DataStream = first._stream if keyed else first
        b: DataStream = bs._stream
        if a._env is not b._env:
            raise ValueError("connect: the streams belong to different StreamEnvironments; build a job in one")
        a._check_open("connect()")
        descriptors = list(bs.descriptors)
        stamps = (a._timestamps, b._timestamps)
        if keyed:
            if not isinstance(fn, KeyedBroadcastProcessFunction):
                raise TypeError(
                    f"process on a keyed stream connected to a broadcast stream takes a "
                    f"pe.KeyedBroadcastProcessFunction, got {fn!r}"
                    + (
                        " (a BroadcastProcessFunction has no keyed state: connect a stream that is not keyed)"
                        if isinstance(fn, BroadcastProcessFunction)
                        else ""
                    )
                )
            _check_overrides(fn, KeyedBroadcastProcessFunction, ["process_element", "process_broadcast_element"])
            select = first._select

            def factory(uid: str, n: str, _c: bool) -> Operator:
                return KeyedBroadcastProcessOperator(uid, n, select, per_subtask(fn, n), descriptors, stamps)

            event_time = overrides_broadcast_on_timer(fn)
        else:
            if not isinstance(fn, BroadcastProcessFunction):
                raise TypeError(
                    f"process on a stream connected to a broadcast stream takes a pe.BroadcastProcessFunction, "
                    f"got {fn!r}"
                    + (
                        " (for keyed state and timers, key the stream first: "
                        "stream.key_by(k).connect(rules.broadcast(descriptor)))"
                        if isinstance(fn, KeyedBroadcastProcessFunction)
                        else ""
                    )
                )
            _check_overrides(fn, BroadcastProcessFunction, ["process_element", "process_broadcast_element"])

            def factory(uid: str, n: str, _c: bool) -> Operator:
                return BroadcastProcessOperator(uid, n, per_subtask(fn, n), descriptors, stamps)

            event_time = False
        step = _Step("op", f"{len(a._steps)}-broadcast_process", factory, event_time=event_time, broadcast_state=True)
        node = a._new(step, [first._stream._node if keyed else a._node, b._node])
        return DataStream(a._env, node)


class KeyedStream:
    def __init__(self, stream: DataStream, select: Callable[[Any], Any]) -> None:
        self._stream = stream
        self._select = select

    def aggregate(self, *aggregations: Aggregation, emit: str = "updates") -> DataStream:
        """Keyed count / sum / min / max / mean on whole Arrow batches (``pe.agg``).

        ``emit="updates"`` (the default): per input batch, one row per key it touched
        with that key's totals so far and ``_seq`` (int64), which grows from each row
        of a key to the next, across failures and rescaling (not 1, 2, 3: see
        ``pyengine.runtime.aggregate``): the row with the largest ``_seq`` is the key's
        final value. To collapse such an output in Spark::

            from pyspark.sql import Window, functions as F
            latest = Window.partitionBy("k").orderBy(F.col("_seq").desc())
            final = updates.withColumn("_r", F.row_number().over(latest)).filter("_r = 1").drop("_r", "_seq")

        ``emit="final"``: one row per key with its totals, at the end of (bounded)
        input, exactly once across failures; no ``_seq``.

        Columns are checked now when the stream's schema is known (Arrow sources, up
        to a ``map``): a missing one raises ``ColumnNotFoundError``."""
        column = getattr(self._select, "column", None)
        if not isinstance(column, str):
            raise TypeError("aggregate needs the stream keyed by a column name: key_by('column'), not a function")
        if not aggregations:
            raise ValueError("aggregate needs at least one aggregation, e.g. pe.agg.count()")
        for a in aggregations:
            if not isinstance(a, Aggregation):
                raise TypeError(f"aggregate takes pe.agg aggregations, got {a!r}")
        outputs = [a.output for a in aggregations]
        clashes = sorted({o for o in outputs if outputs.count(o) > 1 or o == column})
        if clashes:
            raise ValueError(f"aggregate output columns must be unique and differ from the key; repeated: {clashes}")
        aggs = list(aggregations)
        check_aggregate(self._stream._schema, column, aggs, emit)
        return self._stream._op(
            "aggregate", lambda uid, n, _c: AggregateOperator(uid, n, column, aggs, emit), side_outputs=False
        )

    @overload
    def connect(self, other: KeyedStream) -> ConnectedStreams: ...

    @overload
    def connect(self, other: BroadcastStream) -> BroadcastConnectedStream: ...

    def connect(self, other: Union[KeyedStream, BroadcastStream]) -> Union[ConnectedStreams, BroadcastConnectedStream]:
        """This keyed stream and ``other`` (keyed too, into the same key space) for
        one ``pe.KeyedCoProcessFunction``: records of either side with equal keys
        meet the same keyed state and timers (PyFlink's ``connect``). With a
        ``BroadcastStream`` (``rules.broadcast(descriptor)``), the broadcast state
        pattern: ``.process(pe.KeyedBroadcastProcessFunction)``."""
        if isinstance(other, BroadcastStream):
            return BroadcastConnectedStream(self, other)
        if not isinstance(other, KeyedStream):
            raise TypeError(
                f"connect on a keyed stream takes a keyed stream (other.key_by(...)) or a broadcast stream "
                f"(other.broadcast(pe.MapStateDescriptor(...))), got {other!r}"
            )
        return ConnectedStreams(self, other)

    def interval_join(self, other: KeyedStream) -> IntervalJoin:
        """An interval join (PyFlink's): ``a.key_by(k).interval_join(b.key_by(k))
        .between(lower_ms, upper_ms).process(fn)`` pairs each record of ``a`` with the
        records of ``b`` of the same key whose timestamps lie in
        ``[a.ts + lower_ms, a.ts + upper_ms]``; event time on both sides."""
        return IntervalJoin(self, other)

    def process(self, fn: KeyedProcessFunction) -> DataStream:
        if isinstance(fn, type) and issubclass(fn, KeyedProcessFunction):
            raise TypeError(f"process takes an instance of a KeyedProcessFunction: pass {fn.__name__}(), not the class")
        if not isinstance(fn, KeyedProcessFunction):
            raise TypeError(f"process takes a pyengine.KeyedProcessFunction, got {fn!r}")
        _check_overrides(fn, KeyedProcessFunction, ["process_element"])

        select = self._select
        timestamps = self._stream._timestamps
        stream = self._stream._op(
            "process", lambda uid, n, _c: KeyedProcessOperator(uid, n, select, per_subtask(fn, n), timestamps)
        )
        stream._steps[-1].event_time = overrides_on_timer(fn)
        return stream

    def transform_with_state(
        self,
        processor: Any,
        output_schema: Any,
        *,
        time_mode: str = "None",
        event_time_column: Optional[str] = None,
        initial_state: Any = None,
        micro_batch: bool = True,
    ) -> DataStream:
        """Runs a Spark ``StatefulProcessor`` (``pyspark.sql.streaming``) unchanged, as
        Spark's ``transformWithState``: ``Iterator[Row]`` in and out, its value, list
        and map states and its timers pyengine keyed state (checkpointed, rescaled,
        readable with ``pe.state.read_keyed_state``). ``output_schema`` is a
        ``StructType`` or DDL string; the output goes on as Arrow batches of it.
        ``time_mode`` is ``"None"``, ``"ProcessingTime"`` or ``"EventTime"`` (which
        needs the stream's timestamps and watermarks upstream, by which late rows are
        dropped; ``event_time_column`` is Spark's ``eventTimeColumnName``: the output
        column whose values are the output rows' event time downstream).
        ``initial_state`` (records, a pyarrow Table or a pandas DataFrame,
        keyed like the stream) goes to ``handleInitialState`` on a job's first run
        only. ``micro_batch`` (on by default) keeps Spark's micro-batches: each key's
        rows of one batch (up to a checkpoint, a watermark, a due timer, the end of
        input, or a second after they came) in one call, timers between batches;
        off, a call per key per input buffer. Needs pyspark; see ``pyengine.spark.tws``."""
        from ..spark.tws_build import build

        return build(  # type: ignore[no-any-return]
            self,
            processor,
            output_schema,
            flavour="row",
            time_mode=time_mode,
            event_time_column=event_time_column,
            initial_state=initial_state,
            micro_batch=micro_batch,
        )

    def transform_with_state_in_pandas(
        self,
        processor: Any,
        output_schema: Any,
        *,
        time_mode: str = "None",
        event_time_column: Optional[str] = None,
        initial_state: Any = None,
        micro_batch: bool = True,
    ) -> DataStream:
        """As ``transform_with_state``, for a processor written for Spark's
        ``transformWithStateInPandas``: each key's rows come as an iterator of one
        pandas DataFrame, and it yields DataFrames; ``handleInitialState`` gets one
        DataFrame per key."""
        from ..spark.tws_build import build

        return build(  # type: ignore[no-any-return]
            self,
            processor,
            output_schema,
            flavour="pandas",
            time_mode=time_mode,
            event_time_column=event_time_column,
            initial_state=initial_state,
            micro_batch=micro_batch,
        )

    def window(self, assigner: WindowAssigner) -> WindowedStream:
        """Windows per key: ``pe.windows.tumbling(size_ms)``, ``sliding(size_ms,
        slide_ms)`` or ``session(gap_ms)``; then ``.aggregate(pe.agg...)`` or
        ``.process(fn)``. Event time needs the stream's timestamps (a
        ``watermark_strategy`` or ``assign_timestamps_and_watermarks`` upstream)."""
        return WindowedStream(self, assigner)
