"""State handles: what a snapshot hands to the coordinator, and what restore reads.

Every handle turns into plain JSON (``to_json``/``handle_from_json``) because the
checkpoint's ``_metadata`` lists them all, and metadata must be readable by
anyone without running code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "BatchIndexEntry",
    "ByteStreamStateHandle",
    "KeyGroupsStateHandle",
    "OperatorStateHandle",
    "StateHandle",
    "StreamStateHandle",
    "handle_from_json",
]


class StateHandle:
    """Base of all handles."""

    kind = "abstract"

    @property
    def state_size(self) -> int:
        raise NotImplementedError

    def to_json(self) -> Dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class StreamStateHandle(StateHandle):
    """A file in checkpoint storage: its path in the storage's filesystem, size and xxh3-64."""

    path: str
    size: int
    checksum: str

    kind = "file"

    @property
    def state_size(self) -> int:
        return self.size

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "size": self.size, "checksum": self.checksum}


@dataclass(frozen=True)
class ByteStreamStateHandle(StateHandle):
    """Small state kept inside ``_metadata`` itself instead of in a file of its own."""

    name: str
    data: bytes
    checksum: str

    kind = "inline"

    def __repr__(self) -> str:  # the bytes themselves: kilobytes of binary in a printed handle
        return f"ByteStreamStateHandle(name={self.name!r}, {len(self.data):,} bytes, checksum={self.checksum!r})"

    @property
    def state_size(self) -> int:
        return len(self.data)

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "data": self.data.hex(), "checksum": self.checksum}


@dataclass(frozen=True)
class BatchIndexEntry:
    """Where one record batch of a state file is: the key groups it holds
    (``key_group`` to ``last_key_group``) and its byte range, so a subtask can
    read (and verify) only batches with key groups it owns."""

    key_group: int
    batch: int
    offset: int
    length: int
    checksum: str
    last_key_group: int = -1

    def __post_init__(self) -> None:
        if self.last_key_group < 0:
            object.__setattr__(self, "last_key_group", self.key_group)

    def overlaps(self, start: int, end: int) -> bool:
        return self.key_group <= end and self.last_key_group >= start

    def to_json(self) -> List[Any]:
        return [self.key_group, self.batch, self.offset, self.length, self.checksum, self.last_key_group]

    @classmethod
    def from_json(cls, data: List[Any]) -> BatchIndexEntry:
        last = int(data[5]) if len(data) > 5 else -1
        return cls(int(data[0]), int(data[1]), int(data[2]), int(data[3]), str(data[4]), last)


@dataclass(frozen=True)
class KeyGroupsStateHandle(StateHandle):
    """Keyed state of some key groups (Flink's KeyGroupsStateHandle): a state file
    (in storage or inline), the key groups it covers, and its batch index."""

    stream: StateHandle
    key_group_start: int
    key_group_end: int
    index: Tuple[BatchIndexEntry, ...] = field(default=())
    backend: str = "heap"
    # For incremental snapshots: which files (by storage path) this handle builds on.
    shared: Tuple[str, ...] = field(default=())

    kind = "keyed"

    @property
    def state_size(self) -> int:
        return self.stream.state_size

    def key_groups(self) -> range:
        return range(self.key_group_start, self.key_group_end + 1)

    def batches_for(self, start: int, end: int) -> List[BatchIndexEntry]:
        return [e for e in self.index if e.overlaps(start, end)]

    def to_json(self) -> Dict[str, Any]:
        return {
            "kind": self.kind,  # "keyed", or "operator" for OperatorStateHandle
            "stream": self.stream.to_json(),
            "key_groups": [self.key_group_start, self.key_group_end],
            "index": [e.to_json() for e in self.index],
            "backend": self.backend,
            "shared": list(self.shared),
        }


class OperatorStateHandle(KeyGroupsStateHandle):
    """Operator state of one subtask: a state file and the index of the subtask that
    wrote it (kept as a one-key-group range, so the JSON form is the keyed one's)."""

    kind = "operator"

    @property
    def subtask(self) -> int:
        return self.key_group_start


def handle_from_json(data: Dict[str, Any], *, where: str = "") -> StateHandle:
    """Rebuilds a handle from its JSON form; ``where`` names the source in errors."""
    try:
        kind = data["kind"]
        if kind == "file":
            return StreamStateHandle(str(data["path"]), int(data["size"]), str(data["checksum"]))
        if kind == "inline":
            return ByteStreamStateHandle(str(data["name"]), bytes.fromhex(data["data"]), str(data["checksum"]))
        if kind in ("keyed", "operator"):
            start, end = data["key_groups"]
            cls = KeyGroupsStateHandle if kind == "keyed" else OperatorStateHandle
            return cls(
                stream=handle_from_json(data["stream"], where=where),
                key_group_start=int(start),
                key_group_end=int(end),
                index=tuple(BatchIndexEntry.from_json(e) for e in data.get("index", [])),
                backend=str(data.get("backend", "heap")),
                shared=tuple(data.get("shared", [])),
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed state handle{' in ' + where if where else ''}: {exc!r}") from None
    raise ValueError(f"unknown state handle kind {kind!r}{' in ' + where if where else ''}")


def checksum_hex(value: int) -> str:
    return f"xxh3:{value:016x}"


def parse_checksum(text: Optional[str]) -> Optional[int]:
    """The value of an ``xxh3:`` checksum (None for anything else, segmented ones included)."""
    if not text or not text.startswith("xxh3:"):
        return None
    return int(text[5:], 16)
