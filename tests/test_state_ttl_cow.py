"""Copy-on-write of TTL'd state (issue #43): the randomized freeze test of
test_state_heap over TTL'd value, list and map state (typed and untyped, mutable and
immutable values), and what a first write or read after a snapshot copies: a TTL list
or map whose values are immutable is copied by its pointers (the snapshot and the
state share the value objects), read without a copy at all."""

from __future__ import annotations

import copy
import random
from typing import Any, List

import pyarrow as pa
import pytest

from pyengine._native import StampedList
from pyengine.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
    create_keyed_backend,
)

OPS = ["value_set", "value_mutate", "list_add", "list_add_all", "list_mutate", "list_update", "map_put",
       "map_mutate", "map_remove", "map_items", "list_get", "clear", "tick", "freeze", "release"]  # fmt: skip
TTL_MS = 50


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000

    def __call__(self) -> int:
        return self.ms


def _model_of(frozen_groups: Any) -> List[Any]:
    return [{k: _plain(v) for k, v in g.items()} for g in copy.deepcopy([dict(g) for g in frozen_groups])]


def _plain(v: Any) -> Any:
    """A stored entry as plain lists and tuples (a StampedList as its (value, stamp) pairs)."""
    if type(v) is StampedList or type(v) is list:
        return [tuple(e) if type(e) in (tuple, list) else e for e in v]
    if type(v) is dict:
        return {k: tuple(e) if type(e) is tuple else e for k, e in v.items()}
    return v


def _groups(table: Any) -> List[Any]:
    return [{k: _plain(v) for k, v in g.items()} for g in table.groups]


@pytest.mark.parametrize("values", ["mutable", "immutable", "typed"])
@pytest.mark.parametrize("seed", range(20))
def test_nothing_done_after_a_freeze_changes_frozen_ttl_state(seed: int, values: str) -> None:
    """Random writes, reads, in-place mutations of values read from state and expiry
    (the clock moving on), interleaved with freezes and releases: every frozen
    snapshot still holds exactly what the state held when it froze, and the live
    state holds what a backend never frozen holds after the same calls."""
    rng = random.Random(seed)
    clocks = [Clock(), Clock()]
    live = create_keyed_backend("heap", max_parallelism=4, ttl_clock_ms=clocks[0])
    plain = create_keyed_backend("heap", max_parallelism=4, ttl_clock_ms=clocks[1])
    typed = values == "typed"
    descriptors = [
        ValueStateDescriptor("v", type=pa.int64() if typed else None, ttl=TTL_MS),
        ListStateDescriptor("l", pa.int64() if typed else None, ttl=TTL_MS),
        MapStateDescriptor("m", pa.int64() if typed else None, pa.int64() if typed else None, ttl=TTL_MS),
    ]
    states = [[b.get_state(d) for d in descriptors] for b in (live, plain)]
    snapshots: List[Any] = []  # (table name, frozen groups, deep copy taken at freeze time)

    def value(arg: int) -> Any:
        return [arg] if values == "mutable" else arg

    for _ in range(500):
        op = rng.choice(OPS)
        key = rng.randrange(6)
        if op == "freeze":
            for name, table in live._tables.items():
                frozen = table.freeze()
                snapshots.append((name, frozen, _model_of(frozen)))
            continue
        if op == "release":
            if snapshots:
                for table in live._tables.values():
                    table.release()
                snapshots = [s for s in snapshots if live._tables[s[0]].active_snapshots > 0]
            continue
        if op == "tick":
            step = rng.choice([1, 10, 30])
            for c in clocks:
                c.ms += step
            continue
        arg = rng.randrange(100)
        seen = []
        for backend, (v, lst, mp) in zip((live, plain), states, strict=True):
            backend.set_current_key(key)
            if op == "value_set":
                v.update(value(arg))
            elif op == "value_mutate":
                got = v.value()
                if type(got) is list:
                    got.append(arg)
            elif op == "list_add":
                lst.add(value(arg))
            elif op == "list_add_all":
                lst.add_all([value(arg), value(arg + 1)])
            elif op == "list_update":
                lst.update([value(arg)])
            elif op == "list_mutate":
                got = lst.get()
                if got and type(got[0]) is list:
                    got[0].append(arg)
            elif op == "list_get":
                seen.append(list(lst.get()))
            elif op == "map_put":
                mp.put(arg % 3, value(arg))
            elif op == "map_mutate":
                got = mp.get(arg % 3)
                if type(got) is list:
                    got.append(arg)
            elif op == "map_items":
                seen.append(sorted(mp.items(), key=repr))
            elif op == "map_remove":
                mp.remove(arg % 3)
            else:
                (v, lst, mp)[arg % 3].clear()
        if seen:
            assert seen[0] == seen[1], f"{op} read differently from a frozen state"
        for name, frozen, model in snapshots:
            assert [{k: _plain(v) for k, v in g.items()} for g in frozen] == model, (
                f"snapshot of {name!r} changed after {op}"
            )
        for name in ("v", "l", "m"):
            assert _groups(live._tables[name]) == _groups(plain._tables[name]), f"{name!r} differs after {op}"


def _one_key(descriptor: Any) -> Any:
    backend = create_keyed_backend("heap", max_parallelism=4, ttl_clock_ms=Clock())
    state = backend.get_state(descriptor)
    backend.set_current_key("k")
    return backend, state, backend._tables[descriptor.name]


def _stored(table: Any) -> Any:
    return next(g["k"] for g in table.groups if "k" in g)


@pytest.mark.parametrize("typed", [False, True])
def test_a_ttl_lists_first_write_after_a_freeze_copies_its_pointers_and_a_read_nothing(typed: bool) -> None:
    _backend, lst, table = _one_key(ListStateDescriptor("l", pa.float64() if typed else None, ttl=TTL_MS))
    amounts = [float(i) + 0.5 for i in range(100)]
    lst.add_all(amounts)
    before = _stored(table)
    table.freeze()
    assert list(lst.get()) == amounts
    assert _stored(table) is before  # a read after the freeze copied nothing
    lst.add(7.5)
    after = _stored(table)
    assert after is not before and type(after) is StampedList
    assert list(before) == [(a, 1_000) for a in amounts]  # what the snapshot holds did not change
    assert all(x is y for x, y in zip(after.values, before.values, strict=False))  # the same value objects
    assert list(lst.get()) == [*amounts, 7.5]


@pytest.mark.parametrize("typed", [False, True])
def test_a_ttl_maps_first_write_after_a_freeze_shares_its_entries(typed: bool) -> None:
    _backend, mp, table = _one_key(
        MapStateDescriptor("m", pa.string() if typed else None, pa.int64() if typed else None, ttl=TTL_MS)
    )
    for i in range(40):
        mp.put(f"/page/{i}", i)
    before = _stored(table)
    entries = dict(before)
    table.freeze()
    assert mp.get("/page/3") == 3 and _stored(table) is before
    mp.put("/page/3", 4)
    after = _stored(table)
    assert after is not before and before == entries  # the snapshot's map did not change
    assert all(after[k] is before[k] for k in before if k != "/page/3")  # entries shared, not copied
    assert mp.get("/page/3") == 4


def test_mutable_values_are_still_copied_before_a_write() -> None:
    _backend, lst, table = _one_key(ListStateDescriptor("l", ttl=TTL_MS))
    lst.add([1])
    before = _stored(table)
    table.freeze()
    got = lst.get()
    got[0].append(2)  # a value read from state, changed in place
    assert list(before) == [([1], 1_000)]
    assert list(lst.get()) == [[1, 2]]
