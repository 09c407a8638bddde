from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyengine.state import (
    KeyGroupRange,
    assign_to_key_group,
    key_group_range_for_subtask,
    key_groups_of_int64,
    stable_hash,
    subtask_for_key_group,
)

# The hash is part of the checkpoint format: these values must never change.
GOLDEN = [
    (0, 0, 0),
    (1, 12994781566227106604, 44),
    (-1, 7256831767414464289, 33),
    (2**63 - 1, 12373989555017149930, 106),
    (2**64, 17556835035537105868, 76),
    ("user-42", 5836184775705692621, 77),
    (b"\x00\xff", 12221366661834116083, 115),
    (2.5, 9020310487809154890, 74),
    (None, 11400714819323198485, 21),
    ((1, "a"), 2460757272368929587, 51),
    (("a", (2, None)), 17691540430023608665, 89),
]


@pytest.mark.parametrize("key, expected_hash, expected_group", GOLDEN)
def test_golden_hashes_never_change(key, expected_hash, expected_group) -> None:
    assert stable_hash(key) == expected_hash
    assert assign_to_key_group(key, 128) == expected_group


def test_hash_is_the_same_in_another_process() -> None:
    code = "from pyengine.state import stable_hash; print([stable_hash(k) for k in ('x', b'y', 7, (1, 'z'))])"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed},
                       check=True).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    assert len(outputs) == 1


def test_equal_keys_share_a_key_group() -> None:
    assert stable_hash(1) == stable_hash(1.0) == stable_hash(True)
    assert stable_hash(0) == stable_hash(-0.0) == stable_hash(False)
    assert stable_hash(float("nan")) == stable_hash(-float("nan"))


def test_unhashable_key_types_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="a key of type list has no stable hash"):
        stable_hash([1])


@settings(deadline=None)  # alone, its first example pays pyarrow.compute's import (~0.4 s)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200), st.integers(1, 32768))
def test_vectorised_int64_path_matches_the_scalar_one(keys, max_parallelism) -> None:
    expected = [assign_to_key_group(k, max_parallelism) for k in keys]
    assert key_groups_of_int64(np.array(keys, dtype=np.int64), max_parallelism).tolist() == expected
    assert key_groups_of_int64(pa.array(keys, pa.int64()), max_parallelism).tolist() == expected


@given(st.integers(1, 512), st.data())
def test_subtask_ranges_partition_the_key_groups(max_parallelism, data) -> None:
    parallelism = data.draw(st.integers(1, max_parallelism))
    owned = []
    for i in range(parallelism):
        r = key_group_range_for_subtask(max_parallelism, parallelism, i)
        assert r.start == -(-i * max_parallelism // parallelism)  # ceil(i * maxP / P)
        assert all(subtask_for_key_group(max_parallelism, parallelism, kg) == i for kg in r)
        owned.extend(r)
    assert owned == list(range(max_parallelism))


def test_bad_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="parallelism must be between 1 and max_parallelism \\(4\\), got 5"):
        key_group_range_for_subtask(4, 5, 0)
    with pytest.raises(ValueError, match="max_parallelism must be between 1 and 32768"):
        key_group_range_for_subtask(40000, 1, 0)
    with pytest.raises(ValueError, match="subtask index"):
        key_group_range_for_subtask(128, 4, 4)


def test_key_group_range_basics() -> None:
    r = KeyGroupRange.of(3, 6)
    assert len(r) == 4 and 3 in r and 7 not in r and list(r) == [3, 4, 5, 6]
    assert len(r.intersection(KeyGroupRange.of(5, 9))) == 2
    assert len(r.intersection(KeyGroupRange.of(8, 9))) == 0
    assert str(r) == "3-6"
