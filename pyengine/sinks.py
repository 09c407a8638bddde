"""Sinks: where a job's output goes, exactly once.

Transactional sinks stage what a subtask wrote between two checkpoints and make
it visible when the checkpoint covering it completes (two-phase commit). A
staged piece is named by the run that wrote it and the checkpoint of that run
that covers it, so recovery needs no state of its own: restoring a checkpoint
that covers ``[(run W, 5), (run X, 12)]`` commits every staged piece of W up to
5 and of X up to 12 (those checkpoints completed; only their commit never ran)
and removes everything else of that lineage (its records will be replayed).

A runner drives a sink as follows (the driver's calls in capitals):

- ``begin_run(run)`` once per run, before anything else;
- ``recover(covered)`` before each attempt, the first too;
- ``stage``/``commit`` in the tasks (on Spark: on executors, after pickling);
- ``end_run(status)`` once at the end.

The sinks live in ``pyengine.connectors``, one module per system, on the protocol of
``pyengine.connectors.base``; this module is where a user finds them
(``pe.sinks.FileSink``), and it only re-exports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .connectors.base import FINAL as FINAL  # the checkpoint id of the end of input, for a sink written by hand
from .connectors.base import Covered, RecordRejectedError, RunInfo, Sink, run_tag
from .connectors.console import CollectSink, DiscardSink, PrintSink
from .connectors.filesink import FileSink

__all__ = [
    "CollectSink",
    "Covered",
    "DeltaSink",
    "DiscardSink",
    "FileSink",
    "PostgresSink",
    "PrintSink",
    "RecordRejectedError",
    "RunInfo",
    "Sink",
    "run_tag",
]

if TYPE_CHECKING:
    from .connectors.delta import DeltaSink
    from .connectors.postgres import PostgresSink
else:
    _LAZY = {"DeltaSink": "pyengine.connectors.delta", "PostgresSink": "pyengine.connectors.postgres"}

    def __getattr__(name: str) -> Any:
        """``DeltaSink`` and ``PostgresSink`` live in ``pyengine.connectors.delta`` and
        ``pyengine.connectors.postgres``; they are looked up by name on first use (PEP 562),
        so ``import pyengine`` loads neither, and ``deltalake`` or ``psycopg`` is loaded
        only when a table is written."""
        if name in _LAZY:
            import importlib

            return getattr(importlib.import_module(_LAZY[name]), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
