"""A TTL added to a state's descriptor, or dropped from it, between a checkpoint and
the job restored from it (a user tuning state retention); and a declared type changed.

With a TTL every entry is stored with its write time; without one it is not. Before,
a restored state declared with a TTL it was checkpointed without failed at its first
read (``TypeError``), and one declared without the TTL it had read its entries as
``(value, stamp)`` tuples, silently. Now the entries are migrated when the state is
declared: they get the restore's time as their write time (the checkpoint does not
say when they were written, so they live a whole TTL from the restore), or lose it."""

from __future__ import annotations

from typing import Any, Dict

import pyarrow as pa
import pytest

from pyengine.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    StateTypeError,
    ValueStateDescriptor,
    create_keyed_backend,
)
from pyengine.state.keygroups import assign_to_key_group, key_group_range_for_subtask
from pyengine.storage import checkpoint_storage

TTL = StateTtlConfig(1_000)


class Clock:
    ms = 10_000

    def __call__(self) -> int:
        return self.ms


def _add(a: int, b: int) -> int:
    return a + b


# kind: (descriptor maker, write one entry, read the current key's state)
KINDS: Dict[str, Any] = {
    "value": (lambda ttl: ValueStateDescriptor("s", ttl=ttl), lambda s: s.update({"n": 2}), lambda s: s.value()),
    "typed-value": (
        lambda ttl: ValueStateDescriptor("s", type=pa.float64(), ttl=ttl),
        lambda s: s.update(2.5),
        lambda s: s.value(),
    ),
    "list": (lambda ttl: ListStateDescriptor("s", ttl=ttl), lambda s: s.add((1, "a")), lambda s: list(s.get())),
    "typed-list": (
        lambda ttl: ListStateDescriptor("s", pa.float64(), ttl=ttl),
        lambda s: s.add(1.5),
        lambda s: list(s.get()),
    ),
    "map": (lambda ttl: MapStateDescriptor("s", ttl=ttl), lambda s: s.put("k", [1, 2]), lambda s: s.items()),
    "reducing": (lambda ttl: ReducingStateDescriptor("s", _add, ttl=ttl), lambda s: s.add(3), lambda s: s.get()),
}


def _checkpoint(backend: Any, storage: Any, checkpoint_id: int) -> Any:
    return backend.snapshot(checkpoint_id, storage.location(checkpoint_id)).run().handles


@pytest.mark.parametrize("backend_kind", ["heap", "incremental"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("added", [True, False], ids=["ttl-added", "ttl-dropped"])
def test_a_ttl_added_or_dropped_across_a_restore(tmp_path: Any, backend_kind: str, kind: str, added: bool) -> None:
    make, write, read = KINDS[kind]
    before, after = (make(None), make(TTL)) if added else (make(TTL), make(None))
    clock = Clock()
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "ttl-change")
    backend = create_keyed_backend(backend_kind, max_parallelism=8, ttl_clock_ms=clock)
    state = backend.get_state(before)
    for key in range(10):
        backend.set_current_key(key)
        write(state)
    backend.set_current_key(3)
    expected = read(state)
    first = _checkpoint(backend, storage, 1)

    clock.ms += 900  # restored later: a migrated entry's time is the restore's
    restored = create_keyed_backend(backend_kind, max_parallelism=8, ttl_clock_ms=clock)
    restored.restore(first)
    restored.set_current_key(3)
    migrated = restored.get_state(after)
    assert read(migrated) == expected  # the value, never a (value, stamp) tuple
    restored.set_current_key(4)
    write(migrated)
    after_write = read(migrated)

    # the migrated layout is what the next checkpoint holds (a delta over the first, incremental)
    second = _checkpoint(restored, storage, 2)
    again = create_keyed_backend(backend_kind, max_parallelism=8, ttl_clock_ms=clock)
    again.restore(second)
    state2 = again.get_state(after)
    again.set_current_key(3)
    assert read(state2) == expected
    again.set_current_key(4)
    assert read(state2) == after_write

    if added:  # expiry counts from the restore: alive 999 ms after it, gone at 1,000
        clock.ms += 999
        again.set_current_key(3)
        assert read(state2) == expected
        clock.ms += 1
        again.set_current_key(3)
        assert read(state2) in (None, [])


@pytest.mark.parametrize("backend_kind", ["heap", "incremental"])
def test_a_restored_ttl_state_checkpointed_before_it_is_declared_keeps_its_write_times(
    tmp_path: Any, backend_kind: str
) -> None:
    """A job that declares a state lazily may checkpoint it before: the file must still
    say its entries carry write times, or a later restore would read stamps as values."""
    clock = Clock()
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "lazy")
    backend = create_keyed_backend(backend_kind, max_parallelism=8, ttl_clock_ms=clock)
    value = backend.get_state(ValueStateDescriptor("v", ttl=TTL))
    backend.set_current_key(1)
    value.update("x")
    restored = create_keyed_backend(backend_kind, max_parallelism=8, ttl_clock_ms=clock)
    restored.restore(_checkpoint(backend, storage, 1))
    second = _checkpoint(restored, storage, 2)  # nothing declared yet
    for descriptor in (ValueStateDescriptor("v", ttl=TTL), ValueStateDescriptor("v")):
        again = create_keyed_backend(backend_kind, max_parallelism=8, ttl_clock_ms=clock)
        again.restore(second)
        again.set_current_key(1)
        assert again.get_state(descriptor).value() == "x"


