"""The Spark runner: a job's subtasks as the tasks of one barrier-mode Spark stage.

``sc.parallelize(range(T), T).barrier().mapPartitions(run)`` starts all T subtasks
at once (one Spark task per subtask; chained operators share it). Each task builds
its own ``StreamTask``, serves its input gate on a Flight ``ChannelServer``,
registers with the driver's ``ControlServer`` and, once every task has, gets the
addresses of its downstream subtasks and opens a ``RemoteChannel`` to each. The
driver runs the ``CheckpointCoordinator`` as the embedded runner does; commands
(trigger, complete, abort, end, cancel) reach tasks through the control plane.

Spark does not retry a failed barrier result stage, so this runner owns failover:
when any task fails it cancels the stage, restores the latest completed checkpoint
and submits a new stage, up to ``restart_attempts`` — Flink's full restart, with
Spark as the cluster manager.

The process runner (``processes.py``) is this runner without Spark: ``_SparkJob``'s
hooks (``_open_backend``, ``_check_picklable``, ``_submit``, ``_check_sinks``,
``_collected``, ``_transport``) let it start the same task body in worker processes
and move buffers over local sockets instead of Flight.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..connectors.console import CollectSink
from ..coordinator import ExecutionAttempt, ThreadTimerService
from ..errors import KeySelectorError, NonRetryableError
from ..io import CheckpointOptions, CheckpointType
from ..runtime.outputs import Output, Outputs
from ..runtime.statistics import EventTimeStatistics, event_time_statistics
from ..storage import checkpoint_storage
from ..storage.metadata import OperatorState
from .control import ControlClient, ControlServer
from .flight import JobTls, listening_server
from .local import (
    FROZEN_HEAP,
    GIL_SWITCH_INTERVAL_S,
    LocalRunner,
    _step_name,
    build_task,
    covered_by,
    out_edges,
    recover_sinks,
    sinks_of,
)
from .result import JobResult

__all__ = ["SparkRunner"]


log = logging.getLogger(__name__)

REGISTRATION_TIMEOUT_S = 120.0
COUNTERS_INTERVAL_S = 1.0  # how often a task sends its counters to the driver's monitoring


@dataclass
class _TaskSpec:
    """What every Spark task gets in its closure."""

    graph: Any
    env: Any
    name: str
    job_id: str
    storage_uri: str
    probe_path: str
    restored: Dict[str, OperatorState]
    attempt: int
    control: str
    token: str
    local: bool = True  # Spark in local mode: every task on this machine
    tls: Optional[JobTls] = None  # the run's certificate, off loopback (as secret as the token)
    # How buffers cross channels: None for Flight (Python records in msgpack, never code:
    # Spark's, across machines), else (channel class, serve function) of the same shapes
    # as flight.RemoteChannel and flight.serve (the process runner's sockets).
    transport: Optional[Tuple[Any, Any]] = None


class _CoordinatorProxy:
    """What a StreamTask calls on its coordinator, forwarded to the driver."""

    def __init__(self, client: ControlClient) -> None:
        self._client = client
        self._lock = threading.Lock()  # the Flight client is used from task and async threads

    def receive_acknowledge_message(self, checkpoint_id: int, attempt: Any, snapshot: Any, metrics: Any) -> None:
        with self._lock:
            self._client.acknowledge(checkpoint_id, snapshot, metrics)

    def receive_decline_message(self, checkpoint_id: int, attempt: Any, cause: Any, state: Any = None) -> None:
        # ``state`` (what the failed snapshot wrote) is not sent: only the driver's registry
        # may judge whether a shared file is still referenced, and the control plane takes
        # no file list from an executor for deletion. Those files stay, as they did before.
        with self._lock:
            self._client.decline(checkpoint_id, cause)


def _run_subtask(spec: _TaskSpec, index: int) -> Iterator[str]:
    """The body of one Spark task: subtask ``index`` of the flattened job graph."""
    from . import flight

    RemoteChannel, serve = spec.transport or (flight.RemoteChannel, flight.serve)

    env, graph = spec.env, spec.graph
    p = env.parallelism
    v_index, s = divmod(index, p)
    vertex = graph.vertices[v_index]
    attempt = ExecutionAttempt(vertex.name, s, spec.attempt)
    client = ControlClient(spec.control, spec.token, attempt, tls=spec.tls)
    # Its own client for the long poll, so an acknowledgement never waits behind one.
    poll_client = ControlClient(spec.control, spec.token, attempt, tls=spec.tls)
    proxy = _CoordinatorProxy(client)
    storage = checkpoint_storage(spec.storage_uri, spec.job_id)
    try:
        if not storage.fs.get_file_info(spec.probe_path).is_file:
            raise OSError(f"the driver's probe file {spec.probe_path} is not visible here")
    except OSError as exc:
        with proxy._lock:
            client.failed(
                f"checkpoint storage {spec.storage_uri!r} is not reachable from this executor ({exc}); "
                "on a cluster use storage every executor reaches (s3://, gs://, hdfs://)"
            )
        raise
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
    # Batches from Flight are not 64-byte aligned; Arrow's hash aggregation would warn
    # about each one. Realigning is its own recommended fix.
    os.environ.setdefault("ACERO_ALIGNMENT_HANDLING", "reallocate")
    # Imported now, before the job starts, not on its first records (~0.1 s in a new worker).
    import pyarrow.acero
    import pyarrow.compute  # noqa: F401

    executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pyengine-async")
    failure: List[BaseException] = []

    def on_failure(exc: BaseException) -> None:
        failure.append(exc)
        try:
            with proxy._lock:
                client.failed(_describe_failure(exc))
        except Exception:  # the driver is gone: nothing left to tell
            pass

    def on_drained(_: ExecutionAttempt) -> None:
        with proxy._lock:
            client.drained()

    task = build_task(
        env=env,
        vertex=vertex,
        v_index=v_index,
        subtask=s,
        attempt=attempt,
        job_name=spec.name,
        local_recovery_dir=_local_recovery_dir(spec, vertex.name, s) if env.local_recovery else None,
        output=None,  # set once the downstream tasks' addresses are known
        storage=storage,
        executor=executor,
        coordinator=proxy,
        restored=spec.restored,
        on_failure=on_failure,
        on_drained=on_drained,
    )
    server = None
    if task.gate is not None:
        server, _ = serve(task.gate, spec.token, _executor_host(spec), tls=spec.tls)
    try:
        with proxy._lock:
            client.register(server.location if server is not None else "")
    except BaseException:  # the cleanup below is not reached: a reused worker must not keep these
        if server is not None:
            server.shutdown()
        executor.shutdown(wait=False)
        client.close()
        poll_client.close()
        raise
    channels: List[Any] = []
    stop = threading.Event()

    monitored = getattr(env, "monitoring", None) is not None
    event_time = bool(getattr(graph, "event_time", False))
    report = monitored or event_time
    next_report = 0.0

    def commands() -> None:
        nonlocal next_report
        while not stop.is_set():
            counters = None
            if report and time.monotonic() >= next_report:
                counters = _task_report(task, monitored, event_time)
                next_report = time.monotonic() + COUNTERS_INTERVAL_S
            try:
                batch = poll_client.poll(wait_ms=50, counters=counters)
            except Exception:
                if not stop.is_set():
                    task.cancel()
                return
            for cmd in batch:
                kind = cmd["cmd"]
                if kind == "wiring":
                    wired.put(cmd["downstream"])
                elif kind == "trigger":
                    options = CheckpointOptions(CheckpointType(cmd["type"]), unaligned=bool(cmd["unaligned"]))
                    task.trigger_checkpoint(int(cmd["checkpoint_id"]), int(cmd["timestamp"]), options)
                elif kind == "complete":
                    task.notify_checkpoint_complete(int(cmd["checkpoint_id"]))
                elif kind == "aborted":
                    task.notify_checkpoint_aborted(int(cmd["checkpoint_id"]))
                elif kind == "end":
                    task.end_requested.set()
                elif kind == "cancel":
                    task.cancel()
                    wired.put(None)  # cancelled before it was wired: stop waiting for it

    wired: queue.Queue[Optional[List[str]]] = queue.Queue()
    poller = threading.Thread(target=commands, name="pyengine-control-poll", daemon=True)
    poller.start()
    FROZEN_HEAP.enter()  # as the embedded runner does (see _FrozenHeap); a process worker froze already
    try:
        downstream = wired.get(timeout=REGISTRATION_TIMEOUT_S)
        if downstream is None:
            return
        # One Output per edge out of this vertex (several for a fan-out or side outputs),
        # each over remote channels to the consumer's subtasks, at this subtask's channel of
        # the consumer's one gate (past the channels of its earlier input edges).
        outs: List[Any] = []
        for (c, k, edge), locations in zip(out_edges(graph, v_index), downstream, strict=True):
            edge_channels: List[Any] = [
                RemoteChannel(loc, k * p + s, spec.token, capacity=max(1, env.channel_capacity), tls=spec.tls)
                for loc in locations
            ]
            channels.extend(edge_channels)
            output = Output(
                edge_channels,
                s,
                edge.exchange,
                edge.key_selector,
                env.max_parallelism,
                env.buffer_size,
                task.cancelled,
                gate_channel=k * p + s,
                debloat_target_ms=env.buffer_debloat_target_ms if env.buffer_debloat else None,
                target=_step_name(graph.vertices[c]),
            )
            outs.append((edge.tag, output))
        if len(outs) == 1 and outs[0][0] is None:
            task.output = outs[0][1]
        elif outs:
            task.output = Outputs(outs)
            if task.output.sides:
                task.chain[-1].side_output = task.output.emit_side
                task.chain[-1].side_tags = frozenset(task.output.sides)
        task.start()
        task.finished.wait()
        for channel in channels:
            channel.flush(60)
        if report:  # the final counters and watermarks: the driver's statistics see the whole run
            with proxy._lock:
                client.poll(wait_ms=0, counters=_task_report(task, monitored, event_time))
    finally:
        FROZEN_HEAP.exit()  # first: the cleanup below may raise, and a reused worker must not stay frozen
        stop.set()
        poller.join(5)
        for channel in channels:  # each closed whatever another's did: then the server, which upstream waits on
            try:
                channel.close()
            except Exception as exc:
                log.warning("%s: closing channel %s: %s", attempt, getattr(channel, "channel", "?"), exc)
        if server is not None:
            server.shutdown()
        executor.shutdown(wait=True)
        client.close()
        poll_client.close()
    if failure:
        raise RuntimeError(f"{attempt}: {failure[0]}") from failure[0]
    yield f"{attempt} finished"


EVENT_TIME_KEY = "event_time"  # the task's StreamTask.time_metrics(), in its report


def _task_report(task: Any, monitored: bool, event_time: bool) -> Dict[str, Any]:
    """What a task sends with its poll: its counters when the job is monitored, and
    its event-time figures (``time_metrics``) when the job uses event time. Both ride
    the one message the task sends anyway; the driver's monitoring keeps only the
    counter fields it knows (``clean_counters``), and ``_SparkJob`` the event time."""
    report: Dict[str, Any] = {}
    if monitored:
        from ..monitoring.metrics import task_counters

        report = task_counters(task)
    if event_time:
        report[EVENT_TIME_KEY] = task.time_metrics()
    return report


_TIME_FIELDS = ("currentInputWatermark", "currentOutputWatermark", "numLateRecordsDropped")


def _clean_time_metrics(data: Any) -> Optional[Dict[str, int]]:
    """A task's reported ``time_metrics`` kept only if well formed (JSON from another
    process): exactly the three known fields, each an int of 64 bits."""
    if not isinstance(data, dict):
        return None
    out: Dict[str, int] = {}
    for name in _TIME_FIELDS:
        value = data.get(name)
        if type(value) is not int or not -(2**63) <= value < 2**63:
            return None
        out[name] = value
    return out


class _ReportedTask:
    """A Spark task as the driver last heard of it: what ``event_time_statistics``
    reads of a ``StreamTask`` (its attempt and ``time_metrics()``)."""

    __slots__ = ("_metrics", "attempt")

    def __init__(self, attempt: ExecutionAttempt, metrics: Dict[str, int]) -> None:
        self.attempt = attempt
        self._metrics = metrics

    def time_metrics(self) -> Dict[str, int]:
        return dict(self._metrics)


# -- what runs on an executor before pyengine is imported there ---------------------------------------------------

EXECUTOR_CHECK_TAG = "pyengine-executor-check:"


def _executor_check(expected: str) -> None:
    """On an executor, before anything of pyengine is unpickled: raise (a one-line
    message tagged ``EXECUTOR_CHECK_TAG``, JSON) when the executor's Python cannot
    import pyengine or imports another version. Shipped by value (see ``_by_value``),
    so it needs nothing but the standard library."""
    import json as _json
    import os as _os
    import socket as _socket
    import sys as _sys

    try:
        import pyengine as _pe

        found = str(getattr(_pe, "__version__", "unknown"))
        origin = _os.path.dirname(str(getattr(_pe, "__file__", "") or "")) or "?"
        problem = None if found == expected else f"imports pyengine {found} (from {origin})"
    except Exception as exc:  # not installed, or installed without its native part
        problem = f"cannot import pyengine ({type(exc).__name__}: {exc})"
    if problem is None:
        return
    # A standalone executor works in <work dir>/app-<id>/<executor id>[/<Connect session>].
    parts = _os.getcwd().split(_os.sep)
    executor = "?"
    for i, part in enumerate(parts[:-1]):
        if part.startswith("app-") and parts[i + 1].isdigit():
            executor = parts[i + 1]
    body = {
        "executor": executor,
        "host": _socket.gethostname(),
        "python": _sys.executable,
        "python_version": _sys.version.split()[0],
        "problem": problem,
        "expected": expected,
    }
    raise RuntimeError(EXECUTOR_CHECK_TAG + _json.dumps(body))


def _task_entry(expected: str, payload: bytes, index_iter: Iterator[int]) -> Iterator[str]:
    """The body of a barrier task as shipped (by value): the executor check, then the
    job, unpickled only once pyengine is known to be there."""
    _executor_check(expected)
    from pyengine.runners.spark import _run_tasks

    yield from _run_tasks(payload, index_iter)


def _check_entry(expected: str, index_iter: Iterator[int]) -> Iterator[str]:
    """The preflight task (by value): the executor check alone."""
    import socket as _socket

    _executor_check(expected)
    for _ in index_iter:
        yield _socket.gethostname()


_SHIPPED = ("_executor_check", "_task_entry", "_check_entry", "_arrow_entry")


def _by_value(fn: Any) -> Any:
    """A copy of module-level ``fn`` that cloudpickle ships by value (its module, as
    far as pickling goes, is ``__main__``), whose only globals are the other shipped
    functions (copies too): an executor unpickles it without pyengine."""
    import types

    shipped: Dict[str, Any] = {"__builtins__": __builtins__, "EXECUTOR_CHECK_TAG": EXECUTOR_CHECK_TAG}
    copies = {}
    for name in _SHIPPED:
        original = globals()[name]
        copy = types.FunctionType(original.__code__, shipped, name, original.__defaults__)
        copy.__module__ = "__main__"
        copy.__qualname__ = f"_pyengine{name}"
        copies[name] = copy
    shipped.update(copies)
    return copies[fn.__name__]


def _arrow_entry(fn: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """``fn`` (a task body over partition indices) as a ``mapInArrow`` function: the
    indices come as the ``id`` column of ``spark.range``; what it yields goes back as
    one ``status`` column (shipped by value, as ``fn`` is)."""
    import pyarrow as _pa

    indices = [int(i) for batch in batches for i in batch.column(0).to_pylist()]
    out = [str(line) for line in fn(iter(indices))]
    yield _pa.RecordBatch.from_pydict({"status": _pa.array(out, _pa.string())})


def _run_tasks(payload: bytes, index_iter: Iterator[int]) -> Iterator[str]:
    from pyspark import cloudpickle

    # The job's own spec, pickled by the driver and carried inside Spark's task closure
    # (which Spark itself unpickles): the same trust as any Spark task, never user data
    # or a checkpoint. It is unpickled only after the version check, so a mismatched
    # executor fails with a message instead of an unpickling error.
    spec = cloudpickle.loads(payload)
    for index in index_iter:
        yield from _run_subtask(spec, index)


def _executor_problem(text: str) -> Optional[str]:
    """The executor check's failure inside a Spark error, as a sentence naming the
    executor and the fix; None when the error is something else."""
    import json
    import re

    found = re.search(re.escape(EXECUTOR_CHECK_TAG) + r"(\{[^\n]*?\})", text)
    if found is None:
        return None
    try:
        body = json.loads(found.group(1))
    except ValueError:
        return None
    where = (
        f"executor {body.get('executor')} on host {body.get('host')}"
        if body.get("executor") != "?"
        else (f"an executor on host {body.get('host')}")
    )
    expected = body.get("expected")
    return (
        f"{where} {body.get('problem')} with Python {body.get('python')} ({body.get('python_version')}), but the "
        f"driver runs pyengine {expected}. Every executor needs the same pyengine: install pyengine=={expected} "
        f"into the Python the executors run (spark.pyspark.python / PYSPARK_PYTHON) on every node, or ship a "
        f"packed virtual environment with it: spark.archives=pyengine-env.tar.gz#environment and "
        f"spark.pyspark.python=./environment/bin/python (see the Spark guide, 'Shipping pyengine')"
    )


class _Classic:
    """A classic session: the stage is ``sc.parallelize(range(T), T).barrier().mapPartitions``."""

    connect = False

    def __init__(self, spark: Any) -> None:
        self.sc = spark.sparkContext

    @property
    def master(self) -> str:
        return str(self.sc.master)

    @property
    def local(self) -> bool:
        return self.master.startswith("local")

    def slots(self) -> Optional[int]:
        return int(self.sc.defaultParallelism)

    def driver_host(self) -> str:
        return _driver_host(self.sc)

    def run_barrier(self, count: int, fn: Any, group: str, description: str) -> List[str]:
        self.sc.setJobGroup(group, description, interruptOnCancel=True)
        return list(self.sc.parallelize(range(count), count).barrier().mapPartitions(fn).collect())

    def cancel(self, group: str) -> None:
        self.sc.cancelJobGroup(group)


class _Connect:
    """A Spark Connect session: no ``SparkContext`` and no RDDs, so the stage is the
    DataFrame API's barrier mode, ``spark.range(T, numPartitions=T).mapInArrow(...,
    barrier=True)``, tagged so that it can be interrupted. The coordinator runs in
    this client process: executors reach it at this machine's address on its route to
    the Connect server."""

    connect = True

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        builder = getattr(getattr(spark, "client", None), "_builder", None)
        self.server = str(getattr(builder, "host", "") or "localhost")

    @property
    def master(self) -> str:
        try:
            return str(self.spark.conf.get("spark.master", ""))
        except Exception:  # a serverless platform may not say
            return ""

    @property
    def local(self) -> bool:
        return self.master.startswith("local") and _is_loopback(self.server)

    def slots(self) -> Optional[int]:
        return None  # Connect has no defaultParallelism: a stage too wide waits for slots, then fails

    def driver_host(self) -> str:
        return "127.0.0.1" if self.local else _route_to(self.server)

    def run_barrier(self, count: int, fn: Any, group: str, description: str) -> List[str]:
        import functools

        entry = functools.partial(_by_value(_arrow_entry), fn)
        self.spark.addTag(group)  # this thread's operations
        try:
            frame = self.spark.range(count, numPartitions=count).mapInArrow(entry, "status string", barrier=True)
            return [str(row[0]) for row in frame.collect()]
        finally:
            self.spark.removeTag(group)

    def cancel(self, group: str) -> None:
        self.spark.interruptTag(group)


def _backend(spark: Any) -> Any:
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        return _Connect(spark)
    return _Classic(spark)


def _is_loopback(host: str) -> bool:
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _route_to(host: str) -> str:
    """This machine's address on its route to ``host`` (no packet is sent)."""
    import socket

    if _is_loopback(host):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


