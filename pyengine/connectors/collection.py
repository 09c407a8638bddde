"""In-process sources: ``CollectionSource`` (a list or an Arrow table) and
``GeneratorSource`` (records made from their sequence number).

Both are deterministic by position, so a restore replays exactly what a checkpoint
had not covered."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyarrow as pa

from ..errors import NonRetryableError
from .base import Source

__all__ = [
    "CollectionSource",
    "GeneratorSource",
    "refuse_wrong_collection",
]


class CollectionSource(Source):
    """A list of records, or an Arrow table (read as batches), read in its order by
    one subtask.

    Ordering: like Flink's ``fromCollection``, this source is not parallel: subtask
    0 reads the whole collection, from first to last, and every other source subtask
    ends at once. So whatever the parallelism, the records of one key reach a keyed
    operator in the order of the collection (a hash exchange keeps the order of each
    sender). The operators chained to the source before the first exchange run on
    subtask 0 only: add ``.rebalance()`` after the source to spread stateless work
    over every subtask (this gives up the order per key), or read files with
    ``read_files``, which is parallel by split."""

    def __init__(self, records: Any) -> None:
        refuse_wrong_collection(records)
        if isinstance(records, pa.RecordBatch):
            records = pa.Table.from_batches([records])
        self.records = records if isinstance(records, pa.Table) else list(records)
        self.schema = self.records.schema if isinstance(self.records, pa.Table) else None

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if subtask != 0:
            if position:  # an older CollectionSource dealt rows round-robin to every subtask
                raise NonRetryableError(
                    f"from_collection: the checkpoint has read position {position} for source split {subtask} "
                    "of a collection, which only split 0 reads now; it was written by an older pyengine "
                    "that dealt a collection round-robin: run the job again without restoring it"
                )
            return None
        if isinstance(self.records, pa.Table):
            if position >= self.records.num_rows:
                return None
            rows = self.records.slice(position, n)
            batches = rows.to_batches()
            return batches[0] if len(batches) == 1 else rows.combine_chunks().to_batches()[0]
        if position >= len(self.records):
            return None
        return self.records[position : position + n]


def refuse_wrong_collection(records: Any) -> None:
    """``from_collection`` takes a list (any iterable) of records or an Arrow table.
    A pandas, polars or Spark DataFrame, a dict or a string is iterable too, by
    column names or characters, and would fail later with a confusing message or
    none at all: refused here, naming the call that takes it. The check goes by the
    type's module, so neither pandas nor pyspark is imported."""
    t = type(records)
    module = t.__module__ or ""
    if module.startswith("pyspark.") and hasattr(records, "isStreaming"):
        if records.isStreaming:
            raise TypeError(
                "from_collection takes a list of records or a pyarrow.Table, got a streaming Spark DataFrame "
                "(spark.readStream): read the same input as a batch DataFrame (spark.read...) and pass it to "
                "env.from_dataframe(df), or feed a running job from Structured Streaming's foreachBatch"
            )
        raise TypeError(
            "from_collection takes a list of records or a pyarrow.Table, got a Spark DataFrame: "
            "use env.from_dataframe(df)"
        )
    if module.startswith("pandas.") and t.__name__ == "DataFrame":
        raise TypeError(
            "from_collection takes a list of records or a pyarrow.Table, got a pandas DataFrame: "
            "use env.from_collection(pa.Table.from_pandas(df))"
        )
    if module.startswith("polars.") and t.__name__ in ("DataFrame", "LazyFrame"):
        call = "df.to_arrow()" if t.__name__ == "DataFrame" else "lf.collect().to_arrow()"
        raise TypeError(
            f"from_collection takes a list of records or a pyarrow.Table, got a polars {t.__name__}: "
            f"use env.from_collection({call})"
        )
    if isinstance(records, (str, bytes, bytearray)):
        raise TypeError(
            f"from_collection takes a list of records or a pyarrow.Table, got a {t.__name__} "
            f"(its characters would be the records): wrap it in a list, env.from_collection([value])"
        )
    if isinstance(records, Mapping):
        raise TypeError(
            "from_collection takes a list of records or a pyarrow.Table, got a mapping (its keys would be the "
            "records): for columns use env.from_collection(pa.table(d)), for pairs list(d.items())"
        )
    if not isinstance(records, (pa.Table, pa.RecordBatch)) and not isinstance(records, Iterable):
        raise TypeError(f"from_collection takes a list of records or a pyarrow.Table, got {t.__name__}")


