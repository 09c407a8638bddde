"""Keyed and operator state: descriptors, key groups and state backends."""

from __future__ import annotations

from typing import Any, Optional

from .columnar import NoCurrentKeyError
from .descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReduceFunction,
    ReducingStateDescriptor,
    StateDescriptor,
    StateDescriptorError,
    StateNameConflictError,
    StateTtlConfig,
    StateTypeError,
    StateVisibility,
    TtlUpdateType,
    ValueStateDescriptor,
)
from .heap import HeapKeyedStateBackend
from .keygroups import (
    DEFAULT_MAX_PARALLELISM,
    KeyGroupRange,
    assign_to_key_group,
    key_group_range_for_subtask,
    key_groups_of_int64,
    stable_hash,
    subtask_for_key_group,
)
from .lists import ListState, ListView
from .maps import MapState
from .operator import BroadcastState, OperatorListState, OperatorStateBackend
from .reader import read_keyed_state, read_operator_state
from .serializers import PickleNotAllowedError, StateSerializationError
from .values import AggregatingState, ReducingState, ValueState

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "AggregateFunction",
    "ReduceFunction",
    "AggregatingState",
    "AggregatingStateDescriptor",
    "BroadcastState",
    "HeapKeyedStateBackend",
    "KeyGroupRange",
    "ListState",
    "ListStateDescriptor",
    "ListView",
    "MapState",
    "MapStateDescriptor",
    "NoCurrentKeyError",
    "OperatorListState",
    "OperatorStateBackend",
    "PickleNotAllowedError",
    "ReducingState",
    "ReducingStateDescriptor",
    "StateDescriptor",
    "StateSerializationError",
    "StateDescriptorError",
    "StateNameConflictError",
    "StateTypeError",
    "StateTtlConfig",
    "StateVisibility",
    "TtlUpdateType",
    "ValueState",
    "ValueStateDescriptor",
    "assign_to_key_group",
    "create_keyed_backend",
    "key_group_range_for_subtask",
    "key_groups_of_int64",
    "read_keyed_state",
    "read_operator_state",
    "stable_hash",
    "subtask_for_key_group",
]

BACKENDS = ("heap", "incremental")


def create_keyed_backend(
    kind: str,
    *,
    max_parallelism: int = DEFAULT_MAX_PARALLELISM,
    key_group_range: Optional[KeyGroupRange] = None,
    local_recovery_dir: Optional[str] = None,
    **options: Any,
) -> HeapKeyedStateBackend:
    """A keyed state backend: ``"heap"`` (full snapshots) or ``"incremental"``
    (deltas since the last completed checkpoint)."""
    if kind == "heap":
        cls = HeapKeyedStateBackend
    elif kind == "incremental":
        from .incremental import IncrementalKeyedStateBackend

        cls = IncrementalKeyedStateBackend
    else:
        raise ValueError(f"unknown state backend {kind!r}; choose one of: {', '.join(BACKENDS)}")
    return cls(
        max_parallelism=max_parallelism,
        key_group_range=key_group_range,
        local_recovery_dir=local_recovery_dir,
        **options,
    )
