"""The vectorised session-window aggregate (``SessionWindowAggregateOperator``) against
the per-record ``WindowOperator``, its reference: the same random sequences of
batches and watermarks (out-of-order and late records, nulls, allowed lateness, a
late side output) go to both, subtask by subtask, and after every step both have
emitted the same rows, dropped the same records and sent the same ones to the side
output; a mid-run snapshot restores both, at the same or another parallelism
(2 -> 3, 3 -> 2), both state backends."""

from __future__ import annotations

import random
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.keyed import key_selector
from pyengine.runtime.session_windows import SessionWindowAggregateOperator
from pyengine.runtime.windows import WindowOperator
from pyengine.state.keygroups import assign_to_key_group, key_group_range_for_subtask
from pyengine.storage import checkpoint_storage
from pyengine.storage.metadata import OperatorState
from pyengine.time.strategy import TimestampAssigner

AGGS = (pe.agg.count(), pe.agg.count("v", alias="n_v"), pe.agg.sum("v"), pe.agg.min("v"), pe.agg.max("v"))
MAX_PARALLELISM = 128
LATE = "late"


def _ctx(subtask: int, parallelism: int, backend: str) -> OperatorContext:
    return OperatorContext(
        job_name="j",
        subtask=subtask,
        parallelism=parallelism,
        max_parallelism=MAX_PARALLELISM,
        state_backend=backend,
        local_recovery_dir=None,
        attempt=0,
    )


class Side:
    def __init__(self) -> None:
        self.records: List[Dict[str, Any]] = []

    def __call__(self, tag: str, records: Any) -> None:
        assert tag == LATE
        self.records.extend(records.to_pylist() if isinstance(records, (pa.RecordBatch, pa.Table)) else records)


def _make(kind: str, gap: int, lateness: int, side: Optional[Side]) -> Any:
    assigner = pe.windows.session(gap)
    stamps = TimestampAssigner(column="ts")
    tag = LATE if side is not None else None
    if kind == "vectorised":
        op: Any = SessionWindowAggregateOperator("w", "w", "k", assigner, lateness, stamps, AGGS, late_tag=tag)
    else:
        op = WindowOperator(
            "w", "w", key_selector("k"), "k", assigner, lateness, stamps, aggregations=AGGS, late_tag=tag
        )
    if side is not None:
        op.side_output = side
    return op


class Job:
    """One operator kind at one parallelism: each subtask's instance and what they emitted."""

    def __init__(self, kind: str, parallelism: int, gap: int, lateness: int, backend: str, side: bool) -> None:
        self.kind, self.parallelism, self.gap, self.lateness, self.backend = kind, parallelism, gap, lateness, backend
        self.side = Side() if side else None
        self.ops = [_make(kind, gap, lateness, self.side) for _ in range(parallelism)]
        for i, op in enumerate(self.ops):
            op.setup(_ctx(i, parallelism, backend), None)
            op.open()

    def _subtask_of(self, key: Any) -> int:
        group = assign_to_key_group(key, MAX_PARALLELISM)
        for i in range(self.parallelism):
            r = key_group_range_for_subtask(MAX_PARALLELISM, self.parallelism, i)
            if r.start <= group <= r.end:
                return i
        raise AssertionError(group)

    def step(self, step: Tuple[str, Any], arrow: bool) -> List[Tuple[Any, ...]]:
        out: List[Any] = []
        what, arg = step
        if what == "wm":
            for op in self.ops:
                out.append(op.process_watermark(arg))
        else:
            parts: List[List[Dict[str, Any]]] = [[] for _ in self.ops]
            for r in arg:
                parts[self._subtask_of(r["k"])].append(r)
            for op, part in zip(self.ops, parts, strict=True):
                if part:
                    batch = pa.RecordBatch.from_pylist(part) if arrow and self.kind == "vectorised" else part
                    out.append(op.process(batch))
        return _rows(out)

    def dropped(self) -> int:
        return sum(op.late_records_dropped for op in self.ops)

    def restored(self, parallelism: int) -> Job:
        storage = checkpoint_storage(tempfile.mkdtemp(), "job")
        subtasks = {i: op.snapshot(1, storage.location(1))() for i, op in enumerate(self.ops)}
        state = OperatorState(parallelism=self.parallelism, max_parallelism=MAX_PARALLELISM, subtasks=subtasks)
        job = Job.__new__(Job)
        job.kind, job.parallelism, job.gap, job.lateness, job.backend = (
            self.kind,
            parallelism,
            self.gap,
            self.lateness,
            self.backend,
        )
        job.side = self.side
        job.ops = [_make(self.kind, self.gap, self.lateness, self.side) for _ in range(parallelism)]
        for i, op in enumerate(job.ops):
            op.setup(_ctx(i, parallelism, self.backend), state)
            op.open()
        return job


