"""The job API: ``StreamEnvironment`` and the stream builder users write jobs with.

A pipeline is cut into vertices at exchanges (``key_by``, ``rebalance``,
``broadcast``); operators between two exchanges are chained into one task.
Operators are created per subtask and per attempt from factories, so a restart
never sees state a failed attempt left in memory."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union, overload

from .agg import Aggregation
from .connectors.base import Sink, Source, check_columns
from .connectors.collection import CollectionSource, GeneratorSource
from .connectors.files import FileSource, MonitoredFileSource
from .coordinator import CheckpointConfig
from .errors import JobFailedError, KeySelectorError, NonRetryableError, UnhashableKeyError, suggest_keywords
from .joins import IntervalJoin, JoinedStreams
from .monitoring.config import Monitoring
from .monitoring.console import checkpoint_summary_html
from .runners.result import JobResult
from .runtime.aggregate import AggregateOperator, check_aggregate
from .runtime.broadcast import (
    BroadcastProcessFunction,
    BroadcastProcessOperator,
    KeyedBroadcastProcessFunction,
    KeyedBroadcastProcessOperator,
    check_broadcast_descriptors,
    overrides_broadcast_on_timer,
)
from .runtime.copies import per_subtask
from .runtime.operators import (
    CoProcessFunction,
    FilterOperator,
    FlatMapOperator,
    KeyedCoProcessFunction,
    KeyedCoProcessOperator,
    KeyedProcessFunction,
    KeyedProcessOperator,
    MapBatchesOperator,
    MapOperator,
    Operator,
    OutputTag,
    ProcessFunction,
    ProcessOperator,
    TimestampsAndWatermarksOperator,
    UserFunctionError,
    key_selector,
    overrides_co_on_timer,
    overrides_on_timer,
)
from .runtime.sources import SourceOperator
from .runtime.task import EventTimeStatistics, SinkOperator, event_time_statistics
from .state.descriptors import MapStateDescriptor
from .state.keygroups import check_parallelism
from .time.strategy import TimestampAssigner, WatermarkStrategy
from .windows import WindowAssigner, WindowedStream

if TYPE_CHECKING:
    import pyarrow.fs

__all__ = [
    "BroadcastConnectedStream",
    "BroadcastStream",
    "ConnectedStreams",
    "DataStream",
    "Edge",
    "JobClient",
    "JobGraph",
    "KeyedStream",
    "StreamEnvironment",
]

BACKENDS = ("heap", "incremental")
# How the embedded runner runs subtasks: threads of this process (one GIL: vectorised jobs),
# or worker processes on this machine (per-record Python work on every core).
EXECUTORS = ("threads", "processes")


DEFAULT_BUFFER_SIZE = 1024  # records per buffer of Python records
DEFAULT_CHANNEL_CAPACITY = 8  # buffers per channel (threads; worker processes choose their own)
BATCH_BYTES = 256 * 1024  # the slice of a columnar source, when buffer_size is left to choose


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if type(value) is bool or not isinstance(value, int):
        raise TypeError(f"StreamEnvironment {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"StreamEnvironment {name} must be >= {minimum}, got {value}")


@dataclass(eq=False)
class _Step:
    """A node of the job being built: an operator ("op"), an exchange ("exchange":
    key_by, rebalance, broadcast), a union of streams ("union"), or the side output
    of an operator ("side"). ``inputs`` are the nodes it reads (two for a connect)."""

    kind: str  # "op", "exchange", "union" or "side"
    name: str
    factory: Optional[Callable[[str, str, bool], Operator]] = None
    exchange: str = "forward"
    key: Optional[Callable[[Any], Any]] = None
    uid: Optional[str] = None
    event_time: bool = False  # this step needs watermarks (a strategy, a window, timers)
    inputs: List[_Step] = field(default_factory=list)
    tag: Optional[OutputTag] = None  # a "side" node's tag
    sink: Optional[Sink] = None  # a sink_to's sink
    source: Optional[Source] = None  # a source's
    named: bool = False  # name(...) set its name: not renamed to be unique
    seq: int = 0  # creation order (inputs come first), so builds are deterministic
    schema: Any = None  # the records' pyarrow.Schema while a step keeps it known
    # Where a record's event time is (a TimestampAssigner), once a strategy or a
    # window gave the stream timestamps. Records carry no timestamp of their own:
    # time-aware operators downstream read it with this, so it must still find its
    # column or field after a map (or assign timestamps again after the map).
    timestamps: Optional[TimestampAssigner] = None
    effective_uid: str = ""  # the uid its state goes by, set when a graph is built
    # False for an operator that never sends to a side output (map, filter, a sink...):
    # get_side_output on it is refused rather than read as an empty stream
    side_outputs: bool = True
    # Keeps broadcast state (a broadcast_process): an unaligned checkpoint of it restores
    # only at the parallelism it was taken at (LocalRunner._check_restore says why)
    broadcast_state: bool = False


@dataclass(eq=False)
class Edge:
    """An edge of the job graph into a vertex: records of vertex ``source``'s last
    operator (its side output ``tag``, or its main output when None), partitioned by
    ``exchange`` (``key_selector`` for "hash"), into input ``input`` of the vertex's
    head operator (1 only for a connect's second stream)."""

    source: int  # index of the producing vertex in JobGraph.vertices
    exchange: str
    key_selector: Optional[Callable[[Any], Any]]
    input: int = 0
    tag: Optional[str] = None


@dataclass
class Vertex:
    name: str
    exchange: str  # how records reach this vertex (its first input edge's)
    key_selector: Optional[Callable[[Any], Any]]
    steps: List[_Step] = field(default_factory=list)
    event_time_interval_ms: Optional[int] = None  # set when the job uses event time
    inputs: List[Edge] = field(default_factory=list)  # none for a source's vertex

    def uids(self) -> List[str]:
        return [s.effective_uid or s.uid or s.name for s in self.steps]

    def create_chain(self, checkpointing: bool) -> List[Operator]:
        out = []
        for step, uid in zip(self.steps, self.uids(), strict=True):
            assert step.factory is not None
            op = step.factory(uid, step.name, checkpointing)
            op.event_time_interval_ms = self.event_time_interval_ms  # type: ignore[attr-defined]
            out.append(op)
        return out


def _resolve(
    node: _Step, exchange: Optional[str] = None, key: Optional[Callable[[Any], Any]] = None
) -> List[Tuple[_Step, Optional[str], str, Optional[Callable[[Any], Any]]]]:
    """Where a node's records come from: (operator, side output tag or None, exchange,
    key), through exchanges (the one nearest the consumer wins, as when a line had
    two in a row) and unions."""
    if node.kind == "exchange":
        if exchange is None:
            exchange, key = node.exchange, node.key
        return _resolve(node.inputs[0], exchange, key)
    if node.kind == "union":
        return [edge for i in node.inputs for edge in _resolve(i, exchange, key)]
    if node.kind == "side":
        assert node.tag is not None
        return [(node.inputs[0], node.tag.name, exchange or "forward", key)]
    return [(node, None, exchange or "forward", key)]


class JobGraph:
    """The job as vertices (chains of operators run by one task per subtask) joined by
    edges: a DAG from any number of sources to any number of sinks. An operator is
    chained to the one before it when it is that one's only consumer, reads it without
    an exchange and has one input; anything else (an exchange, a union, a connect, a
    fan-out, a side output) starts a vertex with an edge per input."""

    def __init__(
        self,
        sinks: List[_Step],
        sources: Optional[List[Source]] = None,
        auto_watermark_interval_ms: int = 200,
    ) -> None:
        reachable: Dict[int, _Step] = {}
        todo = list(sinks)
        while todo:
            node = todo.pop()
            if id(node) not in reachable:
                reachable[id(node)] = node
                todo.extend(node.inputs)
        nodes = sorted(reachable.values(), key=lambda n: n.seq)
        ops = [n for n in nodes if n.kind == "op"]
        self.sinks: List[Sink] = [n.sink for n in sorted(sinks, key=lambda n: n.seq) if n.sink is not None]
        used = [n.source for n in ops if n.source is not None]
        if sources is None:
            self.sources: List[Source] = used
        else:  # prepared by the runner when a run starts: the ones this graph reads
            self.sources = [s for s in sources if any(s is u for u in used)]
        self.event_time = any(n.event_time for n in ops)
        resolved = {id(n): [_resolve(i) for i in n.inputs] for n in ops}
        consumers: Dict[int, int] = {}
        for n in ops:
            for sources_of_input in resolved[id(n)]:
                for producer, _tag, _exchange, _key in sources_of_input:
                    consumers[id(producer)] = consumers.get(id(producer), 0) + 1
        self._assign_uids(ops)
        self.vertices: List[Vertex] = []
        vertex_of: Dict[int, int] = {}
        for n in ops:
            inputs = n.inputs
            if len(inputs) == 1 and inputs[0].kind == "op" and consumers.get(id(inputs[0])) == 1:
                v_index = vertex_of[id(inputs[0])]
                self.vertices[v_index].steps.append(n)
                vertex_of[id(n)] = v_index
                continue
            edges = [
                Edge(vertex_of[id(producer)], exchange, key, which, tag)
                for which, resolved_input in enumerate(resolved[id(n)])
                for producer, tag, exchange, key in resolved_input
            ]
            first = edges[0] if edges else None
            vertex = Vertex(
                f"v{len(self.vertices)}",
                first.exchange if first else "forward",
                first.key_selector if first else None,
                [n],
                inputs=edges,
            )
            vertex_of[id(n)] = len(self.vertices)
            self.vertices.append(vertex)
        if self.event_time:  # every task takes part: watermarks must reach each time-aware operator
            for vertex in self.vertices:
                vertex.event_time_interval_ms = auto_watermark_interval_ms
        uids = [u for v in self.vertices for u in v.uids()]
        duplicates = sorted({u for u in uids if uids.count(u) > 1})
        if duplicates:
            raise ValueError(
                f"operator uids must be unique in a job; repeated: {duplicates}. An operator without .uid(...) "
                "takes its .name(...) as its state's uid: give each of them its own .uid(...)"
            )

    @staticmethod
    def _assign_uids(ops: List[_Step]) -> None:
        """Each operator's state uid: its ``uid(...)``, else its name; a default name
        that an earlier operator already has (two branches' ``map`` at the same depth,
        two ``from_collection``) gets ``-2``, ``-3``... by creation order, so the same
        program always gives the same uids. Names given with ``uid``/``name`` are
        kept as they are (a repeat is refused below)."""
        taken = {n.uid or n.name for n in ops if n.uid is not None or n.named}
        for n in ops:
            if n.uid is not None or n.named:
                n.effective_uid = n.uid or n.name
                continue
            uid, k = n.name, 1
            while uid in taken:
                k += 1
                uid = f"{n.name}-{k}"
            taken.add(uid)
            n.effective_uid = uid

    @property
    def sink(self) -> Sink:
        """The first sink (a job with one sink: its sink)."""
        return self.sinks[0]

    def consumers(self, v_index: int) -> List[Tuple[int, int, Edge]]:
        """The edges out of vertex ``v_index``: (consumer vertex, the edge's position
        among the consumer's inputs, the edge), in a stable order."""
        return [
            (c, k, edge)
            for c, vertex in enumerate(self.vertices)
            for k, edge in enumerate(vertex.inputs)
            if edge.source == v_index
        ]

    def nonlinear_features(self) -> List[str]:
        """What makes this graph more than one line (empty for a line): for runners
        that run lines only."""
        features = []
        if len(self.sinks) > 1:
            features.append("several sinks")
        if sum(1 for v in self.vertices if not v.inputs) > 1:
            features.append("several sources")
        if any(e.tag is not None for v in self.vertices for e in v.inputs):
            features.append("side outputs (get_side_output)")
        if any(e.input == 1 for v in self.vertices for e in v.inputs):
            features.append("connect")
        elif any(len(v.inputs) > 1 for v in self.vertices):
            features.append("union")
        if any(len(self.consumers(i)) > 1 for i in range(len(self.vertices))):
            features.append("a stream continued more than once (fan-out)")
        return features

    def state_uids(self) -> List[str]:
        return [u for v in self.vertices for u in v.uids()] + [f"__channel_state__{v.name}" for v in self.vertices]


@suggest_keywords
class StreamEnvironment:
    """Where a job is built and run; every setting is checked here (an unknown keyword
    too, with the closest known one: ``paralellism=2`` asks "did you mean 'parallelism'?")."""

    def __init__(
        self,
        parallelism: int = 1,
        max_parallelism: int = 128,
        checkpointing: Optional[CheckpointConfig] = None,
        state_backend: str = "heap",
        checkpoint_storage: Optional[str] = None,
        local_recovery: bool = False,
        buffer_size: Optional[int] = None,
        buffer_timeout_ms: int = 100,
        restart_attempts: int = 3,
        restart_delay_ms: int = 0,
        channel_capacity: Optional[int] = None,
        auto_watermark_interval_ms: int = 200,
        monitoring: Optional[Monitoring] = Monitoring(),  # noqa: B008 - frozen, so one default serves all
        executor: str = "threads",
        buffer_debloat: bool = True,
        buffer_debloat_target_ms: int = 1000,
    ) -> None:
        _positive_int("parallelism", parallelism)
        if executor not in EXECUTORS:
            raise ValueError(f"StreamEnvironment executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
        _positive_int("max_parallelism", max_parallelism)
        try:
            check_parallelism(parallelism, max_parallelism)
        except ValueError as exc:
            raise ValueError(f"StreamEnvironment parallelism={parallelism}: {exc}") from None
        if checkpointing is not None and not isinstance(checkpointing, CheckpointConfig):
            raise TypeError(f"StreamEnvironment checkpointing must be a CheckpointConfig, got {checkpointing!r}")
        if state_backend not in BACKENDS:
            raise ValueError(
                f"StreamEnvironment state_backend must be one of {', '.join(BACKENDS)}, got {state_backend!r}"
            )
        if checkpoint_storage is not None and (not isinstance(checkpoint_storage, str) or not checkpoint_storage):
            raise ValueError(f"StreamEnvironment checkpoint_storage must be a URI string, got {checkpoint_storage!r}")
        if buffer_size is not None:
            if isinstance(buffer_size, str):
                raise TypeError(
                    f"StreamEnvironment buffer_size must be an int, or None to let each stream choose "
                    f"(what tune's tables show as 'auto'), got {buffer_size!r}"
                )
            _positive_int("buffer_size", buffer_size)
        _positive_int("buffer_timeout_ms", buffer_timeout_ms, 0)
        _positive_int("restart_attempts", restart_attempts, 0)
        _positive_int("restart_delay_ms", restart_delay_ms, 0)
        if channel_capacity is not None:
            _positive_int("channel_capacity", channel_capacity)
        _positive_int("buffer_debloat_target_ms", buffer_debloat_target_ms)
        _positive_int("auto_watermark_interval_ms", auto_watermark_interval_ms)
        if monitoring is not None and not isinstance(monitoring, Monitoring):
            raise TypeError(f"StreamEnvironment monitoring must be a pyengine.Monitoring or None, got {monitoring!r}")
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.checkpointing = checkpointing
        self.state_backend = state_backend
        self.checkpoint_storage = checkpoint_storage
        self.local_recovery = bool(local_recovery)
        # buffer_size=None chooses per stream: buffers of 1,024 Python records (512 in worker
        # processes, pyengine.runners.processes.WORKER_BUFFER_SIZE), and sources of
        # Arrow batches read in slices of about BATCH_BYTES (a buffer's fixed cost in Python
        # is tens of microseconds per operator: 1,024 rows of two int64 columns spent most
        # of a keyed count's time on it). An explicit buffer_size is used for both.
        # What was left to the engine (None), with the value it chose: a runner that
        # chooses otherwise (worker processes) does so only while nobody set it since.
        self.engine_chosen: Dict[str, int] = {}
        chosen_buffers, chosen_capacity = DEFAULT_BUFFER_SIZE, DEFAULT_CHANNEL_CAPACITY
        if executor == "processes":
            from .runners.processes import WORKER_BUFFER_SIZE, WORKER_CHANNEL_CAPACITY

            chosen_buffers, chosen_capacity = WORKER_BUFFER_SIZE, WORKER_CHANNEL_CAPACITY
        self._buffer_size = chosen_buffers if buffer_size is None else buffer_size
        if buffer_size is None:
            self.engine_chosen["buffer_size"] = chosen_buffers
        self.batch_bytes: Optional[int] = BATCH_BYTES if buffer_size is None else None
        self.buffer_timeout_ms = buffer_timeout_ms
        self.restart_attempts = restart_attempts
        self.restart_delay_ms = restart_delay_ms
        # channel_capacity=None chooses per executor: 8 buffers on threads; worker processes
        # keep fewer records in flight (pyengine.runners.processes.worker_environment).
        self._channel_capacity = chosen_capacity if channel_capacity is None else channel_capacity
        if channel_capacity is None:
            self.engine_chosen["channel_capacity"] = chosen_capacity
        self.auto_watermark_interval_ms = auto_watermark_interval_ms  # how often watermarks are generated
        self.monitoring = monitoring
        self.executor = executor
        # Adaptive buffers (Flink's buffer debloating, on by default here): each output
        # channel keeps about this much of its consumer's time in flight.
        self.buffer_debloat = bool(buffer_debloat)
        self.buffer_debloat_target_ms = buffer_debloat_target_ms
        self._streams: List[DataStream] = []  # each source's stream and each sink_to's
        self._sources: List[Source] = []
        self._seq = 0  # nodes of the job in creation order
        self._local_root: Optional[str] = None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _local_dir(self, vertex: str, subtask: int) -> Optional[str]:
        if not self.local_recovery:
            return None
        if self._local_root is None:
            import tempfile

            self._local_root = tempfile.mkdtemp(prefix="pyengine-local-recovery-")
        return os.path.join(self._local_root, f"{vertex}-{subtask}")

    # -- sources -----------------------------------------------------------------------------

    @suggest_keywords
    def from_source(
        self, source: Source, name: str = "source", *, watermark_strategy: Optional[WatermarkStrategy] = None
    ) -> DataStream:
        """A stream read from ``source``. ``watermark_strategy``: event time, with
        watermarks generated per split (Flink's per-split watermarks; see
        ``pe.WatermarkStrategy``)."""
        if not isinstance(source, Source):
            raise TypeError(f"from_source takes a pyengine Source, got {source!r}")
        strategy = _check_strategy(watermark_strategy, f"{name}: watermark_strategy")
        if any(s is source for s in self._sources):
            raise ValueError(
                f"from_source: this {type(source).__name__} already is a source of the job; continue its stream "
                "more than once instead (each branch gets every record), or make a second source"
            )
        step = _Step(
            "op",
            name,
            lambda uid, n, _c: SourceOperator(uid, n, source, strategy),
            event_time=strategy is not None,
            source=source,
            seq=self._next_seq(),
        )
        stream = DataStream(self, step)
        stream._schema = getattr(source, "schema", None)  # known for Arrow sources: columns checked at build
        if strategy is not None:
            stream._timestamps = strategy.timestamps
            _check_timestamp_column(stream._schema, strategy.timestamps, "watermark_strategy")
        self._streams.append(stream)
        self._sources.append(source)
        return stream

    @suggest_keywords
    def from_collection(
        self,
        records: Iterable[Any],
        name: str = "collection",
        *,
        watermark_strategy: Optional[WatermarkStrategy] = None,
    ) -> DataStream:
        """A list of records, or a ``pyarrow.Table`` (then the stream carries Arrow batches),
        read in its order by one subtask, so each key's records keep that order at any
        parallelism (as Flink's ``fromCollection``; see ``CollectionSource``). A pandas or
        Spark DataFrame is refused, naming the call that takes it."""
        return self.from_source(CollectionSource(records), name, watermark_strategy=watermark_strategy)

    @suggest_keywords
    def read_files(
        self,
        path: str,
        format: str = "parquet",
        columns: Optional[List[str]] = None,
        name: str = "files",
        *,
        watermark_strategy: Optional[WatermarkStrategy] = None,
        monitor_interval_ms: Optional[int] = None,
        filesystem: Optional[pyarrow.fs.FileSystem] = None,
    ) -> DataStream:
        """Files (a directory, a file, or a list of files) as Arrow batches, through
        ``pyarrow.dataset``; replayable by file and row. A file that fails to read
        fails the task naming it, and a restart reads it again from the checkpoint
        (``FileSource``): its rows are never skipped.

        ``monitor_interval_ms``: keep watching the directory, picking up new files
        every that many ms, without end (``MonitoredFileSource``: the files each split
        took are checkpointed, so a restore neither skips nor repeats one).
        ``filesystem``: a ``pyarrow.fs.FileSystem`` to read ``path`` with, where one
        inferred from the path will not do (an object store's own credentials or
        options); it travels to the workers with the job, so it must pickle."""
        if monitor_interval_ms is not None:
            source: Source = MonitoredFileSource(path, format, columns, monitor_interval_ms, filesystem)
        else:
            source = FileSource(path, format, columns, filesystem)
        return self.from_source(source, name, watermark_strategy=watermark_strategy)

    @suggest_keywords
    def from_dataframe(self, df: Any, name: str = "dataframe", path: Optional[str] = None) -> DataStream:
        """A batch Spark DataFrame as a replayable source (``pyengine.spark.DataFrameSource``):
        a plain scan of parquet files is read in place; anything else is written once,
        when the job starts, as parquet under ``path`` (by default ``_sources/`` in the
        job's checkpoint directory, reused by a resumed run and deleted when the job
        finishes), then read by position, so a restore replays exactly."""
        from .spark import DataFrameSource

        taken = sum(1 for s in self._sources if isinstance(s, DataFrameSource))
        return self.from_source(DataFrameSource(df, f"{name}-{taken}" if taken else name, path), name)

    @suggest_keywords
    def from_generator(
        self,
        fn: Callable[[int], Any],
        count: Optional[int] = None,
        rate_per_s: Optional[float] = None,
        name: str = "generator",
        *,
        watermark_strategy: Optional[WatermarkStrategy] = None,
    ) -> DataStream:
        """Records ``fn(0), fn(1), ...`` (deterministic by sequence number, read in
        parallel: see ``GeneratorSource``): ``count`` of them, or without end when
        ``count`` is None (the job then runs until cancelled or stopped with a
        savepoint); at most ``rate_per_s`` per second over all subtasks when given,
        for demos and latency measurements."""
        return self.from_source(GeneratorSource(fn, count, rate_per_s), name, watermark_strategy=watermark_strategy)

    # -- running -----------------------------------------------------------------------------

    def _graph(self) -> JobGraph:
        sinks = [s._node for s in self._streams if s._sink is not None]
        if not sinks:
            raise ValueError("the job has no sink: end the pipeline with .sink_to(...)")
        return JobGraph(sinks, list(self._sources), self.auto_watermark_interval_ms)

    def _check_embedded(self, graph: JobGraph) -> None:
        """The embedded runner runs every subtask as a thread of this process: past a
        few dozen threads per core it makes no progress worth having (parallelism 1024
        on 2 cores made none in minutes), so it refuses, saying why."""
        cores = os.cpu_count() or 1
        threads = self.parallelism * len(graph.vertices)
        limit = max(64, 32 * cores)
        if threads > limit:
            raise ValueError(
                f"parallelism={self.parallelism} needs {threads} subtask threads ({len(graph.vertices)} vertices) "
                f"in this process, more than the embedded runner runs on {cores} core(s) (at most {limit}): "
                "lower parallelism, or run on Spark with execute(runner='spark')"
            )

    @property
    def buffer_size(self) -> int:
        """Records per buffer of Python records (the engine's choice when left as None:
        1,024 on threads, 512 in worker processes)."""
        return self._buffer_size

    @buffer_size.setter
    def buffer_size(self, value: int) -> None:
        self._buffer_size = value
        self.engine_chosen.pop("buffer_size", None)  # set by the user: every runner keeps it

    @property
    def channel_capacity(self) -> int:
        """Buffers per channel (the engine's choice when left as None: 8 on threads, 2 in
        worker processes)."""
        return self._channel_capacity

    @channel_capacity.setter
    def channel_capacity(self, value: int) -> None:
        self._channel_capacity = value
        self.engine_chosen.pop("channel_capacity", None)

    def _runner(self, name: str, restore_from: Optional[str], resume: Any, runner: Any) -> Any:
        if not isinstance(name, str) or not name:
            raise ValueError(f"execute needs a job name, got {name!r}")
        if resume not in ("auto", "never"):
            if not isinstance(resume, str) or not resume:
                raise ValueError(f"resume must be 'auto', 'never' or a checkpoint path, got {resume!r}")
            if restore_from is not None and restore_from != resume:
                raise ValueError("pass either resume=<path> or restore_from=<path>, not both")
            restore_from, resume = resume, "never"
        graph = self._graph()
        if runner == "processes" or (runner == "embedded" and self.executor == "processes"):
            from .runners.processes import ProcessRunner

            runner = ProcessRunner()
        if runner == "embedded":
            from .runners.local import LocalRunner

            self._check_embedded(graph)
            return LocalRunner(graph, self, name, restore_from, resume)
        if runner == "spark":
            from .runners.spark import SparkRunner

            runner = SparkRunner()
        if not hasattr(runner, "job") or isinstance(runner, str):
            raise ValueError(f"runner must be 'embedded', 'processes', 'spark' or a SparkRunner, got {runner!r}")
        if not getattr(runner, "supports_graphs", False):
            from .runners.local import refuse_graph

            refuse_graph(graph, type(runner).__name__)
        if graph.event_time and not getattr(runner, "supports_event_time", False):
            # A runner opts in with supports_event_time once its channels carry watermarks
            # (the Spark runner's Flight channels do: pyengine.runners.flight.encode_event).
            raise ValueError(
                f"this job uses event time (a watermark strategy, a window or timers), which {type(runner).__name__} "
                "does not run: run it embedded (execute(..., runner='embedded')) or on Spark (runner='spark')"
            )
        return runner.job(graph, self, name, restore_from, resume)

    def execute(
        self,
        name: str = "pyengine-job",
        *,
        resume: str = "auto",
        restore_from: Optional[str] = None,
        runner: Any = "embedded",
    ) -> JobResult:
        """Runs the job to its end and returns its ``JobResult``; raises ``JobFailedError``
        (with the result, and the user's exception as its cause) when it fails.

        ``resume``: ``"auto"`` (the default) continues the latest unfinished run of the
        job called ``name`` in this checkpoint storage, as a reused
        ``checkpointLocation`` does in Spark: after a crash or a failure, run the same
        job again (fixed if need be) and it carries on from its latest checkpoint, its
        output exact. It applies when ``checkpoint_storage`` is set, checkpointing is
        on, and the sink keeps its output (not a ``CollectSink``). ``"never"`` starts
        fresh. A path (a checkpoint, a savepoint, a job's checkpoint directory, or a
        storage root that ``name`` picks one job of) restores that; ``restore_from`` is
        the same.

        ``runner``: "embedded" (threads in this process, or worker processes with
        ``StreamEnvironment(executor="processes")``), "processes" (the same as that),
        "spark" (a barrier stage on the active Spark session, or a local one), or a
        ``pe.runners.SparkRunner(spark)``.

        A job with an unbounded source runs until ``JobClient.cancel()`` or
        ``stop_with_savepoint`` (start it with ``execute_async``); Ctrl-C during
        ``execute`` cancels it cleanly (its run is recorded CANCELED, and running the
        job again resumes from its latest checkpoint) and re-raises the interrupt."""
        client = JobClient(self._runner(name, restore_from, resume, runner))
        try:
            return client.wait()
        except KeyboardInterrupt:  # Ctrl-C: stop the job cleanly, then let the interrupt go on
            client.cancel()
            client.wait(60, raise_failure=False)
            raise

    def execute_async(
        self,
        name: str = "pyengine-job",
        *,
        resume: str = "auto",
        restore_from: Optional[str] = None,
        runner: Any = "embedded",
    ) -> JobClient:
        """Starts the job on a background thread; the client triggers savepoints and waits
        (``wait()`` raises ``JobFailedError`` as ``execute`` does)."""
        return JobClient(self._runner(name, restore_from, resume, runner))


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


def _raise_if_failed(result: JobResult) -> JobResult:
    if result.status != "FAILED":
        return result
    cause = result.cause
    user = cause.__cause__ if cause is not None and cause.__cause__ is not None else cause
    # the user's exception, with where it was raised when the runner wrapped it
    # (UserFunctionError, KeySelectorError: their messages name the operator and repeat it)
    what = f"{type(user).__name__}: {user}" if user is not None else "unknown cause"
    if isinstance(cause, UserFunctionError) and user is not cause and str(cause):
        what = str(cause)  # "operator 'x' (subtask 0): KeyError: ..."
    elif isinstance(cause, (KeySelectorError, UnhashableKeyError, NonRetryableError)) and user is not cause:
        # "key_by into 'x': ...", or the engine's own refusal, which names the operator and the way out
        what = f"{type(cause).__name__}: {cause}"
    raise JobFailedError(
        f"job {result.name!r} (run {result.job_id}) failed after {result.restarts} restart(s): {what}",
        result,
        user,
    ) from user


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


class JobClient:
    """A running job: ``trigger_savepoint(dir)``, ``stop_with_savepoint(dir)``, ``wait()``."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self._result: Any = None
        self._error: Optional[BaseException] = None
        # Set when the job's thread is done. Not Thread.is_alive(): a Ctrl-C that lands
        # inside Thread.join can leave a running thread marked stopped (CPython 3.11),
        # and the job would be left running while wait() reported it over.
        self._done = threading.Event()
        runner.start_monitoring()  # before the job's thread, so monitoring_url is there at once
        self._thread = threading.Thread(target=self._run, name=f"job-{runner.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._runner.run()
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    def _wait_running(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._runner.all_running():
            if self._done.is_set():
                raise RuntimeError(f"job {self._runner.name!r} is not running: {self._ended()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {self._runner.name!r} is not running after {timeout_s:g} s")
            time.sleep(0.005)

    def _ended(self) -> str:
        """How the job's run ended, for an error about a job no longer running."""
        if self._error is not None:
            return f"it failed: {type(self._error).__name__}: {self._error}"
        result = self._result
        status = getattr(result, "status", None)
        cause = getattr(result, "cause", None)
        if status == "FAILED" and cause is not None:
            return f"it FAILED: {cause}"
        return f"it ended {status}" if status else "it ended"

    def trigger_savepoint(self, directory: str, timeout_s: float = 600) -> str:
        self._wait_running(timeout_s)
        return str(self._runner.trigger_savepoint(directory, timeout_s))

    def stop_with_savepoint(self, directory: str, timeout_s: float = 600) -> str:
        """Takes a savepoint in ``directory`` and stops the job (status FINISHED); returns
        the savepoint's path, for ``execute(name, resume=path)``. As Flink's synchronous
        savepoint, nothing is output past it: the sources emit nothing after its barrier.
        If it fails, this raises and the job goes on. If ``timeout_s`` passes first, this
        raises TimeoutError and the savepoint goes on: the job stops once it completes."""
        self._wait_running(timeout_s)
        return str(self._runner.stop_with_savepoint(directory, timeout_s))

    @property
    def checkpoints(self) -> Any:
        """The live ``CheckpointStatsTracker`` (None until the job has started)."""
        coordinator = self._runner.coordinator
        return None if coordinator is None else coordinator.stats

    @property
    def restarts(self) -> int:
        """Restarts so far."""
        return int(self._runner.restarts)

    def event_time(self) -> EventTimeStatistics:
        """Event time now, live: each subtask's watermarks and the late records
        dropped so far (``pyengine.runtime.task.EventTimeStatistics``): the embedded
        runner's tasks read directly; on Spark, as the tasks last reported them with
        their poll (about once a second: ``_SparkJob.event_time_statistics``)."""
        reported = getattr(self._runner, "event_time_statistics", None)
        if callable(reported):
            return reported()  # type: ignore[no-any-return]
        return event_time_statistics(list(getattr(self._runner, "_tasks", [])))

    def watermarks(self) -> Dict[str, List[int]]:
        """Each vertex's subtasks' current input watermark (``event_time().watermarks``)."""
        return self.event_time().watermarks

    @property
    def monitoring_url(self) -> Optional[str]:
        """Where the job's monitoring server answers (None when monitoring is off or
        could not listen; ``pyengine.monitoring`` says why)."""
        monitor = self._runner.monitor
        return None if monitor is None else monitor.url

    def _repr_html_(self) -> str:
        stats = self.checkpoints
        if stats is None:
            return f"<p>job <b>{self._runner.name}</b> starting</p>"
        status = "DONE" if self.done() else "RUNNING"
        return checkpoint_summary_html(
            stats, name=self._runner.name, status=status, restarts=self.restarts, url=self.monitoring_url
        )

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Ends the job without a savepoint (an unbounded one runs until this or
        ``stop_with_savepoint``); ``wait()`` then returns its result, status
        ``CANCELED``. What completed checkpoints committed stays; running the job
        again resumes from the latest one."""
        cancel = getattr(self._runner, "cancel", None)
        if cancel is None:
            raise NotImplementedError(f"{type(self._runner).__name__} cannot cancel a job")
        cancel()

    def wait(self, timeout_s: Optional[float] = None, *, raise_failure: bool = True) -> JobResult:
        """The job's result once it ends; raises ``JobFailedError`` if it failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._done.is_set():  # short waits: Ctrl-C reaches the waiting thread
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._done.wait(0.1 if left is None else min(0.1, left))
        if not self._done.is_set():
            raise TimeoutError(f"job {self._runner.name!r} still running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        return _raise_if_failed(self._result) if raise_failure else self._result


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
    ) -> DataStream:
        """Runs a Spark ``StatefulProcessor`` (``pyspark.sql.streaming``) unchanged, as
        Spark's ``transformWithState``: ``Iterator[Row]`` in and out, its value, list
        and map states and its timers pyengine keyed state (checkpointed, rescaled,
        readable with ``pe.state.read_keyed_state``). ``output_schema`` is a
        ``StructType`` or DDL string; the output goes on as Arrow batches of it.
        ``time_mode`` is ``"None"``, ``"ProcessingTime"`` or ``"EventTime"`` (which
        needs the stream's timestamps and watermarks upstream; ``event_time_column``
        names the column to drop late rows by, else the stream's timestamps are
        used). ``initial_state`` (records, a pyarrow Table or a pandas DataFrame,
        keyed like the stream) goes to ``handleInitialState`` on a job's first run
        only. Needs pyspark; see ``pyengine.spark.tws``."""
        from .spark.tws import build

        return build(  # type: ignore[no-any-return]
            self,
            processor,
            output_schema,
            flavour="row",
            time_mode=time_mode,
            event_time_column=event_time_column,
            initial_state=initial_state,
        )

    def transform_with_state_in_pandas(
        self,
        processor: Any,
        output_schema: Any,
        *,
        time_mode: str = "None",
        event_time_column: Optional[str] = None,
        initial_state: Any = None,
    ) -> DataStream:
        """As ``transform_with_state``, for a processor written for Spark's
        ``transformWithStateInPandas``: each key's rows come as an iterator of one
        pandas DataFrame, and it yields DataFrames; ``handleInitialState`` gets one
        DataFrame per key."""
        from .spark.tws import build

        return build(  # type: ignore[no-any-return]
            self,
            processor,
            output_schema,
            flavour="pandas",
            time_mode=time_mode,
            event_time_column=event_time_column,
            initial_state=initial_state,
        )

    def window(self, assigner: WindowAssigner) -> WindowedStream:
        """Windows per key: ``pe.windows.tumbling(size_ms)``, ``sliding(size_ms,
        slide_ms)`` or ``session(gap_ms)``; then ``.aggregate(pe.agg...)`` or
        ``.process(fn)``. Event time needs the stream's timestamps (a
        ``watermark_strategy`` or ``assign_timestamps_and_watermarks`` upstream)."""
        return WindowedStream(self, assigner)
