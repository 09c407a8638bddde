"""pyengine: Flink-grade, exactly-once checkpointing for Python stream pipelines.

``import pyengine as pe``; then ``pe.StreamEnvironment``, ``pe.CheckpointConfig``,
``pe.KeyedProcessFunction``, ``pe.sinks.FileSink`` and friends; keyed state through
``pe.KeyedContext`` with ``pe.ValueStateDescriptor[int](...)`` and the other typed
descriptors and state classes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time these load on first use
    from . import agg, errors, runners, sinks, spark, state, windows
    from .api import (
        BroadcastConnectedStream,
        BroadcastStream,
        ConnectedStreams,
        DataStream,
        KeyedStream,
        StreamEnvironment,
    )
    from .coordinator.config import CheckpointConfig
    from .errors import JobFailedError
    from .joins import JoinContext, JoinFunction, ProcessJoinFunction
    from .monitoring.config import Monitoring
    from .runtime.base import OutputTag
    from .runtime.broadcast import (
        BroadcastContext,
        BroadcastProcessFunction,
        BroadcastStateError,
        KeyedBroadcastContext,
        KeyedBroadcastProcessFunction,
        KeyedBroadcastReadOnlyContext,
        ReadOnlyBroadcastContext,
        ReadOnlyBroadcastState,
    )
    from .runtime.keyed import KeyedContext, KeyedCoProcessFunction, KeyedProcessFunction
    from .runtime.process import CoProcessFunction, ProcessContext, ProcessFunction
    from .state import (
        AggregatingState,
        AggregatingStateDescriptor,
        BroadcastState,
        ListState,
        ListStateDescriptor,
        ListView,
        MapState,
        MapStateDescriptor,
        ReducingState,
        ReducingStateDescriptor,
        StateTtlConfig,
        StateVisibility,
        TtlUpdateType,
        ValueState,
        ValueStateDescriptor,
    )
    from .time import TimeDomain, WatermarkStrategy
    from .tune import tune

__version__ = "0.1.0"

__all__ = [
    "AggregatingState",
    "AggregatingStateDescriptor",
    "BroadcastConnectedStream",
    "BroadcastContext",
    "BroadcastProcessFunction",
    "BroadcastState",
    "BroadcastStateError",
    "BroadcastStream",
    "CheckpointConfig",
    "CoProcessFunction",
    "ConnectedStreams",
    "DataStream",
    "KeyedBroadcastContext",
    "KeyedBroadcastProcessFunction",
    "KeyedBroadcastReadOnlyContext",
    "KeyedCoProcessFunction",
    "KeyedContext",
    "KeyedProcessFunction",
    "KeyedStream",
    "OutputTag",
    "ProcessContext",
    "ProcessFunction",
    "ReadOnlyBroadcastContext",
    "ReadOnlyBroadcastState",
    "ListState",
    "ListStateDescriptor",
    "ListView",
    "MapState",
    "MapStateDescriptor",
    "ReducingState",
    "ReducingStateDescriptor",
    "StateTtlConfig",
    "StateVisibility",
    "TtlUpdateType",
    "ValueState",
    "ValueStateDescriptor",
    "Monitoring",
    "StreamEnvironment",
    "__version__",
    "JobFailedError",
    "JoinContext",
    "JoinFunction",
    "ProcessJoinFunction",
    "TimeDomain",
    "WatermarkStrategy",
    "agg",
    "errors",
    "runners",
    "sinks",
    "spark",
    "state",
    "tune",
    "windows",
]

_LAZY = {
    "StreamEnvironment": ("pyengine.api", "StreamEnvironment"),
    "CheckpointConfig": ("pyengine.coordinator.config", "CheckpointConfig"),
    "KeyedProcessFunction": ("pyengine.runtime.operators", "KeyedProcessFunction"),
    "KeyedContext": ("pyengine.runtime.operators", "KeyedContext"),
    **{
        name: ("pyengine.runtime.operators", name)
        for name in (
            "CoProcessFunction",
            "KeyedCoProcessFunction",
            "OutputTag",
            "ProcessContext",
            "ProcessFunction",
        )
    },
    **{
        name: ("pyengine.api", name)
        for name in ("BroadcastConnectedStream", "BroadcastStream", "ConnectedStreams", "DataStream", "KeyedStream")
    },
    **{
        name: ("pyengine.runtime.broadcast", name)
        for name in (
            "BroadcastContext",
            "BroadcastProcessFunction",
            "BroadcastStateError",
            "KeyedBroadcastContext",
            "KeyedBroadcastProcessFunction",
            "KeyedBroadcastReadOnlyContext",
            "ReadOnlyBroadcastContext",
            "ReadOnlyBroadcastState",
        )
    },
    **{
        name: ("pyengine.state", name)
        for name in (
            "AggregatingState",
            "AggregatingStateDescriptor",
            "BroadcastState",
            "ListState",
            "ListStateDescriptor",
            "ListView",
            "MapState",
            "MapStateDescriptor",
            "ReducingState",
            "ReducingStateDescriptor",
            "StateTtlConfig",
            "StateVisibility",
            "TtlUpdateType",
            "ValueState",
            "ValueStateDescriptor",
        )
    },
    **{name: ("pyengine.joins", name) for name in ("JoinContext", "JoinFunction", "ProcessJoinFunction")},
    "Monitoring": ("pyengine.monitoring.config", "Monitoring"),
    "sinks": ("pyengine.sinks", None),
    "errors": ("pyengine.errors", None),
    "JobFailedError": ("pyengine.errors", "JobFailedError"),
    "agg": ("pyengine.agg", None),
    "runners": ("pyengine.runners", None),
    # pe.state.read_keyed_state, pe.spark.ForeachBatchHandler as the guides write them
    # (pyengine.spark imports pyspark only when it is used)
    "state": ("pyengine.state", None),
    "spark": ("pyengine.spark", None),
    "WatermarkStrategy": ("pyengine.time", "WatermarkStrategy"),
    "TimeDomain": ("pyengine.time", "TimeDomain"),
    "windows": ("pyengine.windows", None),
    # the package itself: it is callable (pe.tune(...) is pyengine.tune.tune), and once
    # imported Python binds pyengine.tune to the package whatever this table says
    "tune": ("pyengine.tune", None),
}


def __getattr__(name: str) -> Any:
    """The job API, imported on first use: ``import pyengine`` stays cheap for
    tools that only need the gate or the state backends."""
    if name not in _LAZY:
        raise AttributeError(f"module 'pyengine' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The lazy names too, so completion in a REPL or a notebook offers the API."""
    return sorted({*globals(), *_LAZY})
