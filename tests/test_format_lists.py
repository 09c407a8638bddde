"""Typed list state written and read through one flat array (``_flat_lists`` /
``_listed`` in ``pyengine.snapshot.format``): the same Arrow column and the same
Python values as pyarrow's own conversion of the lists, for every element type the
flat path takes, with empty lists, deleted keys (nulls) and sliced columns; and the
collector paused during a restore."""

from __future__ import annotations

import gc
import threading
from typing import Any, List

import numpy as np
import pyarrow as pa
import pytest

from pyengine.snapshot.format import _FLAT_LIST_DTYPES, TOMBSTONE, StateColumn, _flat_lists, _listed, _value_child
from pyengine.state import ListStateDescriptor, create_keyed_backend
from pyengine.state.heap import COLLECTOR_PAUSE
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
