"""pyengine: Flink-grade, exactly-once checkpointing for Python stream pipelines."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
