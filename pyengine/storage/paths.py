"""Paths inside ``_metadata``: stored relative to the directory that holds it, so a
copied checkpoint or savepoint reads its own files (see ``metadata``), and the
canonical JSON its checksum covers. Below both ``filesystem`` (which writes
``_metadata``) and ``metadata`` (which reads it)."""

from __future__ import annotations

import json
import posixpath
from typing import Any, Callable, Dict, Optional

import xxhash

from .handles import checksum_hex

__all__ = ["absolute", "canonical", "paths", "relocatable"]


def canonical(body: Any) -> bytes:
    """The bytes a ``_metadata`` checksum covers."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _checksum(body: Any) -> str:
    return checksum_hex(xxhash.xxh3_64_intdigest(canonical(body)))


def relocatable(data: Dict[str, Any], base: str) -> Dict[str, Any]:
    """``to_json()`` output with the paths inside ``base``'s parent (the job or
    savepoint directory) made relative to ``base`` (the directory ``_metadata`` goes
    in), and the checksum made anew over that."""
    root = base.rstrip("/").rsplit("/", 1)[0] + "/"
    if data.get("checksum") != _checksum(data.get("metadata")):
        return data  # not ours to vouch for: written as it is, and refused when read

    def rel(path: str) -> str:
        return posixpath.relpath(path, base) if path.startswith(root) else path

    body = paths(data["metadata"], rel)
    return {**data, "metadata": body, "checksum": _checksum(body)}


def _is_relative(path: str) -> bool:
    return not path.startswith("/") and "://" not in path


def absolute(path: str, base: Optional[str], where: str) -> str:
    if not _is_relative(path):
        return path
    if base is None:
        raise ValueError(f"{where} holds the relative path {path!r} and no directory to resolve it against")
    scheme, sep, rest = base.rpartition("://")
    return f"{scheme}{sep}{posixpath.normpath(posixpath.join(rest, path))}"


def paths(body: Any, fix: Callable[[str], str]) -> Any:
    """``body`` with every file path (a ``path`` value, the entries of a ``shared``
    list) passed through ``fix``."""
    if isinstance(body, dict):
        out: Dict[str, Any] = {}
        for key, value in body.items():
            if key == "path" and isinstance(value, str):
                out[key] = fix(value)
            elif key == "shared" and isinstance(value, list):
                out[key] = [fix(v) if isinstance(v, str) else v for v in value]
            else:
                out[key] = paths(value, fix)
        return out
    if isinstance(body, list):
        return [paths(v, fix) for v in body]
    return body
