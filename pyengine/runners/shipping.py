"""The job, shipped to the process runner's workers: pickled with cloudpickle, with the
driver-memory sinks (``CollectSink``, ``DiscardSink``, ``PrintSink``) replaced by proxies
that forward their calls to the driver's objects over the worker's pipe, the records of
collection sources sent apart to the one worker that reads them, and, when a part of the
job does not pickle, the message that names it and the fix.

Apart from ``processes.py`` (which starts the workers and drives the attempts) because it
is one concern a reader looks for on its own: what goes into a worker's payload and how it
comes out there (``_load_by_value``)."""

from __future__ import annotations

import io
import pickle
import sys
import threading
import types
from collections import ChainMap
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Tuple

from ..connectors.base import Sink
from ..connectors.collection import CollectionSource
from ..connectors.console import CollectSink, DiscardSink, PrintSink
from ..runtime.copies import narrow
from .sockets import _pickles

# Sinks whose output lives in the driver's memory: workers get a proxy (``_SinkProxy``).
_PROXIED = (CollectSink, DiscardSink, PrintSink)


def _cloudpickle() -> Any:
    """cloudpickle, which ships lambdas and closures by value: the package if installed,
    else the copy inside pyspark; an error naming the fix when neither is there."""
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:
        pass
    try:
        from pyspark import cloudpickle as bundled

        return bundled
    except ImportError:
        raise ImportError(
            "the process runner ships the job's functions to its worker processes with cloudpickle, "
            "which is not installed: pip install cloudpickle"
        ) from None


# -- the job, pickled for a worker ------------------------------------------------------------


def _code_keeping_its_file(reduce: Any) -> Any:
    """cloudpickle's reducer of code objects, but keeping the file the code came from:
    cloudpickle 3.1 writes ``<dynamic-code>`` instead (a payload that does not depend
    on where the code is), and a worker's traceback through a function of the job's
    script then showed neither its file nor its line's source. The workers run on the
    driver's machine, where the file is."""

    def reduce_code(code: Any) -> Any:
        rebuild, args = reduce(code)
        return rebuild, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)

    return reduce_code


def _pickler_class() -> Any:
    cloudpickle = _cloudpickle()
    reduce = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)
    base_table = getattr(cloudpickle.Pickler, "dispatch_table", None)

    class JobPickler(cloudpickle.Pickler):  # type: ignore[misc, name-defined]
        """cloudpickle, with the driver-memory sinks replaced by references to the
        driver's objects (``reducer_override``: called for objects of classes only, never
        for the lists, tuples and dicts of a collection source, which stay in C), and
        code objects that keep their file (``_code_keeping_its_file``)."""

        if reduce is not None and base_table is not None:
            dispatch_table = ChainMap({types.CodeType: _code_keeping_its_file(reduce)}, base_table)

        def __init__(self, file: Any, proxied: List[Sink], collections: Optional[List[Any]] = None) -> None:
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.proxied = proxied
            self.collections = collections

        def reducer_override(self, obj: Any) -> Any:
            if self.collections is not None and type(obj) is CollectionSource:
                # Its records go apart, to the one worker that reads them: see _collection_source.
                self.collections.append(obj.records)
                return _collection_source, (len(self.collections) - 1, obj.schema)
            if type(obj) in _PROXIED:
                for i, sink in enumerate(self.proxied):
                    if sink is obj:
                        return _sink_proxy, (i, bool(obj.transactional))
                self.proxied.append(obj)
                return _sink_proxy, (len(self.proxied) - 1, bool(obj.transactional))
            return super().reducer_override(obj)

    return JobPickler


def dumps_job(spec: Any, collections: Optional[List[Any]] = None) -> Tuple[bytes, List[Sink]]:
    """``spec`` pickled for a worker, and the driver's sinks its proxies stand for.
    With ``collections`` (a list), the records of every ``from_collection`` source
    are left out and appended to it instead (``_collection_source``)."""
    proxied: List[Sink] = []
    out = io.BytesIO()
    _pickler_class()(out, proxied, collections).dump(spec)
    return out.getvalue(), proxied


# In a worker: the records of the job's collection sources, when this worker reads them.
_WORKER_COLLECTIONS: Optional[List[Any]] = None


class _NotShipped:
    """The records of a collection source in a worker that was not sent them (one
    that does not run the source's first subtask, the only one reading them): any
    use is an error, never an empty collection."""

    def __init__(self, key: int) -> None:
        self.key = key

    def _refuse(self, *_: Any) -> Any:
        raise RuntimeError(
            f"collection source {self.key}: its records were sent only to the worker process of the "
            "source's first subtask (the one that reads a collection), not to this one"
        )

    __len__ = __getitem__ = __iter__ = _refuse


