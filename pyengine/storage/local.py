"""Local recovery: a second copy of keyed state on the task's own disk.

A snapshot is written through a duplicating stream to primary storage and to the
subtask's local directory. The local file is byte-identical, so its handle is the
primary's with another path. The local copy is a convenience: if writing it
fails, it is dropped and the checkpoint goes on; on restore, a local copy is used
only when present and valid (checksum verified), else primary storage is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Iterable, Optional, Sequence, Set, Tuple

from .filesystem import CheckpointStateOutputStream, CorruptStateError, read_bytes
from .handles import KeyGroupsStateHandle, StateHandle, StreamStateHandle

__all__ = ["DuplicatingOutputStream", "LocalRecoveryDirectory"]

log = logging.getLogger(__name__)


class DuplicatingOutputStream:
    """Writes to a primary checkpoint stream and, as long as it works, a local file."""

    def __init__(self, primary: CheckpointStateOutputStream, local_path: str) -> None:
        self.primary = primary
        self.local_path = local_path
        self._temp = local_path + ".inprogress"
        self._local: Optional[Any]
        try:
            self._local = open(self._temp, "wb")
        except OSError as exc:
            log.warning("local recovery copy %s not written: %s", local_path, exc)
            self._local = None
        self.local_ok = self._local is not None
        self.closed = False

    def _local_failed(self, exc: BaseException) -> None:
        log.warning("local recovery copy %s dropped: %s", self.local_path, exc)
        self.local_ok = False
        if self._local is not None:
            try:
                self._local.close()
            finally:
                self._local = None
                _remove(self._temp)

    def write(self, data: Any) -> int:
        n = self.primary.write(data)
        if self._local is not None:
            try:
                self._local.write(data)
            except OSError as exc:
                self._local_failed(exc)
        return n

    def tell(self) -> int:
        return self.primary.tell()

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def begin_segment(self, start: Optional[int] = None) -> None:
        self.primary.begin_segment(start)

    def end_segment(self) -> Tuple[int, int, str]:
        return self.primary.end_segment()

    def write_segment(self, parts: Sequence[Any], digest: int) -> Tuple[int, int, str]:
        segment = self.primary.write_segment(parts, digest)
        if self._local is not None:
            try:
                for part in parts:
                    self._local.write(part)
            except OSError as exc:
                self._local_failed(exc)
        return segment

    def close_and_get_handle(self) -> StateHandle:
        self.closed = True
        handle = self.primary.close_and_get_handle()
        if self._local is not None:
            try:
                self._local.close()
                if isinstance(handle, StreamStateHandle):
                    os.replace(self._temp, self.local_path)
                else:  # inlined in _metadata: nothing to recover locally
                    _remove(self._temp)
                    self.local_ok = False
            except OSError as exc:
                self._local_failed(exc)
            self._local = None
        return handle

    def abort(self) -> None:
        self.closed = True
        self.primary.abort()
        if self._local is not None:
            self._local.close()
            self._local = None
        _remove(self._temp)

    def __enter__(self) -> DuplicatingOutputStream:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class LocalRecoveryDirectory:
    """The local copies of one subtask's keyed state."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)

    def path_for(self, primary_path: str) -> str:
        return os.path.join(self.path, primary_path.rstrip("/").rsplit("/", 1)[-1])

    def open_stream(self, primary: CheckpointStateOutputStream) -> DuplicatingOutputStream:
        return DuplicatingOutputStream(primary, self.path_for(primary.path))

    def local_handle(self, handle: KeyGroupsStateHandle) -> Optional[KeyGroupsStateHandle]:
        """The local twin of a primary handle, if a local copy exists."""
        if not isinstance(handle.stream, StreamStateHandle):
            return None
        local = self.path_for(handle.stream.path)
        if not os.path.exists(local):
            return None
        return replace(handle, stream=replace(handle.stream, path=local))

    def prefer_local(self, handles: Iterable[KeyGroupsStateHandle]) -> list:
        """Each handle replaced by its local twin when that copy is present and intact."""
        chosen = []
        for handle in handles:
            local = self.local_handle(handle)
            if local is not None:
                try:
                    segments = [(e.offset, e.length, e.checksum) for e in local.index]
                    read_bytes(local.stream, what="local recovery copy", segments=segments)
                except CorruptStateError as exc:
                    log.warning("local recovery copy unusable, reading primary storage instead: %s", exc)
                    local = None
            chosen.append(local or handle)
        return chosen

    def keep_only(self, handles: Iterable[StateHandle]) -> None:
        """Deletes local copies that none of ``handles`` (the latest completed checkpoint's) use."""
        keep: Set[str] = set()
        for handle in handles:
            stream = getattr(handle, "stream", None)
            if isinstance(stream, StreamStateHandle):
                keep.add(os.path.basename(self.path_for(stream.path)))
        for name in os.listdir(self.path):
            if name not in keep:
                _remove(os.path.join(self.path, name))
