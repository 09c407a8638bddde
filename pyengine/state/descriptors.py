"""State descriptors: a state's name, kind, value type, time-to-live and serializer.

The names are Flink's. ``type`` is an optional ``pyarrow.DataType``: typed
state is stored in columns of that type (fast, compact, readable by any Arrow
tool), untyped state through the safe serializer. ``ttl`` is a
``StateTtlConfig``, a ``datetime.timedelta`` or milliseconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional, Protocol, TypeVar, Union

import pyarrow as pa

from ..errors import NonRetryableError
from .serializers import serializer_for

__all__ = [
    "AggregateFunction",
    "ReduceFunction",
    "StateDescriptorError",
    "StateNameConflictError",
    "StateTypeError",
    "AggregatingStateDescriptor",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "ReducingStateDescriptor",
    "StateDescriptor",
    "StateTtlConfig",
    "StateVisibility",
    "TtlUpdateType",
    "ValueStateDescriptor",
]

# Type parameters of the descriptors: what the state holds, so that
# ``ctx.get_state(ValueStateDescriptor[int]("n")).value()`` is ``Optional[int]``
# in a type checker. They are for the checker only: at run time the declared
# Arrow ``type`` (if any) is what is checked and stored.
# Each defaults to Any (PEP 696), so an untyped ``ListStateDescriptor("x")`` stays
# ``ListStateDescriptor[Any]`` instead of a type checker asking for an annotation.
# typing_extensions (which every mypy installs) only for the checker: at run time
# the parameters carry nothing and typing's TypeVar has no ``default`` before 3.13.
if TYPE_CHECKING:
    from typing_extensions import TypeVar as _TypeVar

    T = _TypeVar("T", default=Any)
    K = _TypeVar("K", default=Any)
    V = _TypeVar("V", default=Any)
    IN = _TypeVar("IN", default=Any)
    OUT = _TypeVar("OUT", default=Any)
else:
    T, K, V, IN, OUT = (TypeVar(n) for n in ("T", "K", "V", "IN", "OUT"))


class StateDescriptorError(NonRetryableError, TypeError):
    """A state descriptor that cannot work as written (an Arrow type where the default
    goes, a default that is not of the declared type): the same code fails the same way
    after any restart, so a job fails at once."""


class StateTypeError(NonRetryableError, TypeError):
    """A value written to a state that does not fit the state's declared Arrow type:
    the replay after a restart writes it again, so a job fails at once."""


class StateNameConflictError(NonRetryableError, ValueError):
    """One state name asked for with two different descriptors (another kind, type or
    TTL): the same code asks again after any restart, so a job fails at once."""


class TtlUpdateType(enum.Enum):
    """When an entry's time-to-live restarts."""

    ON_CREATE_AND_WRITE = "on_create_and_write"
    ON_READ_AND_WRITE = "on_read_and_write"


class StateVisibility(enum.Enum):
    """Whether an expired entry that is still stored may be returned."""

    NEVER_RETURN_EXPIRED = "never_return_expired"
    RETURN_EXPIRED_IF_NOT_CLEANED_UP = "return_expired_if_not_cleaned_up"


@dataclass(frozen=True)
class StateTtlConfig:
    """Time-to-live of state entries, in processing time (Flink's StateTtlConfig)."""

    ttl_ms: int
    update_type: TtlUpdateType = TtlUpdateType.ON_CREATE_AND_WRITE
    state_visibility: StateVisibility = StateVisibility.NEVER_RETURN_EXPIRED

    def __post_init__(self) -> None:
        if type(self.ttl_ms) is not int or self.ttl_ms <= 0:
            raise ValueError(f"StateTtlConfig: ttl_ms must be a positive int of milliseconds, got {self.ttl_ms!r}")
        object.__setattr__(self, "update_type", TtlUpdateType(self.update_type))
        object.__setattr__(self, "state_visibility", StateVisibility(self.state_visibility))

    @classmethod
    def of(cls, ttl: Union[StateTtlConfig, timedelta, int, float, None]) -> Optional[StateTtlConfig]:
        """Normalises a descriptor's ``ttl`` argument; None means no expiry."""
        if ttl is None or isinstance(ttl, StateTtlConfig):
            return ttl
        if isinstance(ttl, timedelta):
            ms = ttl / timedelta(milliseconds=1)
        elif isinstance(ttl, (int, float)) and not isinstance(ttl, bool):
            ms = ttl
        else:
            raise TypeError(f"ttl must be a StateTtlConfig, a timedelta or milliseconds, got {ttl!r}")
        if ms <= 0 or ms != ms:
            raise ValueError(f"ttl must be positive, got {ttl!r}")
        return cls(max(1, round(ms)))


class ReduceFunction(Protocol):
    """PyFlink's ``ReduceFunction`` shape: an object whose ``reduce(a, b)`` folds two
    values into one; ``ReducingStateDescriptor`` takes it or a plain function."""

    def reduce(self, value1: Any, value2: Any) -> Any: ...


class AggregateFunction(Protocol):
    """What an AggregatingStateDescriptor needs (Flink's AggregateFunction)."""

    def create_accumulator(self) -> Any: ...

    def add(self, value: Any, accumulator: Any) -> Any: ...

    def get_result(self, accumulator: Any) -> Any: ...


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a state name must be a non-empty str, got {name!r}")