# -- a declared type changed across a restore -------------------------------------------------------

TYPE_CHANGES = [
    # (before, after, written, expected after the restore or the refusal's words)
    (ListStateDescriptor("s", pa.float64()), ListStateDescriptor("s", pa.int64()), [0.5, 2.5], "0.5 is not an int64"),
    (ListStateDescriptor("s", pa.int64()), ListStateDescriptor("s", pa.float64()), [1, 2], [1.0, 2.0]),
    (ListStateDescriptor("s"), ListStateDescriptor("s", pa.int64()), [1, "x"], "'x' is not an int64"),
    (ListStateDescriptor("s"), ListStateDescriptor("s", pa.int32()), [1, 2], [1, 2]),
    (ListStateDescriptor("s", pa.float64(), ttl=TTL), ListStateDescriptor("s", pa.int64(), ttl=TTL), [0.5], "0.5"),
    (ListStateDescriptor("s", pa.float64()), ListStateDescriptor("s", pa.string()), [0.5], "is not a string"),
    (ValueStateDescriptor("s", None, pa.float64()), ValueStateDescriptor("s", None, pa.int64()), 596.5, "596.5"),
    (ValueStateDescriptor("s", None, pa.int64()), ValueStateDescriptor("s", None, pa.int32()), 2**40, "int32"),
    (ValueStateDescriptor("s", None, pa.int64()), ValueStateDescriptor("s", None, pa.float64()), 596, 596.0),
    (MapStateDescriptor("s", pa.string(), pa.float64()), MapStateDescriptor("s", pa.string(), pa.int64()), 1.5, "1.5"),
    (MapStateDescriptor("s", pa.string(), pa.int64()), MapStateDescriptor("s", pa.string(), pa.float64()), 1, 1.0),
]


def _write(state: Any, value: Any) -> None:
    if hasattr(state, "put"):
        state.put("k", value)
    elif hasattr(state, "add_all"):
        state.add_all(value)
    else:
        state.update(value)


def _read(state: Any) -> Any:
    if hasattr(state, "put"):
        return dict(state.items()).get("k")
    if hasattr(state, "add_all"):
        return list(state.get())
    return state.value()


