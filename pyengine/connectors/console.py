"""Sinks that keep nothing outside the run: collect in memory, print, discard.

Used by tests, examples and ``execute()``'s ``JobResult.records``; none of them
needs a two-phase commit across runs."""

from __future__ import annotations

import sys
import threading
from typing import Any, Dict, List, Optional, TextIO, Tuple

import pyarrow as pa

from ..state.serializers import unviewed as _unviewed
from .base import Covered, RunInfo, Sink
from .records import _rows

__all__ = [
    "CollectSink",
    "DiscardSink",
    "PrintSink",
]


class CollectSink(Sink):
    """Results kept in memory and returned in ``JobResult.records``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (run id, subtask, checkpoint id) -> records staged
        self._staged: Dict[Tuple[Optional[str], int, int], List[Any]] = {}
        self._run_id: Optional[str] = None
        self.records: List[Any] = []

    def begin_run(self, run: RunInfo) -> None:
        with self._lock:
            self._run_id = run.run_id

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        rows = _rows(records)
        # a ListState.get() view in a record: kept as the list it shows, as the process
        # runner (which pickles records) and every other sink deliver it, and plain data
        # for json.dumps or pyarrow after the job
        plain = None if isinstance(records, (pa.Table, pa.RecordBatch)) else _unviewed(rows)
        if plain is not None:
            rows = plain
        with self._lock:
            self._staged.setdefault((self._run_id, subtask, checkpoint_id), []).extend(rows)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        with self._lock:
            keys = [k for k in self._staged if k[0] == self._run_id and k[1] == subtask and k[2] <= checkpoint_id]
            for key in sorted(keys, key=lambda k: k[2]):
                self.records.extend(self._staged.pop(key))

    def recover(self, covered: Covered) -> None:
        """Commits staged pieces the restored state covers (checkpoints of their run up
        to the covered one: they completed, only their commit never ran); drops the rest."""
        upto = {str(r): int(c) for r, c in covered}
        with self._lock:
            for key in sorted(self._staged, key=lambda k: (k[2], k[1])):
                records = self._staged.pop(key)
                run_id, _, checkpoint_id = key
                if run_id is not None and run_id in upto and checkpoint_id <= upto[run_id]:
                    self.records.extend(records)


class PrintSink(Sink):
    """Prints each record as it arrives (not transactional: for looking, not for keeping)."""

    transactional = False

    def __init__(self, stream: Optional[TextIO] = None, prefix: str = "") -> None:
        self._stream = stream
        self.prefix = prefix
        self._lock = threading.Lock()

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        out = self._stream or sys.stdout
        with self._lock:
            for r in _rows(records):
                print(f"{self.prefix}{r}", file=out)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        pass

    def recover(self, covered: Covered) -> None:
        pass


class DiscardSink(Sink):
    """Drops everything, counting records: for benchmarks, as Flink's DiscardingSink."""

    transactional = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        with self._lock:
            self.count += len(records)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        pass

    def recover(self, covered: Covered) -> None:
        pass
