"""The keyed state file: an Arrow IPC file, LZ4-compressed, one per subtask and snapshot.

Every file is readable with ``pyarrow.ipc.open_file`` alone. Columns:

* ``key_group`` and ``state`` (an index into the state list in the schema
  metadata): run-end encoded, a few runs per batch instead of a value per row;
* ``key``: int64 when every key in the file is a 64-bit int, else a dense union
  of ``int`` (int64), ``str`` (utf8) and ``packed`` (binary: the key through the
  safe serializer), whichever holds a key exactly;
* ``value``: with one state, that state's storage type (version 1); with
  several states of at most four distinct storage types (the usual case: a few
  declared types, binary for untyped states, int64 for timers), a sparse union
  with one child per storage type, the metadata mapping each state to its child
  (version 3: a sparse union has no offset per row, where a dense one costs 4
  bytes a row that LZ4 cannot shrink; the other children of a batch are nulls,
  which it can); with more types, a dense union with one child per state
  (version 1), or, past the 128 children an Arrow union can have (its type codes
  are int8), one child per distinct storage type and the map (version 2). Files
  of version 1 are the layout every pyengine reads; a pyengine that does not know
  a version refuses the file by its number. A state with a declared Arrow type and no
  time-to-live stores its values as that type (lists as ``list<type>``, maps as
  ``map<key, value>``); any other state stores each entry through its
  serializer as binary. Deletions in a delta are null values.

Each record batch holds entries of one state and of a range of consecutive key
groups; small key groups share a batch, so per-batch costs stay low. Runs are in
key-group order, except in a delta of columnar state, which lists its upserts in
key-group order and then its deletions (a key group may then have two runs).
The schema metadata ``pyengine`` (JSON) names the format version, backend,
key-group range, states and the (first key group, last key group, state) of
every batch; the state handle also records each batch's byte range and xxh3-64,
so a subtask reads and verifies only the batches holding its key groups.

This module is the layout (constants, versions, ``StateColumn``, the schema metadata);
``columns.py`` encodes and decodes the columns, ``writer.py`` writes a file and
``reader.py`` reads one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pyarrow as pa

from ..state.keygroups import KeyGroupRange
from ..state.serializers import (
    SafeSerializer,
)
from ..storage.filesystem import CorruptStateError
from .stamped import declared_types, stamped_type

__all__ = [
    "TOMBSTONE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_VERSION_LIST_TAILS",
    "MAX_STATES_PER_FILE",
    "MAX_UNION_CHILDREN",
    "SchemaInfo",
    "StateColumn",
    "check_state_count",
    "read_schema_info",
    "value_layout",
]

FORMAT_NAME = "pyengine-keyed-state"
FORMAT_VERSION = 1  # what a file of one state, or of many states of many types, is written as
FORMAT_VERSION_SHARED_CHILDREN = 2  # a file of more states: union children shared by storage type
FORMAT_VERSION_SPARSE = 3  # several states of at most SPARSE_MAX_CHILDREN storage types: a sparse union by type
# Any of the layouts above, with the timestamps of every ``timers`` state as SPLIT_TIMESTAMPS
# (metadata ``"timers_encoding": "split"``): a pyengine reading versions up to 3 refuses the file.
FORMAT_VERSION_SPLIT_TIMERS = 4
# Any of the layouts above (split timers included, with ``"timers_encoding": "split"``), in a
# delta holding list tails: a column marked ``"appends": true`` whose lists are elements
# appended to that key's list since the chain's previous file (a pyengine reading versions up
# to 4 would take them for whole lists, so it refuses the file by its number).
FORMAT_VERSION_LIST_TAILS = 5
# Any of the layouts above (list tails as in version 5 included), with TTL states (but those
# that opted in to pickle) written as columns of values and stamps (metadata
# ``"ttl_encoding": "columns"``, the state's ``"stamped"``; see ``snapshot/stamped.py``), timers
# split as in version 4: a pyengine reading up to 5 refuses it.
FORMAT_VERSION_STAMPED = 6
READ_VERSIONS = (
    FORMAT_VERSION,
    FORMAT_VERSION_SHARED_CHILDREN,
    FORMAT_VERSION_SPARSE,
    FORMAT_VERSION_SPLIT_TIMERS,
    FORMAT_VERSION_LIST_TAILS,
    FORMAT_VERSION_STAMPED,
)
# A timer's int64 timestamp as its high and low 32 bits, t == (hi << 32) | lo. LZ4 spends
# ~1.6 ns a byte on an int64 column of nearby values (matches of a few zero bytes, a token
# each: 8 MB of a second's spread of timestamps took 13 ms, to 4.7 MB); ``hi`` is one
# value over a 49-day span, which it stores in next to nothing, and ``lo`` it gives up on
# at ~4 GB/s and stores as is (1 ms, 4 MB). Any Arrow reader can join them back.
SPLIT_TIMESTAMPS = pa.struct([pa.field("hi", pa.int32(), nullable=False), pa.field("lo", pa.uint32(), nullable=False)])
# A sparse union has no offsets (a dense one costs 4 bytes a row, which LZ4 cannot
# shrink: they count 0, 1, 2...), but every child is as long as the batch: the
# children other than the batch's own are nulls (zeroed buffers), which LZ4 reduces
# to almost nothing but which are still made and compressed. With few children that costs less than the
# offsets; with many, more.
SPARSE_MAX_CHILDREN = 4
# An Arrow union's type codes are int8 (0..127), so it has at most 128 children.
MAX_UNION_CHILDREN = 128
# The ``state`` column's run values are int16.
MAX_STATES_PER_FILE = (1 << 15) - 1
_KEY_INT, _KEY_STR, _KEY_PACKED = 0, 1, 2
_KEY_TYPE = pa.dense_union([pa.field("int", pa.int64()), pa.field("str", pa.string()), pa.field("packed", pa.binary())])
_SAFE = SafeSerializer()


class _Tombstone:
    """An entry deleted since the previous snapshot (incremental deltas): a null value.
    Live state never holds None (``update(None)`` clears), so a null is unambiguous."""

    def __repr__(self) -> str:
        return "TOMBSTONE"


TOMBSTONE = _Tombstone()
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class StateColumn:
    """How one state is stored in a file."""

    name: str
    kind: str
    arrow_type: Optional[pa.DataType]  # the declared type, if any
    map_key_type: Optional[pa.DataType]
    serializer: str  # "msgpack" or "pickle"
    ttl: bool
    # as a file says them (str of the declared types), typed or not: what its writes were checked against
    declared: Tuple[Optional[str], Optional[str]] = (None, None)  # (map key type, value or element type)
    # A list state's tails (version 5): each entry's elements are appended to the key's list as
    # the chain's previous files left it, rather than replacing it. The same state has its
    # ordinary column in the file too, for the keys whose list was rewritten or cleared.
    appends: bool = False
    # a TTL state's entries as columns of values and stamps (written now; read: what the file says)
    ttl_columns: bool = True

    @property
    def typed(self) -> bool:
        if self.ttl or self.serializer == "pickle":
            return False
        if self.kind == "map":
            return self.arrow_type is not None and self.map_key_type is not None
        return self.arrow_type is not None

    @property
    def stamped(self) -> bool:
        """A TTL state written as columns of values and stamps (version 5): the values
        in their declared types (``stamped_typed``), or serialized per key as without
        TTL, rather than each entry serialized with its stamps. A state that opted in
        to pickle keeps the older layout."""
        return self.ttl and self.ttl_columns and self.serializer != "pickle" and self.kind != "timers"

    @property
    def stamped_typed(self) -> bool:
        """A stamped state's values are in their declared types (not serialized)."""
        if not self.stamped or self.arrow_type is None:
            return False
        return self.kind != "map" or self.map_key_type is not None

    @property
    def split_timestamps(self) -> bool:
        """A ``timers`` state's timestamps, written as SPLIT_TIMESTAMPS."""
        return self.kind == "timers" and self.typed and pa.types.is_int64(self.arrow_type)

    @property
    def file_type(self) -> pa.DataType:
        """The type of this state's values in a file written now (``storage_type``, but
        for a timers state's split timestamps)."""
        return SPLIT_TIMESTAMPS if self.split_timestamps else self.storage_type

    @property
    def storage_type(self) -> pa.DataType:
        if self.stamped:
            return stamped_type(self.kind, self.arrow_type if self.stamped_typed else None, self.map_key_type)
        if not self.typed:
            return pa.binary()
        return self.plain_type

    @property
    def plain_type(self) -> pa.DataType:
        """The declared types' layout without stamps (a typed state's storage type)."""
        assert self.arrow_type is not None
        if self.kind == "list":
            return pa.list_(self.arrow_type)
        if self.kind == "map":
            assert self.map_key_type is not None
            return pa.map_(self.map_key_type, self.arrow_type)
        return self.arrow_type

    def to_json(self) -> Dict[str, Any]:
        out = {
            "name": self.name,
            "kind": self.kind,
            "type": None if self.arrow_type is None else str(self.arrow_type),
            "map_key_type": None if self.map_key_type is None else str(self.map_key_type),
            "serializer": self.serializer,
            "ttl": self.ttl,
            "typed": self.typed,
            **({"stamped": "typed" if self.stamped_typed else "serialized"} if self.stamped else {}),
        }
        if self.appends:  # only then: files without tails stay as every version 1-4 reader knows them
            out["appends"] = True
        return out


