"""Typed list state written and read through one flat array (``_flat_lists`` /
``_listed`` in ``pyengine.snapshot.columns``): the same Arrow column and the same
Python values as pyarrow's own conversion of the lists, for every element type the
flat path takes, with empty lists, deleted keys (nulls) and sliced columns; and the
collector paused during a restore. Typed map state likewise, through flat arrays of its
keys and of its values (``_flat_maps`` / ``_mapped``)."""

from __future__ import annotations

import gc
import threading
from typing import Any, List

import numpy as np
import pyarrow as pa
import pytest

from pyengine.snapshot.columns import (
    _FLAT_LIST_DTYPES,
    _flat_lists,
    _flat_maps,
    _listed,
    _mapped,
    _value_child,
)
from pyengine.snapshot.format import TOMBSTONE, StateColumn
from pyengine.state import ListStateDescriptor, create_keyed_backend
from pyengine.state.heap import COLLECTOR_PAUSE
from pyengine.state.serializers import LIST_TYPECODES, TYPED_LIST
from pyengine.storage import checkpoint_storage


def _random_lists(arrow_type: pa.DataType, seed: int, n: int = 300) -> List[Any]:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(_FLAT_LIST_DTYPES[arrow_type])
    out: List[Any] = []
    for _ in range(n):
        if rng.random() < 0.1:
            out.append(TOMBSTONE)
            continue
        size = int(rng.choice([0, 1, 3, 40]))
        if dtype == np.bool_:
            out.append([bool(b) for b in rng.integers(0, 2, size)])
        elif dtype.kind == "f":
            out.append([float(x) for x in (rng.standard_normal(size) * 1e3).astype(dtype)])
        else:
            info = np.iinfo(dtype)
            out.append([int(x) for x in rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)])
    return out


@pytest.mark.parametrize("arrow_type", list(_FLAT_LIST_DTYPES), ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flat_lists_equal_pyarrows_own_conversion(arrow_type: pa.DataType, seed: int) -> None:
    column = StateColumn("xs", "list", arrow_type, None, "msgpack", False)
    values = _random_lists(arrow_type, seed)
    flat = _flat_lists(column, values)
    assert flat is not None
    reference = pa.array([None if v is TOMBSTONE else v for v in values], pa.list_(arrow_type))
    assert flat.equals(reference)
    assert _value_child(column, values).equals(reference)
    # read back, whole and in slices (a batch is cut into key groups by slicing)
    assert _listed(column, flat) == values
    for a, b in [(0, 0), (0, 1), (5, 77), (150, 300), (299, 300)]:
        got = _listed(column, reference.slice(a, b - a))
        assert got == values[a:b] or (got is None and a == b)
        if got is not None:  # the same Python types as to_pylist gives
            expected = [None if v is TOMBSTONE else v for v in values[a:b]]
            assert [type(x) for v in got if v is not TOMBSTONE for x in v] == [
                type(x) for v in reference.slice(a, b - a).to_pylist() if v is not None for x in v
            ]
            assert len(got) == len(expected)


def test_other_element_types_and_null_elements_take_pyarrows_path() -> None:
    strings = StateColumn("s", "list", pa.string(), None, "msgpack", False)
    assert _flat_lists(strings, [["a"], []]) is None
    assert _value_child(strings, [["a"], [], TOMBSTONE]).to_pylist() == [["a"], [], None]
    ints = StateColumn("i", "list", pa.int64(), None, "msgpack", False)
    with_null = pa.array([[1, None], [2]], pa.list_(pa.int64()))
    assert _listed(ints, with_null) is None  # to_pylist then: a null element stays None
    # a value the state's checks would refuse: pyarrow's conversion names it
    with pytest.raises(Exception, match="cannot snapshot state 'i'"):
        _value_child(ints, [[1, "x"]])


def test_a_restore_pauses_the_collector_and_leaves_it_as_it_was(tmp_path: Any) -> None:
    backend = create_keyed_backend("heap")
    amounts = backend.get_state(ListStateDescriptor("amounts", pa.float64()))
    for key in range(50):
        backend.set_current_key(key)
        amounts.add_all([key + i / 4 for i in range(key % 7)])
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "lists")
    handles = backend.snapshot(1, storage.location(1)).run().handles

    seen: List[bool] = []
    restored = create_keyed_backend("heap")
    real_restore = restored._restore

    def spying(*args: Any) -> None:
        seen.append(gc.isenabled())
        real_restore(*args)

    restored._restore = spying  # type: ignore[method-assign]
    assert gc.isenabled()
    restored.restore(handles)
    assert seen == [False] and gc.isenabled()
    restored.set_current_key(6)
    assert restored.get_state(ListStateDescriptor("amounts", pa.float64())).get() == [6 + i / 4 for i in range(6)]

    gc.disable()  # a process that turned the collector off keeps it off
    try:
        create_keyed_backend("heap").restore(handles)
        assert not gc.isenabled()
    finally:
        gc.enable()

    # nested and concurrent pauses: on again only when the last one ends
    with COLLECTOR_PAUSE:
        inner_done = threading.Event()

        def other() -> None:
            with COLLECTOR_PAUSE:
                pass
            inner_done.set()

        threading.Thread(target=other).start()
        assert inner_done.wait(10)
        assert not gc.isenabled()
    assert gc.isenabled()


