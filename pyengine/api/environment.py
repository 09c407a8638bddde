"""``StreamEnvironment``: where a job is built and run (Flink's
``StreamExecutionEnvironment``), with its settings, its source builders
(``from_collection``, ``from_source``, ``read_text_file``, ...) and ``execute``. The
streams it returns are built in ``pyengine.api.datastream``; the graph they compile to is
``pyengine.api.graph``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional

from ..connectors.base import Source
from ..connectors.collection import CollectionSource, GeneratorSource
from ..connectors.files import FileSource, MonitoredFileSource
from ..coordinator import CheckpointConfig
from ..errors import suggest_keywords
from ..monitoring.config import Monitoring
from ..runners.result import JobResult
from ..runtime.sources import SourceOperator
from ..state.keygroups import check_parallelism
from ..time.strategy import WatermarkStrategy
from .client import JobClient
from .datastream import DataStream, _check_strategy, _check_timestamp_column
from .graph import JobGraph, _Step

if TYPE_CHECKING:
    import pyarrow.fs

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
            from ..runners.processes import WORKER_BUFFER_SIZE, WORKER_CHANNEL_CAPACITY

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
        from ..spark import DataFrameSource

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
            from ..runners.processes import ProcessRunner

            runner = ProcessRunner()
        if runner == "embedded":
            from ..runners.local import LocalRunner

            self._check_embedded(graph)
            return LocalRunner(graph, self, name, restore_from, resume)
        if runner == "spark":
            from ..runners.spark import SparkRunner

            runner = SparkRunner()
        if not hasattr(runner, "job") or isinstance(runner, str):
            raise ValueError(f"runner must be 'embedded', 'processes', 'spark' or a SparkRunner, got {runner!r}")
        if not getattr(runner, "supports_graphs", False):
            from ..runners.local import refuse_graph

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
