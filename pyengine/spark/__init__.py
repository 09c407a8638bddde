"""What a Spark user imports: pyengine's integrations with Spark DataFrames.

Nothing here imports pyspark at module level; a DataFrame given to pyengine
brings its own session."""

from __future__ import annotations

from .dataframe import DataFrameSource

__all__ = ["DataFrameSource"]
