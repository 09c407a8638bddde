"""Failure injection for the exactly-once tests: one ``Chaos`` is shared by every
subtask and every attempt of a job (functions and sinks keep it through
``__deepcopy__``), so a planned failure happens once in the whole run, in whichever
attempt gets there, and the restarted job runs past it."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable, List, Mapping, Optional, Tuple, Union

import pyengine as pe

Plan = Union[str, Mapping[str, int], Iterable[Tuple[str, int]]]


class Chaos:
    """Fails the ``n``-th call of ``hit(point)`` for each ``(point, n)`` planned, once.

    ``Chaos("user", 40)`` plans one failure (its ``at`` is 40); a mapping
    ``{"user": 40, "commit": 2}`` or pairs ``[("record", 350), ("record", 700)]`` plan
    several. ``fired`` lists what failed, in order, ``calls`` counts the hits of each
    point."""

    def __init__(self, plan: Plan, at: Optional[int] = None) -> None:
        if isinstance(plan, str):
            if at is None:
                raise TypeError("Chaos(point, at): the call of point that fails is missing")
            pairs: List[Tuple[str, int]] = [(plan, at)]
        elif isinstance(plan, Mapping):
            pairs = list(plan.items())
        else:
            pairs = list(plan)
        self.at = at
        self.plan = set(pairs)
        self.calls: Counter = Counter()
        self.fired: List[Tuple[str, int]] = []
        self.lock = threading.Lock()

    def hit(self, point: str) -> None:
        with self.lock:
            self.calls[point] += 1
            n = self.calls[point]
            if (point, n) not in self.plan:
                return
            self.plan.discard((point, n))
            self.fired.append((point, n))
        raise RuntimeError(f"injected failure at {point} #{n}")

    def fired_at(self, point: str) -> bool:
        """Whether a failure planned at ``point`` happened."""
        return any(p == point for p, _ in self.fired)


class ChaosSink(pe.sinks.CollectSink):
    """A ``CollectSink`` whose every commit hits ``"commit"`` first: a failure between
    a checkpoint's completion and its output's publication."""

    def __init__(self, chaos: Chaos) -> None:
        super().__init__()
        self.chaos = chaos

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        self.chaos.hit("commit")
        super().commit(subtask, checkpoint_id)
