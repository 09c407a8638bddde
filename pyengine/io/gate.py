"""The public checkpointed input gate.

``CheckpointedInputGate(...)`` returns the native gate by default, or the
pure-Python reference with ``implementation="reference"``. Both are instances
of ``CheckpointedInputGate`` (registered virtual subclasses) and behave
identically; the native one is what runs jobs, the reference is the oracle the
tests compare it with. Returning the implementation object itself, rather than
wrapping it, keeps a Python call off every push and poll.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterable, List, Optional, Tuple

from ._config import DEFAULT_CAPACITY, Callbacks, GateConfig
from .native import NativeCheckpointedInputGate
from .reference import ReferenceCheckpointedInputGate

__all__ = ["CheckpointedInputGate", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("native", "reference")


class CheckpointedInputGate(abc.ABC):
    """Input channels of one subtask plus the checkpoint barrier handler.

    Producers ``push`` buffers and events into numbered channels; the consumer
    ``poll_next``\\ s them back in Flink's order (round-robin over channels in
    the order they became available, blocked channels held back), while the
    handler selected by ``mode``/``unaligned`` turns barriers into calls on
    ``listener``:

    * ``trigger_checkpoint_on_barrier(barrier, metrics)`` when this subtask
      must snapshot (``metrics`` is a ``CheckpointMetrics``; ``barrier.options.unaligned``
      says, as ``metrics.unaligned`` does, how it is taken here: an aligned-first
      checkpoint is aligned if aligned in time, unaligned from its timeout);
    * ``abort_checkpoint_on_barrier(checkpoint_id, reason)`` with a
      ``CheckpointFailureReason``;
    * unaligned only, if the listener (or its ``channel_state_writer``) has
      them: ``add_input_data(checkpoint_id, channel, buffer)`` for every
      in-flight buffer, in order, and ``finish_input(checkpoint_id)`` once the
      last barrier of that checkpoint is in.

    ``capacity`` is per channel, in buffers; events may exceed it by a few
    slots so they are never held up by backpressure. ``clock`` (nanoseconds)
    replaces the real clocks, for deterministic tests and simulations.
    """

    def __new__(  # type: ignore[misc]
        cls,
        num_channels: int,
        listener: Any,
        *,
        mode: str = "exactly_once",
        unaligned: bool = False,
        aligned_timeout_ms: float = 0,
        capacity: int = DEFAULT_CAPACITY,
        implementation: str = "native",
        clock: Optional[Callable[[], int]] = None,
    ) -> CheckpointedInputGate:
        config = GateConfig.create(
            num_channels,
            mode=mode,
            unaligned=unaligned,
            aligned_timeout_ms=aligned_timeout_ms,
            capacity=capacity,
            clock=clock,
        )
        callbacks = Callbacks.bind(listener)
        if implementation == "native":
            return NativeCheckpointedInputGate(config, callbacks)  # type: ignore[return-value]
        if implementation == "reference":
            return ReferenceCheckpointedInputGate(config, callbacks)  # type: ignore[return-value]
        raise ValueError(f"implementation must be 'native' or 'reference', got {implementation!r}")

    # The interface both implementations provide. CheckpointedInputGate(...) always
    # returns one of them, so these bodies never run.

    def push(self, channel: int, item: Any) -> bool:
        """Queue ``item`` on ``channel``; False when the channel is full (backpressure).
        Safe to call from any thread."""
        raise NotImplementedError

    def push_many(self, channel: int, items: Iterable[Any]) -> int:
        """Queue items in order until one does not fit; returns how many were queued."""
        raise NotImplementedError

    def put(self, channel: int, item: Any, timeout: Optional[float] = None) -> bool:
        """Like ``push`` but waits (GIL released) for space; False on timeout."""
        raise NotImplementedError

    def poll_next(self) -> Optional[Tuple[int, Any]]:
        """The next ``(channel, item)`` without blocking, or None.

        Items are data buffers, barriers (after the handler processed them) and
        ``EndOfPartition``; cancellation markers are consumed."""
        raise NotImplementedError

    def poll_batch(self, max_items: int) -> List[Tuple[int, Any]]:
        """Up to ``max_items`` results of ``poll_next`` in one call.

        A batch holds either only data buffers or a single event, so every
        listener call except ``add_input_data`` happens before the caller sees
        the data that follows it."""
        raise NotImplementedError

    def poll_priority(self) -> Optional[Tuple[int, Any]]:
        """Only what must not wait behind data, without blocking: a barrier that
        overtakes in-flight buffers (unaligned; its listener calls happen here), or
        the switch to unaligned once ``aligned_timeout`` has passed. Never data, so a
        task whose output is full can still take part in a checkpoint."""
        raise NotImplementedError

    def next(self, timeout: Optional[float] = None) -> Optional[Tuple[int, Any]]:
        """Like ``poll_next`` but waits (GIL released) up to ``timeout`` seconds;
        None on timeout or once the gate is finished."""
        raise NotImplementedError

    def queued(self, channel: int) -> int:
        """How many items ``channel`` currently holds."""
        raise NotImplementedError

    num_channels: int
    capacity: int
    is_finished: bool
    latest_checkpoint_id: int
    blocked_channels: List[int]
    last_alignment_duration_ns: int
    last_checkpoint_start_delay_ns: int
    bytes_processed_during_alignment: int


CheckpointedInputGate.register(NativeCheckpointedInputGate)
CheckpointedInputGate.register(ReferenceCheckpointedInputGate)
