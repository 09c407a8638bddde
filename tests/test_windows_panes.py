"""The paned ``AlignedWindowAggregateOperator`` against the per-record ``WindowOperator``
(Flink's, the reference), driven step by step with the same random sequences:
batches of records (out of order, some late, some with null values) and watermarks,
allowed lateness, late data to a side output or dropped and counted, and a snapshot
restored mid-way at another parallelism (rescaling by key groups)."""

from __future__ import annotations

import random
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyengine as pe
from pyengine.runtime.aligned_windows import AlignedWindowAggregateOperator
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.windows import WindowAssigner, WindowOperator
from pyengine.state.keygroups import assign_to_key_group
from pyengine.time.strategy import TimestampAssigner

AGGS = (pe.agg.count(), pe.agg.sum("v"), pe.agg.min("v"), pe.agg.max("v"), pe.agg.mean("v"), pe.agg.count("v"))
MAX_PARALLELISM = 128
Steps = List[Tuple[str, Any]]


def _context(subtask: int, parallelism: int, backend: str) -> OperatorContext:
    return OperatorContext(
        job_name="t",
        subtask=subtask,
        parallelism=parallelism,
        max_parallelism=MAX_PARALLELISM,
        state_backend=backend,
        local_recovery_dir=None,
        attempt=0,
    )


class Subtasks:
    """One operator per subtask, records routed to them by key group, as a job does."""

    def __init__(
        self, make: Any, parallelism: int, backend: str, restored: Any = None, late: Optional[List[Any]] = None
    ) -> None:
        self.ops = []
        self.late: List[Dict[str, Any]] = [] if late is None else late  # the side output, across a restore
        for i in range(parallelism):
            op = make()
            op.setup(_context(i, parallelism, backend), restored)
            op.open()
            op.side_output = self._side
            self.ops.append(op)

    def _side(self, tag: str, records: Any) -> None:
        self.late.extend(records.to_pylist() if isinstance(records, (pa.RecordBatch, pa.Table)) else records)

    def records(self, batch: List[Dict[str, Any]], arrow: bool) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        for op in self.ops:
            r = op.backend.key_group_range
            mine = [x for x in batch if r.start <= assign_to_key_group(x["k"], MAX_PARALLELISM) <= r.end]
            if mine:
                out += _rows(op.process(pa.RecordBatch.from_pylist(mine) if arrow else mine))
        return out

    def watermark(self, wm: int) -> List[Dict[str, Any]]:
        return [row for op in self.ops for row in _rows(op.process_watermark(wm))]

    def dropped(self) -> int:
        return sum(op.late_records_dropped for op in self.ops)

    def snapshot(self) -> Any:
        from pyengine.storage import checkpoint_storage
        from pyengine.storage.metadata import OperatorState

        storage = checkpoint_storage(tempfile.mkdtemp(), "job")
        states = {i: op.snapshot(1, storage.location(1))() for i, op in enumerate(self.ops)}
        return OperatorState(parallelism=len(self.ops), max_parallelism=MAX_PARALLELISM, subtasks=states)


def _rows(out: Any) -> List[Dict[str, Any]]:
    if isinstance(out, (pa.RecordBatch, pa.Table)):
        return out.to_pylist()
    return list(out)


def _last(rows: List[Dict[str, Any]]) -> Dict[Tuple[Any, int, int], Dict[str, Any]]:
    """Each (key, window)'s last row: the per-record operator emits one updated row
    per late record, the vectorised one per batch, with the same final totals."""
    return {(r["k"], r["window_start"], r["window_end"]): r for r in rows}


def _sequence(rng: random.Random, steps: int, keys: List[Any], span: int) -> Steps:
    out: Steps = []
    now, wm = 0, -(2**63)
    for _ in range(steps):
        if rng.random() < 0.3:
            wm = max(wm, now - rng.randrange(0, span))
            out.append(("watermark", wm))
            continue
        batch = []
        for _ in range(rng.randrange(1, 12)):
            behind = rng.randrange(0, 4 * span) if rng.random() < 0.2 else rng.randrange(0, span // 3 + 1)
            v = None if rng.random() < 0.15 else rng.randrange(-50, 100)
            batch.append({"k": rng.choice(keys), "ts": now - behind, "v": v})
            now += rng.randrange(0, 4)
        out.append(("records", batch))
    out.append(("watermark", 2**63 - 1))
    return out


ASSIGNERS = st.one_of(
    st.builds(lambda size, off: pe.windows.tumbling(size, off % size), st.integers(3, 40), st.integers(0, 20)),
    st.builds(  # slides that divide the size, that do not (panes of their gcd), and longer than it (gaps)
        lambda slide, size, off: pe.windows.sliding(size, slide, off % slide),
        st.integers(2, 15),
        st.integers(2, 45),
        st.integers(0, 15),
    ),
)


def _operators(assigner: WindowAssigner, lateness: int, late_tag: Optional[str]) -> Tuple[Any, Any]:
    timestamps = TimestampAssigner(column="ts")

    def aligned() -> Any:
        return AlignedWindowAggregateOperator("w", "w", "k", assigner, lateness, timestamps, AGGS, late_tag=late_tag)

    def per_record() -> Any:
        return WindowOperator(
            "w", "w", lambda r: r["k"], "k", assigner, lateness, timestamps, aggregations=AGGS, late_tag=late_tag
        )

    return aligned, per_record


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    assigner=ASSIGNERS,
    lateness=st.sampled_from([0, 0, 7, 30]),
    side_output=st.booleans(),
    arrow=st.booleans(),
    strings=st.booleans(),
    backend=st.sampled_from(["heap", "incremental"]),
    parallelism=st.sampled_from([(1, 1), (2, 3), (3, 1)]),
    seed=st.integers(0, 10**6),
)
def test_panes_equal_the_per_record_operator_step_by_step(
    assigner: WindowAssigner,
    lateness: int,
    side_output: bool,
    arrow: bool,
    strings: bool,
    backend: str,
    parallelism: Tuple[int, int],
    seed: int,
) -> None:
    rng = random.Random(seed)
    keys: List[Any] = [f"user-{i}" for i in range(5)] if strings else [0, 1, 2, 3, 17, 2**40]
    steps = _sequence(rng, 40, keys, span=max(assigner.size, assigner.slide))
    cut = rng.randrange(len(steps))  # the aligned operator is snapshotted and restored here
    late_tag = "late" if side_output else None
    aligned, per_record = _operators(assigner, lateness, late_tag)
    before, after = parallelism
    ours, reference = Subtasks(aligned, before, backend), Subtasks(per_record, 1, "heap")
    for i, (kind, value) in enumerate(steps):
        if i == cut:
            ours = Subtasks(aligned, after, backend, restored=ours.snapshot(), late=ours.late)
        if kind == "records":
            got, want = ours.records(value, arrow), reference.records(value, False)
        else:
            got, want = ours.watermark(value), reference.watermark(value)
        assert _last(got) == _last(want), (i, kind, value)
    assert ours.dropped() == reference.dropped()
    assert sorted(map(repr, ours.late)) == sorted(map(repr, reference.late))