def value_layout(columns: Sequence[StateColumn]) -> Tuple[List[pa.DataType], Optional[List[int]], bool]:
    """The value union's children, each state's child when they are shared, and
    whether the union is sparse.

    Several states of at most ``SPARSE_MAX_CHILDREN`` distinct storage types (the
    common case: a few declared types and binary for untyped states), not counting
    the timers' split timestamps (they were int64, which the states often share; a
    fifth child of null rows costs two zeroed buffers, a dense union 4 bytes a row):
    a sparse union with one child per distinct type, in order of first use, and the
    state -> child map (version 3, or 4 with timers). Otherwise up to
    ``MAX_UNION_CHILDREN`` states: a dense union with one child per state (version
    1, None). More: a dense union with one child per distinct type and the map
    (version 2) — an operator's states are mostly a handful of types, so a union of
    types has room for any number of states. ``ValueError``, naming the limit, when
    even the distinct types are too many, or the states more than the ``state``
    column's int16 holds: ``check_state_count`` says so when the states are declared."""
    types = [c.file_type for c in columns]
    check_state_count(len(columns), types)
    children, child_of = _by_type(types)
    timers = any(t.equals(SPLIT_TIMESTAMPS) for t in children)
    if 1 < len(columns) and len(children) - timers <= SPARSE_MAX_CHILDREN:
        return children, child_of, True
    if len(columns) <= MAX_UNION_CHILDREN:
        return types, None, False
    return children, child_of, False