class SparkRunner:
    """Run jobs on Spark: ``env.execute(name, runner=pe.runners.SparkRunner(spark))``, or
    ``runner="spark"`` for the active session (or a local one sized to the job)."""

    # Watermarks and watermark status travel between its tasks over the Flight channels
    # as metadata events, in order with the data (``flight.encode_event``); each task's
    # watermarks reach the driver with its poll (``JobResult.event_time``).
    supports_event_time = True
    supports_graphs = True  # several sources and sinks, union, connect, side outputs

    def __init__(self, spark: Any = None) -> None:
        _require_pyspark()
        self.spark = spark

    def job(
        self, graph: Any, env: Any, name: str, restore_from: Optional[str] = None, resume: str = "auto"
    ) -> _SparkJob:
        """The job, ready to ``run()`` (``env.execute`` calls this): any job graph, each
        edge a set of Flight channels into its consumer's one gate."""
        return _SparkJob(graph, env, name, restore_from, self.spark, resume)

    def run(
        self, graph: Any, env: Any, name: str, restore_from: Optional[str] = None, resume: str = "auto"
    ) -> JobResult:
        return self.job(graph, env, name, restore_from, resume).run()


class _SparkJob(LocalRunner):
    """One job on Spark. The coordination (checkpoints, final checkpoint, failover)
    is the embedded runner's; tasks are Spark tasks instead of threads."""

    def __init__(
        self,
        graph: Any,
        env: Any,
        name: str,
        restore_from: Optional[str] = None,
        spark: Any = None,
        resume: str = "auto",
    ) -> None:
        super().__init__(graph, env, name, restore_from, resume)
        self._check_sinks()
        self._spark = spark
        self._token = secrets.token_hex(16)
        self._registered: Dict[ExecutionAttempt, str] = {}
        self._running = False
        self._ending = False
        self._control: Optional[ControlServer] = None
        self._attempt_number = 0
        self._spark_thread: Optional[threading.Thread] = None
        self._spark_error: Optional[BaseException] = None
        self._group = f"pyengine-{uuid.uuid4().hex[:8]}"
        # Each subtask's latest event-time figures of the current attempt (its poll's).
        self._time_reports: Dict[ExecutionAttempt, Dict[str, int]] = {}
        self._time_lock = threading.Lock()

    # Where tasks run, as a failure's note names it (``_rebuild_failure``).
    _where = "a Spark executor"

    def _transport(self) -> Optional[Tuple[Any, Any]]:
        """How the tasks' buffers travel (``_TaskSpec.transport``): Flight, never pickle
        between machines."""
        return None

    def _check_sinks(self) -> None:
        """Refuses sinks that cannot work where the tasks run (a subclass's may)."""
        if any(isinstance(sink, CollectSink) for sink in sinks_of(self.graph)):
            raise ValueError(
                "CollectSink keeps records in memory, which Spark executors do not share with the driver: "
                "use FileSink (parquet, which spark.read.parquet reads) on Spark"
            )

    # -- the JobGateway, over the control plane -------------------------------------------

    def _attempts(self) -> List[ExecutionAttempt]:
        p = self.env.parallelism
        return [ExecutionAttempt(v.name, s, self._attempt_number) for v in self.graph.vertices for s in range(p)]

    def tasks_to_trigger(self) -> Sequence[ExecutionAttempt]:
        sources = {v.name for v in self.graph.vertices if not v.inputs}  # every source is triggered
        return [a for a in self._attempts() if a.vertex in sources]

    def tasks_to_ack(self) -> Sequence[ExecutionAttempt]:
        return self._attempts()

    def all_running(self) -> bool:
        return self._failure is None and self._running and not self._ending

    def _send(self, task: ExecutionAttempt, command: Dict[str, Any]) -> None:
        if self._control is not None:
            self._control.send(task, command)

    def trigger(self, task: ExecutionAttempt, checkpoint_id: int, timestamp: int, options: CheckpointOptions) -> None:
        self._send(
            task,
            {
                "cmd": "trigger",
                "checkpoint_id": checkpoint_id,
                "timestamp": timestamp,
                "type": options.checkpoint_type.value,
                "unaligned": options.unaligned,
            },
        )

    def notify_complete(self, task: ExecutionAttempt, checkpoint_id: int) -> None:
        self._send(task, {"cmd": "complete", "checkpoint_id": checkpoint_id})

    def notify_aborted(self, task: ExecutionAttempt, checkpoint_id: int) -> None:
        self._send(task, {"cmd": "aborted", "checkpoint_id": checkpoint_id})

    def records_read(self) -> int:
        """Not counted on the driver (the sources read on executors): ``interval_ms="auto"``
        assumes replay as fast as the first processing, the safe side."""
        return 0

    def is_processing_backlog(self) -> bool:
        """The driver's copies of the sources never read, so they cannot tell a backlog:
        the backlog interval applies on Spark only through the coordinator's
        ``set_processing_backlog``. (Asking them could keep a flag that starts True, and
        with ``interval_during_backlog_ms=0`` no checkpoint would ever commit.)"""
        return False

    def _on_register(self, attempt: ExecutionAttempt, location: str) -> None:
        if attempt.attempt == self._attempt_number:
            self._registered[attempt] = location
            self._wake.set()

    def _on_failed(self, attempt: ExecutionAttempt, message: str) -> None:
        if attempt.attempt == self._attempt_number:
            self.fail_job(_rebuild_failure(attempt, message, self._where))

    def _on_drained(self, attempt: ExecutionAttempt) -> None:
        if attempt.attempt == self._attempt_number:
            self._task_drained(attempt)

    def _on_report(self, attempt: ExecutionAttempt, report: Any) -> None:
        """A task's poll report: its event time is kept here (current attempt only: a
        restored task's late count starts from its checkpoint, so the latest attempt's
        figures are the run's), its counters go to the monitor."""
        if isinstance(report, dict) and attempt.attempt == self._attempt_number:
            metrics = _clean_time_metrics(report.get(EVENT_TIME_KEY))
            if metrics is not None:
                with self._time_lock:
                    self._time_reports[attempt] = metrics
        if self.monitor is not None:
            self.monitor.report_task_counters(attempt, report)

    def event_time_statistics(self) -> EventTimeStatistics:
        """Event time as the tasks of the current attempt last reported it (about once
        a second while they run, and once more as each ends)."""
        with self._time_lock:
            reported = [_ReportedTask(a, m) for a, m in self._time_reports.items() if a.attempt == self._attempt_number]
        return event_time_statistics(reported)

    def _result(
        self,
        status: str,
        cause: Optional[BaseException],
        restarts: int,
        records: List[Any],
        storage: Any,
        started: float,
    ) -> JobResult:
        result = super()._result(status, cause, restarts, records, storage, started)
        if getattr(self.graph, "event_time", False):  # LocalRunner reads its task objects; here they are remote
            result.event_time = self.event_time_statistics()
        return result

    # -- Spark ----------------------------------------------------------------------------

    def _session(self) -> Any:
        if self._spark is not None:
            return self._spark
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            return active
        slots = len(self._attempts())
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        return (
            SparkSession.builder.master(f"local[{slots}]")
            .appName(f"pyengine {self.name}")
            .config("spark.ui.enabled", "false")
            .getOrCreate()
        )

    def _check_slots(self, backend: Any) -> None:
        needed = len(self._attempts())
        slots = backend.slots()
        if slots is not None and slots < needed:
            raise RuntimeError(
                f"the job needs {needed} task slots at once (a barrier stage: {len(self.graph.vertices)} "
                f"operator chains x parallelism {self.env.parallelism}), but the Spark cluster has {slots}; "
                f"use local[{needed}] or more executor cores, or lower the parallelism"
            )

    def _submit(self, backend: Any, spec: _TaskSpec) -> None:
        import functools

        from pyspark import cloudpickle

        count = len(self._attempts())
        run = functools.partial(_by_value(_task_entry), _version(), cloudpickle.dumps(spec))

        def job() -> None:
            try:
                backend.run_barrier(count, run, self._group, f"pyengine {self.name} attempt {spec.attempt}")
            except BaseException as exc:  # the stage failed or was cancelled
                self._spark_error = exc
                problem = _executor_problem(str(exc))
                if problem is not None:  # no restart installs pyengine
                    self.fail_job(NonRetryableError(problem))
                    return
                failure = RuntimeError(f"the Spark stage failed: {_stage_failure(str(exc))}")
                if _worker_crashed(str(exc)):
                    # The root cause, though its peers (their channels cut) may have told first.
                    with self._failure_lock:
                        failure.__context__ = self._failure
                        self._failure = failure
                self.fail_job(failure)
            finally:
                self._wake.set()

        self._spark_error = None
        self._spark_thread = threading.Thread(target=job, name="pyengine-spark-job", daemon=True)
        self._spark_thread.start()

    def _run(self) -> JobResult:
        env = self.env
        started = time.monotonic()
        # Spark first: a missing pyspark or too few slots is said before anything is written.
        backend = self._open_backend()
        timers = ThreadTimerService()
        try:
            storage, restored_meta = self._start_run(timers)
        except BaseException:
            timers.shutdown()
            if self.coordinator is not None:
                self.coordinator.shutdown()
            if self.lease is not None:
                self._close_run("FAILED")
            raise
        probe_path = f"{storage.root}/.pyengine-probe"
        restarts, status, cause = 0, "FAILED", None
        # Everything after the run opened is undone in the finally below (a job that does
        # not pickle, say, must not leave its lease, locks and servers behind).
        try:
            with storage.fs.open_output_stream(probe_path) as out:
                out.write(b"written by the driver; every executor must read it")
            assert self.coordinator is not None
            coordinator = self.coordinator
            self._control = listening_server(
                lambda: ControlServer(
                    coordinator,
                    self._token,
                    on_register=self._on_register,
                    on_drained=self._on_drained,
                    on_failed=self._on_failed,
                    host=backend.driver_host(),
                )
            )
            self._control.on_counters = self._on_report
            spec_base = dict(
                graph=self.graph,
                env=env,
                name=self.name,
                job_id=storage.job_id,  # the job directory: this run's own, or the one it resumes
                storage_uri=storage.uri,
                probe_path=probe_path,
                control=self._control.location,
                token=self._token,
                tls=self._control.tls,
                local=backend.local,
                transport=self._transport(),
            )
            self._check_picklable(_TaskSpec(restored={}, attempt=0, **spec_base))
            while True:
                self._failure = None
                self._drained = set()
                self._registered = {}
                with self._time_lock:
                    self._time_reports = {}
                self._running = False
                self._ending = False
                self._wake.clear()
                restored = dict(restored_meta.operators) if restored_meta is not None else {}
                recover_sinks(self.graph, covered_by(restored_meta))
                self._attempted = True
                self._submit(backend, _TaskSpec(restored=restored, attempt=self._attempt_number, **spec_base))
                outcome = self._supervise_spark()
                if outcome == "finished":
                    status = "FINISHED"
                    break
                for a in self._attempts():
                    self._send(a, {"cmd": "cancel"})
                backend.cancel(self._group)
                if self._spark_thread is not None:
                    self._spark_thread.join(120)
                from ..io import CheckpointFailureReason

                self.coordinator.abort_pending_checkpoints(CheckpointFailureReason.JOB_FAILOVER_REGION)
                if outcome == "stopped":
                    # As the embedded runner: the tasks may have been cancelled before the
                    # savepoint's commit reached them, so the sink commits what it covers here.
                    recover_sinks(self.graph, covered_by(self._stop_savepoint))
                    status = "FINISHED"
                    break
                if outcome == "cancelled":
                    status = "CANCELED"
                    break
                cause = self._failure
                if not self._restart(restarts):
                    break
                restarts += 1
                self._attempt_number += 1
                restored_meta = self.coordinator.restore_latest() or restored_meta
        finally:
            assert self.coordinator is not None
            self.coordinator.shutdown()
            timers.shutdown()
            if self._control is not None:
                self._control.shutdown()
            if storage.fs.get_file_info(probe_path).is_file:
                storage.fs.delete_file(probe_path)
            self._close_run("STOPPED" if self._stop_with_savepoint.is_set() else status)
        return self._result(status, cause, restarts, self._collected(), storage, started)

    def _open_backend(self) -> Any:
        """What runs the tasks (``_Classic`` or ``_Connect``: ``master``, ``local``,
        ``slots()``, ``driver_host()``, ``run_barrier``, ``cancel``), checked first."""
        backend = _backend(self._session())
        self._check_slots(backend)
        if not backend.local:
            self._check_executors(backend)
        return backend

    def _collected(self) -> List[Any]:
        """``JobResult.records``: none on Spark (a CollectSink is refused there)."""
        return []

    def _check_executors(self, backend: Any) -> None:
        """Before the run opens: a barrier stage as wide as the job checks that its
        executors import the driver's pyengine (each task of the job checks again,
        before it unpickles anything: executors may come and go)."""
        import functools

        count = len(self._attempts())
        check = functools.partial(_by_value(_check_entry), _version())
        try:
            backend.run_barrier(count, check, self._group, f"pyengine {self.name}: executor check")
        except Exception as exc:
            problem = _executor_problem(str(exc))
            if problem is not None:
                raise RuntimeError(f"job {self.name!r} cannot run on this cluster: {problem}") from None
            raise

    def _check_picklable(self, spec: _TaskSpec) -> None:
        from pyspark import cloudpickle

        try:
            cloudpickle.dumps(spec)
        except Exception as exc:
            raise TypeError(
                f"job {self.name!r} cannot be shipped to Spark executors: its functions, sources or sinks "
                f"cannot be pickled ({type(exc).__name__}: {exc})"
            ) from None

    def _supervise_spark(self) -> str:
        coordinator = self.coordinator
        assert coordinator is not None
        attempts = self._attempts()
        deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
        while len(self._registered) < len(attempts):
            if self._failure is not None:
                return "failed"
            if self._cancel.is_set():
                return "cancelled"
            if time.monotonic() > deadline:
                self.fail_job(RuntimeError(f"only {len(self._registered)} of {len(attempts)} tasks started"))
                return "failed"
            self._wake.wait(0.05)
            self._wake.clear()
        p = self.env.parallelism
        for v_index, vertex in enumerate(self.graph.vertices):
            # per edge out of the vertex (``out_edges``' order): its consumer's subtasks' addresses
            downstream = [
                [
                    self._registered[ExecutionAttempt(self.graph.vertices[c].name, j, self._attempt_number)]
                    for j in range(p)
                ]
                for c, _, _ in out_edges(self.graph, v_index)
            ]
            for s in range(p):
                task = ExecutionAttempt(vertex.name, s, self._attempt_number)
                self._send(task, {"cmd": "wiring", "downstream": downstream})
        self._running = True
        checkpointing = self.env.checkpointing is not None
        if checkpointing:
            coordinator.start_checkpoint_scheduler()
        while True:
            self._wake.wait(timeout=0.05)
            self._wake.clear()
            if self._failure is not None:
                coordinator.stop_checkpoint_scheduler()
                return "failed"
            # An unbounded job (an event-time stream, say) ends only so, as on the embedded runner.
            if self._stop_with_savepoint.is_set():
                coordinator.stop_checkpoint_scheduler(abort_pending=False)
                return "stopped"
            if self._cancel.is_set():
                coordinator.stop_checkpoint_scheduler()
                return "cancelled"
            if not self._ending and len(self._drained) == len(attempts):
                if checkpointing and not self._final_checkpoint():
                    coordinator.stop_checkpoint_scheduler()
                    return "failed"
                self._ending = True
                coordinator.stop_checkpoint_scheduler(abort_pending=False)
                for a in attempts:
                    self._send(a, {"cmd": "end"})
            if self._spark_thread is not None and not self._spark_thread.is_alive():
                return "failed" if self._failure is not None else "finished"


