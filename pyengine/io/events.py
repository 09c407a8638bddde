"""Events that travel on channels between the data, and what the gate reports.

They are small immutable values: the same barrier object may be broadcast to
many channels and compared across processes, so it must never change after it
is built. The classes are final because the native gate recognises events by
their exact type (one pointer comparison per buffer, not an ``isinstance``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict

__all__ = [
    "CancelCheckpointMarker",
    "CheckpointBarrier",
    "CheckpointFailureReason",
    "CheckpointMetrics",
    "CheckpointOptions",
    "CheckpointType",
    "EndOfPartition",
    "MAX_WATERMARK",
    "MIN_WATERMARK",
    "WATERMARK_ACTIVE",
    "WATERMARK_IDLE",
    "Watermark",
    "WatermarkStatus",
    "time_event_from_json",
    "time_event_to_json",
]


class _Final:
    """Base of the event classes: they may not be subclassed."""

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if _Final not in cls.__bases__:
            raise TypeError(f"{cls.__mro__[1].__name__} is final: the gate recognises events by exact type")
        super().__init_subclass__(**kwargs)


def _check_checkpoint_id(owner: str, checkpoint_id: Any) -> None:
    if type(checkpoint_id) is bool or not isinstance(checkpoint_id, int):
        raise TypeError(f"{owner}: checkpoint_id must be an int, got {checkpoint_id!r}")
    if checkpoint_id < 0:
        raise ValueError(f"{owner}: checkpoint_id must be >= 0, got {checkpoint_id}")
    if checkpoint_id >= 2**63:
        raise ValueError(f"{owner}: checkpoint_id must fit in 64 bits, got {checkpoint_id}")


class CheckpointType(enum.Enum):
    """What a barrier asks for: a periodic checkpoint or a user-owned savepoint."""

    CHECKPOINT = "checkpoint"
    SAVEPOINT = "savepoint"
    SYNC_SAVEPOINT = "sync_savepoint"

    def __repr__(self) -> str:
        return f"CheckpointType.{self.name}"

    @property
    def is_savepoint(self) -> bool:
        return self is not CheckpointType.CHECKPOINT


@dataclass(frozen=True, slots=True, repr=False)
class CheckpointOptions(_Final):
    """How a checkpoint is taken. Savepoints are always aligned, as in Flink."""

    checkpoint_type: CheckpointType = CheckpointType.CHECKPOINT
    unaligned: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_type, CheckpointType):
            raise TypeError(
                f"CheckpointOptions: checkpoint_type must be a CheckpointType, got {self.checkpoint_type!r}"
            )
        if not isinstance(self.unaligned, bool):
            raise TypeError(f"CheckpointOptions: unaligned must be a bool, got {self.unaligned!r}")
        if self.unaligned and self.checkpoint_type.is_savepoint:
            raise ValueError(f"CheckpointOptions: a {self.checkpoint_type.value} cannot be unaligned")

    def __repr__(self) -> str:
        extra = ", unaligned=True" if self.unaligned else ""
        return f"CheckpointOptions({self.checkpoint_type!r}{extra})"


_DEFAULT_OPTIONS = CheckpointOptions()


@dataclass(frozen=True, slots=True, repr=False)
class CheckpointBarrier(_Final):
    """Marks the point in a channel's stream that belongs to checkpoint ``checkpoint_id``.

    ``timestamp`` is when the coordinator triggered the checkpoint (milliseconds
    since the epoch); the gate derives the checkpoint start delay from it.
    """

    checkpoint_id: int
    timestamp: int
    options: CheckpointOptions = _DEFAULT_OPTIONS

    def __post_init__(self) -> None:
        _check_checkpoint_id("CheckpointBarrier", self.checkpoint_id)
        if type(self.timestamp) is bool or not isinstance(self.timestamp, int):
            raise TypeError(f"CheckpointBarrier: timestamp must be an int (ms), got {self.timestamp!r}")
        if not 0 <= self.timestamp < 2**63:
            raise ValueError(f"CheckpointBarrier: timestamp must be >= 0 ms since the epoch, got {self.timestamp}")
        if not isinstance(self.options, CheckpointOptions):
            raise TypeError(f"CheckpointBarrier: options must be CheckpointOptions, got {self.options!r}")

    def __repr__(self) -> str:
        opts = "" if self.options == _DEFAULT_OPTIONS else f", {self.options!r}"
        return f"CheckpointBarrier({self.checkpoint_id}, timestamp={self.timestamp}{opts})"

    @property
    def id(self) -> int:
        """Flink's name for ``checkpoint_id``."""
        return self.checkpoint_id

    @property
    def checkpoint_type(self) -> CheckpointType:
        return self.options.checkpoint_type

    @property
    def is_checkpoint(self) -> bool:
        """True for a checkpoint, False for either kind of savepoint."""
        return not self.options.checkpoint_type.is_savepoint

    def with_alignment(self, unaligned: bool) -> CheckpointBarrier:
        """This barrier as a gate takes its checkpoint: unaligned (Flink's ``asUnaligned``,
        at once or at the aligned timeout) or aligned (an aligned-first checkpoint whose
        barriers all arrived in time). The gate triggers with it, so the task's
        ``options.unaligned`` says whether in-flight data (``finish_input``) will follow.
        ``self`` when it already says so."""
        if self.options.unaligned is unaligned:
            return self
        return CheckpointBarrier(
            self.checkpoint_id, self.timestamp, CheckpointOptions(self.options.checkpoint_type, unaligned)
        )