def _rows(outputs: List[Any]) -> List[Tuple[Any, ...]]:
    rows: List[Dict[str, Any]] = []
    for out in outputs:
        rows.extend(out.to_pylist() if isinstance(out, (pa.RecordBatch, pa.Table)) else out)
    return sorted(
        (
            (r["k"], r["window_start"], r["window_end"], r["count"], r["n_v"], r["sum_v"], r["min_v"], r["max_v"])
            for r in rows
        ),
        key=repr,
    )


def scenario(seed: int) -> Tuple[List[Tuple[str, Any]], int, int]:
    """Batches of records and watermarks: keys 0..k (a hot one), event time moving on
    with jitter, some records far behind (late, or inside the allowed lateness), some
    values null; the watermark behind the data by a random bound, sometimes jumping."""
    rng = random.Random(seed)
    gap = rng.choice([5, 20, 60])
    lateness = rng.choice([0, 0, 15, 80])
    keys = rng.randint(1, 12)
    named = rng.random() < 0.2
    widen = rng.random() < 0.25  # whole numbers first, then halves: the accumulators become floats
    steps: List[Tuple[str, Any]] = []
    now, wm = 0, -(2**63)
    for _ in range(rng.randint(5, 40)):
        batch = []
        for _ in range(rng.randint(1, 60)):
            now += rng.choice([0, 1, 2, 5, 30])
            ts = now - rng.randint(0, 25)
            if rng.random() < 0.08:
                ts = now - rng.randint(30, 300)  # far behind: late, or inside the allowed lateness
            key: Any = 0 if rng.random() < 0.3 else rng.randint(0, keys)
            if named:  # keys that are not ints: every session in session/more, record by record
                key = f"user-{key}"
            v: Any = None if rng.random() < 0.1 else rng.randint(-100, 1000)
            if widen and v is not None and len(steps) > 6:
                v += 0.5  # halves: every sum exact, in any order
            batch.append({"k": key, "ts": ts, "v": v})
        steps.append(("batch", batch))
        if rng.random() < 0.6:
            wm = max(wm, now - rng.choice([0, 10, 25, 100]))
            steps.append(("wm", wm))
    steps.append(("wm", 2**63 - 1))
    return steps, gap, lateness


@pytest.mark.parametrize("seed", range(40))
def test_the_vectorised_operator_equals_the_per_record_one_step_by_step(seed: int) -> None:
    rng = random.Random(seed * 7 + 1)
    steps, gap, lateness = scenario(seed)
    backend = rng.choice(["heap", "incremental"])
    side = rng.random() < 0.5
    arrow = rng.random() < 0.7
    p = rng.choice([1, 2, 3])
    ref = Job("per-record", p, gap, lateness, backend, side)
    vec = Job("vectorised", p, gap, lateness, backend, side)
    restore_at = rng.randint(0, len(steps) - 1) if rng.random() < 0.6 else -1
    new_p = rng.choice([1, 2, 3])
    emitted = 0
    for i, step in enumerate(steps):
        if i == restore_at:
            ref, vec = ref.restored(new_p), vec.restored(new_p)
        expected = ref.step(step, arrow)
        got = vec.step(step, arrow)
        assert got == expected, (seed, i, step[0])
        emitted += len(got)
        assert vec.dropped() == ref.dropped(), (seed, i)
    if side:
        assert sorted(map(repr, vec.side.records)) == sorted(map(repr, ref.side.records))  # type: ignore[union-attr]
    assert emitted, "the scenario fired no session: it would prove nothing"


@pytest.mark.parametrize("backend", ["heap", "incremental"])
@pytest.mark.parametrize("parallelism", [(2, 3), (3, 2)])
def test_a_rescaled_restore_goes_on_as_the_per_record_operator(backend: str, parallelism: Tuple[int, int]) -> None:
    steps, gap, _ = scenario(1234)
    ref = Job("per-record", parallelism[0], gap, 15, backend, side=True)
    vec = Job("vectorised", parallelism[0], gap, 15, backend, side=True)
    half = len(steps) // 2
    for i, step in enumerate(steps):
        if i == half:
            ref, vec = ref.restored(parallelism[1]), vec.restored(parallelism[1])
        assert vec.step(step, True) == ref.step(step, True), i
    assert vec.dropped() == ref.dropped()