def _version() -> str:
    """The driver's pyengine version (the package is loaded: this module is in it)."""
    return str(sys.modules["pyengine"].__version__)


def _no_checkpoints() -> Any:
    from .local import _NO_CHECKPOINTS

    return _NO_CHECKPOINTS


def _require_pyspark() -> None:
    """The Spark runner needs pyspark, an optional dependency: say how to get it."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise ImportError(
            'the Spark runner needs pyspark, which is not installed: pip install "pyspark>=3.5" cryptography '
            "(the spark extra of pyengine)"
        ) from None


_FAILURE_TAG = "pyengine-failure:"


def _describe_failure(exc: BaseException) -> str:
    """A task's failure as the driver rebuilds it: the user's exception (inside the
    operator's ``UserFunctionError``) by type, message and traceback, as JSON text, so
    that no pickle crosses the control plane."""
    import json
    import traceback

    from ..errors import is_non_retryable
    from ..runtime.base import UserFunctionError

    wrapped = isinstance(exc, (UserFunctionError, KeySelectorError))  # the engine's wrappers: where, then the cause
    user = exc.__cause__ if wrapped and exc.__cause__ is not None else exc
    body = {
        "where": str(exc) if user is not exc else "",
        "module": type(user).__module__,
        "type": type(user).__qualname__,
        "message": str(user),
        "traceback": "".join(traceback.format_exception(user)),
        "non_retryable": is_non_retryable(exc),
    }
    return _FAILURE_TAG + json.dumps(body)


def _rebuild_failure(attempt: ExecutionAttempt, message: str, where: str = "a Spark executor") -> BaseException:
    """The driver's copy of a task's failure (see ``_describe_failure``): the user's
    exception type when the driver has it (a module it has imported already: nothing
    is imported by name from a message), with the executor's traceback as a note."""
    import json

    from ..errors import NonRetryableError
    from ..runtime.base import UserFunctionError

    if not message.startswith(_FAILURE_TAG):
        return RuntimeError(f"{attempt}: {message}")
    try:
        body = json.loads(message[len(_FAILURE_TAG) :])
        module, qualname, text = str(body["module"]), str(body["type"]), str(body["message"])
    except (ValueError, KeyError, TypeError):
        return RuntimeError(f"{attempt}: {message}")
    cls: Any = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    user: BaseException
    if isinstance(cls, type) and issubclass(cls, BaseException):
        user = cls.__new__(cls)
        user.args = (text,)
    else:
        kind: Any = NonRetryableError if body.get("non_retryable") else RuntimeError
        user = kind(f"{module}.{qualname}: {text}")
    note = f"raised on {where} ({attempt}); its traceback there:\n{body.get('traceback', '')}"
    notes: Any = user
    notes.__notes__ = [*getattr(user, "__notes__", []), note]  # add_note, which Python 3.10 lacks
    if user.__class__ is not UserFunctionError and body.get("where"):
        wrapper = UserFunctionError(str(body["where"]))
        wrapper.__cause__ = user
        return wrapper
    return user


def _worker_crashed(text: str) -> bool:
    return "Python worker exited unexpectedly" in text or ("crashed" in text and "worker" in text)


def _stage_failure(text: str) -> str:
    """Why a Spark stage failed, in words: a Python worker that died is named as such
    (its exception, if any, is lost with it), else the Python exception inside."""
    if _worker_crashed(text):
        return (
            "a Python worker crashed (it exited unexpectedly: killed, out of memory, or os._exit) "
            f"while running the job's tasks [{_python_cause(text)}]"
        )
    return _python_cause(text)


def _python_cause(text: str) -> str:
    """The Python exception inside a Py4J/Spark error, if there is one (its last
    ``SomethingError: message`` line), else the error's first line."""
    import re

    found = re.findall(r"^(\w+(?:Error|Exception|Exit): .*)$", text, flags=re.MULTILINE)
    return (found[-1] if found else text.splitlines()[0] if text else "unknown")[:500]


def _local_recovery_dir(spec: _TaskSpec, vertex: str, subtask: int) -> str:
    """Local recovery on an executor: under Spark's local directories (its scratch disks)."""
    import tempfile

    root = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0] or tempfile.gettempdir()
    return os.path.join(root, f"pyengine-{spec.job_id}", f"{vertex}-{subtask}")


def _driver_host(sc: Any) -> str:
    """Where executors reach the driver: loopback in local mode, else ``spark.driver.host``."""
    if str(sc.master).startswith("local"):
        return "127.0.0.1"
    return str(sc.getConf().get("spark.driver.host", "127.0.0.1"))


def _executor_host(spec: _TaskSpec) -> str:
    """Where other tasks reach this one: its executor's address as Spark knows it."""
    if spec.local:
        return "127.0.0.1"
    try:
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        return str(context.getTaskInfos()[context.partitionId()].address).rsplit(":", 1)[0]
    except Exception:
        import socket

        return os.environ.get("SPARK_LOCAL_IP") or socket.gethostbyname(socket.gethostname())
