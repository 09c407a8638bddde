"""Time for the coordinator: a clock and delayed actions, real or manual.

The coordinator never sleeps or reads the wall clock itself, so its tests drive
time by hand (``ManualTimerService``) and every rule is checked exactly."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Callable, List, Protocol, Tuple

__all__ = ["Cancellable", "ManualTimerService", "ThreadTimerService", "TimerService"]


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class TimerService(Protocol):
    def now_ms(self) -> int: ...

    def schedule(self, delay_ms: float, action: Callable[[], Any]) -> Cancellable: ...

    def shutdown(self) -> None: ...


class _Scheduled:
    __slots__ = ("action", "cancelled")

    def __init__(self, action: Callable[[], Any]) -> None:
        self.action = action
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ThreadTimerService:
    """Delayed actions on one daemon thread, in due order."""

    def __init__(self, name: str = "pyengine-timer") -> None:
        self._queue: List[Tuple[float, int, _Scheduled]] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def schedule(self, delay_ms: float, action: Callable[[], Any]) -> Cancellable:
        item = _Scheduled(action)
        with self._cond:
            heapq.heappush(self._queue, (time.monotonic() + max(0.0, delay_ms) / 1000, next(self._seq), item))
            self._cond.notify()
        return item

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._queue or self._queue[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._queue else max(0.0, self._queue[0][0] - time.monotonic()))
                if self._stopped:
                    return
                _, _, item = heapq.heappop(self._queue)
            if not item.cancelled:
                item.action()

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()


class ManualTimerService:
    """Time moves only with ``advance(ms)``; actions due by then run in order."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._queue: List[Tuple[float, int, _Scheduled]] = []
        self._seq = itertools.count()

    def now_ms(self) -> int:
        return self._now

    def schedule(self, delay_ms: float, action: Callable[[], Any]) -> Cancellable:
        item = _Scheduled(action)
        heapq.heappush(self._queue, (self._now + max(0.0, delay_ms), next(self._seq), item))
        return item

    def advance(self, ms: float) -> None:
        target = self._now + ms
        while self._queue and self._queue[0][0] <= target:
            due, _, item = heapq.heappop(self._queue)
            self._now = max(self._now, int(due))
            if not item.cancelled:
                item.action()
        self._now = int(target)

    @property
    def scheduled(self) -> int:
        """Actions waiting (cancelled ones excluded)."""
        return sum(1 for _, _, item in self._queue if not item.cancelled)

    def shutdown(self) -> None:
        self._queue.clear()