def _by_type(types: Sequence[pa.DataType]) -> Tuple[List[pa.DataType], List[int]]:
    """The distinct types, in order of first use, and each type's index among them."""
    children: List[pa.DataType] = []
    child_of: List[int] = []
    for t in types:
        for i, known in enumerate(children):
            if known.equals(t):
                child_of.append(i)
                break
        else:
            children.append(t)
            child_of.append(len(children) - 1)
    return children, child_of


def check_state_count(count: int, storage_types: Optional[Sequence[pa.DataType]] = None, *, where: str = "") -> None:
    """Raises ``ValueError`` when ``count`` states (of ``storage_types``, if known)
    cannot share one keyed state file: more than ``MAX_STATES_PER_FILE`` states, or,
    past ``MAX_UNION_CHILDREN`` states, more than ``MAX_UNION_CHILDREN`` distinct
    storage types. A backend can call it as states are registered (``where`` naming
    the operator), so a job is refused when it opens, not at its first checkpoint."""
    who = f"{where}: " if where else ""
    if count > MAX_STATES_PER_FILE:
        raise ValueError(
            f"{who}{count} keyed states in one operator; a keyed state file holds at most {MAX_STATES_PER_FILE} "
            "(its state column is int16): keep related values in one state (a map, or a typed struct)"
        )
    if storage_types is None or count <= MAX_UNION_CHILDREN:
        return
    distinct: List[pa.DataType] = []
    for t in storage_types:
        if not any(known.equals(t) for known in distinct):
            distinct.append(t)
    if len(distinct) > MAX_UNION_CHILDREN:
        raise ValueError(
            f"{who}{count} keyed states of {len(distinct)} distinct Arrow types in one operator; a keyed state file "
            f"with more than {MAX_UNION_CHILDREN} states holds at most {MAX_UNION_CHILDREN} distinct types (an Arrow "
            "union's type codes are int8): declare fewer distinct types, or keep related values in one state"
        )


@dataclass(frozen=True)
class SchemaInfo:
    """What a state file's schema metadata says about it."""

    backend: str
    max_parallelism: int
    key_groups: KeyGroupRange
    columns: Tuple[StateColumn, ...]
    batches: Tuple[Tuple[int, int, int], ...]  # (first key group, last key group, state) of batches 1..n
    plain_keys: bool = False  # the key column is int64, not a union
    plain_values: bool = False  # the value column is the one state's own, not a union
    value_children: Optional[Tuple[int, ...]] = None  # each state's union child, when shared (version 2)
    split_timers: bool = False  # timers states' timestamps are SPLIT_TIMESTAMPS (version 4)

    def value_child(self, state_index: int) -> int:
        """The value union's child that holds ``state_index``'s values."""
        return state_index if self.value_children is None else self.value_children[state_index]


