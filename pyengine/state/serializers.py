"""How state values that have no declared Arrow type are turned into bytes.

The default, ``SafeSerializer``, handles plain Python data (None, bool, int of
any size, float, str, bytes, list, tuple, dict, and the datetime, date and
Decimal values of Spark's timestamp, date and decimal types) through
MessagePack, with extension types so that tuples stay tuples, big ints stay
exact and an aware datetime comes back as the same instant (in UTC). Decoding it
can never run code, so a checkpoint file from anywhere is safe to read.
``PickleSerializer`` handles anything, and can run arbitrary code when decoding:
it is used only for states whose descriptor opts in with ``serializer="pickle"``,
and state files say which serializer wrote them, so a pickled payload is refused
unless the reader opted in too.
"""

from __future__ import annotations

import array
import datetime as _dt
import decimal as _decimal
import pickle
from typing import Any, Callable, Dict, List, Optional, Set

import msgpack
import pyarrow as pa

from ..errors import NonRetryableError

__all__ = [
    "SERIALIZERS",
    "PickleNotAllowedError",
    "PickleSerializer",
    "SafeSerializer",
    "Serializer",
    "StateSerializationError",
    "safe_packer",
    "serializer_for",
]

_EXT_TUPLE = 1
_EXT_BIGINT = 2
_EXT_DATETIME = 3  # [microseconds since the epoch, 1 if aware (stored in UTC) else 0]
_EXT_DATE = 4  # the proleptic Gregorian ordinal
_EXT_DECIMAL = 5  # its str
_EPOCH = _dt.datetime(1970, 1, 1)


class StateSerializationError(NonRetryableError, TypeError):
    """A value cannot be stored with the state's serializer. A restart would restore
    the state without it, replay the same records and store it again: the job fails
    at once (it restarted ``restart_attempts`` times on the same error before)."""


class PickleNotAllowedError(PermissionError):
    """A state payload was written with pickle and the reader did not opt in."""


class Serializer:
    name: str = ""

    def dumps(self, value: Any) -> bytes:
        raise NotImplementedError

    def loads(self, data: bytes) -> Any:
        raise NotImplementedError


# Sequences of the engine's own that a user may store where a list goes (a
# ``ListState.view()`` put into another state): stored as the list they show.
STORED_AS_LISTS: Set[type] = set()


# A typed list state (no TTL) of these element types keeps each key's elements in one
# array.array, a buffer of C numbers, rather than a list of Python objects: 8 bytes an
# int64 or float64 instead of a pointer and a 24-32 byte object, nothing for the cyclic
# collector to walk, and snapshots and restores that copy buffers (snapshot.format)
# instead of converting every element. The state's check lets in only values that fit.
LIST_TYPECODES: Dict[pa.DataType, str] = {
    t: code
    for t, code in (
        (pa.int8(), "b"), (pa.uint8(), "B"), (pa.int16(), "h"), (pa.uint16(), "H"), (pa.int32(), "i"),
        (pa.uint32(), "I"), (pa.int64(), "q"), (pa.uint64(), "Q"), (pa.float64(), "d"),
    )
    if array.array(code).itemsize == t.bit_width // 8
}  # fmt: skip
TYPED_LIST = array.array


def list_typecode(descriptor: Any) -> Optional[str]:
    """The array.array typecode a list state's elements are stored in, or None (a list)."""
    if getattr(descriptor, "kind", None) != "list" or getattr(descriptor, "ttl", None) is not None:
        return None
    if getattr(descriptor, "allows_pickle", False):
        return None
    element = getattr(descriptor, "type", None)
    return None if element is None else LIST_TYPECODES.get(element)


class PickledBytes(bytes):
    """A restored state's value still as the pickle it was written as: decoded only
    once a descriptor opts in to pickle, and written back as these very bytes by a
    checkpoint taken before that (pickling it again would store the bytes, not the
    value)."""

    __slots__ = ()


def stored_as_list(cls: type) -> type:
    """Registers ``cls`` (a read-only sequence type) to be stored as a list."""
    STORED_AS_LISTS.add(cls)
    return cls


def unviewed(values: List[Any]) -> Optional[List[Any]]:
    """``values`` with each ``ListState.get()`` (a ``ListView``, or another of the
    engine's read-only sequences), at any depth, as the list it shows, or None when
    there is none: pyarrow takes lists, not other sequences. Arrow conversions ask
    only once they failed, so their rows cost nothing for it; a CollectSink asks of
    every batch (its records are kept as plain data)."""
    if not any(_has_view(v) for v in values):
        return None
    return [_as_lists(v) for v in values]


def _has_view(value: Any) -> bool:
    t = type(value)
    if t in STORED_AS_LISTS:
        return True
    if t is dict:
        return any(_has_view(v) for v in value.values())
    if t is list or t is tuple:
        return any(_has_view(v) for v in value)
    return False


def _as_lists(value: Any) -> Any:
    t = type(value)
    if t in STORED_AS_LISTS or t is list:
        return [_as_lists(v) for v in value]
    if t is tuple:
        return tuple(_as_lists(v) for v in value)
    if t is dict:
        return {k: _as_lists(v) for k, v in value.items()}
    return value


