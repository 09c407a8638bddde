"""``pyengine tune``: measures a job across buffer and checkpoint settings (buffer size,
buffer timeout, channel capacity, checkpoint interval, aligned or unaligned and the
aligned timeout) with short runs, and recommends settings for a goal (throughput or
latency) under constraints (``max_latency_ms``, ``max_recovery_s``), with the evidence:
a table, an HTML report with figures, and pytest-benchmark JSON.

``pe.tune(...)`` is ``pyengine.tune.tune``; ``measure`` runs one setting once."""

from __future__ import annotations

import sys
import types
from typing import Any

from .measure import JobBuilder, Measurement, measure
from .search import GOALS, TuneResult, recommend, tune
from .settings import DEFAULT_SPACE, Setting

__all__ = [
    "DEFAULT_SPACE",
    "GOALS",
    "JobBuilder",
    "Measurement",
    "Setting",
    "TuneResult",
    "measure",
    "recommend",
    "tune",
]


class _CallableModule(types.ModuleType):
    """``pe.tune(...)`` is the function, and ``pyengine.tune`` is this package: once the
    package is imported Python binds the name ``tune`` of ``pyengine`` to it, so the
    package answers the call itself rather than leave ``pe.tune`` to depend on import order."""

    def __call__(self, *args: Any, **kwargs: Any) -> TuneResult:
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
