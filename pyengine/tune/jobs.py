"""Built-in jobs for ``pyengine tune`` when the user gives none, and for the tests.

``keyed_count``: an unbounded stream of (user, created) Arrow batches, counted per user
with the newest creation time (vectorised keyed aggregate; its state grows with the
users seen), into a transactional sink that commits at checkpoints and drops the rows:
the output is visible when its checkpoint completes, so the interval is part of the
latency, as it is for any exactly-once sink."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import numpy as np
import pyarrow as pa

from ..connectors.base import Sink, Source

__all__ = ["BUILTIN", "CommitDiscardSink", "StampedSource", "keyed_count"]

LATENCY_FIELD = "max_created"


class StampedSource(Source):
    """``count`` rows (None: without end) of users ``0..users-1``, each stamped with the
    wall time it was read (``created``, s since the epoch), so the sink can measure
    end-to-end latency; ``rate_per_s`` paces it (a read waits until its rows are due).
    Positions are deterministic (the users), the stamps are not: they are only timing."""

    schema = pa.schema([("user", pa.int64()), ("created", pa.float64())])

    def __init__(self, users: int = 100_000, count: Optional[int] = None, rate_per_s: Optional[float] = None) -> None:
        self.users = users
        self.count = count
        self.rate_per_s = rate_per_s
        self._start: Dict[int, float] = {}

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        first = subtask + position * parallelism
        last = first + n * parallelism
        if self.count is not None:
            if first >= self.count:
                return None
            last = min(last, self.count)
        seq = np.arange(first, last, parallelism, dtype=np.int64)
        now = time.time()
        if self.rate_per_s is not None:
            start = self._start.setdefault(subtask, now - first / self.rate_per_s)
            due = start + seq[-1] / self.rate_per_s
            if due > now:
                time.sleep(min(due - now, 0.05))
                return []  # not due yet: polled again, so checkpoints go on meanwhile
        # a multiplicative hash spreads the users over the key groups without a Python loop
        users = (seq * 2654435761) % self.users
        return pa.record_batch([users, np.full(len(seq), now)], schema=self.schema)


class CommitDiscardSink(Sink):
    """Transactional and dropping: output counts as delivered when its checkpoint
    completes, as with a file or Delta sink, without their I/O in the measurement."""

    transactional = True

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        pass

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        pass

    def recover(self, covered: Any) -> None:
        pass


def keyed_count(
    users: int = 100_000, count: Optional[int] = None, rate_per_s: Optional[float] = None
) -> Callable[[Any], None]:
    """The built-in job, as a build function for ``measure`` and ``tune``."""
    from .. import agg

    def build(env: Any) -> None:
        (
            env.from_source(StampedSource(users, count, rate_per_s), "stamped")
            .key_by("user")
            .aggregate(agg.count(), agg.max("created", alias=LATENCY_FIELD))
            .uid("per-user")
            .sink_to(CommitDiscardSink())
        )

    return build


BUILTIN: Dict[str, Callable[..., Callable[[Any], None]]] = {"keyed-count": keyed_count}
