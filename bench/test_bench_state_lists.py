"""Typed list state (issue #19): a list state typed as an Arrow number keeps each key's
elements in one ``array.array`` (``pyengine.state.serializers.LIST_TYPECODES``), against
the same state held as Python lists, the representation before.

10 M float64 elements over 100,000 keys (a tenth of PYENGINE_BENCH_RECORDS per key
count, at most 100 elements a key), on the heap backend. Rows, each against the other
in the same run, interleaved:

- a checkpoint's asynchronous part (``snapshot(...).run()``, a RAM directory where
  there is one): the arrays' buffers are joined, the lists' elements converted one by
  one (``np.fromiter``) — target: arrays at most 0.8x the lists' time (measured
  0.27-0.34x);
- decoding the restored column: an array per key from its piece of the buffer against
  a list per key (``piece.tolist()``, what a restore made before) — target: at most
  0.8x (measured 0.2-0.3x);
- the state's memory (``sys.getsizeof`` of the containers and their element objects),
  reported: 8 bytes an element against 32 (a float object and its pointer);
- a full collection of the garbage collector with the state alive, reported: the
  arrays hold no objects for it to walk.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import pyarrow as pa
import pytest
from conftest import SUMMARY

from pyengine.snapshot.format import StateColumn, _listed
from pyengine.state import ListStateDescriptor, create_keyed_backend
from pyengine.state.heap import _retype_lists
from pyengine.storage import checkpoint_storage

RECORDS = int(os.environ.get("PYENGINE_BENCH_RECORDS", 10_000_000))
KEYS = max(RECORDS // 100, 1_000)
PER_KEY = 100
ROUNDS = 5
AMOUNTS = ListStateDescriptor("amounts", pa.float64())
TARGET = 0.8


def _backend(as_lists: bool) -> Any:
    """KEYS keys of PER_KEY floats each: as array.arrays (the default), or with the
    very same values moved into Python lists (``as_lists``)."""
    backend = create_keyed_backend("heap")
    amounts = backend.get_state(AMOUNTS)
    values = (np.arange(PER_KEY) / 4).tolist()
    for key in range(KEYS):
        backend.set_current_key(key)
        amounts.update(values)
    if as_lists:
        _retype_lists(backend._tables["amounts"], None)
    return backend


def _directory() -> str:
    return tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def _async_seconds(backend: Any, checkpoint_id: int) -> Tuple[float, Any]:
    storage = checkpoint_storage(_directory(), "lists")
    pending = backend.snapshot(checkpoint_id, storage.location(checkpoint_id))
    started = time.perf_counter()
    result = pending.run()
    return time.perf_counter() - started, result


def _memory(backend: Any) -> int:
    total = 0
    for group in backend._tables["amounts"].groups:
        for stored in group.values():
            total += sys.getsizeof(stored)
            if type(stored) is list:
                total += sum(map(sys.getsizeof, stored))
    return total


def _collection_with(as_lists: bool) -> float:
    """A full collection's time with the state alive (best of three)."""
    backend = _backend(as_lists)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - started)
    del backend
    gc.collect()
    return best


@pytest.fixture(scope="module")
def states() -> Dict[str, Any]:
    return {"lists": _backend(True), "arrays": _backend(False)}


def test_typed_list_checkpoint_restore_and_memory(states: Dict[str, Any]) -> None:
    snapshot: Dict[str, List[float]] = {"lists": [], "arrays": []}
    decode: Dict[str, List[float]] = {"lists": [], "arrays": []}
    column = StateColumn("amounts", "list", pa.float64(), None, "msgpack", False)
    child = None
    for n in range(ROUNDS):
        for what in ("lists", "arrays"):  # interleaved: a slow spell hits both
            seconds, result = _async_seconds(states[what], n + 1)
            snapshot[what].append(seconds)
            if child is None:
                child = pa.array([list(range(PER_KEY))] * KEYS, pa.list_(pa.float64()))
            started = time.perf_counter()
            got = _listed(column, child, typed_arrays=what == "arrays")
            decode[what].append(time.perf_counter() - started)
            assert got is not None and len(got) == KEYS
            del got, result
    best_snapshot = {k: min(v) for k, v in snapshot.items()}
    best_decode = {k: min(v) for k, v in decode.items()}
    memory = {k: _memory(b) for k, b in states.items()}
    states.clear()  # each collection timed with its own representation alone alive
    collect = {what: _collection_with(what == "lists") for what in ("lists", "arrays")}
    elements = KEYS * PER_KEY
    snap_ratio = best_snapshot["arrays"] / best_snapshot["lists"]
    decode_ratio = best_decode["arrays"] / best_decode["lists"]
    SUMMARY.append(
        f"typed list state (float64), {elements:,} elements / {KEYS:,} keys, best of {ROUNDS} interleaved: "
        f"checkpoint (asynchronous part) {best_snapshot['arrays'] * 1e3:.0f} ms as arrays, "
        f"{best_snapshot['lists'] * 1e3:.0f} ms as lists -> {snap_ratio:.2f}x (target <= {TARGET}x); "
        f"restore decoding {best_decode['arrays'] * 1e3:.0f} ms, {best_decode['lists'] * 1e3:.0f} ms "
        f"-> {decode_ratio:.2f}x (target <= {TARGET}x); memory {memory['arrays'] / elements:.1f} "
        f"and {memory['lists'] / elements:.1f} bytes an element; a full collection "
        f"{collect['arrays'] * 1e3:.0f} ms and {collect['lists'] * 1e3:.0f} ms"
    )
    assert snap_ratio <= TARGET, f"typed list checkpoint as arrays at {snap_ratio:.2f}x the lists' time"
    assert decode_ratio <= TARGET, f"typed list restore decoding as arrays at {decode_ratio:.2f}x the lists' time"
    assert memory["arrays"] < memory["lists"] / 3
