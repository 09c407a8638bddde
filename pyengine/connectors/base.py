"""The protocol a connector implements: ``Source`` for input, ``Sink`` for output.

Every source and sink of pyengine, and a third party's own, is a subclass of one of
these two classes; the runtime knows nothing else about a connector. Exactly-once
rests on two promises, one per side.

**A source is replayable by position.** The runtime reads a source split by split
(``Source.read(subtask, parallelism, position, n)``) and keeps each split's
position, the number of its records already read, in the operator state of the
source task, together with whatever ``Source.split_state`` returns. A checkpoint
therefore holds, per split, "read up to here"; a restore hands every split back
with its position (at another parallelism too: splits are dealt round-robin to the
new subtasks), calls ``restore_split_state`` and reads on from there. So ``read``
must give the same records for the same position in every attempt; a source that
cannot (a queue that forgets what it delivered) cannot be exactly-once.

**A sink commits in two phases, tied to checkpoints.** The sink task buffers what
reaches it between two checkpoints; when checkpoint ``n``'s barrier comes, before the
barrier goes on, it hands the buffer to ``stage(subtask, n, records)`` (the
pre-commit: written, but invisible to readers). When checkpoint ``n`` completes, every
sink subtask is told ``commit(subtask, n)``, which makes visible what it staged for
``n`` and earlier checkpoints (Flink's ``TwoPhaseCommitSinkFunction``). A commit may
be lost (a failure right after the checkpoint completed), hence ``recover``.
A staged piece is named by the run that wrote it and the checkpoint of that run that
covers it, so recovery needs no state of its own: restoring a checkpoint that
covers ``[(run W, 5), (run X, 12)]`` commits every staged piece of W up to 5 and of
X up to 12 (those checkpoints completed; only their commit never ran) and removes
everything else of that lineage (its records will be replayed).

A runner drives a sink as follows:

- ``begin_run(run)`` once per run, on the driver, before anything else (``RunInfo``:
  who writes; a sink that keeps output across runs checks here that it may write);
- ``recover(covered)`` on the driver before each attempt, the first too: make the
  output exactly what the restored state covers (``()``: a fresh start);
- ``open``, ``stage`` and ``commit`` in the tasks (on Spark: on executors, after
  pickling, so a sink's locks are made anew there); at the end of input without
  checkpoints, what is left is staged and committed as checkpoint ``FINAL``;
- ``end_run(status)`` once at the end, on the driver (``FINISHED``, ``FAILED`` or
  ``CANCELED``).

A sink that is not transactional (``transactional = False``: print, discard) gets
each batch at ``stage`` as it arrives (checkpoint id 0), nothing buffered; what it
writes is at-least-once (a replay writes it again).

Where a new connector goes: one module per system in ``pyengine/connectors/``, built
on this module only (never on ``pyengine.sinks``, the user's names, nor on a runner),
and loading the system's own library on first use."""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import pyarrow as pa

from ..errors import ColumnNotFoundError, NonRetryableError, suggest_keywords

__all__ = [
    "Covered",
    "FINAL",
    "RecordRejectedError",
    "RunInfo",
    "Sink",
    "Source",
    "check_columns",
    "run_tag",
]


FINAL = 2**62  # the checkpoint id of what is staged at the end of input without checkpoints

# The lineage a restored state covers: (run id, last checkpoint id of that run it covers), oldest first.
Covered = Sequence[Tuple[str, int]]


@dataclass(frozen=True)
class RunInfo:
    """Who is writing: one run of a job.

    ``run_id`` is this run's id (the job id of ``JobResult``); ``lineage_id`` the id of
    the first run of the chain of restores this run continues (a fresh run: its own
    id), so a sink tells its own earlier output from another job's; ``restored`` the
    lineage of the checkpoint this run started from (``()`` for a fresh start)."""

    job_name: str
    run_id: str
    lineage_id: str
    restored: Tuple[Tuple[str, int], ...] = ()


class RecordRejectedError(NonRetryableError, ValueError):
    """A record a sink cannot write as it is: a value that is not JSON (NaN, a set,
    bytes, an object), a field the declared schema lacks or a value that does not
    fit it. No restart changes the record, so the job fails at once; it is also a
    ``ValueError``, as a bad value is in Python."""


def run_tag(run_id: str) -> str:
    """The 12 hex characters that name a run in part-file names: the start of a hex
    run id (``uuid4().hex``), else a digest of the id, so every run id has one and a
    part name never carries characters a filesystem dislikes."""
    if re.fullmatch(r"[0-9a-f]{12,}", run_id):
        return run_id[:12]
    return hashlib.sha1(run_id.encode()).hexdigest()[:12]


def _covered_map(covered: Covered) -> Dict[str, int]:
    """Run tag -> last checkpoint covered (a run listed twice: its larger id)."""
    out: Dict[str, int] = {}
    for run_id, checkpoint_id in covered:
        tag = run_tag(str(run_id))
        out[tag] = max(out.get(tag, -1), int(checkpoint_id))
    return out