def _check_type(what: str, value: Any) -> None:
    if value is not None and not isinstance(value, pa.DataType):
        raise TypeError(f"{what} must be a pyarrow.DataType or None, got {value!r}")
    if value is not None and _has_dictionary(value):
        # Inside the state file's union, pyarrow writes a dictionary type it then cannot
        # read ("Message metadata too long"): a checkpoint that would never restore.
        raise StateDescriptorError(
            f"{what} {value} is or holds a dictionary type, which state cannot store (a checkpoint of it "
            "could not be read back); declare the values' own type instead, e.g. pa.string() for "
            "pa.dictionary(pa.int32(), pa.string())"
        )


def _has_dictionary(arrow_type: pa.DataType) -> bool:
    if pa.types.is_dictionary(arrow_type):
        return True
    return any(_has_dictionary(arrow_type.field(i).type) for i in range(arrow_type.num_fields))


_TTL = Optional[Union[StateTtlConfig, timedelta, int, float]]

# pyarrow's factories of types without parameters, to name a type as code (``pa.float64()``
# prints as ``double``, which is no pyarrow function)
_FACTORIES = (
    "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
    "float64", "string", "large_string", "binary", "large_binary", "date32", "date64", "null",
)  # fmt: skip


def _spelled(arrow_type: pa.DataType) -> str:
    """How to write ``arrow_type`` in code, or "the type" for one with parameters."""
    for name in _FACTORIES:
        if getattr(pa, name)() == arrow_type:
            return f"pa.{name}()"
    return "the type"


@dataclass(frozen=True)
class StateDescriptor:
    """Common part of every descriptor; use the concrete classes.

    Every descriptor ends with ``ttl`` (positional, last) and the keyword-only
    ``serializer`` (``"safe"``, or ``"pickle"`` to opt in for this state)."""

    name: str

    kind = "state"

    def __post_init__(self) -> None:
        _check_name(self.name)
        object.__setattr__(self, "ttl", StateTtlConfig.of(getattr(self, "ttl", None)))
        serializer_for(getattr(self, "serializer", "safe"))  # validates the name

    @property
    def allows_pickle(self) -> bool:
        return getattr(self, "serializer", "safe") == "pickle"


@dataclass(frozen=True)
class ValueStateDescriptor(StateDescriptor, Generic[T]):
    """One value per key. ``value()`` returns ``default`` for a key without one.

    ``ValueStateDescriptor[int]("count", 0)`` types the state for a type checker."""

    default: Optional[T] = None
    type: Optional[pa.DataType] = None
    ttl: _TTL = None
    serializer: str = field(default="safe", kw_only=True)

    kind = "value"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.default, pa.DataType):  # PyFlink's habit: the type second
            spelled = _spelled(self.default)
            raise StateDescriptorError(
                f"ValueStateDescriptor {self.name!r}: the second argument is the default value (what a key "
                f"without one reads), and {self.default} is an Arrow type; pass the type as type=: "
                f"ValueStateDescriptor({self.name!r}, type={spelled}), or after a default: "
                f"ValueStateDescriptor({self.name!r}, <default>, {spelled})"
            )
        _check_type("ValueStateDescriptor type", self.type)


@dataclass(frozen=True)
class ListStateDescriptor(StateDescriptor, Generic[T]):
    """A list of elements per key; ``type`` is the element type
    (``ListStateDescriptor[float]("amounts")`` for a type checker)."""

    type: Optional[pa.DataType] = None
    ttl: _TTL = None
    serializer: str = field(default="safe", kw_only=True)

    kind = "list"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_type("ListStateDescriptor type", self.type)


@dataclass(frozen=True)
class MapStateDescriptor(StateDescriptor, Generic[K, V]):
    """A map per key (user keys to user values;
    ``MapStateDescriptor[str, int]("pages")`` for a type checker)."""

    key_type: Optional[pa.DataType] = None
    value_type: Optional[pa.DataType] = None
    ttl: _TTL = None
    serializer: str = field(default="safe", kw_only=True)

    kind = "map"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_type("MapStateDescriptor key_type", self.key_type)
        _check_type("MapStateDescriptor value_type", self.value_type)


@dataclass(frozen=True)
class ReducingStateDescriptor(StateDescriptor, Generic[T]):
    """One value per key, folded with ``reduce_function(accumulated, new)`` on ``add``."""

    reduce_function: Union[Callable[[T, T], T], ReduceFunction]
    type: Optional[pa.DataType] = None
    ttl: _TTL = None
    serializer: str = field(default="safe", kw_only=True)

    kind = "reducing"

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.reduce_function
        if not callable(f) and callable(getattr(f, "reduce", None)):
            # PyFlink's shape: a ReduceFunction object whose reduce(a, b) folds two values
            object.__setattr__(self, "reduce_function", f.reduce)
        elif not callable(f):
            raise TypeError(
                f"ReducingStateDescriptor {self.name!r}: reduce_function must be a function of two values "
                f"(or an object with a reduce(a, b) method), got {f!r}"
            )
        _check_type("ReducingStateDescriptor type", self.type)


@dataclass(frozen=True)
class AggregatingStateDescriptor(StateDescriptor, Generic[IN, OUT]):
    """An accumulator per key, built by ``aggregate_function``; ``type`` is the accumulator's.
    ``IN`` is what ``add`` takes and ``OUT`` what ``get`` returns (for a type checker)."""

    aggregate_function: AggregateFunction
    type: Optional[pa.DataType] = None
    ttl: _TTL = None
    serializer: str = field(default="safe", kw_only=True)

    kind = "aggregating"

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.aggregate_function
        missing = [m for m in ("create_accumulator", "add", "get_result") if not callable(getattr(f, m, None))]
        if missing:
            raise TypeError(f"AggregatingStateDescriptor {self.name!r}: aggregate_function lacks {', '.join(missing)}")
        _check_type("AggregatingStateDescriptor type", self.type)
