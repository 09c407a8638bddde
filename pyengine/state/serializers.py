"""How state values that have no declared Arrow type are turned into bytes.

The default, ``SafeSerializer``, handles plain Python data (None, bool, int of
any size, float, str, bytes, list, tuple, dict) through MessagePack, with
extension types so that tuples stay tuples and big ints stay exact. Decoding it
can never run code, so a checkpoint file from anywhere is safe to read.
``PickleSerializer`` handles anything, and can run arbitrary code when decoding:
it is used only for states whose descriptor opts in with ``serializer="pickle"``,
and state files say which serializer wrote them, so a pickled payload is refused
unless the reader opted in too.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional, Set

import msgpack

__all__ = [
    "SERIALIZERS",
    "PickleNotAllowedError",
    "PickleSerializer",
    "SafeSerializer",
    "Serializer",
    "StateSerializationError",
    "serializer_for",
]

_EXT_TUPLE = 1
_EXT_BIGINT = 2


class StateSerializationError(TypeError):
    """A value cannot be stored with the state's serializer."""


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


def stored_as_list(cls: type) -> type:
    """Registers ``cls`` (a read-only sequence type) to be stored as a list."""
    STORED_AS_LISTS.add(cls)
    return cls


def _default(obj: Any) -> Any:
    t = type(obj)
    if t is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if t is int:  # beyond 64 bits
        return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
    if t in STORED_AS_LISTS:
        return list(obj)
    raise StateSerializationError(
        f"a value of type {t.__module__}.{t.__qualname__} cannot be stored by the safe serializer, which takes "
        "None, bool, int, float, str, bytes, list, tuple and dict; declare the state's pyarrow type, convert "
        "the value, or opt in to pickle for this state with serializer='pickle'"
    )


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TUPLE:
        return tuple(_unpack(data))
    if code == _EXT_BIGINT:
        return int(data)
    raise ValueError(f"unknown extension type {code} in a state value")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_default, strict_types=True, use_bin_type=True)


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