def test_a_pane_is_dropped_once_its_last_window_is_cleaned_up() -> None:
    """Sliding 30 / 10 with lateness 5: the pane [20, 30) is in the windows that
    start at 0, 10 and 20; it goes once the last of them is past 20 + 29 + 5."""
    aligned, _ = _operators(pe.windows.sliding(30, 10), 5, None)
    ops = Subtasks(aligned, 1, "heap")
    op = ops.ops[0]
    ops.records([{"k": 1, "ts": 25, "v": 1}], arrow=True)
    assert sorted(op._panes) == [20]
    ops.watermark(53)
    assert sorted(op._panes) == [20]
    ops.watermark(54)
    assert op._panes == {} and op._fired == set() and op._pending == set()


def test_firing_many_windows_at_once_is_one_batch_in_window_order() -> None:
    aligned, _ = _operators(pe.windows.tumbling(10), 0, None)
    ops = Subtasks(aligned, 1, "heap")
    ops.records([{"k": k, "ts": t, "v": t} for t in range(0, 1000, 3) for k in (5, 6)], arrow=True)
    out = ops.ops[0].process_watermark(2**63 - 1)
    assert isinstance(out, pa.RecordBatch) and out.num_rows == 200
    starts = out.column("window_start").to_pylist()
    assert starts == sorted(starts)


@pytest.mark.parametrize("arrow", [True, False])
def test_keys_of_a_narrower_int_type_keep_their_type(arrow: bool) -> None:
    aligned, _ = _operators(pe.windows.sliding(20, 10), 0, None)
    ops = Subtasks(aligned, 1, "heap")
    batch = pa.RecordBatch.from_pydict(
        {"k": pa.array([1, 2, 1], pa.int32()), "ts": pa.array([1, 2, 3], pa.int64()), "v": [1.5, 2.0, None]}
    )
    ops.ops[0].process(batch)
    out = ops.ops[0].process_watermark(2**63 - 1)
    assert out.schema.field("k").type == pa.int32()
    assert sorted(zip(out.column("k").to_pylist(), out.column("count").to_pylist(), strict=True)) == [
        (1, 2),
        (1, 2),
        (2, 1),
        (2, 1),
    ]


def test_a_checkpoint_encodes_only_the_panes_that_changed() -> None:
    """A pane unchanged since the previous snapshot keeps its bytes (not encoded again);
    one that took records is encoded anew; a restore from either reads the same rows."""
    aligned, _ = _operators(pe.windows.sliding(30, 10), 0, None)
    ops = Subtasks(aligned, 1, "heap")
    op = ops.ops[0]
    ops.records([{"k": k, "ts": t, "v": t} for t in (1, 12, 25) for k in (1, 2)], arrow=True)
    first = {p: pane.encode(op._kinds) for p, pane in op._panes.items()}
    ops.snapshot()
    ops.records([{"k": 3, "ts": 26, "v": 7}], arrow=True)  # the pane [20, 30) only
    restored = Subtasks(aligned, 2, "heap", restored=ops.snapshot())
    assert op._panes[0].encoded is first[0] and op._panes[10].encoded is first[10]
    assert op._panes[20].encoded is not first[20]
    assert _last(restored.watermark(2**63 - 1)) == _last(ops.watermark(2**63 - 1))


def test_late_rows_with_a_tag_nobody_reads_are_not_counted_as_dropped() -> None:
    """As ``WindowOperator`` (and Flink): with ``side_output_late_data`` the late rows go
    to the side output, or nowhere when nothing reads it; never into the drop count."""
    for make in _operators(pe.windows.tumbling(10), 0, "late"):
        op = make()
        op.setup(_context(0, 1, "heap"), None)
        op.open()
        op.process(pa.RecordBatch.from_pylist([{"k": 1, "ts": 25, "v": 1}]))
        op.process_watermark(40)
        op.process(pa.RecordBatch.from_pylist([{"k": 1, "ts": 3, "v": 1}]))  # late: [0, 10) is long gone
        assert op.late_records_dropped == 0, type(op).__name__
