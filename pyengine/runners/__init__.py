"""Runners: ``local`` (embedded, every subtask a thread) and, later, ``spark``."""

from __future__ import annotations

from .local import LocalRunner
from .result import JobResult

__all__ = ["JobResult", "LocalRunner"]
