"""TTL state as columns of values and stamps (state file version 6, ``snapshot/stamped.py``):
what the columns hold, after the expired entries are masked out in bulk, is what the
Python filter of ``state/ttl.py`` (``_live_entry``, the reference that wrote version 4)
keeps, for random values, lists and maps, typed and untyped, with deletions (a delta's
tombstones); and a TTL clock's floats are rounded up to whole milliseconds, stamps
and readings alike."""

from __future__ import annotations

import random
from typing import Any, List, Optional

import pyarrow as pa
import pytest

from pyengine._native import StampedList
from pyengine.snapshot.format import TOMBSTONE
from pyengine.snapshot.stamped import decode_stamped, encode_stamped
from pyengine.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor, create_keyed_backend
from pyengine.state.serializers import SafeSerializer
from pyengine.state.ttl import _ABSENT, _live_entry

_SAFE = SafeSerializer()


def _value(rng: random.Random, typed: bool) -> Any:
    if typed:
        return rng.choice([rng.randrange(-5, 1000), None]) if rng.random() < 0.05 else rng.randrange(-5, 1000)
    return rng.choice([rng.random(), f"s{rng.randrange(50)}", [rng.randrange(9)], {"a": rng.randrange(9)}, None, 7])


def _entries(rng: random.Random, kind: str, typed: bool, n: int) -> List[Any]:
    out: List[Any] = []
    for _ in range(n):
        if rng.random() < 0.1:
            out.append(TOMBSTONE)
            continue
        if kind == "value":
            out.append((_value(rng, typed) if not typed else rng.randrange(1000), rng.randrange(0, 100)))
        elif kind == "list":
            pairs = [
                (_value(rng, False) if not typed else rng.random(), rng.randrange(0, 100))
                for _ in range(rng.randrange(0, 8))
            ]
            pairs = [(v, s) for v, s in pairs if v is not None]
            if rng.random() < 0.7:
                stamped = StampedList()
                stamped.values.extend(v for v, _ in pairs)
                stamped.stamps.extend(s for _, s in pairs)
                out.append(stamped)
            else:
                out.append(pairs)  # restored from a version 4 file: (value, stamp) pairs
        else:
            out.append(
                {
                    f"k{rng.randrange(20)}": (_value(rng, typed), rng.randrange(0, 100))
                    for _ in range(rng.randrange(0, 6))
                }
            )
    return out


def _plain(entry: Any, kind: str) -> Any:
    if entry is TOMBSTONE:
        return entry
    if kind == "list":
        return [tuple(e) for e in entry]
    if kind == "map":
        return {u: tuple(e) for u, e in entry.items()}
    return tuple(entry)


TYPES = {"value": (pa.int64(), None), "list": (pa.float64(), None), "map": (pa.int64(), pa.string())}


@pytest.mark.parametrize("kind", ["value", "list", "map"])
@pytest.mark.parametrize("typed", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_stamped_columns_keep_what_the_python_filter_keeps(kind: str, typed: bool, seed: int) -> None:
    rng = random.Random(seed)
    entries = _entries(rng, kind, typed, rng.randrange(0, 60))
    limit: Optional[int] = rng.choice([None, -1, 30, 60, 99])
    arrow_type, key_type = TYPES[kind] if typed else (None, None)
    column, rows = encode_stamped(kind, arrow_type, key_type, entries, limit, TOMBSTONE, _SAFE.dumps)
    decoded = decode_stamped(kind, column, TOMBSTONE, None if typed else _SAFE.loads)
    expected = []
    for e in entries:
        if e is TOMBSTONE:
            expected.append(e)
            continue
        live = e if limit is None else _live_entry(e, kind, limit)
        if live is _ABSENT or (kind != "value" and limit is not None and not live):
            continue
        expected.append(live)
    kept = entries if rows is None else [e for e, keep in zip(entries, rows.tolist(), strict=True) if keep]
    assert len(kept) == len(decoded) == len(expected)
    assert [_plain(d, kind) for d in decoded] == [_plain(e, kind) for e in expected]
    for d in decoded:
        if kind == "list" and d is not TOMBSTONE:
            assert type(d) is StampedList  # what a list state writes, restored as it


def test_a_float_ttl_clock_counts_whole_milliseconds_across_a_snapshot(tmp_path: Any) -> None:
    from pyengine.storage import checkpoint_storage

    now = [1_000.4]
    backend = create_keyed_backend("heap", max_parallelism=4, ttl_clock_ms=lambda: now[0])
    v = backend.get_state(ValueStateDescriptor("v", ttl=100))
    lst = backend.get_state(ListStateDescriptor("l", pa.float64(), ttl=100))
    mp = backend.get_state(MapStateDescriptor("m", ttl=100))
    backend.set_current_key("k")
    v.update(1)
    lst.add(2.5)
    mp.put("a", 3)
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "float-clock")
    handles = backend.snapshot(1, storage.location(1)).run().handles
    now[0] = 1_099.6  # read as 1100: 99 ms after the stamps (1001, rounded up from 1000.4)
    restored = create_keyed_backend("heap", max_parallelism=4, ttl_clock_ms=lambda: now[0])
    restored.restore(handles)
    rv = restored.get_state(ValueStateDescriptor("v", ttl=100))
    rl = restored.get_state(ListStateDescriptor("l", pa.float64(), ttl=100))
    rm = restored.get_state(MapStateDescriptor("m", ttl=100))
    restored.set_current_key("k")
    assert rv.value() == 1 and list(rl.get()) == [2.5] and rm.get("a") == 3
    now[0] = 1_100.2  # read as 1101: 100 ms after the stamps, expired
    restored.set_current_key("k")
    assert rv.value() is None and list(rl.get()) == [] and rm.get("a") is None
