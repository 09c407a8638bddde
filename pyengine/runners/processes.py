"""The process-parallel embedded runner: every subtask in a worker process of this machine.

The embedded runner runs every subtask as a thread of one interpreter, so per-record
Python work (a ``KeyedProcessFunction``, ``map`` over Python records) never uses more
than one core: the GIL lets one thread run Python at a time. This runner starts a
worker process per parallel slot instead, as Bytewax and Spark do, and is selected with
``StreamEnvironment(executor="processes")`` or ``execute(runner="processes")``.

Slots are Flink's slot sharing: worker ``s`` runs subtask ``s`` of every vertex, each a
thread, so a job at parallelism p is p processes whatever its number of vertices. What
goes from a subtask to one in the same worker (a forward edge; the share of a hash
exchange that stays in its slot) is handed to the downstream gate as the threads
runner hands it, never pickled; only what crosses slots goes over a socket. Measured
on the per-record counter (a source and a keyed function, 4 M records, this 2-core
machine): with a process per subtask, every record was pickled once and four processes
shared two cores, and parallelism 2 ran at 1.1x parallelism 1; see ``bench/test_bench_processes.py``
for the figures with slots.

It is the Spark runner without Spark: the same task body (``spark._run_subtask``:
a ``StreamTask`` serving its input gate to its upstream subtasks, here on a Unix socket
rather than a Flight ``ChannelServer``; see ``runners/sockets.py``), the same driver-side
``ControlServer`` and ``CheckpointCoordinator``, the same failover (any worker
failing, or dying, fails the attempt; the driver kills the rest and restores the
latest completed checkpoint, up to ``restart_attempts``). Only what starts the tasks
differs: ``_ProcessBackend`` forks them from a ``multiprocessing`` fork server that
has pyengine and pyarrow imported already, so a worker starts in milliseconds rather
than the second a fresh interpreter takes to import them, and stays cheap across
restarts (the fork server lives as long as this process).

The job reaches a worker pickled with cloudpickle (so lambdas and closures travel, as
to Spark executors; ``runners/shipping.py`` pickles it and names what does not pickle).
Sinks that keep their output in the driver's memory
(``CollectSink``, ``DiscardSink``, ``PrintSink``) are not copied: a worker gets a
proxy that forwards their calls to the driver's object over the worker's pipe, a
transactional sink's ``stage`` answered before the subtask acknowledges the
checkpoint, so what a completed checkpoint covers is always on the driver for
``Sink.recover``.

What is unpickled, and from whom: the job and the sink proxies' calls come over the
pipes between this process and the workers it forked (the trust of
``multiprocessing`` itself); data buffers between workers come pickled over Unix
sockets that only the job's processes can open (``multiprocessing.connection`` with
the job's secret token as its authkey), because the Flight channels' safe serializer
cost as much per record as a per-record operator's own work. The control plane stays
JSON, and checkpoint files never hold pickles."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Tuple

from ..connectors.base import Sink
from ..errors import NonRetryableError
from . import shipping
from .result import JobResult
from .shipping import _cloudpickle, _Link, _load_by_value, _pickler_class, dumps_job, unpicklable_message
from .sockets import open_channel, serve_sockets
from .spark import _describe_failure, _rebuild_failure, _SparkJob, _TaskSpec

__all__ = ["ProcessRunner"]

log = logging.getLogger(__name__)

# What the fork server imports once, so that every worker forked from it has them.
_PRELOAD = [
    "pyengine",
    "pyengine.api",
    "pyengine.agg",
    "pyengine.windows",
    "pyengine.monitoring",
    "pyengine.monitoring.metrics",
    "pyengine.runtime.aggregate",
    "pyengine.runtime.broadcast",
    "pyengine.runtime.joins",
    "pyengine.state.heap",
    "pyengine.state.incremental",
    "pyengine.state.columnar",
    "pyengine.snapshot.strategies",
    "pyengine.runners.processes",
    "pyengine.runners.spark",
    "pyengine.runners.flight",
    "pyengine.runners.control",
    "pyarrow.flight",
    "pyarrow.compute",
    "pyarrow.acero",
    "pyarrow.parquet",
]
START_METHODS = ("forkserver", "spawn")
# A worker collects its youngest generation every this many container allocations
# (CPython's default is 700). Records that cross a socket are unpickled into new tuples
# and lists, so at parallelism 2 a worker allocated about half as many containers again
# as at parallelism 1, and each collection walks the buffers in flight: on the per-record
# counter the collector took ~0.25 us a record, most of it gone at 20,000. What is
# garbage only through a cycle lives a little longer; nothing else changes.
WORKER_GC_THRESHOLD = 20_000
KILL_WAIT_S = 10.0


# -- a worker -------------------------------------------------------------------------------


def _worker_main(
    payload: Tuple[bytes, bytes, bytes], indexes: List[int], conn: Connection, where: Dict[str, Any]
) -> None:
    """A worker process: the subtasks ``indexes`` of the job in ``payload`` (a slot:
    subtask s of every vertex), a thread each; ``payload`` is the job, the attempt, and
    the records of its collection sources if one of them reads them, else ``b""``. The
    driver's working directory, ``sys.path`` and environment first (a fork server's are
    those of when it started), then the job; the end goes to the driver as
    ``("done", ...)`` once every subtask finished, or ``("error", description, index)``
    as soon as one failed, before the process exits (its other subtasks with it: the
    driver fails the attempt either way)."""
    try:
        os.chdir(where["cwd"])
    except OSError:
        pass
    sys.path[:] = list(where["sys_path"])
    os.environ.clear()
    os.environ.update(where["environ"])
    if where.get("cpu") is not None:  # first, before any thread starts: every thread inherits it
        try:
            os.sched_setaffinity(0, {where["cpu"]})
        except OSError:  # the core went away since the driver looked (a cpuset changed): unpinned, as it was
            pass
    link = _Link(conn)
    try:
        shipping._WORKER_LINK = link
        job, attempt, collections = payload
        if collections:  # this worker reads the job's collection sources
            shipping._WORKER_COLLECTIONS = _load_by_value(collections)
        graph, env = _load_by_value(job)
        spec = pickle.loads(attempt)
        spec.graph, spec.env = graph, env
        # What the fork server imported and the job just unpickled stays: out of the cyclic
        # collector's sight, a collection of the oldest generation does not walk it again
        # (nor touch, and so copy, the fork server's pages).
        gc.freeze()
        # Fewer collections of the youngest generation: see WORKER_GC_THRESHOLD.
        threshold, older, oldest = gc.get_threshold()
        gc.set_threshold(max(threshold, WORKER_GC_THRESHOLD), older, oldest)
    except BaseException as exc:
        link.post(("load-error", f"{type(exc).__name__}: {exc}"))
        conn.close()
        os._exit(3)
    from .spark import _run_subtask

    lines: Dict[int, List[str]] = {}
    first_failure = threading.Lock()

    def run(index: int) -> None:
        try:
            lines[index] = list(_run_subtask(spec, index))
        except BaseException as exc:
            if not first_failure.acquire(blocking=False):
                return  # a later failure: the first one is what the driver hears, then the process ends
            try:
                link.post(("error", _describe_failure(exc.__cause__ if exc.__cause__ is not None else exc), index))
            except Exception:  # the driver is gone
                pass
            conn.close()
            os._exit(1)

    threads = [
        threading.Thread(target=run, args=(index,), name=f"pyengine-subtask-{index}", daemon=True) for index in indexes
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    link.post(("done", [line for index in indexes for line in lines[index]], time.process_time()))
    conn.close()


# -- the driver's side ----------------------------------------------------------------------


class WorkerFailed(RuntimeError):
    """A worker process ended without finishing its subtasks."""

    def __init__(
        self, message: str, *, index: int = -1, crashed: bool = False, load_error: bool = False, described: bool = False
    ) -> None:
        super().__init__(message)
        # a described failure: the failed subtask's index in the job (``_attempts()``);
        # a crash or a load error: the worker's (its slot); -1: none in particular
        self.index = index
        self.described = described  # the message is ``_describe_failure``'s text
        self.crashed = crashed  # died without a word: killed, out of memory, os._exit
        self.load_error = load_error  # could not unpickle the job: no restart helps


def _exit_reason(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with code {code}"


@dataclasses.dataclass(frozen=True)
class _Payload:
    """What an attempt's workers are sent: the job and the attempt, pickled, and the
    records of the job's collection sources, pickled apart and sent only to the
    workers that read them (``readers``: the slots of the sources' subtask 0)."""

    job: bytes
    attempt: bytes
    collections: bytes = b""
    readers: FrozenSet[int] = frozenset()

    def for_worker(self, index: int) -> Tuple[bytes, bytes, bytes]:
        """``_worker_main``'s payload for worker ``index``."""
        return self.job, self.attempt, self.collections if index in self.readers else b""


def _usable_cores() -> List[int]:
    """The cores this process may run on, in order ([] where the platform does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return []


def _cores_for(count: int) -> List[Optional[int]]:
    """The core each of ``count`` workers is pinned to, or None for each to leave them to
    the kernel: pinned when the workers are as many as the cores this process may use,
    or a multiple (worker w on the w-th core, round the cores), else not (nor where the
    platform cannot pin): three workers on two cores, pinned, would leave one core to
    two of them, and a keyed exchange runs at its slowest slot.

    Why pin: a worker runs its slot's subtasks as threads under one GIL, so it never
    uses more than one core at a time, but unpinned the kernel moves its threads between
    cores, and every record a task hands to the next (source to keyed function) is then
    read from the other core's cache. Measured on the per-record counter at parallelism
    2 (two workers, two cores): ~1,100 migrations a run instead of ~300 at parallelism 1,
    and the same Python work (the modulo of the source's function) sampled 2.6 times as
    often; pinned, the job ran up to ~40% faster. Why only when the workers fill the
    cores: a job with fewer workers than cores cannot know which cores other jobs use,
    and two such jobs would both pin to the first. ``ProcessRunner(pin_workers=False)``
    never pins (a machine busy with other work, where a fixed core may be the busy one)."""
    cpus = _usable_cores()
    if not cpus or count < len(cpus) or count % len(cpus):
        return [None] * count  # fewer than the cores, or some cores would get one more worker than others
    return [cpus[w % len(cpus)] for w in range(count)]


class _Stage:
    """One attempt's worker processes, one per slot: started, served (their sinks'
    calls, their ends) and, on ``cancel``, killed."""

    def __init__(
        self,
        context: Any,
        slots: List[List[int]],
        payload: _Payload,
        proxied: List[Sink],
        names: List[str],
        pin: bool = True,
    ) -> None:
        self.context = context
        self.pin = pin  # each worker on one core, when they fill the cores (_cores_for)
        self.slots = slots  # per worker, the subtasks it runs (their indexes in the job)
        self.count = len(slots)
        self.payload = payload
        self.proxied = proxied
        # what each worker runs, for messages: "slot 1/2: v0 (1/2), v1 (1/2)"
        self.names = [
            f"slot {w + 1}/{len(slots)}: {', '.join(names[i] for i in members)}" for w, members in enumerate(slots)
        ]
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.procs: List[Any] = []
        self.conns: List[Connection] = []
        self.started_s = 0.0  # how long starting took (the workers' start-up, measured)
        self.cpu_s: Dict[int, float] = {}  # CPU seconds each finished worker used (all its threads)

    def _start(self) -> None:
        where = {"cwd": os.getcwd(), "sys_path": list(sys.path), "environ": dict(os.environ)}
        cpus = _cores_for(self.count) if self.pin else [None] * self.count
        began = time.monotonic()
        for index in range(self.count):
            with self.lock:
                if self.cancelled.is_set():
                    return
                parent, child = self.context.Pipe(duplex=True)
                proc = self.context.Process(
                    target=_worker_main,
                    args=(self.payload.for_worker(index), self.slots[index], child, {**where, "cpu": cpus[index]}),
                    name=f"pyengine-worker-{index + 1}-of-{self.count}",
                    daemon=True,
                )
                with _without_main():
                    proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        self.started_s = time.monotonic() - began

    def run(self) -> List[str]:
        """Starts the workers and serves them until every one has finished (their
        lines) or one failed (``WorkerFailed``, the others left to ``cancel``)."""
        self._start()
        if self.cancelled.is_set():
            raise WorkerFailed("cancelled before it started")
        done: Dict[int, List[str]] = {}
        open_conns = {conn: i for i, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: i for i, proc in enumerate(self.procs)}
        while len(done) < self.count:
            ready = wait(list(open_conns) + list(sentinels), timeout=0.5)
            if self.cancelled.is_set():
                raise WorkerFailed("cancelled")
            for item in ready:
                if item in open_conns:
                    index = open_conns[item]
                    if not self._serve(item, index, done):
                        del open_conns[item]
                elif item in sentinels:
                    index = sentinels.pop(item)
                    conn = self.conns[index]
                    while conn in open_conns and self._serve(conn, index, done):  # what it sent before it ended
                        pass
                    open_conns.pop(conn, None)
                    if index not in done:
                        self.procs[index].join(1)
                        code = self.procs[index].exitcode
                        raise WorkerFailed(
                            f"the worker process of {self.names[index]} (pid {self.procs[index].pid}) "
                            f"{_exit_reason(code)} while running the job",
                            index=index,
                            crashed=True,
                        )
        return [line for i in range(self.count) for line in done[i]]

    def _serve(self, conn: Connection, index: int, done: Dict[int, List[str]]) -> bool:
        """One message from worker ``index``: False once its pipe is closed."""
        try:
            if not conn.poll():  # nothing (more) to read: wait() said so, or a drain is done
                return False
            message = conn.recv()
        except (EOFError, OSError):
            return False
        kind = message[0]
        if kind == "sink":
            _, key, method, args, reply = message
            try:
                value = getattr(self.proxied[key], method)(*args)
                answer: Tuple[str, Any] = ("ok", value)
            except BaseException as exc:
                answer = ("error", exc)
            if reply:
                try:
                    conn.send(answer)
                except (OSError, ValueError):
                    return False
                except Exception as exc:  # an exception that does not pickle: its words travel
                    conn.send(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))
                    del exc
            elif answer[0] == "error":
                raise WorkerFailed(f"{type(self.proxied[key]).__name__}.{method} failed on the driver: {answer[1]}")
            return True
        if kind == "done":
            done[index] = [str(line) for line in message[1]]
            self.cpu_s[index] = float(message[2])
            return True
        if kind == "load-error":
            raise WorkerFailed(
                f"the worker process of {self.names[index]} could not load the job: {message[1]}. Every function, "
                "source and sink of a job run in worker processes must load in a new Python process: define "
                "them at the top level of an importable module or of the script that runs the job (a module "
                "that only this process has imported, or changed sys.path for, is not there)",
                index=index,
                load_error=True,
            )
        if kind == "error":
            raise WorkerFailed(str(message[1]), index=int(message[2]), described=True)
        return True

    def cancel(self) -> None:
        """Kills every worker of this stage (SIGKILL: their state is in the checkpoints)."""
        self.cancelled.set()
        with self.lock:
            procs, conns = list(self.procs), list(self.conns)
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
        deadline = time.monotonic() + KILL_WAIT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for conn in conns:
            conn.close()


class _ProcessBackend:
    """The Spark runner's backend interface (``master``, ``local``, ``slots()``,
    ``driver_host()``, ``run_barrier``, ``cancel``) over worker processes of this machine."""

    connect = False
    master = "processes"
    local = True

    def __init__(self, start_method: str, pin_workers: bool = True) -> None:
        self.context = _context(start_method)
        self.pin_workers = pin_workers
        self._stage: Optional[_Stage] = None
        self._lock = threading.Lock()

    def slots(self) -> Optional[int]:
        return None

    def driver_host(self) -> str:
        return "127.0.0.1"

    def stage(self, slots: List[List[int]], payload: _Payload, proxied: List[Sink], names: List[str]) -> _Stage:
        """A new attempt's stage, current from now on (``cancel`` kills it)."""
        stage = _Stage(self.context, slots, payload, proxied, names, self.pin_workers)
        with self._lock:
            self._stage = stage
        return stage

    def run_barrier(self, count: int, fn: Any, group: str, description: str) -> List[str]:
        """Runs ``count`` tasks at once, a worker each (``fn`` a ``(payload, proxied,
        names)`` triple, see ``stage``); raises when one fails."""
        (job, attempt), proxied, names = fn
        return self.stage([[i] for i in range(count)], _Payload(job, attempt), proxied, names).run()

    def cancel(self, group: str) -> None:
        with self._lock:
            stage = self._stage
        if stage is not None:
            stage.cancel()


_LAUNCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """While a worker is launched: ``multiprocessing`` leaves out the main module.

    By default a "forkserver" or "spawn" child runs the parent's main script again (as
    ``__mp_main__``) so that references into it unpickle; a script that builds and runs
    its job at the top level, without an ``if __name__ == "__main__":`` guard, would
    then run the job again in every worker. Nothing of a worker needs it: cloudpickle
    ships what the job uses of ``__main__`` by value. Held under a lock, restored after."""
    from multiprocessing import spawn

    original = spawn.get_preparation_data

    def preparation_data(name: str) -> Dict[str, Any]:
        data = dict(original(name))
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    with _LAUNCH_LOCK:
        spawn.get_preparation_data = preparation_data  # type: ignore[assignment]
        try:
            yield
        finally:
            spawn.get_preparation_data = original  # type: ignore[assignment]


_CONTEXTS: Dict[str, Any] = {}


def _context(start_method: str) -> Any:
    """The multiprocessing context: a fork server preloading pyengine (where the
    platform has one), else spawn. The fork server is started once per process, on
    the first job, and every later job and restart forks from it."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
    if start_method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        start_method = "spawn"
    context = _CONTEXTS.get(start_method)
    if context is None:
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            module = _cloudpickle().__name__
            context.set_forkserver_preload([*_PRELOAD, module])
        _CONTEXTS[start_method] = context
    return context


class _ProcessJob(_SparkJob):
    """One job in worker processes: the Spark runner's coordination (control plane,
    checkpoints, failover) with ``_ProcessBackend`` starting the tasks."""

    _where = "a worker process"

    def _transport(self) -> Optional[Tuple[Any, Any]]:
        """Unix sockets between the workers this process forked (``SocketChannel``), the
        gate itself within a worker (``_SlotChannel``): see ``open_channel``."""
        return (open_channel, serve_sockets)

    def __init__(
        self,
        graph: Any,
        env: Any,
        name: str,
        restore_from: Optional[str] = None,
        resume: str = "auto",
        start_method: str = "forkserver",
        pin_workers: bool = True,
    ) -> None:
        super().__init__(graph, env, name, restore_from, None, resume)
        self._start_method = start_method
        self._pin_workers = pin_workers
        self._backend_obj: Optional[_ProcessBackend] = None
        self._job_payload = b""
        self._collections_payload = b""  # the collection sources' records, for their readers only
        self._proxied: List[Sink] = []
        self.worker_start_s: List[float] = []  # each attempt's start of its workers, measured
        # CPU seconds of each worker of the last attempt, by its name (its slot and subtasks)
        self.worker_cpu_s: Dict[str, float] = {}

    def _check_sinks(self) -> None:
        """Every sink runs here: driver-memory sinks through proxies, the rest copied."""

    def _open_backend(self) -> Any:
        count = len(self._slots())
        cores = os.cpu_count() or 1
        limit = max(32, 8 * cores)
        if count > limit:
            raise ValueError(
                f"parallelism={self.env.parallelism} needs {count} worker processes (one per parallel slot), "
                f"more than the process runner starts on {cores} core(s) (at most {limit}): lower "
                "parallelism, run threads (executor='threads'), or run on Spark (runner='spark')"
            )
        usable = len(_usable_cores()) or cores
        if count > usable:
            log.warning(
                "job %r: parallelism=%d runs %d worker processes on %d core(s): the workers share cores, each "
                "a slot's subtasks under one interpreter lock, and a keyed exchange runs at its slowest slot; a "
                "per-record job is fastest at parallelism=%d here (a new user measured p=3 and p=4 30-40%% "
                "slower than p=2 on 2 cores)",
                self.name,
                self.env.parallelism,
                count,
                usable,
                usable,
            )
        self._backend_obj = _ProcessBackend(self._start_method, self._pin_workers)
        return self._backend_obj

    def _collected(self) -> List[Any]:
        return list(getattr(self.graph.sink, "records", []))

    def _task_names(self) -> List[str]:
        return [f"{a.vertex} ({a.subtask + 1}/{self.env.parallelism})" for a in self._attempts()]

    def _slots(self) -> List[List[int]]:
        """The workers' subtasks: worker ``s`` runs subtask ``s`` of every vertex (Flink's
        slot sharing), by their indexes in ``_attempts()``."""
        slots: Dict[int, List[int]] = {}
        for i, a in enumerate(self._attempts()):
            slots.setdefault(a.subtask, []).append(i)
        return [slots[s] for s in sorted(slots)]

    def _check_picklable(self, spec: _TaskSpec) -> None:
        """Pickles the job (graph and environment) once for every attempt: with a large
        collection source that is most of the driver's work (~0.5 s per 600,000 records)."""
        try:
            collections: List[Any] = []
            self._job_payload, self._proxied = dumps_job((spec.graph, worker_environment(spec.env)), collections)
            if collections:
                out = io.BytesIO()
                _pickler_class()(out, self._proxied).dump(collections)
                self._collections_payload = out.getvalue()
        except Exception as exc:
            raise TypeError(unpicklable_message(self.name, self.graph, exc)) from None

    def _submit(self, backend: Any, spec: _TaskSpec) -> None:
        # the attempt's own part (restored state, attempt number) apart from the job's
        attempt, _ = dumps_job(dataclasses.replace(spec, graph=None, env=None))
        attempts = self._attempts()
        slots = self._slots()
        sources = {v.name for v in self.graph.vertices if not v.inputs}
        readers = frozenset(
            w
            for w, members in enumerate(slots)
            if any(attempts[i].vertex in sources and attempts[i].subtask == 0 for i in members)
        )
        payload = _Payload(self._job_payload, attempt, self._collections_payload, readers)
        stage = backend.stage(slots, payload, self._proxied, self._task_names())

        def job() -> None:
            try:
                stage.run()
            except BaseException as exc:
                self._spark_error = exc
                if stage.cancelled.is_set():
                    self.fail_job(RuntimeError("the job's worker processes were cancelled"))
                    return
                if isinstance(exc, WorkerFailed) and exc.load_error:
                    self.fail_job(NonRetryableError(str(exc)))
                    return
                failure: BaseException
                if isinstance(exc, WorkerFailed) and exc.described:
                    failure = _rebuild_failure(self._attempts()[exc.index], str(exc), self._where)
                else:
                    failure = RuntimeError(str(exc))
                if isinstance(exc, WorkerFailed) and exc.crashed:
                    # The root cause, though its peers (their channels cut) may have told first.
                    with self._failure_lock:
                        failure.__context__ = self._failure
                        self._failure = failure
                self.fail_job(failure)
            finally:
                if stage.started_s:
                    self.worker_start_s.append(stage.started_s)
                self.worker_cpu_s = {stage.names[w]: cpu for w, cpu in sorted(stage.cpu_s.items())}
                self._wake.set()

        self._spark_error = None
        self._spark_thread = threading.Thread(target=job, name="pyengine-process-job", daemon=True)
        self._spark_thread.start()


