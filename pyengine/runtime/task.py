"""``StreamTask``: one subtask, a mailbox loop around an operator chain.

Checkpoint triggers (from the coordinator for sources, from the input gate for
the rest), completion notifications and record processing all run on the
task's own thread, one at a time — the mailbox model, so state never changes
under a snapshot's synchronous part. The asynchronous part runs on a shared
thread pool and ends in an acknowledgement or a decline."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import pyarrow as pa

from ..coordinator import ExecutionAttempt, SubtaskMetrics, TaskStateSnapshot
from ..errors import is_non_retryable
from ..io import CheckpointBarrier, CheckpointedInputGate, CheckpointOptions, EndOfPartition
from ..io.events import MAX_WATERMARK, MIN_WATERMARK, CheckpointType, Watermark, WatermarkStatus
from ..state import ListStateDescriptor, subtask_for_key_group
from ..state.keygroups import assign_to_key_group
from ..storage.filesystem import CheckpointStorage
from ..storage.metadata import OperatorState, SubtaskState
from .base import Operator, OperatorContext, rows_of
from .collector import YOUNG_GENERATION
from .outputs import END_OF_DATA, OnChannel, Output, Outputs, _runs
from .sink_operator import SinkOperator
from .sources import SourceOperator
from .statistics import EventTimeStatistics, event_time_statistics

__all__ = [
    "EventTimeStatistics",
    "Output",
    "Outputs",
    "SinkOperator",
    "StreamTask",
    "TaskCancelled",
    "event_time_statistics",
]

_CHANNEL_STATE = ListStateDescriptor("in-flight")
_INPUT, _OUTPUT = 0, 1  # the two kinds of in-flight records of an unaligned checkpoint


MAX_READ_ROWS = 1 << 20  # a slice of a columnar source holds at most this many rows
MAX_READ_BYTES = 16 << 20  # and at most this many bytes when its output channels grew
PRIORITY_CHECK_S = 0.002  # within a batch of buffers, how often an unaligned barrier is looked for


class TaskCancelled(Exception):
    """The runner cancelled the task (failover or shutdown)."""


class _ChannelState:
    """In-flight input buffers of one unaligned checkpoint."""

    def __init__(self) -> None:
        self.buffers: List[Any] = []
        self.channels: List[int] = []  # the input channel of each buffer
        self.done = threading.Event()
        self.aborted = False

    def abort(self) -> None:
        """Wakes the asynchronous part waiting for the rest of the data: it gives up."""
        self.aborted = True
        self.done.set()


class StreamTask:
    """One subtask: its chain, its input gate (None for sources) and its output."""

    def __init__(
        self,
        *,
        attempt: ExecutionAttempt,
        chain: List[Operator],
        ctx: OperatorContext,
        gate_factory: Optional[Callable[[Any], CheckpointedInputGate]],
        output: Optional[Union[Output, Outputs]],
        storage: CheckpointStorage,
        executor: Executor,
        coordinator: Any,
        restored: Dict[str, OperatorState],
        buffer_size: int,
        buffer_timeout_ms: int,
        on_failure: Callable[[BaseException], None],
        on_drained: Callable[[ExecutionAttempt], None],
        channel_state_uid: str,
        input_key_selector: Optional[Callable[[Any], Any]] = None,
        read_bytes: Optional[int] = None,
        input_edges: Optional[Sequence[Tuple[int, Optional[Callable[[Any], Any]]]]] = None,
        channels_per_edge: int = 0,
        input_exchanges: Optional[Sequence[str]] = None,
    ) -> None:
        self.input_key_selector = input_key_selector
        # The job graph's edges into this task, in the order of their channels at the one
        # gate over all of them (``channels_per_edge`` each): per edge, which input of the
        # head operator it feeds (0, or 1 for a connect's second stream) and its key
        # selector when it is keyed (in-flight records of a restore go by key).
        self.input_edges = list(input_edges) if input_edges else [(0, input_key_selector)]
        self._channels_per_edge = channels_per_edge
        # Each input edge's exchange (None: unknown, a line's one edge). A broadcast edge's
        # restored in-flight input goes with the broadcast state it belongs to: a new
        # subtask takes both from the same old subtask (``subtask % old parallelism``).
        self.input_exchanges = list(input_exchanges) if input_exchanges else []
        # A source of Arrow batches is read in slices of about ``read_bytes`` (never fewer
        # rows than ``buffer_size``): a buffer's fixed cost in Python (tens of microseconds
        # per operator) needs batches far larger than Flink's 32 KiB to vanish, and columnar
        # data already there gains no latency from a small slice. None: ``buffer_size`` rows.
        self.read_bytes = read_bytes
        self._row_bytes = 0
        self.attempt = attempt
        self.chain = chain
        self.ctx = ctx
        self.output = output
        self.storage = storage
        self.executor = executor
        self.coordinator = coordinator
        self.buffer_size = buffer_size
        self.buffer_timeout_s = buffer_timeout_ms / 1000
        self.on_failure = on_failure
        self.on_drained = on_drained  # all input processed and all output delivered
        self.mailbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.running = threading.Event()
        self.end_requested = threading.Event()
        self.finished = threading.Event()
        self.gate = gate_factory(self) if gate_factory is not None else None
        self._channel_edge: Optional[List[int]] = None  # channel -> edge, with several edges
        self._channel_input: Optional[List[int]] = None  # channel -> input, with two inputs
        if self.gate is not None and len(self.input_edges) > 1:
            per = self._channels_per_edge or self.gate.num_channels // len(self.input_edges)
            self._channel_edge = [min(c // per, len(self.input_edges) - 1) for c in range(self.gate.num_channels)]
            inputs = [self.input_edges[e][0] for e in self._channel_edge]
            self._channel_input = inputs if any(inputs) else None
        if isinstance(output, Outputs) and output.sides:
            chain[-1].side_output = output.emit_side  # only the last operator's side outputs have consumers
            chain[-1].side_tags = frozenset(output.sides)
        self._channel_states: Dict[int, _ChannelState] = {}
        self._held: Optional[List[Tuple[int, Any]]] = None  # the rest of a batch, during a priority check
        # The ids of the stops' savepoints (SYNC_SAVEPOINT) this task took and that were not
        # aborted: while there is one, a source reads nothing and no task fires a
        # processing-time timer or polls a watermark generator, so no output goes past the
        # savepoint (Flink's synchronous savepoint) while the job is being stopped. A set:
        # a stop retried after a timeout may be pending beside the first one.
        self._stopping: Set[int] = set()
        # Checkpoint ids aborted here, recorded when the notification comes (not when the
        # mailbox runs it): a task whose barrier comes through its gate may hear of the
        # abort before the barrier reaches it, and must not stop for it then (Flink's
        # abortedCheckpointIds). Pruned as later barriers are taken.
        self._aborted: Set[int] = set()
        self._channel_state_uid = channel_state_uid
        self._restored = restored
        self._replay: List[Tuple[int, List[Any]]] = []  # (input, records) of an unaligned restore
        self._replay_output: List[Tuple[int, List[Any]]] = []  # (output edge, records)
        # (output edge, channels, records): a broadcast exchange's, to those channels only
        self._replay_channels: List[Tuple[int, List[int], List[Any]]] = []
        self._input_ended = False
        self._drained_reported = False
        # event time (see _setup_time): on when the job uses it
        self.event_time = False
        self.input_watermark = MIN_WATERMARK  # what the valve (or, for a source, the chain) put out
        self.output_watermark = MIN_WATERMARK  # the last watermark sent downstream
        self.output_idle = False  # the last status sent downstream (idle: left out of the watermark)
        self._valve: Any = None
        self._generators: List[Any] = []  # (index, operator) of the chain's watermark generators
        self._timer_ops: List[Any] = []  # (index, operator) with processing-time timers
        self._watermark_interval_s = 0.2
        self._next_watermark_poll = 0.0
        # Counters for monitoring, read from other threads (pyengine.monitoring.metrics):
        # records counted per buffer, waits timed where the task already waits.
        self.records_in = 0
        self.records_out = 0
        self.idle_ns = 0
        self.backpressured_ns = 0
        self.started_ns = 0
        self.ended_ns = 0
        self.thread = threading.Thread(target=self._run, name=f"task-{attempt}", daemon=True)

    # -- the gate's listener -----------------------------------------------------------------

    def trigger_checkpoint_on_barrier(self, barrier: CheckpointBarrier, metrics: Any) -> None:
        self.perform_checkpoint(barrier.checkpoint_id, barrier.timestamp, barrier.options, metrics)

    def abort_checkpoint_on_barrier(self, checkpoint_id: int, reason: Any) -> None:
        self._drop_channel_state(checkpoint_id)
        if self.output is not None:
            from ..io import CancelCheckpointMarker

            self.output.broadcast_event(CancelCheckpointMarker(checkpoint_id))
        from ..coordinator.coordinator import CheckpointException
        from ..io import CheckpointFailureReason

        cause = (
            CheckpointException(reason)
            if isinstance(reason, CheckpointFailureReason)
            else CheckpointException(CheckpointFailureReason.CHECKPOINT_DECLINED, str(reason))
        )
        self.coordinator.receive_decline_message(checkpoint_id, self.attempt, cause)

    def add_input_data(self, checkpoint_id: int, channel: int, buffer: Any) -> None:
        # The gate may hand over overtaken buffers before it calls the trigger.
        state = self._channel_states.setdefault(checkpoint_id, _ChannelState())
        state.buffers.append(buffer)
        state.channels.append(channel)

    def finish_input(self, checkpoint_id: int) -> None:
        self._channel_states.setdefault(checkpoint_id, _ChannelState()).done.set()

    def _drop_channel_state(self, checkpoint_id: int) -> None:
        state = self._channel_states.pop(checkpoint_id, None)
        if state is not None:
            state.abort()

    # -- checkpoints -------------------------------------------------------------------------

    def trigger_checkpoint(self, checkpoint_id: int, timestamp: int, options: CheckpointOptions) -> None:
        """From the coordinator (sources only): runs in the mailbox."""
        self.mailbox.put(lambda: self.perform_checkpoint(checkpoint_id, timestamp, options, None))

    def perform_checkpoint(self, checkpoint_id: int, timestamp: int, options: CheckpointOptions, metrics: Any) -> None:
        started = time.perf_counter()
        location = self.storage.location(checkpoint_id)
        for i, op in enumerate(self.chain):  # head first: what one emits reaches the next before its turn
            produced = op.prepare_snapshot_pre_barrier(checkpoint_id)
            if produced:
                self._emit(produced, start=i + 1)
        output_in_flight: List[Tuple[int, Any]] = []  # (output edge, buffer)
        if self.output is not None:
            barrier = CheckpointBarrier(checkpoint_id, timestamp, options)
            if options.unaligned:
                if isinstance(self.output, Outputs):
                    output_in_flight = self.output.overtaking_by_edge(barrier)
                else:
                    output_in_flight = [(0, b) for b in self.output.broadcast_overtaking(barrier)]
            else:
                self.output.broadcast_event(barrier)
        writers = [(op.uid, op.snapshot(checkpoint_id, location)) for op in self.chain]
        if options.checkpoint_type is CheckpointType.SYNC_SAVEPOINT and checkpoint_id not in self._aborted:
            self._stopping.add(checkpoint_id)
        if self._aborted:  # list(): the coordinator's thread may add to it meanwhile
            for old in [c for c in list(self._aborted) if c <= checkpoint_id]:
                self._aborted.discard(old)
        channel_state: Optional[_ChannelState] = None
        if options.unaligned and self.gate is not None:
            channel_state = self._channel_states.setdefault(checkpoint_id, _ChannelState())
            if self._held:
                # The rest of a batch taken from the gate, not yet processed (the barrier came
                # up in a priority check within it: _run_gate): in flight, ahead of whatever
                # the gate hands over for these channels, so first in the channel state.
                held = [(c, b) for c, b in self._held if type(b) is list or type(b) is pa.RecordBatch]
                channel_state.channels[:0] = [c for c, _ in held]
                channel_state.buffers[:0] = [b for _, b in held]
        sync_ms = (time.perf_counter() - started) * 1000
        alignment_ms = metrics.alignment_duration_ns / 1e6 if metrics is not None else 0.0
        start_delay_ms = metrics.checkpoint_start_delay_ns / 1e6 if metrics is not None else 0.0
        processed = metrics.bytes_processed_during_alignment if metrics is not None else 0

        def run_async() -> None:
            async_started = time.perf_counter()
            snapshot: Optional[TaskStateSnapshot] = None
            try:
                snapshot = TaskStateSnapshot()
                for uid, write in writers:
                    snapshot.operators[uid] = write()
                persisted = 0
                input_in_flight: List[Tuple[int, Any]] = []  # (input edge, buffer)
                if channel_state is not None:
                    # A task that ends or is cancelled first never completes this channel state
                    # (and the gate may have created it after cancel() swept them): give up then.
                    while not channel_state.done.wait(timeout=0.05):
                        if self.finished.is_set() or self.cancelled.is_set():
                            break
                    if not channel_state.done.is_set() or channel_state.aborted:
                        raise RuntimeError(f"checkpoint {checkpoint_id} ended before its in-flight data was in")
                    self._channel_states.pop(checkpoint_id, None)
                    edge_of = self._channel_edge
                    input_in_flight = [
                        (0 if edge_of is None else edge_of[c], b)
                        for c, b in zip(channel_state.channels, channel_state.buffers, strict=True)
                    ]
                if channel_state is not None or output_in_flight:
                    snapshot.operators[self._channel_state_uid] = self._write_channel_state(
                        checkpoint_id, input_in_flight, output_in_flight
                    )
                    persisted = sum(
                        len(b) for _, b in input_in_flight + output_in_flight if isinstance(b, (list, pa.RecordBatch))
                    )
                handles = snapshot.handles()
                size = sum(getattr(h, "state_size", 0) for h in handles)
                self.coordinator.receive_acknowledge_message(
                    checkpoint_id,
                    self.attempt,
                    snapshot,
                    SubtaskMetrics(
                        sync_duration_ms=sync_ms,
                        async_duration_ms=(time.perf_counter() - async_started) * 1000,
                        alignment_duration_ms=alignment_ms,
                        start_delay_ms=start_delay_ms,
                        unaligned=options.unaligned,
                        processed_data=processed,
                        persisted_data=persisted,
                        checkpointed_size=size,
                        full_size=size,
                    ),
                )
            except Exception as exc:
                if is_non_retryable(exc) and not self.cancelled.is_set():
                    # A value no checkpoint can hold (StateSerializationError): every later
                    # checkpoint, and every restart's, would decline the same way. The task
                    # fails first, so the job fails with this cause, not the declined
                    # checkpoint's (which would count against tolerable failures, then
                    # restart the job on the same records).
                    self.on_failure(exc)
                # what was written before the failure goes with the decline, so the
                # coordinator deletes it (a delta no checkpoint will ever reference)
                self.coordinator.receive_decline_message(checkpoint_id, self.attempt, exc, snapshot)

        self.executor.submit(run_async)

    def _write_channel_state(
        self, checkpoint_id: int, inputs: List[Tuple[int, Any]], outputs: List[Tuple[int, Any]]
    ) -> SubtaskState:
        """In-flight records as union list state: ``[subtask, _INPUT, record]`` for input
        this task had not processed, ``[subtask, _OUTPUT, record]`` for output that
        had not reached the next task. With several edges in or out, the kind says
        which: ``2 * edge`` for input of the task's edge ``edge``, ``2 * edge + 1`` for
        output on it (edge 0's are ``_INPUT`` and ``_OUTPUT``, as for one edge)."""
        from ..state import OperatorStateBackend

        backend = OperatorStateBackend(subtask_index=self.ctx.subtask, parallelism=self.ctx.parallelism)
        me = self.ctx.subtask
        entries = [
            [me, 2 * edge + kind, r]
            for kind, buffers in ((_INPUT, inputs), (_OUTPUT, outputs))
            for edge, b in buffers
            if isinstance(b, (list, pa.RecordBatch))
            for r in rows_of(b)
        ]
        # a broadcast exchange's output, per channel: [subtask, kind, record, channel]
        entries.extend(
            [me, 2 * edge + _OUTPUT, r, b.channel]
            for edge, b in outputs
            if isinstance(b, OnChannel) and isinstance(b.buffer, (list, pa.RecordBatch))
            for r in rows_of(b.buffer)
        )
        backend.get_union_list_state(_CHANNEL_STATE).update(entries)
        result = backend.snapshot(checkpoint_id, self.storage.location(checkpoint_id)).run()
        return SubtaskState(operator=list(result.handles))

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        def complete() -> None:
            for op in self.chain:
                op.notify_checkpoint_complete(checkpoint_id)

        self.mailbox.put(complete)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        self._drop_channel_state(checkpoint_id)  # now: the async part may be waiting for it
        self._aborted.add(checkpoint_id)  # now: its barrier may still be on its way (see __init__)

        def aborted() -> None:
            self._stopping.discard(checkpoint_id)  # a stop that failed: the job goes on
            for op in self.chain:
                op.notify_checkpoint_aborted(checkpoint_id)

        self.mailbox.put(aborted)

    # -- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def cancel(self) -> None:
        self.cancelled.set()
        for checkpoint_id in list(self._channel_states):
            self._drop_channel_state(checkpoint_id)

    def _drain_mailbox(self) -> None:
        while True:
            try:
                action = self.mailbox.get_nowait()
            except queue.Empty:
                return
            action()

    def _emit(self, records: List[Any], start: int = 0) -> None:
        for op in self.chain[start:]:
            if not records:
                return
            records = op.process(records)
        if records and self.output is not None:
            self.records_out += len(records)  # rows of a list or of an Arrow batch
            self.output.emit(records)

    def _emit_input(self, which: int, records: Any) -> None:
        """A buffer of the head operator's input ``which`` (1: a connect's second stream)."""
        if which == 0:
            self._emit(records)
            return
        produced = self.chain[0].process2(records)
        if produced:
            self._emit(produced, start=1)

    def _restore(self) -> None:
        for op in self.chain:
            op.setup(self.ctx, self._restored.get(op.uid))
        channel = self._restored.get(self._channel_state_uid)
        if channel is not None:
            from ..state import OperatorStateBackend

            backend = OperatorStateBackend(subtask_index=self.ctx.subtask, parallelism=self.ctx.parallelism)
            backend.restore(channel.operator_handles())
            entries = backend.get_union_list_state(_CHANNEL_STATE).get()
            inputs: Dict[int, List[Any]] = {}
            outputs: Dict[int, List[Any]] = {}
            on_channels: Dict[int, List[Any]] = {}  # output edge -> [old subtask, channel, record]
            for entry in entries:
                sub, kind, r = entry[0], entry[1], entry[2]
                if len(entry) > 3:
                    on_channels.setdefault(int(kind) // 2, []).append([sub, entry[3], r])
                    continue
                (outputs if kind % 2 else inputs).setdefault(int(kind) // 2, []).append([sub, r])
            for edge, pairs in sorted(inputs.items()):
                which, select = self.input_edges[min(edge, len(self.input_edges) - 1)]
                broadcast = edge < len(self.input_exchanges) and self.input_exchanges[edge] == "broadcast"
                if broadcast:  # the records of the old subtask whose broadcast state this one restores
                    old = self.ctx.subtask % channel.parallelism
                    self._replay.append((which, [r for sub, r in pairs if sub == old]))
                    continue
                self._replay.append((which, self._my_share(pairs, channel.parallelism, select)))
            # A broadcast exchange's in-flight output: each old subtask's is re-sent by one
            # new subtask, old channel c to every new channel that restores old subtask c.
            for edge, triples in sorted(on_channels.items()):
                old_p, me, p = channel.parallelism, self.ctx.subtask, self.ctx.parallelism
                for sub, old_channel, r in triples:
                    if sub % p != me:
                        continue
                    targets = [c for c in range(p) if c % old_p == old_channel] if old_p != p else [old_channel]
                    self._replay_channels.append((edge, targets, [r]))
            # output goes through the partitioner again, so any one subtask may re-send it
            same = channel.parallelism == self.ctx.parallelism
            for edge, pairs in sorted(outputs.items()):
                mine = [r for sub, r in pairs if sub == self.ctx.subtask] if same else [r for _, r in pairs]
                self._replay_output.append((edge, mine if same else mine[self.ctx.subtask :: self.ctx.parallelism]))
        for op in self.chain:
            op.open()
        self._setup_time()

    def _setup_time(self) -> None:
        """Event time is on when the job has a watermark strategy, a window or a
        function with timers (``Vertex.create_chain`` marks every operator): then
        every task takes part, so watermarks reach each time-aware operator."""
        from .base import Operator

        interval = getattr(self.chain[0], "event_time_interval_ms", None)
        self._timer_ops = [
            (i, op)
            for i, op in enumerate(self.chain)
            if type(op).next_processing_time is not Operator.next_processing_time
        ]
        if interval is None:
            return
        self.event_time = True
        self._watermark_interval_s = interval / 1000
        self._generators = [(i, op) for i, op in enumerate(self.chain) if op.generates_watermarks]
        if self.gate is not None:
            from ..time.valve import StatusWatermarkValve

            self._valve = StatusWatermarkValve(self.gate.num_channels)

    # -- event time ----------------------------------------------------------------------

    def _advance_watermark(self, watermark: int, start: int = 0) -> None:
        """The watermark reaches the chain at ``start``: each operator fires what it
        passes (emitted through the operators after it, ahead of the watermark), and
        a generator in the chain stops it (only the end of input goes through); then
        it goes downstream, if it advanced."""
        chain = self.chain
        if start == 0 and watermark > self.input_watermark:
            self.input_watermark = watermark
        for i in range(start, len(chain)):
            op = chain[i]
            if op.generates_watermarks and watermark != MAX_WATERMARK:
                return  # it makes its own (a source's start after it)
            produced = op.process_watermark(watermark)
            if produced:
                self._emit(produced, start=i + 1)
        if watermark > self.output_watermark:
            self.output_watermark = watermark
            if self.output is not None:
                self.output.broadcast_event(Watermark(watermark))

    def _forward_status(self, status: WatermarkStatus) -> None:
        self.output_idle = status.idle
        if self.output is not None:
            self.output.broadcast_event(status)

    def _on_time_event(self, channel: int, item: Any) -> None:
        """A watermark or status from an input channel, through the valve."""
        valve = self._valve
        if valve is None:
            return
        if type(item) is Watermark:
            watermark = valve.input_watermark(item.timestamp, channel)
            if watermark is not None:
                self._advance_watermark(watermark)
            return
        watermark, idle = valve.input_status(item.idle, channel)
        if watermark is not None:
            self._advance_watermark(watermark)
        if idle is not None:
            self._forward_status(WatermarkStatus(idle))

    def _time_tick(self) -> None:
        """From the loop, between buffers: the generators' periodic watermarks and the
        processing-time timers that are due (the mailbox's timers, as in Flink)."""
        if self._stopping:
            return
        if self._generators:
            now = time.monotonic()
            if now >= self._next_watermark_poll:
                self._next_watermark_poll = now + self._watermark_interval_s
                mono_ms = time.monotonic_ns() // 1_000_000
                for i, op in self._generators:
                    for event in op.poll_watermark(mono_ms):
                        if type(event) is Watermark:
                            self._advance_watermark(event.timestamp, i + 1)
                        else:
                            self._forward_status(event)
        if self._timer_ops and not self._input_ended:  # at the end of input they stay pending, as in Flink
            wall = time.time_ns() // 1_000_000
            for i, op in self._timer_ops:
                due = op.next_processing_time()
                if due is not None and due <= wall:
                    produced = op.on_processing_time(wall)
                    if produced:
                        self._emit(produced, start=i + 1)

    def debloat_metrics(self) -> Optional[Dict[str, Any]]:
        """The adaptive buffers' current limits of this subtask's output: the smallest
        buffer size and in-flight limit over its channels, and each channel's (with the
        consumer's measured records/s); None for a sink or with ``buffer_debloat=False``."""
        output = self.output
        return None if output is None else output.debloat_stats()

    def time_metrics(self) -> Dict[str, Any]:
        """This subtask's event-time figures (Flink's metric names)."""
        return {
            "currentInputWatermark": self.input_watermark if self.gate is not None else self.output_watermark,
            "currentOutputWatermark": self.output_watermark,
            "numLateRecordsDropped": sum(op.late_records_dropped for op in self.chain),
        }

    def _my_share(self, entries: List[Any], old_parallelism: int, select: Optional[Callable[[Any], Any]]) -> List[Any]:
        """This subtask's part of the restored in-flight records of every old subtask:
        by key for a keyed input (a record must meet its key's state), else its own
        records at the same parallelism, else a round-robin share."""
        me, p = self.ctx.subtask, self.ctx.parallelism
        if select is not None:
            max_p = self.ctx.max_parallelism
            return [
                r for _, r in entries if subtask_for_key_group(max_p, p, assign_to_key_group(select(r), max_p)) == me
            ]
        if old_parallelism == p:
            return [r for sub, r in entries if sub == me]
        return [r for _, r in entries][me::p]

    def _run(self) -> None:
        self.started_ns = time.perf_counter_ns()
        YOUNG_GENERATION.enter()
        try:
            self._restore()
            self.running.set()
            # in-flight data of an unaligned checkpoint comes before new input: first what
            # this task had emitted, then what it had not yet processed
            if self._replay_channels and self.output is not None:
                replay_channels, self._replay_channels = self._replay_channels, []
                for edge, channels, records in _runs(replay_channels):
                    if isinstance(self.output, Outputs):
                        self.output.emit_to_channels(edge, channels, records)
                    else:
                        self.output.emit_to_channels(channels, records)
            if self._replay_output and self.output is not None:
                replay_out, self._replay_output = self._replay_output, []
                for edge, records in replay_out:
                    if not records:
                        continue
                    if isinstance(self.output, Outputs):
                        self.output.emit_to(edge, records)
                    else:
                        self.output.emit(records)
            if self._replay:
                replay, self._replay = self._replay, []
                for which, records in replay:
                    if records:
                        self._emit_input(which, records)
            if isinstance(self.chain[0], SourceOperator):
                self._run_source(self.chain[0])
            else:
                self._run_gate()
            self._finish()
        except TaskCancelled:
            pass
        except BaseException as exc:
            if not self.cancelled.is_set():
                self.on_failure(exc)
        finally:
            YOUNG_GENERATION.exit()
            self.ended_ns = time.perf_counter_ns()
            self.running.clear()
            self.finished.set()
            for op in self.chain:
                try:
                    op.close()
                except Exception:
                    pass

    def _check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise TaskCancelled()

    def _maybe_flush(self) -> None:
        if self.output is not None and time.monotonic() - self.output.last_flush >= self.buffer_timeout_s:
            self.output.flush(timed_out=True)

    def _backpressured(self) -> bool:
        """True (after a short wait) while output waits for room: no new input then."""
        output = self.output
        if output is None or output.drain():
            return False
        if self.gate is not None:
            self.gate.poll_priority()  # an unaligned barrier does not wait for the room
        started = time.perf_counter_ns()
        output.wait_for_room(0.005)
        self.backpressured_ns += time.perf_counter_ns() - started
        return True

    def _end_of_data(self) -> None:
        """Bounded input is over here: the maximum watermark (every event-time window and
        timer fires), operators' end_input, then END_OF_DATA downstream."""
        if self.event_time:
            self._advance_watermark(MAX_WATERMARK)
        self._emit_end_of_input()
        if self.output is not None:
            self.output.send_end_of_data()
        self._input_ended = True

    def _report_drained(self) -> None:
        """Once: every record this task will see is processed and delivered downstream."""
        if self._input_ended and not self._drained_reported and (self.output is None or self.output.available):
            self._drained_reported = True
            self.on_drained(self.attempt)

    def _wait_mailbox(self, seconds: float) -> None:
        """A source with nothing to read waits here: a checkpoint trigger or a
        notification ends the wait at once instead of after it."""
        started = time.perf_counter_ns()
        try:
            action = self.mailbox.get(timeout=seconds)
        except queue.Empty:
            return
        finally:
            self.idle_ns += time.perf_counter_ns() - started
        action()

    def _run_source(self, source: SourceOperator) -> None:
        source.idle_wait = self._wait_mailbox
        while True:
            self._check_cancelled()
            self._drain_mailbox()
            if self._backpressured():  # also what moves the stop's barrier on when the output is full
                continue
            if self._stopping:  # past a stop's savepoint: wait to be cancelled (or resumed)
                self._maybe_flush()
                self._wait_mailbox(0.02)
                continue
            if not source.exhausted:
                n = self.buffer_size
                if self._row_bytes:
                    n = max(n, min(self.read_bytes // self._row_bytes, MAX_READ_ROWS))  # type: ignore[operator]
                    # grown output channels (pyengine.runtime.debloat.grow): read what they take
                    grown = self.output.read_rows() if self.output is not None else None
                    if grown is not None:
                        n = max(n, min(grown, MAX_READ_ROWS, MAX_READ_BYTES // self._row_bytes))
                elif self.read_bytes and self.output is not None:  # Python records: as many as grown buffers hold
                    grown = self.output.read_rows()
                    if grown is not None:
                        n = max(n, min(grown, MAX_READ_ROWS))
                records = source.read(n)
                if self.read_bytes and not self._row_bytes and type(records) is pa.RecordBatch and records.num_rows:
                    # sized once, from the first slice: a slice size that followed rows of
                    # varying width would change at every read (only growing changes it)
                    self._row_bytes = max(1, records.nbytes // records.num_rows)
                self.records_in += len(records)
                if self.read_bytes and len(records) < n and self.output is not None:
                    self.output.short_read()  # short of input: channels that grew give way (debloat.grow)
                self._emit(records, start=1)
                self._time_tick()
                self._maybe_flush()
                continue
            if not self._input_ended:
                self._end_of_data()
                continue  # END_OF_DATA may wait for room like any output
            self._report_drained()
            if self.end_requested.is_set():
                self._drain_mailbox()
                return
            try:
                action = self.mailbox.get(timeout=0.02)
            except queue.Empty:
                continue
            action()

    def _emit_end_of_input(self) -> None:
        for i, op in enumerate(self.chain):
            produced = op.end_input()
            if produced:
                self._emit(produced, start=i + 1)

    def _run_gate(self) -> None:
        gate = self.gate
        assert gate is not None
        limit = 64  # buffers per poll, adapted to how long they take
        ended: set = set()  # channels that delivered END_OF_DATA
        channel_input = self._channel_input  # None: every channel feeds the first input
        while True:
            self._check_cancelled()
            self._drain_mailbox()
            if self._backpressured():
                continue
            if self._timer_ops or self._generators:
                self._time_tick()
            batch = gate.poll_batch(limit)
            if not batch:
                if gate.is_finished:
                    break
                self._maybe_flush()
                # Input ended while the output waited for room (END_OF_DATA pushed behind a
                # full channel): drained once the room came. Reported here too, not only
                # after a batch, as no batch comes any more: the upstream tasks' END_OF_PARTITION
                # waits for the end of the job, which waits for this report.
                self._report_drained()
                waited = time.perf_counter_ns()
                got = gate.next(timeout=0.02)
                self.idle_ns += time.perf_counter_ns() - waited
                if got is None:
                    continue
                batch = [got]
            started = time.perf_counter()
            checked = started
            buffers = 0
            rows = 0
            last = len(batch) - 1
            for i, (channel, item) in enumerate(batch):
                if type(item) is list or type(item) is pa.RecordBatch:
                    rows += len(item)
                    if channel_input is None or not channel_input[channel]:
                        self._emit(item)
                    else:
                        self._emit_input(channel_input[channel], item)
                    buffers += 1
                    if i < last and time.perf_counter() - checked >= PRIORITY_CHECK_S:
                        # A batch that takes long must not hold back an unaligned barrier: it
                        # may overtake the rest of the batch too, which the checkpoint then
                        # persists as in-flight input (perform_checkpoint takes it from _held).
                        self._held = batch[i + 1 :]
                        try:
                            gate.poll_priority()
                        finally:
                            self._held = None
                        checked = time.perf_counter()
                elif type(item) is Watermark or type(item) is WatermarkStatus:
                    self._on_time_event(channel, item)
                elif item is END_OF_DATA:
                    ended.add(channel)
                    if len(ended) == gate.num_channels and not self._input_ended:
                        self._end_of_data()
            self.records_in += rows
            if buffers:
                # Batches of about 2 ms of work, by what the last one cost per buffer: few
                # gate calls for fast buffers, and a barrier seldom waits for a priority
                # check within a batch.
                per_buffer = (time.perf_counter() - started) / buffers
                limit = max(1, min(64, int(0.002 / per_buffer) if per_buffer > 0 else 64))
            self._maybe_flush()
            self._report_drained()
        self._drain_mailbox()
        if not self._input_ended:
            self._emit_end_of_input()

    def _finish(self) -> None:
        if self.output is not None:
            self.output.broadcast_event(EndOfPartition())
            while not self.output.drain():
                self._check_cancelled()
                self._drain_mailbox()
                self.output.wait_for_room(0.02)
