"""Runners: ``local`` (embedded, every subtask a thread), ``processes`` (embedded, a
worker process of this machine per parallel slot) and ``spark`` (every subtask a task of one
barrier-mode Spark stage; imports pyspark only when used)."""

from __future__ import annotations

from typing import Any

from .local import LocalRunner
from .result import JobResult

__all__ = ["JobResult", "LocalRunner", "ProcessRunner", "SparkRunner"]


def __getattr__(name: str) -> Any:
    if name == "SparkRunner":
        from .spark import SparkRunner

        return SparkRunner
    if name == "ProcessRunner":
        from .processes import ProcessRunner

        return ProcessRunner
    raise AttributeError(f"module 'pyengine.runners' has no attribute {name!r}")