def _default(obj: Any) -> Any:
    t = type(obj)
    if t is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if t is int:  # beyond 64 bits
        return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
    if t is _dt.datetime:  # Spark's timestamp (aware) and timestamp_ntz (naive)
        aware = obj.tzinfo is not None and obj.utcoffset() is not None
        naive = obj.astimezone(_dt.timezone.utc).replace(tzinfo=None) if aware else obj
        micros = (naive - _EPOCH) // _dt.timedelta(microseconds=1)
        return msgpack.ExtType(_EXT_DATETIME, _pack([micros, 1 if aware else 0]))
    if t is _dt.date:
        return msgpack.ExtType(_EXT_DATE, _pack(obj.toordinal()))
    if t is _decimal.Decimal:
        return msgpack.ExtType(_EXT_DECIMAL, str(obj).encode())
    if t in STORED_AS_LISTS:
        return list(obj)
    raise StateSerializationError(
        f"a value of type {t.__module__}.{t.__qualname__} cannot be stored by the safe serializer, which takes "
        "None, bool, int, float, str, bytes, list, tuple, dict, datetime, date and Decimal; declare the state's "
        "pyarrow type, convert "
        "the value, or opt in to pickle for this state with serializer='pickle'"
    )


# The exact types the safe serializer encodes at the top of a value (None aside), the
# most frequent first: C's check of a write (``_native._FastCheck``) compares a
# value's type with each, so a value of one of them costs a few comparisons and no
# Python call. A container's contents are not looked at on a write (that would cost
# its size): a value inside it that the serializer cannot encode fails the next
# checkpoint, with the same non-retryable error.
PLAIN_TYPES = (int, str, float, dict, list, tuple, bytes, bool, _dt.datetime, _dt.date, _decimal.Decimal)


_PLAIN = frozenset(PLAIN_TYPES)


def plain_check(what: str) -> Any:
    """The per-write check of a state without a declared type that the safe
    serializer stores (``table._validator``'s counterpart): a value of another type
    than ``PLAIN_TYPES`` is encoded once, and refused here, naming the state
    (``what``) and the type, if the checkpoint would refuse it: a lock or a
    socket fails at ``update()``, not at the next checkpoint."""

    def check_plain(v: Any) -> Any:
        if v.__class__ in _PLAIN:  # the Python paths' calls (add_all, put_all): no encoding
            return v
        try:
            _pack(v)
        except (StateSerializationError, TypeError, ValueError, OverflowError):
            t = type(v)
            raise StateSerializationError(
                f"{what}: a value of type {t.__module__}.{t.__qualname__} cannot be checkpointed: the state has no "
                "declared type, so its values go through the safe serializer, which takes None, bool, int, float, "
                "str, bytes, list, tuple, dict, datetime, date and Decimal; store plain data (e.g. the address, not "
                "the connection: keep a lock or a socket in an attribute of the function, made in open()), convert "
                "the value (float(x) for a NumPy number), or opt in to pickle for this state with serializer='pickle'"
            ) from None
        return v

    check_plain.pyengine_types = PLAIN_TYPES  # type: ignore[attr-defined]
    return check_plain


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TUPLE:
        return tuple(_unpack(data))
    if code == _EXT_BIGINT:
        return int(data)
    if code == _EXT_DATETIME:
        micros, aware = _unpack(data)
        value = _EPOCH + _dt.timedelta(microseconds=micros)
        return value.replace(tzinfo=_dt.timezone.utc) if aware else value
    if code == _EXT_DATE:
        return _dt.date.fromordinal(_unpack(data))
    if code == _EXT_DECIMAL:
        return _decimal.Decimal(data.decode())
    raise ValueError(f"unknown extension type {code} in a state value")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_default, strict_types=True, use_bin_type=True)


def safe_packer() -> Callable[[Any], bytes]:
    """The safe serializer's encoding (the same bytes as ``SafeSerializer.dumps``,
    which its ``loads`` reads) by one reused ``msgpack.Packer``: ``dumps`` makes a
    packer per call, most of the time of a small value's encoding. For an operator
    that encodes thousands of small values per checkpoint (the interval join's
    segments); a packer is not thread-safe: one per thread."""
    packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
    return packer.pack  # type: ignore[no-any-return]


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)


class SafeSerializer(Serializer):
    """Plain Python data through MessagePack; decoding never runs code."""

    name = "msgpack"

    def dumps(self, value: Any) -> bytes:
        return _pack(value)

    def loads(self, data: bytes) -> Any:
        return _unpack(data)


class PickleSerializer(Serializer):
    """Any picklable value. Decoding runs code: only for states that opted in."""

    name = "pickle"

    def dumps(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def loads(self, data: bytes) -> Any:
        return pickle.loads(data)


SERIALIZERS = {"safe": SafeSerializer(), "msgpack": SafeSerializer(), "pickle": PickleSerializer()}


def serializer_for(name: Optional[str]) -> Serializer:
    """The serializer a descriptor asks for (``"safe"``, the default, or ``"pickle"``)."""
    try:
        return SERIALIZERS[name or "safe"]
    except KeyError:
        raise ValueError(f"serializer must be 'safe' or 'pickle', got {name!r}") from None