class Sink:
    """A sink's subtasks call ``stage``/``commit``; the runner calls ``begin_run``,
    ``recover`` and ``end_run`` on the driver."""

    transactional = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every sink's constructor, a user's own too, answers an unknown keyword with
        # "did you mean" (pe.sinks.FileSink(fromat="csv")), its signature unchanged.
        super().__init_subclass__(**kwargs)
        suggest_keywords(cls)

    def open(self, subtask: int) -> None:
        pass

    # Sinks travel to Spark executors inside the job: their locks are made anew there.
    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def begin_run(self, run: RunInfo) -> None:
        """Once per run, on the driver, before anything else: who is writing. A sink
        that keeps output across runs checks here that it may write where it writes."""

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        """Keeps ``records`` invisibly until ``commit`` of a checkpoint >= ``checkpoint_id``.

        ``checkpoint_id`` is this run's (ids restart in each run; ``FINAL`` at the end of
        input without checkpoints). ``records`` is a list of records, or a
        ``pyarrow.Table`` when the stream carried Arrow batches (``map_batches``,
        ``aggregate``, ``read_files``)."""
        raise NotImplementedError

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        """Makes visible what ``subtask`` staged in this run for checkpoints <= ``checkpoint_id``."""
        raise NotImplementedError

    def recover(self, covered: Covered) -> None:
        """Before each attempt (the first too), on the driver: make the output exactly
        what the restored state covers. ``covered`` lists ``(run_id, last checkpoint id)``
        of the lineage, oldest first; ``()`` is a fresh start."""
        raise NotImplementedError

    def end_run(self, status: str) -> None:
        """Once at the end of the run, on the driver: ``FINISHED``, ``FAILED`` or ``CANCELED``."""


class Source:
    """A bounded, replayable input, read split by split.

    ``read(subtask, parallelism, position, n)`` returns up to ``n`` records of the
    split that subtask ``subtask`` of ``parallelism`` reads, starting at
    ``position`` (the number of records of that split already read):

    - a list of records or a ``pyarrow.RecordBatch``, possibly shorter than ``n`` or
      empty: what is there now. A short or empty result does **not** end the split:
      the source is polled again (after a short back-off when nothing came), so a
      source that waits on something outside (a queue, a service) returns what it
      has and lets checkpoints and other tasks go on meanwhile;
    - ``None`` (``Source.END``): the split has ended; it is not read again.

    ``read`` must be deterministic by position: the records from ``position`` on
    are the same in every attempt, so that a restore, which rewinds each split to
    its checkpointed position, replays exactly what the checkpoint had not covered.

    ``schema`` is the ``pyarrow.Schema`` of the records when the source knows it
    (Arrow sources), else None; with it, column names are checked when the job is
    built (``key_by``, ``aggregate``) instead of failing at run time.

    Ordering: records of one split reach the next operator in the order ``read``
    returns them; records of different splits interleave. Each source says below
    what that means for the order of one key's records downstream."""

    END: Optional[Any] = None
    """What ``read`` returns at the end of a split."""

    schema: Optional[pa.Schema] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every source's constructor, a user's own too, answers an unknown keyword with
        # "did you mean", its signature unchanged.
        super().__init_subclass__(**kwargs)
        suggest_keywords(cls)

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        """Up to ``n`` records from ``position`` of the split; ``None`` at its end."""
        raise NotImplementedError

    def split_state(self, subtask: int, parallelism: int) -> Any:
        """What a split needs besides its position to be read again the same way after
        a restore (plain data; None: nothing), checkpointed with the position. A
        source whose splits grow as it runs (a watched directory: the files a split
        has taken, in order) keeps it here."""
        return None

    def restore_split_state(self, subtask: int, parallelism: int, state: Any) -> None:
        """Before a run reads a split: the state ``split_state`` gave at the restored
        checkpoint, or None for a fresh start."""

    def is_processing_backlog(self) -> bool:
        """True while the source is catching up on a backlog (Flink's
        ``isProcessingBacklog``, FLIP-309): the job then checkpoints every
        ``CheckpointConfig.interval_during_backlog_ms``. Asked from the coordinator's
        thread at every checkpoint tick, so it must be cheap and thread-safe (read a
        flag). A source may also tell the coordinator itself,
        ``coordinator.set_processing_backlog(name, True)``."""
        return False


def check_columns(schema: Optional[pa.Schema], columns: Sequence[str], where: str) -> None:
    """Raises ``ColumnNotFoundError`` naming the first of ``columns`` that ``schema``
    lacks, the columns there are, and the closest name; nothing when the schema is
    unknown (None), as after a ``map``."""
    if schema is None:
        return
    names = list(schema.names)
    for column in columns:
        if column not in names:
            raise ColumnNotFoundError(_missing(column, names, where))


def _missing(column: str, names: Sequence[str], where: str) -> str:
    import difflib

    close = difflib.get_close_matches(column, list(names), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: no column {column!r} in the records (columns: {', '.join(map(str, names))}){hint}"
