"""The adapter's bulk grouping of a micro-batch (``tws._order``: a NumPy sort, the rows
reordered as arrays) against the per-row grouping it replaces where it applies: the
same calls, the same keys in the same order (first arrival), each key's rows in
arrival order, each pandas frame indexed 0..n-1."""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor
from test_tws import make_operator

import pyengine.spark.tws_grouping as tws


class Recording(StatefulProcessor):
    """Records every call as (key, its rows as (user, v) tuples) and yields the count."""

    def __init__(self) -> None:
        self.calls: List[Tuple[Any, Any]] = []

    def init(self, handle: Any) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        seen = [(r["user"], r["v"]) for r in rows]
        self.calls.append((key, seen))
        yield Row(user=key[0], count=len(seen))


class RecordingPandas(Recording):
    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        frames = list(rows)
        assert len(frames) == 1
        (df,) = frames
        assert list(df.index) == list(range(len(df))), "a key's frame is indexed 0..n-1"
        assert list(df.columns) == ["user", "v"]
        seen = list(zip(df["user"].tolist(), df["v"].tolist(), strict=True))
        self.calls.append((key, seen))
        yield pd.DataFrame({"user": [key[0]], "count": [len(seen)]})


def _run(flavour: str, records: Any) -> Tuple[List[Tuple[Any, Any]], pa.RecordBatch]:
    processor = Recording() if flavour == "row" else RecordingPandas()
    op = make_operator(processor, "user bigint, count bigint", flavour=flavour)
    op.micro_batch = True
    op.micro_batch_max_delay_ms = None
    assert op.process(records) == []
    out = op.end_input()
    return processor.calls, out


KEYS = {
    "dense": lambda rng, n: rng.integers(0, 50, n),
    "negative, spanning more than 16 bits": lambda rng, n: rng.integers(-(10**12), 10**12, n) // 10**9 * 10**9,
    "one key": lambda rng, n: np.full(n, 7),
}


@pytest.mark.parametrize("flavour", ["row", "pandas"])
@pytest.mark.parametrize("arrow", [False, True], ids=["dicts", "arrow"])
@pytest.mark.parametrize("keys", list(KEYS))
def test_bulk_grouping_is_the_per_row_grouping(
    monkeypatch: pytest.MonkeyPatch, flavour: str, arrow: bool, keys: str
) -> None:
    rng = np.random.default_rng(5)
    users = KEYS[keys](rng, 700).tolist()
    records: Any = [{"user": u, "v": i} for i, u in enumerate(users)]
    if arrow:
        records = pa.RecordBatch.from_pylist(records)
    bulk_calls, bulk_out = _run(flavour, records)
    monkeypatch.setattr(tws, "_BULK_MIN", 10**9)  # the per-row grouping
    per_row_calls, per_row_out = _run(flavour, records)
    assert bulk_calls == per_row_calls
    assert bulk_out.equals(per_row_out)
    first_seen = list(dict.fromkeys(users))
    assert [k for k, _ in bulk_calls] == [(u,) for u in first_seen]  # keys in order of first arrival
    for (key,), rows in bulk_calls:
        assert [v for _, v in rows] == [i for i, u in enumerate(users) if u == key]  # arrival order


@pytest.mark.parametrize(
    "keys",
    [[2**70, 1] * 40, [True, 1] * 40, [1.0, 2] * 40, ["a", "b"] * 40, [1, 2] * 20],
    ids=["beyond 64 bits", "bool", "float", "str", "few rows"],
)
def test_what_the_bulk_grouping_does_not_take(keys: List[Any]) -> None:
    assert tws._order(keys) is None


def test_the_bulk_order() -> None:
    order, uniques, starts, ends = tws._order([5, 3, 5, 9, 3, 5] * 20)
    assert uniques == [5, 3, 9]
    keys = np.array([5, 3, 5, 9, 3, 5] * 20)[order]
    for key, a, b in zip(uniques, starts, ends, strict=True):
        assert (keys[a:b] == key).all() and b - a == {5: 60, 3: 40, 9: 20}[key]
    assert np.all(np.diff(order[starts[0] : ends[0]]) > 0)  # stable: arrival order kept


class Assigning(StatefulProcessor):
    """Assigns to the frame it is given, as a processor may: no pandas warning."""

    def init(self, handle: Any) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        for df in rows:
            df["v"] = df["v"] * 2
            df.loc[0, "user"] = key[0]
            yield pd.DataFrame({"user": [key[0]], "count": [int(df["v"].sum())]})


def test_a_key_frame_is_the_processors_own() -> None:
    import warnings

    op = make_operator(Assigning(), "user bigint, count bigint", flavour="pandas")
    op.micro_batch, op.micro_batch_max_delay_ms = True, None
    records = [{"user": i % 7, "v": i} for i in range(700)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op.process(records)
        out = op.end_input()
    counts = dict(zip(out.column("user").to_pylist(), out.column("count").to_pylist(), strict=True))
    assert counts == {k: 2 * sum(range(k, 700, 7)) for k in range(7)}
