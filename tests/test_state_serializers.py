from __future__ import annotations

import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyengine.state.serializers import SafeSerializer, StateSerializationError, serializer_for

atoms = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(), st.binary())
hashables = st.recursive(atoms, lambda inner: st.tuples(inner, inner), max_leaves=4)
values = st.recursive(
    atoms,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(hashables, inner, max_size=5),
    ),
    max_leaves=30,
)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


@given(values)
def test_plain_values_round_trip_exactly(value) -> None:
    s = SafeSerializer()
    assert _same(s.loads(s.dumps(value)), value)


def test_other_types_are_refused_with_advice() -> None:
    with pytest.raises(StateSerializationError, match=r"builtins.set .*serializer='pickle'"):
        SafeSerializer().dumps({1, 2})


def test_serializer_names() -> None:
    assert serializer_for(None).name == "msgpack"
    assert serializer_for("pickle").name == "pickle"
    with pytest.raises(ValueError, match="'yaml'"):
        serializer_for("yaml")


moments = st.datetimes(min_value=datetime.datetime(1, 1, 2), max_value=datetime.datetime(9999, 12, 30))


@given(moments, st.booleans())
def test_datetimes_round_trip_as_the_same_instant(moment, aware) -> None:
    """Spark's timestamp (aware) and timestamp_ntz (naive) in untyped state: a naive
    datetime comes back as it was, an aware one as the same instant in UTC."""
    value = moment.replace(tzinfo=datetime.timezone(datetime.timedelta(hours=-5))) if aware else moment
    s = SafeSerializer()
    back = s.loads(s.dumps(value))
    assert back == value and (back.tzinfo is not None) == aware
    if aware:
        assert back.tzinfo == datetime.timezone.utc


@given(st.dates(), st.decimals(allow_nan=False, allow_infinity=False))
def test_dates_and_decimals_round_trip_exactly(day, number) -> None:
    s = SafeSerializer()
    got_day, got_number = s.loads(s.dumps((day, number)))
    assert got_day == day and str(got_number) == str(number)