def _collection_source(key: int, schema: Any) -> CollectionSource:
    """A collection source unpickled in a worker, its records those the driver sent
    this worker apart from the job. A collection is read by the source's subtask 0
    only (``CollectionSource``), so only that subtask's worker gets them: before, every
    worker of a job unpickled every record (a 1,000,000-record collection, four
    workers: four times the unpickling, for one reader)."""
    source = CollectionSource.__new__(CollectionSource)
    source.schema = schema
    source.records = _WORKER_COLLECTIONS[key] if _WORKER_COLLECTIONS is not None else _NotShipped(key)
    return source


_WORKER_LINK: Optional[_Link] = None  # in a worker: its pipe to the driver


def _sink_proxy(key: int, transactional: bool) -> _SinkProxy:
    """A driver-memory sink, unpickled in a worker: the proxy over the worker's pipe."""
    if _WORKER_LINK is None:
        raise RuntimeError("a sink proxy of the process runner is only made in one of its workers")
    return _SinkProxy(_WORKER_LINK, key, transactional)


class _Link:
    """A worker's end of its pipe to the driver, shared by the worker's threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def call(self, message: Tuple[Any, ...]) -> Any:
        with self.lock:
            self.conn.send(message)
            kind, value = self.conn.recv()
        if kind == "error":
            raise value
        return value

    def post(self, message: Tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(message)


class _SinkProxy(Sink):
    """A driver-memory sink as a worker sees it: each call runs on the driver's object.

    A transactional sink's ``stage`` and ``commit`` wait for the driver's answer, so a
    piece is staged there before the checkpoint it belongs to is acknowledged; a
    non-transactional sink's ``stage`` is posted (one pipe write per buffer), and the
    driver reads every posted call before the job's result is made."""

    def __init__(self, link: _Link, key: int, transactional: bool) -> None:
        self._link = link
        self._key = key
        self.transactional = transactional

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("a sink proxy of the process runner cannot be pickled again")

    def open(self, subtask: int) -> None:
        self._link.call(("sink", self._key, "open", (subtask,), True))

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        message = ("sink", self._key, "stage", (subtask, checkpoint_id, records), self.transactional)
        if self.transactional:
            self._link.call(message)
        else:
            self._link.post(message)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        self._link.call(("sink", self._key, "commit", (subtask, checkpoint_id), True))

    def recover(self, covered: Any) -> None:
        raise RuntimeError("recover runs on the driver, not in a worker")


_SKELETONS = ("_make_skeleton_class", "_make_skeleton_enum")  # cloudpickle's makers of classes sent by value


def _load_by_value(data: bytes) -> Any:
    """Unpickles what cloudpickle pickled on the driver, and makes the classes it sent by
    value from the driver's script (``__main__``) findable in this worker's ``__main__``.

    Why: a class defined in the script that runs the job (a ``@dataclass`` of records)
    travels by value, but records of it are pickled by reference from here on, the way
    ``pickle`` pickles any class (module and name): to another worker over a socket, to
    the driver's ``CollectSink`` over the pipe. A worker's ``__main__`` is not the script,
    so without this such a record could not leave its worker ("attribute lookup Click on
    __main__ failed"). Registered under its name, the class pickles here, unpickles in a
    worker as that worker's copy of it, and on the driver as the script's own class."""
    made: List[Any] = []

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = super().find_class(module, name)
            if name in _SKELETONS and "cloudpickle" in module:

                def tracked(*args: Any, **kwargs: Any) -> Any:
                    made.append(found(*args, **kwargs))
                    return made[-1]

                return tracked
            return found

    loaded = _Unpickler(io.BytesIO(data)).load()
    main = sys.modules.get("__main__")
    for cls in made:
        name = getattr(cls, "__qualname__", "")
        if main is not None and getattr(cls, "__module__", None) == "__main__" and name.isidentifier():
            if getattr(main, name, None) is None:  # never over something of the worker's own
                setattr(main, name, cls)
    return loaded


# -- naming what does not pickle ---------------------------------------------------------------


def unpicklable_message(job: str, graph: Any, error: BaseException) -> str:
    """Why job ``job`` cannot go to worker processes, naming the step and, where it
    can be found, the function or captured value that does not pickle, and the fix."""
    found = _find_unpicklable(graph)
    where = f": {found}" if found else ""
    return (
        f"job {job!r} cannot run in worker processes (executor='processes'): a part of it cannot be pickled"
        f"{where} ({type(error).__name__}: {error}). Functions, sources and sinks go to each worker with "
        "cloudpickle: keep locks, open files, sockets, clients and generators out of what they capture or "
        "hold (create them in open(), or in the function, instead), or run the job with executor='threads'"
    )


def _find_unpicklable(graph: Any) -> str:
    """The first step of ``graph`` with something that does not pickle, as a path down
    to the smallest such value found (a function's captured variable, an attribute)."""
    pickler = _pickler_class()
    for vertex in getattr(graph, "vertices", []):
        for step in getattr(vertex, "steps", []):
            for attr in ("source", "factory", "key", "sink", "timestamps"):
                value = getattr(step, attr, None)
                if value is not None and not _pickles(value, pickler):
                    return narrow(lambda v: _pickles(v, pickler), value, f"step {step.name!r} ({attr})")
    return ""