@dataclass(frozen=True, slots=True, repr=False)
class CancelCheckpointMarker(_Final):
    """Sent instead of a barrier by a task that cannot take the checkpoint, so
    downstream tasks abort it at once rather than wait for a barrier that never comes."""

    checkpoint_id: int

    def __post_init__(self) -> None:
        _check_checkpoint_id("CancelCheckpointMarker", self.checkpoint_id)

    def __repr__(self) -> str:
        return f"CancelCheckpointMarker({self.checkpoint_id})"


@dataclass(frozen=True, slots=True, repr=False)
class EndOfPartition(_Final):
    """The last thing a channel delivers: its producer has finished."""

    def __repr__(self) -> str:
        return "EndOfPartition()"


MIN_WATERMARK = -(2**63)
"""No event time has passed yet (Flink's ``Long.MIN_VALUE``): where every watermark starts."""
MAX_WATERMARK = 2**63 - 1
"""The end of event time: a bounded input ends with it, so every window and timer fires."""


@dataclass(frozen=True, slots=True, repr=False)
class Watermark(_Final):
    """Event time has reached ``timestamp`` (ms) on this channel: no record with a
    timestamp at or below it should follow (one that does is late).

    It travels in the channel among the data, like ``END_OF_DATA``: the gate does
    not recognise it as an event, so a blocked channel holds it back with its data,
    and an unaligned barrier overtakes it exactly as it overtakes the data around
    it. Channel state persists data only: a restored task starts from the watermark
    its time-aware operators checkpointed, and upstream watermarks follow."""

    timestamp: int

    def __post_init__(self) -> None:
        if type(self.timestamp) is not int:
            raise TypeError(f"Watermark: timestamp must be an int (ms), got {self.timestamp!r}")
        if not MIN_WATERMARK <= self.timestamp <= MAX_WATERMARK:
            raise ValueError(f"Watermark: timestamp must fit in 64 bits, got {self.timestamp}")

    def __repr__(self) -> str:
        if self.timestamp == MAX_WATERMARK:
            return "Watermark(MAX)"
        return f"Watermark({self.timestamp})"


@dataclass(frozen=True, slots=True, repr=False)
class WatermarkStatus(_Final):
    """A channel turned idle (its producer has no input for a while, so its watermark
    must not hold the others back) or active again: Flink's ``StreamStatus``. Travels
    like a ``Watermark``."""

    idle: bool

    def __post_init__(self) -> None:
        if type(self.idle) is not bool:
            raise TypeError(f"WatermarkStatus: idle must be a bool, got {self.idle!r}")

    def __repr__(self) -> str:
        return "WatermarkStatus(IDLE)" if self.idle else "WatermarkStatus(ACTIVE)"


