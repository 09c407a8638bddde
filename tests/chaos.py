"""Failure injection for the exactly-once tests: one ``Chaos`` is shared by every
subtask and every attempt of a job (functions and sinks keep it through
``__deepcopy__``), so a planned failure happens once in the whole run, in whichever
attempt gets there, and the restarted job runs past it. ``FlakyFiles`` fails a
file source's read the same way, in its filesystem."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any, Iterable, List, Mapping, Optional, Tuple, Union

import pyarrow as pa
import pyarrow.fs as pafs

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


class FlakyFiles:
    """A ``pyarrow.fs`` handler over the local disk whose ``at``-th read of a file's
    bytes fails with an ``OSError`` (``what="open"``: its ``at``-th opening of a file
    fails with a ``PermissionError``), once across every process of the job and every
    attempt (the first to create ``marker`` fails; workers are other processes), then
    reads succeed: an object store's transient read error, in the real read path of
    a file source. Reads count from ``arm()`` on (the driver reads footers first,
    building the source); ``filesystem()`` is what ``read_files`` takes."""

    def __init__(self, marker: str, at: int, what: str = "read") -> None:
        if what not in ("read", "open"):
            raise ValueError(f"FlakyFiles fails a 'read' or an 'open', not {what!r}")
        self.marker, self.at, self.what = marker, at, what
        self.armed = False
        self.reads = 0
        self.lock = threading.Lock()

    def __getstate__(self) -> Any:  # to worker processes: a lock of their own
        state = self.__dict__.copy()
        del state["lock"]
        return state

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def arm(self) -> None:
        self.armed, self.reads = True, 0

    def filesystem(self) -> Any:
        import pyarrow.fs as pafs

        return pafs.PyFileSystem(_FlakyHandler(self))

    def fired(self) -> bool:
        return os.path.exists(self.marker)

    def read(self, what: str = "read") -> None:
        """Counts a read (or an open) and fails the planned one, once."""
        if not self.armed or what != self.what:
            return
        with self.lock:
            self.reads += 1
            if self.reads != self.at:
                return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        if what == "open":  # a permission fixed before the restart
            raise PermissionError(f"injected permission error at open #{self.at}")
        raise OSError(f"injected transient read error at read #{self.at}")


class _FlakyFile:
    """A file object whose reads go through ``FlakyFiles.read`` first."""

    def __init__(self, flaky: FlakyFiles, path: str) -> None:
        self.flaky = flaky
        self.f = open(path, "rb")  # closed by pyarrow's PythonFile
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        self.flaky.read()
        return self.f.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def size(self) -> int:
        return os.fstat(self.f.fileno()).st_size

    def close(self) -> None:
        self.closed = True
        self.f.close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False


class _FlakyHandler(pafs.FileSystemHandler):
    """Local files; reads through ``_FlakyFile``. Writing is not needed by a source."""

    def __init__(self, flaky: FlakyFiles) -> None:
        self.flaky = flaky
        self.local = pafs.LocalFileSystem()

    def __reduce__(self) -> Any:
        return (_FlakyHandler, (self.flaky,))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _FlakyHandler) and other.flaky is self.flaky

    def __hash__(self) -> int:
        return id(self.flaky)

    def get_type_name(self) -> str:
        return "flaky"

    def normalize_path(self, path: str) -> str:
        return path

    def equals(self, other: Any) -> bool:
        return self == other

    def get_file_info(self, paths: Any) -> Any:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: Any) -> Any:
        return self.local.get_file_info(selector)

    def open_input_file(self, path: str) -> Any:
        self.flaky.read("open")
        return pa.PythonFile(_FlakyFile(self.flaky, path), mode="r")

    def open_input_stream(self, path: str) -> Any:
        return self.open_input_file(path)

    def _read_only(self, *args: Any) -> Any:
        raise OSError("FlakyFiles is read-only")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _read_only
    delete_file = move = copy_file = open_output_stream = open_append_stream = _read_only
