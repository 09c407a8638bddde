from __future__ import annotations

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
