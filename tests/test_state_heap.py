from __future__ import annotations

import copy
import random

import pyarrow as pa
import pytest

from pyengine.state import (
    AggregatingStateDescriptor,
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    NoCurrentKeyError,
    ReducingStateDescriptor,
    StateTtlConfig,
    StateVisibility,
    TtlUpdateType,
    ValueStateDescriptor,
    assign_to_key_group,
    create_keyed_backend,
)


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000

    def __call__(self) -> int:
        return self.ms


class Average:
    def create_accumulator(self):
        return (0, 0)

    def add(self, value, acc):
        return (acc[0] + value, acc[1] + 1)

    def get_result(self, acc):
        return acc[0] / acc[1]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def backend(clock):
    return create_keyed_backend("heap", max_parallelism=16, ttl_clock_ms=clock)


def test_value_state_per_key_with_default(backend) -> None:
    count = backend.get_state(ValueStateDescriptor("count", 0, pa.int64()))
    for key in ["a", "b", "a", "a"]:
        backend.set_current_key(key)
        count.update(count.value() + 1)
    backend.set_current_key("a")
    assert count.value() == 3
    backend.set_current_key("b")
    assert count.value() == 1
    count.update(None)  # as Flink: update(None) clears
    assert count.value() == 0
    backend.set_current_key("c")
    assert count.value() == 0
    assert sorted(backend.keys("count")) == ["a"]


def test_list_map_reducing_and_aggregating_state(backend) -> None:
    events = backend.get_state(ListStateDescriptor("events"))
    attrs = backend.get_state(MapStateDescriptor("attrs"))
    total = backend.get_state(ReducingStateDescriptor("total", lambda a, b: a + b))
    mean = backend.get_state(AggregatingStateDescriptor("mean", Average()))
    backend.set_current_key(7)
    assert events.get() == [] and attrs.is_empty() and total.get() is None and mean.get() is None
    events.add("x")
    events.add_all(["y", "z"])
    assert events.get() == ["x", "y", "z"]
    events.update(["only"])
    assert events.get() == ["only"]
    attrs.put("color", "red")
    attrs.put_all({"size": 3, "shape": "round"})
    attrs.remove("shape")
    assert attrs.get("color") == "red" and attrs.get("missing") is None
    assert attrs.contains("size") and not attrs.contains("shape")
    assert sorted(attrs.keys()) == ["color", "size"] and sorted(attrs.items()) == [("color", "red"), ("size", 3)]
    for v in (1, 2, 6):
        total.add(v)
        mean.add(v)
    assert total.get() == 9 and mean.get() == 3.0
    for state in (events, attrs, total, mean):
        state.clear()
    assert events.get() == [] and attrs.is_empty() and total.get() is None and mean.get() is None
    assert backend.num_entries() == 0


def test_typed_state_refuses_values_of_the_wrong_type_where_written(backend) -> None:
    count = backend.get_state(ValueStateDescriptor("count", 0, pa.int64()))
    names = backend.get_state(ListStateDescriptor("names", pa.string()))
    backend.set_current_key(1)
    with pytest.raises(TypeError, match="value state 'count': 'x' is not an int64 value"):
        count.update("x")
    with pytest.raises(TypeError, match="is not an int64"):
        count.update(2**63)
    with pytest.raises(TypeError, match="list state 'names'"):
        names.add(3)
    with pytest.raises(ValueError, match="None cannot be added"):
        names.add(None)
    assert count.value() == 0 and names.get() == []


def test_state_needs_a_current_key(backend) -> None:
    count = backend.get_state(ValueStateDescriptor("count"))
    with pytest.raises(NoCurrentKeyError, match=r"'count' was used with no current key: .*process_element or on_timer"):
        count.value()


def test_keys_outside_the_backends_key_groups_are_refused() -> None:
    b = create_keyed_backend("heap", max_parallelism=128, key_group_range=KeyGroupRange.of(0, 63))
    inside = next(k for k in range(1000) if assign_to_key_group(k, 128) < 64)
    outside = next(k for k in range(1000) if assign_to_key_group(k, 128) >= 64)
    b.set_current_key(inside)
    with pytest.raises(ValueError, match=f"key {outside} belongs to key group .* outside .* 0-63"):
        b.set_current_key(outside)
    assert b.current_key == inside


