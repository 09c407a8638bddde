"""Operator (non-keyed) state: list, union list and broadcast state.

Redistributed on restore as Flink does it (RoundRobinOperatorStateRepartitioner):

* list state: all old subtasks' elements, in old-subtask order, dealt round-robin
  to the new subtasks (each element restored exactly once);
* union list state: every new subtask gets every element;
* broadcast state: every new subtask gets a copy (the same on all old subtasks).

Operator state is small (source offsets, pending transactions), so it is
snapshotted in full, through the safe serializer unless a state opts in to pickle.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.ipc as ipc

from ..storage.filesystem import INLINE_THRESHOLD, CheckpointStorageLocation, CorruptStateError, read_bytes
from ..storage.handles import OperatorStateHandle, StateHandle
from .descriptors import ListStateDescriptor, MapStateDescriptor, StateDescriptor
from .serializers import PickleNotAllowedError, StateSerializationError, serializer_for

__all__ = [
    "BroadcastState",
    "OperatorListState",
    "OperatorStateBackend",
    "OperatorStateSnapshot",
]

FORMAT_NAME = "pyengine-operator-state"
FORMAT_VERSION = 1
MODES = ("split", "union", "broadcast")


class OperatorListState:
    """A list of elements owned by this subtask (Flink's operator ListState)."""

    def __init__(self, elements: List[Any], descriptor: ListStateDescriptor) -> None:
        self._elements = elements
        self.descriptor = descriptor

    def get(self) -> List[Any]:
        return list(self._elements)

    def add(self, value: Any) -> None:
        if value is None:
            raise ValueError(f"operator state {self.descriptor.name!r}: None cannot be added")
        self._elements.append(value)

    def add_all(self, values: Sequence[Any]) -> None:
        for v in values:
            self.add(v)

    def update(self, values: Sequence[Any]) -> None:
        self._elements.clear()
        self.add_all(values)

    def clear(self) -> None:
        self._elements.clear()


class BroadcastState:
    """A map that is the same on every subtask (Flink's BroadcastState)."""

    def __init__(self, entries: Dict[Any, Any], descriptor: MapStateDescriptor) -> None:
        self._entries = entries
        self.descriptor = descriptor

    def get(self, key: Any) -> Any:
        return self._entries.get(key)

    def put(self, key: Any, value: Any) -> None:
        self._entries[key] = value

    def put_all(self, entries: Dict[Any, Any]) -> None:
        self._entries.update(entries)

    def remove(self, key: Any) -> None:
        self._entries.pop(key, None)

    def contains(self, key: Any) -> bool:
        return key in self._entries

    def items(self) -> List[Tuple[Any, Any]]:
        return list(self._entries.items())

    def keys(self) -> List[Any]:
        return list(self._entries)

    def values(self) -> List[Any]:
        return list(self._entries.values())

    def is_empty(self) -> bool:
        return not self._entries

    def clear(self) -> None:
        self._entries.clear()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())


class _Registered:
    __slots__ = ("data", "descriptor", "mode", "state")

    def __init__(self, mode: str, descriptor: Optional[StateDescriptor], data: Any, state: Any) -> None:
        self.mode = mode
        self.descriptor = descriptor
        self.data = data
        self.state = state


