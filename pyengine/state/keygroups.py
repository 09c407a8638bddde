"""Key groups: the unit in which keyed state is assigned to subtasks and rescaled.

A key belongs to key group ``stable_hash(key) % max_parallelism``; subtask ``i``
of ``p`` owns a contiguous range of key groups (Flink's KeyGroupRangeAssignment).
The hash is part of the checkpoint format: state files record key groups, so it
must give the same answer in every process, on every machine, forever. Python's
``hash()`` is salted per process and is never used.

The hash, precisely (all arithmetic modulo 2**64):

* int, bool, and floats with an integral value in the int64 range: murmur3's
  64-bit finalizer (fmix64) of the value as a two's-complement 64-bit integer.
  Equal keys must share a key group, and ``1 == 1.0 == True`` in Python.
* other ints: xxh3-64 of the decimal text, tagged.
* other floats: fmix64 of the IEEE-754 bits (all NaNs alike).
* str: xxh3-64 of the UTF-8 bytes; bytes: xxh3-64 of the bytes.
* None: a constant. tuple: an order-sensitive combination of the elements.

Integer keys hash without a Python call per key on NumPy/Arrow arrays
(``key_groups_of_int64``), with exactly the same results.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import xxhash

from .._native import int_key_group as _int_key_group
from ..errors import UnhashableKeyError

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "UPPER_BOUND_MAX_PARALLELISM",
    "KeyGroupRange",
    "assign_to_key_group",
    "check_parallelism",
    "key_group_range_for_subtask",
    "key_groups_of_int64",
    "stable_hash",
    "subtask_for_key_group",
]

DEFAULT_MAX_PARALLELISM = 128
UPPER_BOUND_MAX_PARALLELISM = 1 << 15  # as Flink

_M64 = (1 << 64) - 1
_NONE_HASH = 0x9E3779B97F4A7C15
_BIGINT_TAG = b"\x01int:"
_TUPLE_SEED = 0x27D4EB2F165667C5
_xxh3 = xxhash.xxh3_64_intdigest
_pack_double = struct.Struct("<d").pack
_unpack_u64 = struct.Struct("<Q").unpack


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    x ^= x >> 33
    return x


def stable_hash(key: Any) -> int:
    """A 64-bit hash of ``key`` that is the same in every process; see the module docstring."""
    t = type(key)
    if t is int or t is bool:
        if -(1 << 63) <= key < (1 << 63):
            return _fmix64(key & _M64)
        return _xxh3(_BIGINT_TAG + str(key).encode())
    if t is str:
        return _xxh3(key.encode("utf-8", "surrogatepass"))
    if t is bytes:
        return _xxh3(key)
    if t is float:
        if key.is_integer() and -(2.0**63) <= key < 2.0**63:
            return _fmix64(int(key) & _M64)
        if math.isnan(key):
            key = math.nan
        return _fmix64(_unpack_u64(_pack_double(key))[0])
    if key is None:
        return _NONE_HASH
    if t is tuple:
        h = _TUPLE_SEED
        for element in key:
            h = _fmix64((h ^ (stable_hash(element) + 0x9E3779B97F4A7C15 + ((h << 6) & _M64) + (h >> 2))) & _M64)
        return h
    raise UnhashableKeyError(
        f"a key of type {t.__name__} has no stable hash; keys must be None, bool, int, float, str, bytes "
        f"or tuples of those (got {key!r})"
    )


def assign_to_key_group(key: Any, max_parallelism: int) -> int:
    """The key group of ``key``: ``stable_hash(key) % max_parallelism``."""
    group = _int_key_group(key, max_parallelism)  # ints in C: the per-record hot case
    if group >= 0:
        return group  # type: ignore[no-any-return]
    return stable_hash(key) % max_parallelism


def key_groups_of_int64(keys: Any, max_parallelism: int) -> np.ndarray:
    """Key groups of many int64 keys at once (a NumPy array, Arrow array or sequence).

    Gives exactly ``assign_to_key_group(int(k), max_parallelism)`` for each key."""
    if hasattr(keys, "to_numpy"):
        keys = keys.to_numpy(zero_copy_only=False)
    x = np.asarray(keys, dtype=np.int64).view(np.uint64).copy()
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return (x % np.uint64(max_parallelism)).astype(np.int32)


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    """Refuses settings that cannot be mapped onto key groups, naming the value."""
    if type(max_parallelism) is not int or not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(
            f"max_parallelism must be between 1 and {UPPER_BOUND_MAX_PARALLELISM}, got {max_parallelism!r}"
        )
    if type(parallelism) is not int or not 1 <= parallelism <= max_parallelism:
        raise ValueError(f"parallelism must be between 1 and max_parallelism ({max_parallelism}), got {parallelism!r}")


@dataclass(frozen=True, order=True)
class KeyGroupRange:
    """Key groups ``start`` to ``end``, both inclusive (Flink's convention). Empty when end < start."""

    start: int
    end: int

    @classmethod
    def of(cls, start: int, end: int) -> KeyGroupRange:
        if start < 0 or end < start - 1:
            raise ValueError(f"invalid key group range {start}..{end}")
        return cls(start, end)

    @classmethod
    def all(cls, max_parallelism: int) -> KeyGroupRange:
        return cls(0, max_parallelism - 1)

    @property
    def num_key_groups(self) -> int:
        return max(0, self.end - self.start + 1)

    def __len__(self) -> int:
        return self.num_key_groups

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return KeyGroupRange(start, end) if start <= end else KeyGroupRange(start, start - 1)

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"


def key_group_range_for_subtask(max_parallelism: int, parallelism: int, index: int) -> KeyGroupRange:
    """The contiguous key groups of subtask ``index``: start = ceil(i*maxP/P),
    end = ceil((i+1)*maxP/P) - 1, as Flink's computeKeyGroupRangeForOperatorIndex."""
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= index < parallelism:
        raise ValueError(f"subtask index must be between 0 and {parallelism - 1}, got {index}")
    start = (index * max_parallelism + parallelism - 1) // parallelism
    end = ((index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """The subtask that owns ``key_group`` (Flink's computeOperatorIndexForKeyGroup)."""
    return key_group * parallelism // max_parallelism