@pytest.mark.parametrize("backend_kind", ["heap", "incremental"])
@pytest.mark.parametrize(("before", "after", "written", "expected"), TYPE_CHANGES)
def test_a_type_changed_across_a_restore_is_checked_value_by_value(
    tmp_path: Any, backend_kind: str, before: Any, after: Any, written: Any, expected: Any
) -> None:
    """A trial: a float64 list state resumed as int64 handed out floats and truncated
    them in the next checkpoint, silently. Now each restored value passes the check a
    write would (converted as a write is: ints into a float state as floats), or the
    state is refused when it is declared, naming both types and the way out."""
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "types")
    backend = create_keyed_backend(backend_kind, max_parallelism=8)
    state = backend.get_state(before)
    backend.set_current_key(1)
    _write(state, written)
    restored = create_keyed_backend(backend_kind, max_parallelism=8)
    restored.restore(_checkpoint(backend, storage, 1))
    restored.set_current_key(1)
    if isinstance(expected, str):
        with pytest.raises(StateTypeError) as refused:
            restored.get_state(after)
        message = str(refused.value)
        assert expected in message and "was checkpointed" in message and "Declare it as it was checkpointed" in message
        return
    got = _read(restored.get_state(after))
    assert got == expected and [type(x) for x in (got if isinstance(got, list) else [got])] == [
        type(x) for x in (expected if isinstance(expected, list) else [expected])
    ]


# -- found by a review: files that disagree, a refused declaration, state not declared again ----------


def _restore(kind: str, handles: Any, clock: Any = None) -> Any:
    backend = create_keyed_backend(kind, max_parallelism=8, ttl_clock_ms=clock)
    backend.restore(handles)
    return backend


@pytest.mark.parametrize("value_type", [pa.bool_(), pa.float64(), pa.int64()])
def test_a_none_in_a_typed_map_stays_none(tmp_path: Any, value_type: pa.DataType) -> None:
    """The flat arrays of a typed map's values made a None value False or NaN."""
    descriptor = MapStateDescriptor("m", pa.string(), value_type)
    backend = create_keyed_backend("heap", max_parallelism=8)
    state = backend.get_state(descriptor)
    backend.set_current_key(1)
    state.put_all({"none": None, "one": {pa.bool_(): True, pa.float64(): 1.5}.get(value_type, 1)})
    storage = checkpoint_storage(str(tmp_path), "none")
    restored = _restore("heap", _checkpoint(backend, storage, 1))
    restored.set_current_key(1)
    again = restored.get_state(descriptor)
    assert again.get("none") is None and again.contains("none") and again.get("one") is not None


@pytest.mark.parametrize("declared_ttl", [True, False])
def test_files_of_one_state_with_and_without_write_times_restore_together(tmp_path: Any, declared_ttl: bool) -> None:
    """Rescaling 2 -> 1: one old subtask declared the state without its TTL (its file
    has no write times), the other never declared it (its file kept them). Both
    files' entries must read as values, whatever order they are read in."""
    clock = Clock()
    storage = checkpoint_storage(str(tmp_path), "rescale")
    halves = [key_group_range_for_subtask(8, 2, i) for i in (0, 1)]
    first, second = (
        create_keyed_backend("heap", max_parallelism=8, key_group_range=r, ttl_clock_ms=clock) for r in halves
    )
    written = {}
    for backend, keys in ((first, halves[0]), (second, halves[1])):
        state = backend.get_state(ValueStateDescriptor("v", ttl=TTL))
        for key in range(40):
            if keys.start <= assign_to_key_group(key, 8) <= keys.end:
                backend.set_current_key(key)
                state.update(f"v{key}")
                written[key] = f"v{key}"
    stamped = _checkpoint(first, storage, 1)
    unstamped_source = create_keyed_backend("heap", max_parallelism=8, key_group_range=halves[1], ttl_clock_ms=clock)
    unstamped_source.restore(_checkpoint(second, storage, 2))
    unstamped_source.get_state(ValueStateDescriptor("v"))  # declared without the TTL: its entries lose their times
    unstamped = _checkpoint(unstamped_source, storage, 3)
    for order in ([*stamped, *unstamped], [*unstamped, *stamped]):
        merged = _restore("heap", order, clock)
        state = merged.get_state(ValueStateDescriptor("v", ttl=TTL if declared_ttl else None))
        for key, value in written.items():
            merged.set_current_key(key)
            assert state.value() == value