def time_event_to_json(event: Any) -> Dict[str, Any]:
    """A ``Watermark`` or ``WatermarkStatus`` as a small JSON-able dict, for transports
    that send events as metadata (the Spark runner's Flight channels)."""
    if type(event) is Watermark:
        return {"e": "wm", "ts": event.timestamp}
    if type(event) is WatermarkStatus:
        return {"e": "idle" if event.idle else "active"}
    raise TypeError(f"not a time event: {event!r}")


def time_event_from_json(body: Dict[str, Any]) -> Any:
    """The inverse of ``time_event_to_json``; ``ValueError`` for anything else."""
    kind = body.get("e")
    if kind == "wm":
        ts = body.get("ts")
        if type(ts) is not int:
            raise ValueError(f"a watermark event needs an int ts, got {ts!r}")
        return Watermark(ts)
    if kind in ("idle", "active"):
        return WatermarkStatus(kind == "idle")
    raise ValueError(f"not a time event: {kind!r}")


WATERMARK_IDLE = WatermarkStatus(True)
WATERMARK_ACTIVE = WatermarkStatus(False)


class CheckpointFailureReason(enum.Enum):
    """Why a checkpoint did not complete; the names are Flink's."""

    CHECKPOINT_DECLINED = "Checkpoint was declined."
    CHECKPOINT_DECLINED_TASK_NOT_READY = "Checkpoint was declined (tasks not ready)."
    CHECKPOINT_DECLINED_TASK_CLOSING = "Checkpoint was declined (task is closing)."
    CHECKPOINT_DECLINED_SUBSUMED = "Checkpoint was canceled because a barrier from newer checkpoint was received."
    CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER = "Task received cancellation from one of its inputs."
    CHECKPOINT_DECLINED_INPUT_END_OF_STREAM = "Checkpoint was declined because one input stream is finished."
    CHECKPOINT_DECLINED_ALIGNMENT_LIMIT_EXCEEDED = "Checkpoint was canceled because the alignment exceeded its limit."
    CHECKPOINT_EXPIRED = "Checkpoint expired before completing."
    CHECKPOINT_SUBSUMED = "Checkpoint has been subsumed."
    CHECKPOINT_COORDINATOR_SHUTDOWN = "CheckpointCoordinator shutdown."
    CHECKPOINT_COORDINATOR_SUSPEND = "Checkpoint Coordinator is suspending."
    PERIODIC_SCHEDULER_SHUTDOWN = "Periodic checkpoint scheduler is shut down."
    TOO_MANY_CHECKPOINT_REQUESTS = "The maximum number of queued checkpoint requests exceeded."
    MINIMUM_TIME_BETWEEN_CHECKPOINTS = (
        "The minimum time between checkpoints is still pending. Checkpoint will be triggered later."
    )
    NOT_ALL_REQUIRED_TASKS_RUNNING = "Not all required tasks are currently running."
    EXCEPTION = "An Exception occurred while triggering the checkpoint."
    CHECKPOINT_ASYNC_EXCEPTION = "Asynchronous task checkpoint failed."
    IO_EXCEPTION = "An Exception occurred while triggering the checkpoint. IO-problem detected."
    TASK_FAILURE = "Task has failed."
    TASK_CHECKPOINT_FAILURE = "Task local checkpoint failure."
    TRIGGER_CHECKPOINT_FAILURE = "Trigger checkpoint failure."
    FINALIZE_CHECKPOINT_FAILURE = "Failure to finalize checkpoint."
    JOB_FAILOVER_REGION = "FailoverRegion is restarting."

    @property
    def message(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class CheckpointMetrics:
    """What the gate measured for a checkpoint, handed to the task at trigger time.

    ``alignment_duration_ns``: how long channels were blocked (0 for unaligned
    and at-least-once checkpoints; for a checkpoint that timed out of alignment,
    the time it spent aligned). ``checkpoint_start_delay_ns``: from the
    coordinator's trigger timestamp to the first barrier at this gate.
    """

    alignment_duration_ns: int = 0
    checkpoint_start_delay_ns: int = 0
    bytes_processed_during_alignment: int = 0
    unaligned: bool = False