# -- typed lists of numbers stored as array.array (LIST_TYPECODES) -------------------------------


@pytest.mark.parametrize("arrow_type", list(LIST_TYPECODES), ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_array_lists_write_and_read_as_the_lists_they_hold(arrow_type: pa.DataType, seed: int) -> None:
    """A state's array.arrays are written from their joined buffers: the very column
    pyarrow makes of the same lists; read back for a backend (``typed_arrays``) they are
    array.arrays of the same typecode and values, and for a reader they are lists."""
    column = StateColumn("xs", "list", arrow_type, None, "msgpack", False)
    values = _random_lists(arrow_type, seed)
    code = LIST_TYPECODES[arrow_type]
    arrays = [v if v is TOMBSTONE else TYPED_LIST(code, v) for v in values]
    reference = pa.array([None if v is TOMBSTONE else v for v in values], pa.list_(arrow_type))
    assert _flat_lists(column, arrays).equals(reference)
    for a, b in [(0, 300), (5, 77), (299, 300)]:
        got = _listed(column, reference.slice(a, b - a), typed_arrays=True)
        assert got is not None
        assert [v if v is TOMBSTONE else (v.typecode, v.tolist()) for v in got] == [
            v if v is TOMBSTONE else (code, v) for v in values[a:b]
        ]
        assert _listed(column, reference.slice(a, b - a)) == values[a:b]  # a reader's: lists
    mixed = [TYPED_LIST(code, [1]), [2]]  # not all arrays (a list restored before): element by element
    assert _flat_lists(column, mixed).to_pylist() == [[1], [2]]


@pytest.mark.parametrize("backend_kind", ["heap", "incremental"])
def test_a_typed_list_is_an_array_that_checkpoints_and_restores(tmp_path: Any, backend_kind: str) -> None:
    floats = ListStateDescriptor("floats", pa.float64())
    ints = ListStateDescriptor("ints", pa.int32())
    plain = ListStateDescriptor("plain")
    backend = create_keyed_backend(backend_kind, max_parallelism=8)
    f, i, p = (backend.get_state(d) for d in (floats, ints, plain))
    for key in range(20):
        backend.set_current_key(key)
        f.add(1)  # an int into a float64 list: stored as a float
        f.add_all([key / 2, 2.5])
        i.update(range(key))
        p.add(key)
    backend.set_current_key(3)

    def stored(b: Any, name: str) -> Any:
        return b._tables[name].groups[b._key_index][3]

    assert type(stored(backend, "floats")) is TYPED_LIST and stored(backend, "floats").typecode == "d"
    assert type(stored(backend, "ints")) is TYPED_LIST and stored(backend, "ints").typecode == "i"
    assert type(stored(backend, "plain")) is list
    assert f.get() == [1.0, 1.5, 2.5] and type(f.get()[0]) is float and i.get() == [0, 1, 2]
    with pytest.raises(Exception, match="is not an int32 value"):
        i.add(2**40)

    storage = checkpoint_storage(str(tmp_path / "ckpt"), "typed-lists")
    pending = backend.snapshot(1, storage.location(1))  # its synchronous part: the arrays are shared now
    f.add(9.0)  # copy-on-write: the snapshot still writes [1.0, 1.5, 2.5]
    assert f.get() == [1.0, 1.5, 2.5, 9.0]
    first = pending.run().handles
    restored = create_keyed_backend(backend_kind, max_parallelism=8)
    restored.restore(first)
    restored.set_current_key(3)
    assert type(stored(restored, "floats")) is TYPED_LIST  # straight into arrays, before any get_state
    rf = restored.get_state(floats)
    assert rf.get() == [1.0, 1.5, 2.5] and restored.get_state(ints).get() == [0, 1, 2]
    rf.add(4.0)
    assert rf.get() == [1.0, 1.5, 2.5, 4.0]

    # a second checkpoint of the restored backend (for the incremental one: a delta over the first)
    second = restored.snapshot(2, storage.location(2)).run().handles
    again = create_keyed_backend(backend_kind, max_parallelism=8)
    again.restore(second)
    again.set_current_key(3)
    assert again.get_state(floats).get() == [1.0, 1.5, 2.5, 4.0]

    # declared again without a type: lists, which take any element
    untyped = create_keyed_backend(backend_kind, max_parallelism=8)
    untyped.restore(first)
    untyped.set_current_key(3)
    u = untyped.get_state(ListStateDescriptor("floats"))
    assert type(stored(untyped, "floats")) is list
    u.add("text")
    assert u.get() == [1.0, 1.5, 2.5, "text"]


# -- typed map state through flat keys and values (_flat_maps / _mapped) --------------------------

MAP_TYPES = [
    (pa.int64(), pa.float64()),
    (pa.string(), pa.int64()),
    (pa.int32(), pa.bool_()),
    (pa.float64(), pa.string()),
    (pa.binary(), pa.uint8()),
    (pa.string(), pa.timestamp("ms")),  # values pyarrow converts: the old path
]


def _random_maps(key_type: pa.DataType, value_type: pa.DataType, seed: int, n: int = 200) -> List[Any]:
    import datetime

    rng = np.random.default_rng(seed)

    def one(t: pa.DataType, i: int) -> Any:
        if pa.types.is_string(t):
            return f"page/{i}"
        if pa.types.is_binary(t):
            return f"b{i}".encode()
        if pa.types.is_boolean(t):
            return bool(i % 2)
        if pa.types.is_floating(t):
            return i / 4
        if pa.types.is_timestamp(t):
            return datetime.datetime(2026, 1, 1) + datetime.timedelta(milliseconds=i)
        return i % 250

    out: List[Any] = []
    for _ in range(n):
        size = int(rng.choice([0, 1, 3, 20]))
        picked = rng.choice(250, size, replace=False).tolist()
        out.append({one(key_type, i): one(value_type, i + 1) for i in picked})
    return out


@pytest.mark.parametrize(("key_type", "value_type"), MAP_TYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_flat_maps_equal_pyarrows_own_conversion(key_type: pa.DataType, value_type: pa.DataType, seed: int) -> None:
    column = StateColumn("m", "map", value_type, key_type, "msgpack", False)
    maps = _random_maps(key_type, value_type, seed)
    reference = pa.array([list(m.items()) for m in maps], pa.map_(key_type, value_type))
    written = _value_child(column, maps)
    assert written.equals(reference)
    if pa.types.is_timestamp(value_type):
        assert _flat_maps(column, maps) is None  # pyarrow converts what NumPy and strings do not take
    for a, b in [(0, 200), (3, 77), (199, 200)]:
        part = reference.slice(a, b - a)
        got = _mapped(column, part)
        assert got == maps[a:b] == [dict(m) for m in part.to_pylist()]
        assert [type(k) for m in got for k in m] == [type(k) for m in maps[a:b] for k in m]
    with_deleted = [*maps[:5], TOMBSTONE, *maps[5:10]]  # a delta's deleted key: pyarrow's path, a null
    column_of_delta = _value_child(column, with_deleted)
    assert column_of_delta.null_count == 1 and _mapped(column, column_of_delta) == with_deleted


def test_a_typed_map_with_a_null_value_checkpoints_and_restores(tmp_path: Any) -> None:
    from pyengine.state import MapStateDescriptor

    descriptor = MapStateDescriptor("m", pa.string(), pa.int64())
    backend = create_keyed_backend("heap", max_parallelism=8)
    state = backend.get_state(descriptor)
    for key in range(30):
        backend.set_current_key(key)
        state.put_all({"a": key, "b": None} if key % 3 == 0 else {"a": key})
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "maps")
    restored = create_keyed_backend("heap", max_parallelism=8)
    restored.restore(backend.snapshot(1, storage.location(1)).run().handles)
    again = restored.get_state(descriptor)
    for key in range(30):
        restored.set_current_key(key)
        assert dict(again.items()) == ({"a": key, "b": None} if key % 3 == 0 else {"a": key})