# -- what the workers run with ---------------------------------------------------------------

# A worker's buffers of Python records and channels, where the job left them to the engine
# (buffer_size=None, channel_capacity=None): 512 records a buffer and 2 buffers a channel,
# against 1,024 and 8 on threads. What decides it is the records in flight, not the
# buffers' fixed cost: a worker's tasks share one core, and every record a task reads was
# made by another task of that worker (or unpickled by its socket thread) a queue earlier.
# With 8,192 records a channel, a keyed task's gate held ~2 MB of tuples at parallelism 2,
# the core's whole L2 cache, and each record came back from memory. On the per-record counter
# at parallelism 2 (3 M records, best of 3): 0.85 M records/s with 1,024 x 8, 1.32 with
# 1,024 x 2, 1.42 with 512 x 2, 1.36 with 512 x 4, 1.33 with 1,024 x 1. Threads keep theirs:
# there a smaller buffer is one more switch of the GIL per buffer, and 256 x 2 ran the
# same counter ~10% slower at parallelism 1.
WORKER_BUFFER_SIZE = 512
WORKER_CHANNEL_CAPACITY = 2


def worker_environment(env: Any) -> Any:
    """``env`` as the workers get it: the settings the job left to the engine set to
    the workers' own (``WORKER_BUFFER_SIZE``, ``WORKER_CHANNEL_CAPACITY``), everything
    else as it is. A copy: the driver's environment stays as the user made it."""
    # left to the engine at construction, and not set since (assigning either removes it)
    chosen = getattr(env, "engine_chosen", {})
    chose_buffers = "buffer_size" in chosen and env.buffer_size != WORKER_BUFFER_SIZE
    chose_capacity = "channel_capacity" in chosen and env.channel_capacity != WORKER_CHANNEL_CAPACITY
    if not chose_buffers and not chose_capacity:
        return env
    shipped = copy.copy(env)
    if chose_buffers:
        shipped._buffer_size = WORKER_BUFFER_SIZE
    if chose_capacity:
        shipped._channel_capacity = WORKER_CHANNEL_CAPACITY
    return shipped


