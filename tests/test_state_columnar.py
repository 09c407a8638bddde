"""Columnar typed value state against dict storage: same behaviour, other layout."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyengine.state import KeyGroupRange, ValueStateDescriptor, create_keyed_backend
from pyengine.state.columnar import ColumnarValueState, ColumnarValueTable
from pyengine.storage import checkpoint_storage

TYPES = [(pa.int64(), lambda r: r.randrange(-(2**63), 2**63)), (pa.float64(), lambda r: r.random()),
         (pa.int32(), lambda r: r.randrange(-(2**31), 2**31)), (pa.bool_(), lambda r: r.random() < 0.5)]  # fmt: skip


def contents(backend, descriptor):
    state = backend.get_state(descriptor)
    out = {}
    for k in backend.keys(descriptor.name):
        backend.set_current_key(k)
        out[k] = state.value()
    return out


@pytest.mark.parametrize("arrow_type, draw", TYPES, ids=lambda t: str(t) if isinstance(t, pa.DataType) else "")
@pytest.mark.parametrize("kind", ["heap", "incremental"])
def test_columnar_behaves_like_dict_storage(tmp_path, arrow_type, draw, kind) -> None:
    rng = random.Random(str(arrow_type))
    storage = checkpoint_storage(str(tmp_path), "job")
    d = ValueStateDescriptor("v", None, arrow_type)
    col = create_keyed_backend(kind, max_parallelism=8)
    plain = create_keyed_backend(kind, max_parallelism=8, columnar=False)
    states = [b.get_state(d) for b in (col, plain)]
    assert isinstance(states[0], ColumnarValueState) and not isinstance(states[1], ColumnarValueState)
    for checkpoint_id in range(1, 6):
        for _ in range(500):
            k, v, op = rng.randrange(300), draw(rng), rng.random()
            for b, s in zip((col, plain), states, strict=True):
                b.set_current_key(k)
                if op < 0.6:
                    s.update(v)
                elif op < 0.8:
                    s.clear()
            if op >= 0.8:
                assert states[0].value() == states[1].value()
        assert contents(col, d) == contents(plain, d)
        snaps = [b.snapshot(checkpoint_id, storage.location(checkpoint_id)) for b in (col, plain)]
        later = draw(rng)
        for b, s in zip((col, plain), states, strict=True):  # after the synchronous part
            b.set_current_key(0)
            s.update(later)
        results = [snap.run() for snap in snaps]
        for b in (col, plain):
            b.notify_checkpoint_complete(checkpoint_id)
        restored = [create_keyed_backend("heap", max_parallelism=8) for _ in range(2)]
        for r, result in zip(restored, results, strict=True):
            r.restore(result.handles)
        assert contents(restored[0], d) == contents(restored[1], d)


def test_first_non_int_key_moves_the_state_to_dict_storage() -> None:
    b = create_keyed_backend("heap", max_parallelism=8)
    d = ValueStateDescriptor("v", 0, pa.int64())
    s = b.get_state(d)
    for k in range(100):
        b.set_current_key(k)
        s.update(k)
    assert isinstance(b._tables["v"], ColumnarValueTable)
    b.set_current_key("text")
    s.update(5)
    assert not isinstance(b._tables["v"], ColumnarValueTable)
    assert contents(b, d) == {**{k: k for k in range(100)}, "text": 5}


def test_vectorised_updates_and_reads() -> None:
    b = create_keyed_backend("heap", max_parallelism=128, key_group_range=KeyGroupRange(0, 127))
    s = b.get_state(ValueStateDescriptor("count", 0, pa.int64()))
    keys = np.arange(0, 100_000, 7, dtype=np.int64)
    s.update_many(keys, keys * 2)
    found, values = s.get_many(np.array([0, 7, 8, 99_995]))
    assert found.tolist() == [True, True, False, True] and values.tolist() == [0, 14, 0, 199_990]
    b.set_current_key(7)
    assert s.value() == 14
    assert b.num_entries("count") == len(keys)


def test_vectorised_keys_outside_the_key_groups_are_refused() -> None:
    b = create_keyed_backend("heap", max_parallelism=128, key_group_range=KeyGroupRange(0, 0))
    s = b.get_state(ValueStateDescriptor("count", 0, pa.int64()))
    with pytest.raises(ValueError, match="outside this backend's key groups"):
        s.update_many(np.arange(1000), np.arange(1000))


def test_restored_columns_read_through_a_descriptor_that_does_not_fit_columns(tmp_path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    b = create_keyed_backend("heap", max_parallelism=8)
    s = b.get_state(ValueStateDescriptor("v", 0, pa.int64()))
    for k in range(50):
        b.set_current_key(k)
        s.update(k * 3)
    result = b.snapshot(1, storage.location(1)).run()
    r = create_keyed_backend("heap", max_parallelism=8)
    r.restore(result.handles)
    assert isinstance(r._tables["v"], ColumnarValueTable)
    untyped = r.get_state(ValueStateDescriptor("v", 0))  # no declared type: dict storage
    assert not isinstance(r._tables["v"], ColumnarValueTable)
    r.set_current_key(7)
    assert untyped.value() == 21


def test_gather_changes_matches_per_key_lookups() -> None:
    """The one-call gather of changed entries against the obvious per-key loop."""
    import random

    import numpy as np

    from pyengine import _native

    rng = random.Random(5)
    groups = [_native.ColumnarGroup(np.int64) for _ in range(6)]
    for g in groups:
        keys = np.array(rng.sample(range(-1000, 1000), rng.randint(0, 300)), np.int64)
        g.put_many(keys, keys * 3)
    touched = [set(rng.sample(range(-1200, 1200), rng.randint(0, 150))) for _ in groups]
    keys, values, deleted, upserts, deletes = _native.gather_changes(groups, touched)
    u = d = 0
    for g, changed, up, de in zip(groups, touched, upserts.tolist(), deletes.tolist(), strict=True):
        expected = {k: g.get(k) for k in changed if g.contains(k)}
        assert dict(zip(keys[u : u + up].tolist(), values[u : u + up].tolist(), strict=True)) == expected
        assert set(deleted[d : d + de].tolist()) == {k for k in changed if not g.contains(k)}
        u += up
        d += de
    assert u == len(keys) and d == len(deleted)
    with pytest.raises(ValueError, match="2 groups but 1 change sets"):
        _native.gather_changes(groups[:2], touched[:1])


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(-40, 40), st.integers(-(2**40), 2**40)),
        st.tuples(st.just("remove"), st.integers(-40, 40), st.just(0)),
        st.tuples(st.just("put_many"), st.integers(0, 2**32), st.integers(0, 30)),
        st.tuples(st.just("merge_many"), st.integers(0, 2**32), st.integers(0, 30)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
        st.tuples(st.just("take"), st.just(0), st.just(0)),
        st.tuples(st.just("freeze"), st.just(0), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, dtype=st.sampled_from([np.int64, np.float64, np.int32, np.bool_]))
def test_take_changes_reports_every_change_since_the_last_take(ops, dtype) -> None:
    """Change tracking by position (C) against a dict model: after any mix of
    writes, removals, clears and copy-on-write freezes, a take holds every key
    written since the last take with its current value, every key removed and
    not written again as deleted, nothing twice, and nothing that is not so."""
    from pyengine import _native

    group = _native.ColumnarGroup(np.dtype(dtype))
    group.put_many(np.arange(-10, 10, dtype=np.int64), np.arange(20).astype(dtype))  # before tracking: not reported
    group.track_changes()
    model = {k: v for k, v in zip(range(-10, 10), np.arange(20).astype(dtype).tolist(), strict=True)}
    written, removed = set(), set()
    frozen = []
    for op, a, b in [*ops, ("take", 0, 0)]:
        if op == "put":
            value = np.array([b]).astype(dtype)[0].item()
            group.put(a, value)
            model[a] = value
            written.add(a)
        elif op == "remove":
            assert group.remove(a) == (a in model)
            if model.pop(a, None) is not None or a in removed:
                removed.add(a)
        elif op in ("put_many", "merge_many"):
            rng = np.random.default_rng(a)
            keys = rng.choice(np.arange(-40, 41, dtype=np.int64), b, replace=False)
            values = rng.integers(-100, 100, b).astype(dtype)
            if op == "put_many":
                group.put_many(keys, values)
                model.update(zip(keys.tolist(), values.tolist(), strict=True))
            else:
                how = "max" if dtype is np.bool_ else "add"
                merged = group.merge_many(keys, values, how)
                model.update(zip(keys.tolist(), merged.tolist(), strict=True))
            written.update(keys.tolist())
        elif op == "clear":
            removed.update(model)
            model.clear()
            group.clear()
        elif op == "freeze":  # a snapshot holds the arrays: the next write copies them
            frozen.append(tuple(a.copy() for a in group.freeze()))
        else:
            keys, values, deleted, upserts, deletes = _native.take_changes([group])
            assert upserts.tolist() == [len(keys)] and deletes.tolist() == [len(deleted)]
            got = dict(zip(keys.tolist(), values.tolist(), strict=True))
            assert len(got) == len(keys), "a key reported twice"
            assert {k: model[k] for k in written if k in model}.items() <= got.items()
            assert all(model.get(k) == v and k in model for k, v in got.items())  # moved entries may come too
            assert sorted(deleted.tolist()) == sorted(k for k in removed if k not in model)
            written, removed = set(), set()
    for keys, values in frozen:  # what snapshots froze never changed under them
        assert len(keys) == len(values)
    assert dict(zip(*(a.tolist() for a in group.arrays()), strict=True)) == model


def test_take_changes_needs_tracking() -> None:
    from pyengine import _native

    with pytest.raises(ValueError, match="does not track changes"):
        _native.take_changes([_native.ColumnarGroup(np.int64)])


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_writes_through_incremental_checkpoints_restore_exactly(tmp_path, seed) -> None:
    """update_many / merge_many / clear across deltas, some checkpoints never
    completing (their changes go into the next delta): every checkpoint restores
    to the state at its synchronous part."""
    rng = np.random.default_rng(seed)
    storage = checkpoint_storage(str(tmp_path), "job")
    b = create_keyed_backend("incremental", max_parallelism=16, max_chain=4)
    count = b.get_state(ValueStateDescriptor("count", 0, pa.int64()))
    universe = np.arange(-5000, 5000, dtype=np.int64)
    for checkpoint_id in range(1, 16):
        keys = rng.choice(universe, int(rng.integers(1, 800)), replace=False)
        if rng.random() < 0.5:
            count.update_many(keys, rng.integers(-99, 99, len(keys)))
        else:
            count.merge_many(keys, rng.integers(-99, 99, len(keys)), "add")
        for k in rng.choice(universe, 30, replace=False).tolist():
            b.set_current_key(k)
            count.clear()
        expected = contents(b, ValueStateDescriptor("count", 0, pa.int64()))
        result = b.snapshot(checkpoint_id, storage.location(checkpoint_id)).run()
        if rng.random() < 0.7:
            b.notify_checkpoint_complete(checkpoint_id)
        r = create_keyed_backend("heap", max_parallelism=16)
        r.restore(result.handles)
        assert contents(r, ValueStateDescriptor("count", 0, pa.int64())) == expected


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([np.int64, np.float64]),
    how=st.sampled_from(["add", "min", "max"]),
    tracking=st.booleans(),
    batches=st.lists(st.tuples(st.integers(0, 2**32), st.integers(0, 60), st.booleans()), max_size=12),
)
def test_merge_groups_in_one_call_equals_merge_many_per_group(dtype, how, tracking, batches) -> None:
    """The one-call merge over every key group (C) against each group's own
    merge_many (NumPy): the same values returned and stored, including int64
    wrap-around and NaN, the same changes tracked, and frozen arrays untouched."""
    from pyengine import _native

    ngroups = 5
    one_call, per_group = ([_native.ColumnarGroup(np.dtype(dtype)) for _ in range(ngroups)] for _ in range(2))
    if tracking:
        for g in one_call + per_group:
            g.track_changes()
    for seed, n, freeze in batches:
        rng = np.random.default_rng(seed)
        keys = rng.choice(np.arange(-60, 60, dtype=np.int64), n, replace=False)
        if dtype is np.int64:
            values = rng.integers(-(2**63), 2**63 - 1, n, endpoint=True, dtype=np.int64)
        else:
            values = rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1.5, -2.25]), n)
        order = np.argsort(keys % ngroups, kind="stable")
        sorted_keys, sorted_values = keys[order], values[order]
        bounds = np.searchsorted((keys % ngroups)[order], np.arange(ngroups + 1))
        active = np.nonzero(np.diff(bounds))[0].tolist()
        frozen = [(g.freeze(), tuple(a.copy() for a in g.arrays())) for g in one_call] if freeze else []
        got = _native.merge_groups(one_call, sorted_keys, sorted_values, bounds, active, how)
        want = np.empty_like(sorted_values)
        for g in active:
            a, b = bounds[g], bounds[g + 1]
            with np.errstate(invalid="ignore"):  # inf + -inf is NaN on both sides
                want[a:b] = per_group[g].merge_many(sorted_keys[a:b], sorted_values[a:b], how)
        assert np.array_equal(got, want, equal_nan=True)
        for mine, theirs in zip(one_call, per_group, strict=True):
            stored = zip(mine.arrays(), theirs.arrays(), strict=True)
            assert all(np.array_equal(x, y, equal_nan=True) for x, y in stored)
        for held, copied in frozen:
            assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(held, copied, strict=True))
    if tracking:
        mine, theirs = _native.take_changes(one_call), _native.take_changes(per_group)
        assert sorted(mine[0].tolist()) == sorted(theirs[0].tolist())
        assert mine[3].tolist() == theirs[3].tolist()


def test_merge_groups_refuses_what_it_cannot_merge() -> None:
    from pyengine import _native

    groups = [_native.ColumnarGroup(np.dtype(np.int64))]
    one = np.array([1], np.int64)
    with pytest.raises(ValueError, match="add, min, max or set"):
        _native.merge_groups(groups, one, one, np.array([0, 1]), [0], "mul")
    with pytest.raises(TypeError, match=r"values are float64, the key groups hold int64"):
        _native.merge_groups(groups, one, one.astype(np.float64), np.array([0, 1]), [0], "add")
    with pytest.raises(TypeError, match="int64 or float64 values only"):
        _native.merge_groups([_native.ColumnarGroup(np.dtype(np.int32))], one, one.astype(np.int32), [0, 1], [0], "add")
    with pytest.raises(ValueError, match="bounds: one more than groups"):
        _native.merge_groups(groups, one, one, np.array([0]), [0], "add")
    with pytest.raises(IndexError, match="key group 3"):
        _native.merge_groups(groups, one, one, np.array([0, 1]), [3], "add")
    with pytest.raises(IndexError, match="key group 0"):
        _native.merge_groups(groups, one, one, np.array([0, 5]), [0], "add")


ODD_VALUES = [0, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, True, 1.5, float("nan"), 7, "7", np.int64(7), None]


@pytest.mark.parametrize("arrow_type", [pa.int64(), pa.float64()], ids=str)
def test_the_native_calls_accept_and_refuse_what_dict_storage_does(arrow_type) -> None:
    """value/update/clear run in C for int keys (``_native.ColumnarValueCalls``): every
    value written, in range or not, of the type or not, has the same outcome as with
    dict storage (stored and read back equal, or the same exception type), and a call
    before any current key is refused the same way."""
    d = ValueStateDescriptor("v", -5, arrow_type)
    col = create_keyed_backend("heap", max_parallelism=8)
    plain = create_keyed_backend("heap", max_parallelism=8, columnar=False)
    states = [b.get_state(d) for b in (col, plain)]
    assert isinstance(states[0], ColumnarValueState)
    for s in states:
        with pytest.raises(RuntimeError, match=r"no current key.*set_current_key\(\) first"):
            s.value()
    for i, v in enumerate(ODD_VALUES):
        outcomes = []
        for b, s in zip((col, plain), states, strict=True):
            b.set_current_key(i)
            try:
                s.update(v)
                got = s.value()
                # a float64 column reads an int back as a float, as it always did
                outcomes.append(("stored", repr(float(got) if arrow_type == pa.float64() else got)))
            except Exception as exc:  # the outcome compared is the exception's type
                outcomes.append(("refused", type(exc).__name__))
        assert outcomes[0] == outcomes[1], v
    for b, s in zip((col, plain), states, strict=True):
        b.set_current_key(len(ODD_VALUES))
        assert s.value() == -5  # never written: the default
        b.set_current_key(0)
        s.clear()
        assert s.value() == -5
    assert isinstance(states[0], ColumnarValueState) and states[0]._fallback is None  # still columnar


@pytest.mark.parametrize("dtype", ["int64", "float64", "int32"])
def test_a_frozen_group_keeps_its_arrays_through_removes_and_inserts(dtype) -> None:
    """Copy-on-write around the raw writes: a remove (the last entry moved into the
    hole) and an insert (the key written through the array's memory) after a freeze
    leave the frozen arrays as they were; removing a key that is not there copies
    nothing and says False."""
    from pyengine import _native

    group = _native.ColumnarGroup(np.dtype(dtype))
    for k in range(10):
        group.put(k, k * 10)
    keys, values = group.freeze()
    before = (keys.copy(), values.copy())
    assert group.remove(99) is False
    assert group.shared  # nothing copied for a key that was not there
    assert group.remove(3) is True and not group.shared
    group.put(42, 420)
    assert (keys == before[0]).all() and (values == before[1]).all()
    assert sorted(zip(*[a.tolist() for a in group.arrays()], strict=True)) == sorted(
        [(k, k * 10) for k in range(10) if k != 3] + [(42, 420)]
    )
    assert group.get(9, None) == 90 and group.get(3, None) is None