def test_conflicting_descriptors_are_refused(backend) -> None:
    backend.get_state(ValueStateDescriptor("s", 0))
    assert backend.get_state(ValueStateDescriptor("s", 0)) is backend.get_state(ValueStateDescriptor("s", 0))
    with pytest.raises(ValueError, match="already registered"):
        backend.get_state(ListStateDescriptor("s"))


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown state backend 'rocksdb'; choose one of: heap, incremental"):
        create_keyed_backend("rocksdb")


def test_value_ttl_expires_and_refreshes(backend, clock) -> None:
    v = backend.get_state(ValueStateDescriptor("v", ttl=100))
    r = backend.get_state(
        ValueStateDescriptor("r", ttl=StateTtlConfig(100, update_type=TtlUpdateType.ON_READ_AND_WRITE))
    )
    backend.set_current_key("k")
    v.update(1)
    r.update(1)
    clock.ms += 60
    assert v.value() == 1 and r.value() == 1  # reading r restarts its clock
    clock.ms += 60
    assert v.value() is None  # 120 ms after its write
    assert r.value() == 1  # 60 ms after its last read
    assert backend.num_entries("v") == 0  # expired entries are cleaned up on access


def test_expired_but_not_cleaned_up_may_be_returned(backend, clock) -> None:
    ttl = StateTtlConfig(10, state_visibility=StateVisibility.RETURN_EXPIRED_IF_NOT_CLEANED_UP)
    v = backend.get_state(ValueStateDescriptor("v", ttl=ttl))
    backend.set_current_key("k")
    v.update("old")
    clock.ms += 50
    assert v.value() == "old"


def test_list_and_map_entries_expire_individually(backend, clock) -> None:
    events = backend.get_state(ListStateDescriptor("events", ttl=100))
    attrs = backend.get_state(MapStateDescriptor("attrs", ttl=100))
    backend.set_current_key("k")
    events.add("early")
    attrs.put("early", 1)
    clock.ms += 60
    events.add("late")
    attrs.put("late", 2)
    clock.ms += 60
    assert events.get() == ["late"]
    assert attrs.items() == [("late", 2)]
    clock.ms += 100
    assert events.get() == [] and attrs.is_empty()


# -- copy-on-write -----------------------------------------------------------------

OPS = ["value_set", "value_mutate", "list_add", "list_mutate", "map_put", "map_mutate", "map_remove",
       "clear", "freeze", "release"]  # fmt: skip


def _model_of(frozen_groups):
    return copy.deepcopy([dict(g) for g in frozen_groups])


@pytest.mark.parametrize("seed", range(25))
def test_nothing_done_after_a_freeze_changes_the_frozen_state(seed) -> None:
    """Random writes and in-place mutations of values read from state, interleaved
    with freezes (a snapshot's synchronous part) and releases (its end): every
    frozen snapshot must still hold exactly what the state held when it froze,
    and the live state must behave as if no snapshot had ever been taken."""
    rng = random.Random(seed)
    live = create_keyed_backend("heap", max_parallelism=4)
    plain = create_keyed_backend("heap", max_parallelism=4)  # the same operations, never frozen
    descriptors = [ValueStateDescriptor("v"), ListStateDescriptor("l"), MapStateDescriptor("m")]
    states = [[b.get_state(d) for d in descriptors] for b in (live, plain)]
    snapshots = []  # (table name, frozen groups, deep copy taken at freeze time)
    for _ in range(400):
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
        arg = rng.randrange(100)
        for backend, (v, lst, mp) in zip((live, plain), states, strict=True):
            backend.set_current_key(key)
            if op == "value_set":
                v.update([arg])
            elif op == "value_mutate":
                got = v.value()
                if got is not None:
                    got.append(arg)
            elif op == "list_add":
                lst.add([arg])
            elif op == "list_mutate":
                got = lst.get()
                if got:
                    got[0].append(arg)
            elif op == "map_put":
                mp.put(arg % 3, [arg])
            elif op == "map_mutate":
                got = mp.get(arg % 3)
                if got is not None:
                    got.append(arg)
            elif op == "map_remove":
                mp.remove(arg % 3)
            else:
                (v, lst, mp)[arg % 3].clear()
        for name, frozen, model in snapshots:
            assert [dict(g) for g in frozen] == model, f"snapshot of {name!r} changed after {op}"
        for name in ("v", "l", "m"):
            assert [dict(g) for g in live._tables[name].groups] == [dict(g) for g in plain._tables[name].groups]