class ProcessRunner:
    """Runs a job's subtasks in worker processes of this machine, each its own Python
    interpreter, so per-record Python work uses every core: a worker per parallel slot,
    running subtask s of every vertex; exchange between slots goes over Unix sockets,
    within a slot straight into the gate; checkpoints and failover are the embedded
    runner's. ``StreamEnvironment(executor="processes")`` selects it for ``execute``.

    ``start_method``: "forkserver" (default where the platform has it: workers fork
    from a server that has pyengine imported, in milliseconds) or "spawn" (a fresh
    interpreter per worker, about a second each).

    ``pin_workers``: each worker stays on one core (Linux, when the workers are at least
    as many as the cores; see ``_cores_for``); False leaves them to the kernel (a
    machine busy with other work, where a fixed core may be the busy one)."""

    supports_graphs = True
    supports_event_time = True

    def __init__(self, start_method: str = "forkserver", pin_workers: bool = True) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
        if not isinstance(pin_workers, bool):
            raise ValueError(f"pin_workers must be True or False, got {pin_workers!r}")
        self.start_method = start_method
        self.pin_workers = pin_workers

    def job(
        self, graph: Any, env: Any, name: str, restore_from: Optional[str] = None, resume: str = "auto"
    ) -> _ProcessJob:
        """The job, ready to ``run()`` (``env.execute`` calls this)."""
        return _ProcessJob(graph, env, name, restore_from, resume, self.start_method, self.pin_workers)

    def run(
        self, graph: Any, env: Any, name: str, restore_from: Optional[str] = None, resume: str = "auto"
    ) -> JobResult:
        return self.job(graph, env, name, restore_from, resume).run()
