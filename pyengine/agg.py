"""Aggregations for ``KeyedStream.aggregate``: ``count``, ``sum``, ``min``, ``max``, ``mean``.

They run on whole Arrow batches: Arrow's hash aggregation reduces a batch to one
row per key, and those partial results are merged into typed columnar keyed
state with a few NumPy calls — no Python call per record. Each one names its
output column (``alias=`` to choose another name).

``aggregate(..., emit="updates")`` (the default) emits the totals so far of every
key a batch touched, with an int64 ``_seq`` column that grows from each row of a
key to the next (the largest is the final value); ``emit="final"`` emits each key
once, at the end of bounded input. See ``pyengine.runtime.aggregate``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Aggregation", "count", "max", "mean", "min", "sum"]

_KINDS = ("count", "sum", "min", "max", "mean")


@dataclass(frozen=True)
class Aggregation:
    """One aggregate over ``column`` (None for ``count``, which counts records)."""

    kind: str
    column: Optional[str]
    alias: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown aggregation {self.kind!r}; use one of {', '.join(_KINDS)}")
        if self.kind != "count" and (not isinstance(self.column, str) or not self.column):
            raise ValueError(f"pe.agg.{self.kind} needs a column name, got {self.column!r}")
        if self.alias is not None and (not isinstance(self.alias, str) or not self.alias):
            raise ValueError(f"alias must be a non-empty string, got {self.alias!r}")

    @property
    def output(self) -> str:
        """The name of the output column."""
        if self.alias is not None:
            return self.alias
        return "count" if self.column is None else f"{self.kind}_{self.column}"


def count(column: Optional[str] = None, *, alias: Optional[str] = None) -> Aggregation:
    """Records per key; with a column, its non-null values per key."""
    return Aggregation("count", column, alias)


def sum(column: str, *, alias: Optional[str] = None) -> Aggregation:
    """Sum of a numeric column per key (nulls skipped); int64 for integer columns, else float64."""
    return Aggregation("sum", column, alias)


def min(column: str, *, alias: Optional[str] = None) -> Aggregation:
    """Smallest non-null value of a numeric column per key."""
    return Aggregation("min", column, alias)


def max(column: str, *, alias: Optional[str] = None) -> Aggregation:
    """Largest non-null value of a numeric column per key."""
    return Aggregation("max", column, alias)


def mean(column: str, *, alias: Optional[str] = None) -> Aggregation:
    """Mean of the non-null values of a numeric column per key (float64)."""
    return Aggregation("mean", column, alias)