class OperatorStateBackend:
    """Operator state of one subtask."""

    def __init__(self, *, subtask_index: int = 0, parallelism: int = 1) -> None:
        if not 0 <= subtask_index < parallelism:
            raise ValueError(f"subtask_index must be in 0..{parallelism - 1}, got {subtask_index}")
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self._states: Dict[str, _Registered] = {}
        self._restored: Dict[str, Tuple[str, Any, str]] = {}  # name -> (mode, data, serializer)

    def _register(self, mode: str, descriptor: StateDescriptor, empty: Any) -> _Registered:
        existing = self._states.get(descriptor.name)
        if existing is not None:
            if existing.mode != mode or existing.descriptor != descriptor:
                raise ValueError(
                    f"operator state {descriptor.name!r} is already registered as {existing.mode} "
                    f"{existing.descriptor!r}"
                )
            return existing
        data = empty
        restored = self._restored.get(descriptor.name)
        if restored is not None:
            restored_mode, restored_data, serializer = restored
            if restored_mode != mode:
                raise ValueError(
                    f"operator state {descriptor.name!r} was checkpointed as {restored_mode} state, not {mode}"
                )
            data = _decode(restored_data, serializer, descriptor)
            del self._restored[descriptor.name]  # only once decoded: a refused call loses nothing
        reg = _Registered(mode, descriptor, data, None)
        self._states[descriptor.name] = reg
        return reg

    def get_list_state(self, descriptor: ListStateDescriptor) -> OperatorListState:
        """Split-redistributed list state: each element goes to one subtask on rescale."""
        reg = self._register("split", descriptor, [])
        reg.state = reg.state or OperatorListState(reg.data, descriptor)
        return reg.state  # type: ignore[no-any-return]

    def get_union_list_state(self, descriptor: ListStateDescriptor) -> OperatorListState:
        """Union-redistributed list state: every subtask gets all elements on restore."""
        reg = self._register("union", descriptor, [])
        reg.state = reg.state or OperatorListState(reg.data, descriptor)
        return reg.state  # type: ignore[no-any-return]

    def get_broadcast_state(self, descriptor: MapStateDescriptor) -> BroadcastState:
        reg = self._register("broadcast", descriptor, {})
        reg.state = reg.state or BroadcastState(reg.data, descriptor)
        return reg.state  # type: ignore[no-any-return]

    @property
    def state_names(self) -> List[str]:
        return sorted(set(self._states) | set(self._restored))

    # -- snapshots ----------------------------------------------------------------

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation) -> OperatorStateSnapshot:
        """Synchronous part: copies the (small) state; ``run()`` writes it."""
        copies = []
        for name in sorted(self._states):
            reg = self._states[name]
            assert reg.descriptor is not None
            data = list(reg.data) if reg.mode != "broadcast" else list(reg.data.items())
            serializer = "pickle" if reg.descriptor.allows_pickle else "msgpack"
            dumps = serializer_for(serializer).dumps
            try:
                copies.append((name, reg.mode, serializer, [dumps(v) for v in data]))
            except StateSerializationError as exc:  # which state: the message names only the value's type
                raise StateSerializationError(f"cannot snapshot operator state {name!r}: {exc}") from None
        for name in sorted(self._restored):  # restored but not (yet) registered: carried over unchanged
            mode, raw, serializer = self._restored[name]
            copies.append((name, mode, serializer, list(raw)))
        return OperatorStateSnapshot(checkpoint_id, location, self.subtask_index, copies)

    def restore(self, handles: Sequence[StateHandle]) -> None:
        """Takes this subtask's share of the operator state in ``handles`` (those of
        every old subtask of the operator); states are decoded when registered."""
        by_state: Dict[str, Tuple[str, str, List[Tuple[int, List[bytes]]]]] = {}
        for handle in handles:
            if not isinstance(handle, OperatorStateHandle):
                raise TypeError(f"operator state restores from OperatorStateHandle, got {handle!r}")
            for name, mode, serializer, values in _read(handle):
                known = by_state.setdefault(name, (mode, serializer, []))
                if known[0] != mode:
                    raise CorruptStateError(f"operator state {name!r} is {known[0]} in one file and {mode} in another")
                known[2].append((handle.subtask, values))
        self._restored = {}
        self._states = {}
        for name, (mode, serializer, parts) in by_state.items():
            parts.sort(key=lambda p: p[0])
            if mode == "split" and sorted(sub for sub, _ in parts) == list(range(self.parallelism)):
                # Same parallelism: every subtask keeps its own elements, as Flink's
                # round-robin repartitioner does when nothing rescales.
                mine = next(values for sub, values in parts if sub == self.subtask_index)
            elif mode == "split":
                everything = [v for _, values in parts for v in values]
                mine = everything[self.subtask_index :: self.parallelism]
            elif mode == "union":
                mine = [v for _, values in parts for v in values]
            else:  # broadcast: the same everywhere; take one old subtask's copy
                mine = parts[self.subtask_index % len(parts)][1]
            self._restored[name] = (mode, mine, serializer)


def _decode(raw: List[bytes], serializer: str, descriptor: StateDescriptor) -> Any:
    if serializer == "pickle" and not descriptor.allows_pickle:
        raise PickleNotAllowedError(
            f"operator state {descriptor.name!r} was checkpointed with pickle, which can run code when read; "
            "its descriptor must opt in with serializer='pickle'"
        )
    loads = serializer_for("pickle" if serializer == "pickle" else "safe").loads
    values = [loads(v) for v in raw]
    if isinstance(descriptor, MapStateDescriptor):
        return {k: v for k, v in values}
    return values


class OperatorStateSnapshot:
    """The asynchronous part: writes the copied operator state as one Arrow file."""

    def __init__(
        self,
        checkpoint_id: int,
        location: CheckpointStorageLocation,
        subtask_index: int,
        copies: List[Tuple[str, str, str, List[bytes]]],
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self._location = location
        self._subtask = subtask_index
        self._copies = copies

    def run(self) -> Any:
        from ..snapshot.strategies import SnapshotResult

        if not self._copies:
            return SnapshotResult()
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "subtask": self._subtask,
            "states": [{"name": n, "mode": m, "serializer": s} for n, m, s, _ in self._copies],
        }
        schema = pa.schema(
            [pa.field("state", pa.int16()), pa.field("value", pa.binary())],
            metadata={"pyengine": json.dumps(meta, separators=(",", ":"))},
        )
        name = f"operator-{self._subtask}-{uuid.uuid4().hex[:12]}"
        stream = self._location.create_output_stream(name, inline_threshold=INLINE_THRESHOLD)
        with stream:
            writer = ipc.new_file(stream, schema, options=ipc.IpcWriteOptions(compression="lz4"))
            for i, (_, _, _, values) in enumerate(self._copies):
                writer.write_batch(
                    pa.record_batch([pa.array([i] * len(values), pa.int16()), pa.array(values, pa.binary())], schema)
                )
            writer.close()
            file_handle = stream.close_and_get_handle()
        handle = OperatorStateHandle(stream=file_handle, key_group_start=self._subtask, key_group_end=self._subtask)
        size = handle.state_size
        return SnapshotResult(handles=[handle], checkpointed_size=size, full_size=size)  # type: ignore[list-item]


def _read(handle: OperatorStateHandle) -> Iterator[Tuple[str, str, str, List[bytes]]]:
    where = f"operator state of subtask {handle.subtask}"
    data = read_bytes(handle.stream, what=where)
    try:
        reader = ipc.open_file(pa.py_buffer(data))
        meta = json.loads(reader.schema.metadata[b"pyengine"])
        table = reader.read_all()
    except (pa.ArrowInvalid, KeyError, ValueError) as exc:
        raise CorruptStateError(f"{where} cannot be read: {exc}") from None
    if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
        raise CorruptStateError(f"{where}: unknown format {meta.get('format')!r} version {meta.get('version')!r}")
    states = table.column("state").to_pylist()
    values = table.column("value").to_pylist()
    for i, spec in enumerate(meta["states"]):
        yield spec["name"], spec["mode"], spec["serializer"], [v for s, v in zip(states, values, strict=True) if s == i]
