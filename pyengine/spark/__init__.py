"""What a Spark user imports: pyengine's integrations with Spark DataFrames.

Nothing here imports pyspark at module level; a DataFrame given to pyengine
brings its own session. The state data source subclasses pyspark's
``DataSource``, so it is loaded on first use (PEP 562)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..connectors.dataframe import DataFrameSource
from .foreach_batch import ForeachBatchHandler
from .tws import OutputSchemaError, StateNotFoundError, TransformWithStateOperator
from .tws_dataframe import transform_with_state, transform_with_state_in_pandas

if TYPE_CHECKING:
    from .state_source import StateDataSource, register_state_source

__all__ = [
    "DataFrameSource",
    "ForeachBatchHandler",
    "OutputSchemaError",
    "StateDataSource",
    "StateNotFoundError",
    "TransformWithStateOperator",
    "register_state_source",
    "transform_with_state",
    "transform_with_state_in_pandas",
]

_LAZY = {"StateDataSource", "register_state_source"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import state_source

        return getattr(state_source, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