def read_schema_info(schema: pa.Schema, *, where: str) -> SchemaInfo:
    raw = (schema.metadata or {}).get(b"pyengine")
    if raw is None:
        raise CorruptStateError(f"{where} is not a pyengine state file (no 'pyengine' schema metadata)")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise CorruptStateError(f"{where}: unreadable schema metadata") from None
    if meta.get("format") != FORMAT_NAME:
        raise CorruptStateError(f"{where} is not a keyed state file (format {meta.get('format')!r})")
    version = meta.get("version")
    if version not in READ_VERSIONS:
        raise CorruptStateError(
            f"{where} has state file format version {version!r}; this pyengine reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}"
        )
    value_field = schema.field("value").type
    encoding = meta.get("value_encoding")
    plain_values = encoding == "plain"
    value_children: Optional[Tuple[int, ...]] = None
    split_timers = version in (FORMAT_VERSION_SPLIT_TIMERS, FORMAT_VERSION_LIST_TAILS, FORMAT_VERSION_STAMPED) and (
        meta.get("timers_encoding") == "split"
    )
    if version == FORMAT_VERSION_SPLIT_TIMERS and not split_timers:
        raise CorruptStateError(f"{where}: version {version} without its timers encoding")
    if version == FORMAT_VERSION_STAMPED and meta.get("ttl_encoding") != "columns":
        raise CorruptStateError(f"{where}: version {version} without its TTL encoding")
    if version != FORMAT_VERSION and encoding == "union_by_type":
        value_children = _checked_children(meta.get("value_children"), len(meta["states"]), value_field, where)
    elif not plain_values and encoding not in ("union", None):  # absent: a union by state, as always
        raise CorruptStateError(f"{where}: value encoding {encoding!r} is not one of version {version}")
    columns = []
    for c in meta["states"]:
        if c.get("appends") and (c.get("kind") != "list" or not c.get("typed") or version != FORMAT_VERSION_LIST_TAILS):
            raise CorruptStateError(f"{where}: state {c.get('name')!r} holds list tails but is not a typed list state")
    for i, c in enumerate(meta["states"]):
        # The exact declared types are the value union's children, not the metadata's text.
        arrow_type = map_key_type = None
        if c.get("stamped") == "typed" and version == FORMAT_VERSION_STAMPED:
            child = value_field if plain_values else value_field.field(value_children[i] if value_children else i).type
            try:
                arrow_type, map_key_type = declared_types(child, c["kind"])
            except (AttributeError, KeyError, TypeError) as exc:
                raise CorruptStateError(f"{where}: stamped state {c['name']!r} is {child}: {exc}") from None
        elif c.get("typed"):
            child = (
                value_field
                if plain_values
                else value_field.field(i if value_children is None else value_children[i]).type
            )
            if c["kind"] == "list":
                arrow_type = child.value_type
            elif c["kind"] == "map":
                arrow_type, map_key_type = child.item_type, child.key_type
            elif split_timers and c["kind"] == "timers":
                if not child.equals(SPLIT_TIMESTAMPS):
                    raise CorruptStateError(f"{where}: timers state {c['name']!r} is {child}, not split timestamps")
                arrow_type = pa.int64()
            else:
                arrow_type = child
        columns.append(
            StateColumn(
                name=c["name"],
                kind=c["kind"],
                arrow_type=arrow_type,
                map_key_type=map_key_type,
                serializer=c["serializer"],
                ttl=bool(c["ttl"]),
                declared=(c.get("map_key_type"), c.get("type")),
                appends=version in (FORMAT_VERSION_LIST_TAILS, FORMAT_VERSION_STAMPED)
                and bool(c.get("appends", False)),
                ttl_columns=version == FORMAT_VERSION_STAMPED and c.get("stamped") in ("typed", "serialized"),
            )
        )
    start, end = meta["key_groups"]
    return SchemaInfo(
        backend=meta["backend"],
        max_parallelism=int(meta["max_parallelism"]),
        key_groups=KeyGroupRange(int(start), int(end)),
        columns=tuple(columns),
        plain_keys=meta.get("key_encoding") == "int64",
        plain_values=plain_values,
        batches=tuple((int(b[0]), int(b[1]), int(b[2])) for b in meta["batches"]),
        value_children=value_children,
        split_timers=split_timers,
    )


def _checked_children(raw: Any, count: int, value_field: pa.DataType, where: str) -> Tuple[int, ...]:
    """A version 2 file's state -> union child map, refused unless it names a child
    of the value union for every state."""
    num_children = value_field.num_fields if pa.types.is_union(value_field) else 0
    if not isinstance(raw, list) or len(raw) != count or not all(type(c) is int and 0 <= c < num_children for c in raw):
        raise CorruptStateError(f"{where}: its value_children do not map each state to a child of the value union")
    return tuple(raw)
