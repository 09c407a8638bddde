"""Helpers for testing code built on pyengine; shipped as public API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from .io.events import CheckpointBarrier, CheckpointFailureReason, CheckpointMetrics

if TYPE_CHECKING:
    from .tune import Measurement, Setting

__all__ = ["JobBenchmark", "ManualClock", "RecordingListener", "pyengine_benchmark"]


@dataclass
class RecordingListener:
    """A gate listener that remembers every call, in order.

    ``log`` holds one tuple per call: ``("trigger", checkpoint_id)``,
    ``("abort", checkpoint_id, reason)``, ``("input", checkpoint_id, channel,
    buffer)`` or ``("finish", checkpoint_id)``; the other attributes give the
    same calls by kind.
    """

    log: List[Tuple[Any, ...]] = field(default_factory=list)
    triggered: List[Tuple[CheckpointBarrier, CheckpointMetrics]] = field(default_factory=list)
    aborted: List[Tuple[int, CheckpointFailureReason]] = field(default_factory=list)
    in_flight: Dict[int, List[Tuple[int, Any]]] = field(default_factory=dict)
    finished: List[int] = field(default_factory=list)

    def trigger_checkpoint_on_barrier(self, barrier: CheckpointBarrier, metrics: CheckpointMetrics) -> None:
        self.triggered.append((barrier, metrics))
        self.log.append(("trigger", barrier.checkpoint_id))

    def abort_checkpoint_on_barrier(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        self.aborted.append((checkpoint_id, reason))
        self.log.append(("abort", checkpoint_id, reason))

    def add_input_data(self, checkpoint_id: int, channel: int, buffer: Any) -> None:
        self.in_flight.setdefault(checkpoint_id, []).append((channel, buffer))
        self.log.append(("input", checkpoint_id, channel, buffer))

    def finish_input(self, checkpoint_id: int) -> None:
        self.finished.append(checkpoint_id)
        self.log.append(("finish", checkpoint_id))

    @property
    def triggered_ids(self) -> List[int]:
        return [barrier.checkpoint_id for barrier, _ in self.triggered]

    @property
    def aborted_ids(self) -> List[int]:
        return [checkpoint_id for checkpoint_id, _ in self.aborted]


class ManualClock:
    """A clock in nanoseconds that only moves when told to, for the gate's
    ``clock`` argument: alignment times and timeouts become exact."""

    def __init__(self, start_ns: int = 1_700_000_000_000_000_000) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, ns: int) -> None:
        self.now_ns += ns

    @property
    def now_ms(self) -> int:
        return self.now_ns // 1_000_000


class JobBenchmark:
    """Benchmarks a whole job in pytest-benchmark's own rounds: each round builds the
    job (``build(env)``, as ``pyengine tune`` takes it) on a fresh environment at
    ``setting`` and runs it to its end, and the round's time is the job's time; so
    ``--benchmark-compare`` between two commits or two settings compares real runs. The
    fastest round's figures go into the benchmark's ``extra_info`` (and so the saved
    JSON): records/s, end-to-end latency p50/p99, checkpoint duration p50/p99, start
    delay, alignment, checkpoint size and in-flight data persisted.

    Use it through the ``pyengine_benchmark`` fixture::

        # conftest.py
        pytest_plugins = ["pyengine.testing"]

        # test_my_job.py
        def test_my_job(pyengine_benchmark):
            m = pyengine_benchmark(build, pe.tune.Setting(buffer_size=16384), rounds=3)
            assert m.throughput > 0

    The job must be bounded (it is timed to its end). ``between`` runs before each round,
    untimed: a baseline measured there is interleaved with the rounds, so a slow spell
    of a shared machine hits both sides of a ratio.

    The first job of a process pays once for what later ones find ready (imports, the
    first allocations of the runtime's pools): 0.6-1.2 s here, which made whichever
    setting a session timed first look several times slower. So the first benchmark
    of a process runs its job once untimed before its rounds (``warm_up``: True always,
    False never, None the first time only).

    The round times (the table's columns) are whole runs, start-up included;
    ``extra_info["records_per_s"]`` counts from the first record read to the end."""

    _warmed = False  # a job has run in this process: later benchmarks need no warm-up

    def __init__(self, benchmark: Any) -> None:
        self.benchmark = benchmark

    def __call__(
        self,
        build: Callable[[Any], Any],
        setting: Optional[Setting] = None,
        *,
        parallelism: int = 2,
        checkpointing: bool = True,
        rounds: int = 3,
        latency_field: Optional[str] = None,
        input_rate_per_s: Optional[float] = None,
        group: Optional[str] = None,
        between: Optional[Callable[[], Any]] = None,
        warm_up: Optional[bool] = None,
    ) -> Measurement:
        from .tune import Setting, measure

        chosen = setting if setting is not None else Setting()
        runs: List[Measurement] = []

        def once() -> None:
            runs.append(
                measure(
                    build,
                    chosen,
                    parallelism=parallelism,
                    checkpointing=checkpointing,
                    latency_field=latency_field,
                    input_rate_per_s=input_rate_per_s,
                )
            )

        def setup() -> None:
            if between is not None:
                between()

        if group is not None:
            self.benchmark.group = group
        if warm_up or (warm_up is None and not JobBenchmark._warmed):
            once()
            runs.clear()
        JobBenchmark._warmed = True
        self.benchmark.pedantic(once, setup=setup, rounds=rounds, iterations=1)
        best = max(runs, key=lambda m: m.throughput)
        info = best.to_json()
        info.pop("notes", None)
        info["records_per_s"] = info.pop("throughput")
        info["checkpointing"] = checkpointing
        self.benchmark.extra_info.update(info)
        return best


try:  # the fixture, for pytest's plugin loader (pytest_plugins = ["pyengine.testing"])
    import pytest
except ImportError:  # pragma: no cover - pytest is a test dependency only
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def pyengine_benchmark(benchmark: Any) -> JobBenchmark:
        """A ``JobBenchmark`` on pytest-benchmark's ``benchmark`` fixture."""
        return JobBenchmark(benchmark)
