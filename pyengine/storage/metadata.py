"""The ``_metadata`` file of a completed checkpoint or savepoint.

Plain JSON, so any tool can read it and reading it can never run code::

    {"format": "pyengine-checkpoint", "version": 1, "checksum": "xxh3:...",
     "metadata": {"job_id": ..., "job_name": ..., "runs": [[run_id, checkpoint_id], ...],
                  "checkpoint_id": ..., "timestamp": ..., "type": ...,
                  "operators": {uid: {"parallelism": P, "max_parallelism": M,
                                      "subtasks": {"0": {"keyed": [...], "operator": [...]}}}},
                  "shared": [uri, ...]}}

``job_id`` is the run that wrote the checkpoint and ``job_name`` the job it is a
run of. ``runs`` is the checkpoint's lineage: each run whose output the state
covers, with the last checkpoint of that run it covers (the runs it was restored
through, then this one). A sink uses it to tell the output a restored run must
keep from what it must drop.

Paths of files inside the job's directory are stored relative to the directory
holding ``_metadata`` (``file``, ``../shared/delta-…``), so a copied checkpoint
or savepoint reads its own files, never the original's, and keeps working when
the original is gone. Paths outside it (a chain another job directory holds,
after a restore from there) stay absolute.

The checksum covers the canonical JSON of ``metadata``, so a damaged file is
told apart from a valid one even when it still parses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import xxhash

from .handles import KeyGroupsStateHandle, OperatorStateHandle, StateHandle, checksum_hex, handle_from_json
from .paths import absolute, canonical, paths

__all__ = [
    "METADATA_FORMAT",
    "METADATA_VERSION",
    "CheckpointMetadata",
    "MetadataError",
    "OperatorState",
    "SubtaskState",
    "load_metadata",
]

METADATA_FORMAT = "pyengine-checkpoint"
METADATA_VERSION = 1


class MetadataError(ValueError):
    """A ``_metadata`` file that cannot be used: damaged, unknown version, malformed."""


@dataclass
class SubtaskState:
    """The state handles one subtask acknowledged."""

    keyed: List[StateHandle] = field(default_factory=list)
    operator: List[StateHandle] = field(default_factory=list)

    def handles(self) -> List[StateHandle]:
        return [*self.keyed, *self.operator]


@dataclass
class OperatorState:
    """The state of one operator (by uid) at its parallelism."""

    parallelism: int
    max_parallelism: int
    subtasks: Dict[int, SubtaskState] = field(default_factory=dict)

    def keyed_handles(self) -> List[KeyGroupsStateHandle]:
        return [
            h
            for s in self.subtasks.values()
            for h in s.keyed
            if isinstance(h, KeyGroupsStateHandle) and not isinstance(h, OperatorStateHandle)
        ]

    def operator_handles(self) -> List[OperatorStateHandle]:
        return [h for s in self.subtasks.values() for h in s.operator if isinstance(h, OperatorStateHandle)]


@dataclass
class CheckpointMetadata:
    job_id: str
    checkpoint_id: int
    timestamp: int
    type: str = "checkpoint"  # or "savepoint"
    operators: Dict[str, OperatorState] = field(default_factory=dict)
    shared: List[str] = field(default_factory=list)  # incremental files this checkpoint uses
    job_name: str = ""
    runs: List[Tuple[str, int]] = field(default_factory=list)  # lineage: (run id, last checkpoint covered)

    def handles(self) -> List[StateHandle]:
        return [h for op in self.operators.values() for s in op.subtasks.values() for h in s.handles()]

    def to_json(self) -> Dict[str, Any]:
        body = {
            "job_id": self.job_id,
            "checkpoint_id": self.checkpoint_id,
            "timestamp": self.timestamp,
            "type": self.type,
            "operators": {
                uid: {
                    "parallelism": op.parallelism,
                    "max_parallelism": op.max_parallelism,
                    "subtasks": {
                        str(i): {
                            "keyed": [h.to_json() for h in s.keyed],
                            "operator": [h.to_json() for h in s.operator],
                        }
                        for i, s in sorted(op.subtasks.items())
                    },
                }
                for uid, op in sorted(self.operators.items())
            },
            "shared": sorted(self.shared),
            "job_name": self.job_name,
            "runs": [[r, c] for r, c in self.runs],
        }
        return {
            "format": METADATA_FORMAT,
            "version": METADATA_VERSION,
            "checksum": checksum_hex(xxhash.xxh3_64_intdigest(canonical(body))),
            "metadata": body,
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str, base: Optional[str] = None) -> CheckpointMetadata:
        if not isinstance(data, dict) or data.get("format") != METADATA_FORMAT:
            raise MetadataError(f"{where} is not pyengine checkpoint metadata")
        version = data.get("version")
        if version != METADATA_VERSION:
            raise MetadataError(
                f"{where} has metadata version {version!r}; this pyengine reads version {METADATA_VERSION}"
            )
        body = data.get("metadata")
        if not isinstance(body, dict) or data.get("checksum") != checksum_hex(
            xxhash.xxh3_64_intdigest(canonical(body))
        ):
            raise MetadataError(f"{where} is damaged: its checksum does not match its content")
        try:
            body = paths(body, lambda p: absolute(p, base, where))
            operators = {
                uid: OperatorState(
                    parallelism=int(op["parallelism"]),
                    max_parallelism=int(op["max_parallelism"]),
                    subtasks={
                        int(i): SubtaskState(
                            keyed=[handle_from_json(h, where=where) for h in s.get("keyed", [])],
                            operator=[handle_from_json(h, where=where) for h in s.get("operator", [])],
                        )
                        for i, s in op["subtasks"].items()
                    },
                )
                for uid, op in body["operators"].items()
            }
            return cls(
                job_id=str(body["job_id"]),
                checkpoint_id=int(body["checkpoint_id"]),
                timestamp=int(body["timestamp"]),
                type=str(body.get("type", "checkpoint")),
                operators=operators,
                shared=[str(p) for p in body.get("shared", [])],
                job_name=str(body.get("job_name", "")),
                runs=[(str(r), int(c)) for r, c in body.get("runs", [])],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MetadataError(f"{where} is malformed: {exc!r}") from None

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, raw: bytes, *, where: str, base: Optional[str] = None) -> CheckpointMetadata:
        """``base``: the directory the file is in (path or URI), against which relative
        paths resolve."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise MetadataError(f"{where} is damaged: not valid JSON") from None
        return cls.from_json(data, where=where, base=base)

    def operator(self, uid: str) -> Optional[OperatorState]:
        return self.operators.get(uid)


def load_metadata(path: str) -> CheckpointMetadata:
    """The metadata of the checkpoint at ``path``: its ``chk-<n>`` directory or its
    ``_metadata`` file, as a local path or storage URI."""
    from .filesystem import resolve

    fs, fs_path, prefix = resolve(path)
    file_path = (
        fs_path if fs_path.endswith("/_metadata") or fs_path == "_metadata" else fs_path.rstrip("/") + "/_metadata"
    )
    try:
        with fs.open_input_stream(file_path) as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is not a completed checkpoint: {prefix}{file_path} does not exist") from None
    return CheckpointMetadata.loads(raw, where=prefix + file_path, base=prefix + file_path.rsplit("/", 1)[0])
