"""Operators: what a task runs on each buffer, and the state each one owns.

The operators live in plainly named modules beside this one: ``base`` (``Operator``,
its context, ``OutputTag``, the event-time mixin, the buffer helpers), ``stateless``
(map, filter, flat_map, map_batches, the watermark assigner), ``keyed`` (the keyed
process operator, ``KeyedContext``, ``key_selector``) and ``process`` (the non-keyed
process operator). This module keeps the public and documented names importable
where users and the API reference have always found them; new code imports from
the module that defines a name."""

from __future__ import annotations

from .base import (
    EventTimeOperatorMixin,
    Operator,
    OperatorContext,
    OutputTag,
    UserFunctionError,
    batch_of,
    rows_of,
)
from .keyed import (
    KeyedContext,
    KeyedCoProcessFunction,
    KeyedCoProcessOperator,
    KeyedOperator,
    KeyedProcessFunction,
    KeyedProcessOperator,
    NaNKeyError,
    key_selector,
    overrides_on_timer,
)
from .process import CoProcessFunction, CoProcessOperator, ProcessContext, ProcessFunction, ProcessOperator
from .stateless import (
    FilterOperator,
    FlatMapOperator,
    MapBatchesOperator,
    MapOperator,
    TimestampsAndWatermarksOperator,
)

__all__ = [
    "NaNKeyError",
    "CoProcessFunction",
    "CoProcessOperator",
    "FilterOperator",
    "FlatMapOperator",
    "KeyedCoProcessFunction",
    "KeyedCoProcessOperator",
    "KeyedContext",
    "KeyedProcessFunction",
    "KeyedOperator",
    "KeyedProcessOperator",
    "EventTimeOperatorMixin",
    "MapBatchesOperator",
    "MapOperator",
    "Operator",
    "OperatorContext",
    "OutputTag",
    "ProcessContext",
    "ProcessFunction",
    "ProcessOperator",
    "TimestampsAndWatermarksOperator",
    "UserFunctionError",
    "batch_of",
    "key_selector",
    "overrides_on_timer",
    "rows_of",
]
