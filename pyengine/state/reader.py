"""Reading state out of a checkpoint or savepoint without running a job.

The State Processor API Flink users wish Flink had in Python: point it at a
checkpoint, name an operator (by uid) and a state, get a ``pyarrow.Table``.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Set, Tuple

import pyarrow as pa

from ..storage.filesystem import CorruptStateError
from ..storage.metadata import CheckpointMetadata, OperatorState, load_metadata
from .keygroups import KeyGroupRange
from .serializers import PickleNotAllowedError, PickleSerializer, SafeSerializer

__all__ = ["read_keyed_state", "read_operator_state"]

_SAFE = SafeSerializer()


def _operator(metadata: CheckpointMetadata, operator: str, path: str) -> OperatorState:
    op = metadata.operator(operator)
    if op is None:
        known = ", ".join(sorted(metadata.operators)) or "none"
        raise KeyError(f"checkpoint {path} has no operator {operator!r}; its operators: {known}")
    return op


def _column(values: List[Any], arrow_type: Any = None, *, pickled: bool = False) -> pa.Array:
    """An Arrow column of ``values``: the given type, else an inferred one, else
    (mixed or exotic values) losslessly as bytes: through the safe serializer, or
    pickle for a state written with pickle and read with ``allow_pickle``."""
    try:
        return pa.array(values, type=arrow_type)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        dumps = PickleSerializer().dumps if pickled else _SAFE.dumps
        return pa.array([dumps(v) for v in values], pa.binary())


def _unwrap_ttl(kind: str, value: Any) -> Any:
    if kind == "list":
        return [e[0] for e in value]
    if kind == "map":
        return {k: e[0] for k, e in value.items()}
    return value[0]


def read_keyed_state(checkpoint_path: str, operator: str, state_name: str, *, allow_pickle: bool = False) -> pa.Table:
    """The entries of keyed state ``state_name`` of ``operator`` in a checkpoint:
    a table with columns ``key``, ``value`` and ``key_group``. ``checkpoint_path``
    is the checkpoint's directory or ``_metadata`` (a local path or storage URI).
    Typed states keep their Arrow type; values of states written with pickle are
    read only with ``allow_pickle=True``."""
    # Imported here: the snapshot format builds on this package's key groups and
    # serializers, so a top-level import would make a cycle.
    from ..snapshot.format import TOMBSTONE
    from ..snapshot.reader import read_keyed_state as _read_file
    from .timers import TIMERS_KIND

    metadata = load_metadata(checkpoint_path)
    op = _operator(metadata, operator, checkpoint_path)
    handles = op.keyed_handles()
    # An incremental checkpoint is a chain per subtask: a base, then deltas whose
    # entries replace the base's and whose nulls delete. Files whose key groups
    # overlap are applied in order; files of disjoint key groups are just joined.
    spans = sorted((h.key_group_start, h.key_group_end) for h in handles)
    chained = any(b[0] <= a[1] for a, b in itertools.pairwise(spans))
    latest: Dict[Tuple[int, Any], Any] = {}
    # A timer state (kind "timers": a row per timer, a key in several) is whole in
    # every file of a chain: a file's rows replace its key groups' timers.
    timers: Dict[int, List[Tuple[Any, Any]]] = {}
    keys: List[Any] = []
    values: List[Any] = []
    key_groups: List[int] = []
    spec = None
    declared: Set[str] = set()  # every keyed state the files name, for the error below
    declared_spec = None  # the state as a file declares it: an empty table when no file has entries
    int_keys = True  # every file's keys are int64: so is an empty table's key column
    for handle in handles:
        info, entries = _read_file(
            handle,
            KeyGroupRange(handle.key_group_start, handle.key_group_end),
            allow_pickle=[state_name] if allow_pickle else [],
            states=[state_name],
            what=f"checkpoint {metadata.checkpoint_id}, operator {operator!r}",
        )
        declared.update(c.name for c in info.columns)
        column = next((c for c in info.columns if c.name == state_name), None)
        declared_spec = column or declared_spec
        int_keys = int_keys and info.plain_keys
        whole = column is not None and column.kind == TIMERS_KIND
        if whole:
            for key_group in range(handle.key_group_start, handle.key_group_end + 1):
                timers.pop(key_group, None)
        for key_group, column, ks, vs in entries:
            spec = column
            if whole:
                timers.setdefault(key_group, []).extend(zip(ks, vs, strict=True))
                continue
            if column.appends:  # list tails (format version 5): appended to the chain's earlier lists
                for k, v in zip(ks, vs, strict=True):
                    before = latest.get((key_group, k)) if chained else None
                    if before is None:
                        raise CorruptStateError(
                            f"checkpoint {checkpoint_path}: list state {state_name!r} appends to key {k!r}, "
                            "which no earlier file of its chain holds"
                        )
                    latest[(key_group, k)] = list(before) + list(v)
                continue
            if chained:
                for k, v in zip(ks, vs, strict=True):
                    if v is TOMBSTONE:
                        latest.pop((key_group, k), None)
                    else:
                        latest[(key_group, k)] = v
                continue
            keys.extend(ks)
            values.extend(vs)
            key_groups.extend([key_group] * len(ks))
    if chained:
        key_groups = [kg for kg, _ in latest]
        keys = [k for _, k in latest]
        values = list(latest.values())
    if timers:  # none of it went through ``latest``
        for key_group in sorted(timers):
            for k, v in timers[key_group]:
                key_groups.append(key_group)
                keys.append(k)
                values.append(v)
    if spec is not None and spec.ttl:
        values = [_unwrap_ttl(spec.kind, v) for v in values]
    if spec is None:
        spec = declared_spec  # declared, no entries (no pending timers, say): an empty table
    if spec is None:
        raise KeyError(
            f"operator {operator!r} in checkpoint {checkpoint_path} has no keyed state {state_name!r}; "
            f"its keyed states: {', '.join(sorted(declared)) or 'none'}"
        )
    value_type = spec.storage_type if spec.typed else None
    if spec.typed and spec.kind == "map":
        values = [list(v.items()) for v in values]
    return pa.table(
        {
            "key": _column(keys) if keys or not int_keys else pa.array([], pa.int64()),
            "value": _column(values, value_type, pickled=spec.serializer == "pickle"),
            "key_group": pa.array(key_groups, pa.int32()),
        }
    )


def read_operator_state(
    checkpoint_path: str, operator: str, state_name: str, *, allow_pickle: bool = False
) -> pa.Table:
    """The entries of operator state ``state_name`` of ``operator`` in a checkpoint:
    columns ``subtask`` and ``value`` for list and union list state, ``subtask``,
    ``key`` and ``value`` for broadcast state."""
    from .operator import _read

    metadata = load_metadata(checkpoint_path)
    op = _operator(metadata, operator, checkpoint_path)
    subtasks: List[int] = []
    values: List[Any] = []
    mode = serializer = None
    for handle in sorted(op.operator_handles(), key=lambda h: h.subtask):
        for name, state_mode, state_serializer, raw in _read(handle):
            if name != state_name:
                continue
            mode, serializer = state_mode, state_serializer
            if serializer == "pickle" and not allow_pickle:
                raise PickleNotAllowedError(
                    f"operator state {state_name!r} in {checkpoint_path} was written with pickle; "
                    "pass allow_pickle=True to read it"
                )
            loads = (PickleSerializer() if serializer == "pickle" else _SAFE).loads
            values.extend(loads(v) for v in raw)
            subtasks.extend([handle.subtask] * len(raw))
    if mode is None:
        raise KeyError(f"operator {operator!r} in checkpoint {checkpoint_path} has no operator state {state_name!r}")
    pickled = serializer == "pickle"
    if mode == "broadcast":
        return pa.table(
            {
                "subtask": pa.array(subtasks, pa.int32()),
                "key": _column([k for k, _ in values], pickled=pickled),
                "value": _column([v for _, v in values], pickled=pickled),
            }
        )
    return pa.table({"subtask": pa.array(subtasks, pa.int32()), "value": _column(values, pickled=pickled)})
