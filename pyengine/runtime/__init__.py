"""The runtime: stream tasks, operators, sources."""

from __future__ import annotations

from .operators import KeyedProcessFunction, Operator, UserFunctionError
from .sources import CollectionSource, GeneratorSource, Source
from .task import StreamTask

__all__ = [
    "CollectionSource",
    "GeneratorSource",
    "KeyedProcessFunction",
    "Operator",
    "Source",
    "StreamTask",
    "UserFunctionError",
]
