"""A hash exchange's routing (``Output.emit``): ``key_by(field)`` over int keys is
routed in C (``route_int_keys``), every other key per record in Python. Both must put
each record on the subtask that owns its key group, in arrival order, and a record
without the key's field must still be refused by name."""

from __future__ import annotations

import threading
from typing import Any, ClassVar, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyengine._native import route_int_keys
from pyengine.errors import ColumnNotFoundError
from pyengine.runtime import outputs as outputs_module
from pyengine.runtime.keyed import key_selector
from pyengine.runtime.outputs import Output
from pyengine.state import assign_to_key_group, subtask_for_key_group

MAX_P = 128


class _Gate:
    """A downstream channel that keeps what it is sent."""

    capacity = 8

    def __init__(self) -> None:
        self.items: List[Any] = []

    def push(self, channel: int, item: Any) -> bool:
        self.items.append(item)
        return True

    def put(self, channel: int, item: Any, timeout: Any = None) -> bool:
        self.items.append(item)
        return True

    def queued(self, channel: int) -> int:
        return 0


def _routed(records: List[Any], field: Any, parallelism: int) -> List[List[Any]]:
    gates = [_Gate() for _ in range(parallelism)]
    out = Output(gates, 0, "hash", key_selector(field), MAX_P, 10**9, threading.Event(), debloat_target_ms=None)
    out.emit(records)
    out.flush()
    return [[r for item in g.items if isinstance(item, list) for r in item] for g in gates]


def _expected(records: List[Any], field: Any, parallelism: int) -> List[List[Any]]:
    channels: List[List[Any]] = [[] for _ in range(parallelism)]
    for r in records:
        channels[subtask_for_key_group(MAX_P, parallelism, assign_to_key_group(r[field], MAX_P))].append(r)
    return channels


KEYS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**70), 2**70),  # past int64: the general path
    st.booleans(),
    st.text(max_size=3),
    st.none(),
)


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(KEYS, max_size=60), parallelism=st.integers(1, 5), tuples=st.booleans())
def test_every_record_goes_to_the_subtask_of_its_key_group_in_order(
    keys: List[Any], parallelism: int, tuples: bool
) -> None:
    records: List[Any] = (
        [(k, i) for i, k in enumerate(keys)] if tuples else [{"k": k, "i": i} for i, k in enumerate(keys)]
    )
    field: Any = 0 if tuples else "k"
    assert _routed(records, field, parallelism) == _expected(records, field, parallelism)


def test_int_keys_take_the_native_path_and_stop_at_the_first_other_key() -> None:
    import operator

    buffers: List[List[Any]] = [[], [], []]
    records = [(7, "a"), (2**62, "b"), ("x", "c"), (3, "d")]
    assert route_int_keys(records, operator.itemgetter(0), MAX_P, buffers) == 2
    assert sorted(r for b in buffers for r in b) == sorted(records[:2])
    assert route_int_keys([{"v": 1}], operator.itemgetter("k"), MAX_P, buffers) == 0  # no field: the caller's


def test_a_record_without_the_key_field_after_routed_ones_is_refused_by_name(monkeypatch) -> None:
    calls: List[int] = []

    def counting(records: Any, get_key: Any, max_p: int, buffers: Any) -> int:
        n = route_int_keys(records, get_key, max_p, buffers)
        calls.append(n)
        return n

    monkeypatch.setattr(outputs_module, "route_int_keys", counting)
    records = [{"user": 1}, {"user": 2}, {"name": "no user"}, {"user": 3}]
    with pytest.raises(ColumnNotFoundError, match=r"key_by\('user'\)"):
        _routed(records, "user", 2)
    assert calls == [2]  # the two before it went the native way


class _Shrinking(tuple):
    """A record whose field read empties the buffer it is in (pathological user code)."""

    buffer: ClassVar[List[Any]] = []

    def __getitem__(self, i: Any) -> Any:
        _Shrinking.buffer.clear()
        return tuple.__getitem__(self, i)


def test_a_key_read_that_empties_the_buffer_stops_the_native_routing_safely() -> None:
    import operator

    records: List[Any] = [(1, "a"), _Shrinking((2, "b")), (3, "c"), (4, "d")]
    _Shrinking.buffer = records
    buffers: List[List[Any]] = [[], []]
    routed = route_int_keys(records, operator.itemgetter(0), MAX_P, buffers)
    assert routed <= 2 and sum(map(len, buffers)) == routed  # no read past the end


def test_key_by_a_name_on_records_with_attributes_says_how_to_key_them() -> None:
    """``key_by("user")`` reads ``record["user"]``; a dataclass record has the attribute,
    not the item: the error says so and gives the lambda (a new user's first guess was
    that the record lacked the field)."""
    from dataclasses import dataclass

    from pyengine.runtime.keyed import key_selector

    @dataclass
    class Click:
        user: int

    with pytest.raises(ColumnNotFoundError, match=r"reads record\['user'\].*key_by\(lambda r: r\.user\)"):
        key_selector("user")(Click(1))
    with pytest.raises(ColumnNotFoundError) as plain:
        key_selector("user")({"name": 1})
    assert "lambda" not in str(plain.value)  # a dict without the key: nothing to suggest
