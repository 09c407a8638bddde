"""A checkpoint's asynchronous part paces its Python work (``snapshot.pacing``) and
encodes untyped values through one MessagePack packer, in slices: the same columns,
byte for byte, as one pass of the serializer; the task gets the interpreter."""

from __future__ import annotations

import datetime as dt
import decimal
import threading
import time
from typing import Any, List

import numpy as np
import pytest

from pyengine.snapshot import columns, pacing
from pyengine.snapshot import format as fmt
from pyengine.state import ListStateDescriptor, ValueStateDescriptor, create_keyed_backend
from pyengine.state.serializers import serializer_for
from pyengine.state.table import StateTable

VALUES: List[Any] = [
    0, -1, 127, 128, 2**40, -(2**63), 2**70, 1.5, "x", b"y", True, None, [1, "a"], {"k": [1.0, None]},
    (1, (2, "t")), dt.datetime(2024, 1, 2, 3, 4, 5, 6), dt.datetime(2024, 1, 2, tzinfo=dt.timezone.utc),
    dt.date(2020, 2, 29), decimal.Decimal("1.25"),
]  # fmt: skip


def _column(kind: str, ttl: bool = False) -> fmt.StateColumn:
    return fmt.StateColumn(name="s", kind=kind, arrow_type=None, map_key_type=None, serializer="msgpack", ttl=ttl)


def test_packed_values_are_the_serializers_bytes() -> None:
    dumps = serializer_for("safe").dumps
    values = VALUES * 3 + [fmt.TOMBSTONE]
    assert columns._packed(values) == [None if v is fmt.TOMBSTONE else dumps(v) for v in values]
    with pytest.raises(TypeError):
        columns._packed([object()])


@pytest.mark.parametrize("kind", ["value", "list"])
def test_sliced_columns_equal_one_pass(kind: str, monkeypatch: Any) -> None:
    rng = np.random.default_rng(7)
    items = [VALUES[i] for i in rng.integers(0, len(VALUES), 1000)]
    values = [[v, 1.0] for v in items] if kind == "list" else items
    whole = columns._value_child(_column(kind), values)
    monkeypatch.setattr(pacing, "SLICE", 7)
    assert columns._value_child(_column(kind), values).equals(whole)
    assert whole.to_pylist() == [serializer_for("safe").dumps(v) for v in values]


@pytest.mark.parametrize("kind", ["value", "list"])
def test_sliced_stamped_columns_equal_one_pass(kind: str, monkeypatch: Any) -> None:
    rng = np.random.default_rng(11)
    stamps = rng.integers(0, 100, 500).tolist()
    if kind == "list":
        values: List[Any] = [[(float(i), s), (2.0, s + 50)] for i, s in enumerate(stamps)]
    else:
        values = [(VALUES[i % len(VALUES)], s) for i, s in enumerate(stamps)]
    values[3] = fmt.TOMBSTONE
    column = _column(kind, ttl=True)
    whole, rows = columns._stamped_child(column, values, 60)
    assert rows is not None  # some keys expired: the slices' masks must line up
    monkeypatch.setattr(pacing, "SLICE", 16)
    sliced, sliced_rows = columns._stamped_child(column, values, 60)
    assert sliced.equals(whole)
    assert np.array_equal(sliced_rows, rows)
    assert columns._stamped_child(column, values, None)[1] is None
    monkeypatch.setattr(pacing, "SLICE", 4096)
    assert columns._stamped_child(column, values, None)[1] is None


def _spin(stop: threading.Event, spun: List[int]) -> None:
    while not stop.is_set():
        spun[0] += 1


def test_pace_leaves_a_busy_task_the_interpreter(monkeypatch: Any) -> None:
    monkeypatch.setenv("PYENGINE_SNAPSHOT_SHARE", "0.1")
    stop, spun = threading.Event(), [0]
    task = threading.Thread(target=_spin, args=(stop, spun))
    task.start()
    try:
        with pacing.paced():
            assert pacing.is_paced()
            started, cpu = time.perf_counter(), time.thread_time()
            while time.perf_counter() - started < 0.5:
                sum(range(2000))
                pacing.pace()
            mine = time.thread_time() - cpu
            wall = time.perf_counter() - started
        assert not pacing.is_paced()
    finally:
        stop.set()
        task.join()
    # CPU time this thread took is about a tenth of the wall time (unpaced: about half)
    assert mine <= 0.25 * wall, f"a paced thread took {mine:.3f} s of CPU in {wall:.3f} s"


def test_pace_does_nothing_unpaced_or_while_the_task_is_idle(monkeypatch: Any) -> None:
    monkeypatch.setenv("PYENGINE_SNAPSHOT_SHARE", "0.1")
    started = time.perf_counter()
    cpu = time.thread_time()
    while time.thread_time() - cpu < 0.1:  # not paced: no pause at all
        pacing.pace()
    assert time.perf_counter() - started < 0.5
    with pacing.paced():  # paced, nobody else busy: after one look, slices run on
        started, cpu = time.perf_counter(), time.thread_time()
        while time.thread_time() - cpu < 0.2:
            sum(range(2000))
            pacing.pace()
        wall = time.perf_counter() - started
    assert wall < 0.2 * 4, f"0.2 s of work took {wall:.2f} s with the task idle"


def test_share_is_checked(monkeypatch: Any) -> None:
    for bad in ("0", "2", "x"):
        monkeypatch.setenv("PYENGINE_SNAPSHOT_SHARE", bad)
        with pytest.raises(ValueError, match="PYENGINE_SNAPSHOT_SHARE"):
            pacing.share()


def test_a_list_of_scalars_owned_after_a_freeze_is_a_private_copy() -> None:
    table = StateTable(ListStateDescriptor("items"), 1)
    shared = [1, 2.5, "a", None]
    nested = [[1], 2]
    table.store(0, "k", shared)
    table.store(0, "n", nested)
    frozen = table.freeze()
    owned = table.own(0, "k", shared)
    owned.append(3)
    assert owned is not shared and frozen[0]["k"] == [1, 2.5, "a", None]
    deep = table.own(0, "n", nested)
    deep[0].append(9)
    assert frozen[0]["n"] == [[1], 2]


def test_paced_snapshot_restores_what_it_wrote(tmp_path: Any, monkeypatch: Any) -> None:
    from pyengine.storage import checkpoint_storage

    monkeypatch.setattr(pacing, "SLICE", 64)
    for kind in ("heap", "incremental"):
        backend = create_keyed_backend(kind)
        count = backend.get_state(ValueStateDescriptor("count"))
        amounts = backend.get_state(ListStateDescriptor("amounts", ttl=3_600_000))
        for k in range(3000):
            backend.set_current_key(k)
            count.update({"n": k})
            amounts.add(k * 0.5)
        result = backend.snapshot(1, checkpoint_storage(str(tmp_path / kind), "j").location(1)).run()
        restored = create_keyed_backend(kind)
        restored.restore(result.handles)
        count2 = restored.get_state(ValueStateDescriptor("count"))
        amounts2 = restored.get_state(ListStateDescriptor("amounts", ttl=3_600_000))
        for k in range(0, 3000, 7):
            restored.set_current_key(k)
            assert count2.value() == {"n": k}
            assert list(amounts2.get()) == [k * 0.5]