# -- a savepoint of the per-record layout (every release before this operator) restores ----------


def _resumed(tmp: Any, parallelism: int, by_function: bool) -> List[List[Tuple[Any, ...]]]:
    import shutil
    import threading

    from session_fixture import SESSION_FIXTURE, session_job

    savepoint = tmp / f"savepoint-{parallelism}-{by_function}"
    shutil.copytree(SESSION_FIXTURE, savepoint)
    released = threading.Event()
    released.set()
    ints, strs = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    env = session_job(tmp / f"run-{by_function}", parallelism, released, ints, strs, by_function=by_function)
    result = env.execute("sessions", restore_from=str(savepoint))
    assert result.status == "FINISHED", result.cause
    out = []
    for sink, column in ((ints, "k"), (strs, "name")):
        out.append(
            sorted(
                (
                    r["key" if by_function else column],
                    r["window_start"],
                    r["window_end"],
                    r["count"],
                    r["sum_v"],
                    r["min_v"],
                    r["max_v"],
                    r["mean_v"],
                )
                for r in sink.records
            )
        )
    return out


@pytest.mark.parametrize("parallelism", [2, 3])
def test_a_savepoint_of_the_per_record_session_layout_restores_into_the_vectorised_one(
    tmp_path: Any, parallelism: int
) -> None:
    """``tests/data/savepoint-session-windows`` holds open sessions in ``window-contents``
    (written by e145a3c's WindowOperator); restored here (at 2 and at 3), the vectorised
    operator takes them over and emits what the per-record operator restored from the
    same savepoint emits."""
    from session_fixture import SESSION_FIXTURE
    from test_windows_lateness import _keyed_state_names

    for uid in ("sessions-k", "sessions-name"):
        assert "window-contents" in _keyed_state_names(str(SESSION_FIXTURE), uid), "the fixture has no open session"
    from session_fixture import GAP, HELD, RECORDS
    from test_windows import reference

    expected = _resumed(tmp_path, parallelism, by_function=True)
    got = _resumed(tmp_path, parallelism, by_function=False)
    assert all(expected) and got == expected
    # Both against the whole input's sessions: each resumed row is one of them (a session
    # open at the savepoint kept what came before it), and every session that starts
    # after the records read before the savepoint is there.
    whole = {(*r[:7], round(r[7], 9)) for r in reference(RECORDS, pe.windows.session(GAP))}
    read = RECORDS[0::2][:HELD] + RECORDS[1::2][:HELD]
    later = {r for r in whole if r[1] > max(x["ts"] for x in read)}
    resumed = {(*r[:7], round(r[7], 9)) for r in got[0]}
    assert resumed <= whole and later <= resumed and resumed - later, "no session open at the savepoint resumed"


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_sessions_moved_from_window_contents_merge_with_the_next_records(backend: str) -> None:
    """A key restored from ``window-contents`` has its sessions in ``session/more`` and
    none in the columns yet: its next records merge with them, not beside them."""
    from pyengine.state import ValueStateDescriptor

    old = Job("vectorised", 1, 20, 0, backend, side=False)
    op = old.ops[0]
    op.backend.set_current_key(7)
    # accumulators in AGGS' order: count(*), n(v), sum(v), min(v), max(v)
    op.backend.get_state(ValueStateDescriptor("window-contents")).update(
        {(100, 125): [2, 2, 30, 10, 20], (10, 30): [1, 1, 5, 5, 5]}
    )
    vec = old.restored(1)
    assert vec.ops[0]._more_keys == {7: 30}  # the end of its oldest session
    assert old.restored(1).step(("wm", 2**63 - 1), True) == [
        (7, 10, 30, 1, 1, 5, 5, 5),
        (7, 100, 125, 2, 2, 30, 10, 20),
    ]
    assert vec.step(("batch", [{"k": 7, "ts": 120, "v": 1}, {"k": 8, "ts": 121, "v": 2}]), True) == []
    assert vec.step(("wm", 2**63 - 1), True) == [
        (7, 10, 30, 1, 1, 5, 5, 5),
        (7, 100, 140, 3, 3, 31, 1, 20),
        (8, 121, 141, 1, 1, 2, 2, 2),
    ]
