"""The runtime: stream tasks, operators, sources."""

from __future__ import annotations

from ..connectors.base import Source
from ..connectors.collection import CollectionSource, GeneratorSource
from .base import Operator, UserFunctionError
from .keyed import KeyedProcessFunction
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
