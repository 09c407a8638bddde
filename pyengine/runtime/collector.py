"""The cyclic garbage collector while tasks run: its youngest generation's threshold
raised for as long as any task of this process runs (see the class for why)."""

from __future__ import annotations

import gc
import threading
from typing import Optional, Tuple

__all__ = ["TASK_GC_THRESHOLD", "YOUNG_GENERATION"]

TASK_GC_THRESHOLD = 20_000


class _YoungGenerationWhileRunning:
    """The cyclic collector's youngest-generation threshold raised to
    ``TASK_GC_THRESHOLD`` (Python's default: 700) while any task of this process
    runs, restored when the last one ends (counted: the threads executor runs many).

    Why: a per-record job keeps the records it buffers (a join's sides, a window's
    contents) as dicts that live for seconds: at 700 the collector walked them in
    the youngest generation, again in the middle one, and the many promotions set
    off a full collection every ~25% growth of the oldest, which walks them all
    again. On Nexmark q4's interval join (``bench/test_bench_joins.py``) that was
    11-13% of the job's CPU, 7 full collections a run; at 20,000, 4-6%, none. The
    collector still runs on every generation (every 20,000 net allocations, the
    older ones as often relative to it), so cycles made by user code are collected
    and memory stays bounded (``tests/test_join_buffers.py``, ``tests/test_gc_heap.py``). The
    worker processes of the processes executor raise it the same way
    (``runners.processes.WORKER_GC_THRESHOLD``). A threshold someone changed while
    tasks ran is left as they set it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks = 0
        self._saved: Optional[Tuple[int, int, int]] = None
        self._ours: Optional[Tuple[int, int, int]] = None

    def enter(self) -> None:
        with self._lock:
            if self._tasks == 0:
                saved = gc.get_threshold()
                if 0 < saved[0] < TASK_GC_THRESHOLD:  # 0: the collector is off, leave it so
                    self._saved, self._ours = saved, (TASK_GC_THRESHOLD, saved[1], saved[2])
                    gc.set_threshold(*self._ours)
            self._tasks += 1

    def exit(self) -> None:
        with self._lock:
            self._tasks -= 1
            if self._tasks == 0 and self._saved is not None:
                if gc.get_threshold() == self._ours:
                    gc.set_threshold(*self._saved)
                self._saved = self._ours = None


YOUNG_GENERATION = _YoungGenerationWhileRunning()