class GeneratorSource(Source):
    """Records ``fn(sequence_number)``: ``count`` of them, or without end when
    ``count`` is None; at most ``rate_per_s`` per second over all subtasks when given
    (paced: a split that is ahead has "nothing now"). Deterministic by construction.

    The rate is a ceiling: each split has a token bucket that fills at its share of
    the rate and holds at most ``BURST_S`` seconds of it, so over any window of ``T``
    seconds the source gives at most ``rate_per_s * (T + BURST_S)`` records. Time the
    job spent not reading (backpressure, a stall, a restart) is not made up for later
    with a burst; the bound of 50 ms is above the source's longest idle back-off
    (20 ms), so an unhindered source still reaches the rate.

    Ordering: parallel, like Flink's ``fromSequence``: subtask ``i`` of ``p`` makes
    the records of sequence numbers ``i, i+p, i+2p, ...``, in increasing order, and
    the subtasks interleave. A key's records keep the sequence order downstream only
    when they all come from one subtask (at parallelism 1, say); otherwise use
    ``from_collection``, which keeps its order per key at any parallelism."""

    BURST_S = 0.05
    """The most of the rate a split saves up while it is not read (its bucket's size)."""

    def __init__(self, fn: Callable[[int], Any], count: Optional[int], rate_per_s: Optional[float] = None) -> None:
        if count is not None and (type(count) is not int or count < 0):
            raise ValueError(f"from_generator count must be an int >= 0 or None (unbounded), got {count!r}")
        if rate_per_s is not None and (isinstance(rate_per_s, bool) or not rate_per_s > 0):
            raise ValueError(f"from_generator rate_per_s must be a number > 0 or None, got {rate_per_s!r}")
        self.fn = fn
        self.count = count
        self.rate_per_s = rate_per_s
        # split -> (when its bucket was last filled, tokens then, the position it expects next)
        self._pace: Dict[Tuple[int, int], Tuple[float, float, int]] = {}

    def __getstate__(self) -> Dict[str, Any]:  # to Spark executors: pacing starts there
        state = self.__dict__.copy()
        state["_pace"] = {}
        return state

    def _allowed(self, subtask: int, parallelism: int, position: int, n: int) -> int:
        """How many records the split may give now: the whole tokens in its bucket,
        which fills at ``rate_per_s / parallelism`` a second up to ``BURST_S`` seconds'
        worth. A split read from another position than the one it gave last (the first
        read, a restore) starts with one token (a restore starts the clock again)."""
        assert self.rate_per_s is not None
        now = time.monotonic()
        rate = self.rate_per_s / parallelism
        size = max(1.0, rate * self.BURST_S)
        bucket = self._pace.get((subtask, parallelism))
        if bucket is None or bucket[2] != position:
            tokens = 1.0
        else:
            tokens = min(size, bucket[1] + (now - bucket[0]) * rate)
        give = max(0, min(n, int(tokens)))
        self._pace[(subtask, parallelism)] = (now, tokens - give, position + give)
        return give

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Optional[List[Any]]:
        first = subtask + position * parallelism
        if self.count is not None and first >= self.count:
            return None
        if self.rate_per_s is not None:
            n = self._allowed(subtask, parallelism, position, n)
            if n == 0:
                return []
        end = first + n * parallelism
        if self.count is not None:
            end = min(self.count, end)
        return [self.fn(i) for i in range(first, end, parallelism)]