def test_an_incremental_chain_across_a_type_change_keeps_the_later_values(tmp_path: Any) -> None:
    """A base written as int64, a delta after the job was resumed as float64: the
    delta's 2.5 was cast into the base's int64 columns on restore (2.0)."""
    storage = checkpoint_storage(str(tmp_path), "chain")
    as_int = ValueStateDescriptor("v", None, pa.int64())
    as_float = ValueStateDescriptor("v", None, pa.float64())
    base = create_keyed_backend("incremental", max_parallelism=8)
    state = base.get_state(as_int)
    for key in range(5):
        base.set_current_key(key)
        state.update(key)
    first = _checkpoint(base, storage, 1)
    resumed = _restore("incremental", first)
    floats = resumed.get_state(as_float)
    resumed.set_current_key(1)
    floats.update(2.5)
    second = _checkpoint(resumed, storage, 2)  # a delta over the int64 base
    again = _restore("incremental", second)
    values = again.get_state(as_float)
    got = {}
    for key in range(5):
        again.set_current_key(key)
        got[key] = values.value()
    assert got == {0: 0.0, 1: 2.5, 2: 2.0, 3: 3.0, 4: 4.0}
    refused = _restore("incremental", second)
    with pytest.raises(StateTypeError, match=r"files of different types .* is not an int64 value"):
        refused.get_state(as_int)


def test_a_refused_declaration_leaves_the_state_as_restored(tmp_path: Any) -> None:
    """A TTL state declared with another type and no TTL: its write times are gone
    (migrated) when the type check refuses it, and declaring it again as it was
    must not take them off a second time ('hello' read as 'h')."""
    clock = Clock()
    storage = checkpoint_storage(str(tmp_path), "atomic")
    backend = create_keyed_backend("heap", max_parallelism=8, ttl_clock_ms=clock)
    backend.get_state(ValueStateDescriptor("v", None, pa.string(), ttl=TTL))
    backend.set_current_key(1)
    backend.get_state(ValueStateDescriptor("v", None, pa.string(), ttl=TTL)).update("hello")
    restored = _restore("heap", _checkpoint(backend, storage, 1), clock)
    restored.set_current_key(1)
    with pytest.raises(StateTypeError, match="'hello' is not an int64 value"):
        restored.get_state(ValueStateDescriptor("v", None, pa.int64()))
    assert restored.get_state(ValueStateDescriptor("v", None, pa.string())).value() == "hello"


@pytest.mark.parametrize("backend_kind", ["heap", "incremental"])
def test_state_checkpointed_before_it_is_declared_again_restores_as_it_was(tmp_path: Any, backend_kind: str) -> None:
    """A restored state not declared again (yet) is written by the next checkpoint as
    it was written: a typed columnar value state stayed typed (it was written into an
    untyped column and that checkpoint failed to restore), a pickled one stayed its
    pickle (it was written as msgpack of the pickle's bytes)."""
    storage = checkpoint_storage(str(tmp_path), "undeclared")
    typed = ValueStateDescriptor("n", None, pa.int64())
    pickled = ValueStateDescriptor("p", serializer="pickle")
    mapped = MapStateDescriptor("m", pa.string(), pa.float64())
    backend = create_keyed_backend(backend_kind, max_parallelism=8)
    n, p, m = (backend.get_state(d) for d in (typed, pickled, mapped))
    backend.set_current_key(1)
    n.update(7)
    p.update(frozenset({1, 2}))
    m.put("a", 0.5)
    restored = _restore(backend_kind, _checkpoint(backend, storage, 1))  # nothing declared before the next one
    again = _restore(backend_kind, _checkpoint(restored, storage, 2))
    again.set_current_key(1)
    assert again.get_state(typed).value() == 7
    assert again.get_state(pickled).value() == frozenset({1, 2})
    assert again.get_state(mapped).items() == [("a", 0.5)]
