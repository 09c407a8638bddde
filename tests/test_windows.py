"""Windows against a brute-force reference: every window computed from the whole
input, sorted by event time, equals the job's output for random out-of-order input
(hypothesis), at parallelism 1-4, both state backends, aligned and unaligned
checkpoints, with a failure injected mid-run (the restart must neither lose nor
repeat a window)."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Dict, List, Tuple

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyengine as pe
from pyengine.windows import WindowAssigner

AGGS = (pe.agg.count(), pe.agg.sum("v"), pe.agg.min("v"), pe.agg.max("v"), pe.agg.mean("v"))


def make_records(n: int, keys: int, step: int, jitter: int, seed: int) -> List[Dict[str, Any]]:
    """Records in sequence order with event times ``i*step + jitter``: each source
    split (a subsequence) is out of order by at most ``jitter`` ms."""
    import random

    rng = random.Random(seed)
    return [
        {"k": rng.randrange(keys), "ts": i * step + rng.randrange(jitter + 1), "v": rng.randrange(-50, 1000)}
        for i in range(n)
    ]


def reference(records: List[Dict[str, Any]], assigner: WindowAssigner) -> List[Tuple[Any, ...]]:
    """Every window of every key, from the whole input sorted by event time."""
    ordered = sorted(records, key=lambda r: r["ts"])
    contents: Dict[Tuple[int, int, int], List[int]] = defaultdict(list)
    if assigner.kind == "session":
        by_key: Dict[int, List[Dict[str, Any]]] = defaultdict(list)
        for r in ordered:
            by_key[r["k"]].append(r)
        for k, rs in by_key.items():
            start, end, values = None, None, []
            for r in rs:
                if start is not None and r["ts"] <= end:  # [ts, ts + gap) touching the session merges
                    end = max(end, r["ts"] + assigner.gap)
                    values.append(r["v"])
                    continue
                if start is not None:
                    contents[(k, start, end)] = values
                start, end, values = r["ts"], r["ts"] + assigner.gap, [r["v"]]
            contents[(k, start, end)] = values
    else:
        for r in ordered:
            for w in assigner.assign(r["ts"]):
                contents[(r["k"], w.start, w.end)].append(r["v"])
    return sorted(
        (k, s, e, len(v), sum(v), min(v), max(v), round(sum(v) / len(v), 9)) for (k, s, e), v in contents.items()
    )


def rows(result: Any) -> List[Tuple[Any, ...]]:
    return sorted(
        (
            r["k"],
            r["window_start"],
            r["window_end"],
            r["count"],
            r["sum_v"],
            r["min_v"],
            r["max_v"],
            round(r["mean_v"], 9),
        )
        for r in result.records
    )


class FailOnce:
    """Raises once, at the ``at``-th record it sees (over all subtasks), in the first attempt only."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen = 0
        self.fired = False
        self.lock = threading.Lock()

    def __call__(self, record: Any) -> Any:
        with self.lock:
            self.seen += 1
            if not self.fired and self.seen >= self.at:
                self.fired = True
                raise RuntimeError("injected failure")
        return record


def run_job(
    tmp_path: Any,
    records: List[Dict[str, Any]],
    assigner: WindowAssigner,
    *,
    parallelism: int,
    backend: str,
    unaligned: bool,
    jitter: int,
    fail_at: int = 0,
    arrow: bool = False,
    tag: str = "",
) -> Any:
    env = pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=unaligned),
        state_backend=backend,
        checkpoint_storage=str(tmp_path / f"ckpt{tag}"),
        buffer_size=16,
        buffer_timeout_ms=1,
        channel_capacity=2,
        restart_attempts=2,
        auto_watermark_interval_ms=1,
    )
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(jitter).with_timestamp_assigner("ts")
    if arrow:
        stream = env.from_collection(pa.Table.from_pylist(records), watermark_strategy=strategy)
    else:
        stream = env.from_generator(lambda i: records[i], len(records), watermark_strategy=strategy)
    if fail_at:
        stream = stream.map(FailOnce(fail_at))
    sink = pe.sinks.CollectSink()
    stream.key_by("k").window(assigner).aggregate(*AGGS).uid("windows").sink_to(sink)
    result = env.execute(f"windows{tag}")
    assert result.status == "FINISHED", result.cause
    if fail_at:
        assert result.restarts == 1, "the injected failure did not restart the job"
    return result


ASSIGNERS = st.one_of(
    st.builds(lambda size, off: pe.windows.tumbling(size, off % size), st.integers(20, 200), st.integers(0, 50)),
    st.builds(
        lambda slide, k, off: pe.windows.sliding(slide * k, slide, off % slide),
        st.integers(15, 80),
        st.integers(1, 4),
        st.integers(0, 30),
    ),
    st.builds(pe.windows.session, st.integers(5, 60)),
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    assigner=ASSIGNERS,
    parallelism=st.integers(1, 4),
    backend=st.sampled_from(["heap", "incremental"]),
    unaligned=st.booleans(),
    arrow=st.booleans(),
    seed=st.integers(0, 10**6),
    fail_at=st.sampled_from([0, 37, 150, 290]),
)
def test_windows_equal_the_brute_force_reference(
    tmp_path_factory: Any,
    assigner: WindowAssigner,
    parallelism: int,
    backend: str,
    unaligned: bool,
    arrow: bool,
    seed: int,
    fail_at: int,
) -> None:
    jitter, step = 30, 3
    records = make_records(400, keys=7, step=step, jitter=jitter, seed=seed)
    tmp = tmp_path_factory.mktemp("w")
    result = run_job(
        tmp,
        records,
        assigner,
        parallelism=parallelism,
        backend=backend,
        unaligned=unaligned,
        jitter=jitter,
        fail_at=fail_at,
        arrow=arrow,
    )
    assert rows(result) == reference(records, assigner), (assigner, parallelism, backend, unaligned, arrow, fail_at)


@pytest.mark.parametrize("assigner", [pe.windows.tumbling(100), pe.windows.sliding(90, 30), pe.windows.session(25)])
def test_string_keys_take_the_same_windows(tmp_path: Any, assigner: WindowAssigner) -> None:
    records = make_records(300, keys=5, step=3, jitter=20, seed=7)
    named = [{**r, "k": f"user-{r['k']}"} for r in records]
    result = run_job(tmp_path, named, assigner, parallelism=2, backend="incremental", unaligned=False, jitter=20)
    expected = reference(named, assigner)
    assert rows(result) == expected


@pytest.mark.parametrize("backend", ["heap", "incremental"])
@pytest.mark.parametrize("assigner", [pe.windows.tumbling(4), pe.windows.sliding(12, 2)])
def test_hundreds_of_open_windows_stay_exact(tmp_path: Any, backend: str, assigner: WindowAssigner) -> None:
    """Windows far shorter than the watermark's bound keep hundreds of windows open
    at once (the layout before panes spilled them to a per-key overflow): the output
    must not change, across a failure and a restore either."""
    records = make_records(400, keys=6, step=3, jitter=600, seed=11)
    result = run_job(
        tmp_path, records, assigner, parallelism=3, backend=backend, unaligned=True, jitter=600, fail_at=200
    )
    assert rows(result) == reference(records, assigner)


@settings(max_examples=300, deadline=None)
@given(
    adds=st.lists(
        st.tuples(st.integers(0, 200), st.integers(1, 30)),  # (start, gap): the window [start, start + gap)
        max_size=40,
    ),
    fires=st.lists(st.integers(0, 260), max_size=6),
    lateness=st.sampled_from([0, 5]),
)
def test_sessions_merge_and_fire_as_flinks_merge_windows_and_the_scan(
    adds: List[Tuple[int, int]], fires: List[int], lateness: int
) -> None:
    """Sessions kept in order and searched (``_Sessions``) against Flink's
    mergeWindows (sort everything, chain the runs) and a scan of every window for the
    timers: the same window returned and the same contents, merged in order of start,
    after every addition (touching windows merge, as Flink's); then timers at random
    times fire the window ending there and drop those whose cleanup has come."""
    from pyengine.runtime.windows import TimeWindow, _Sessions, merge_windows

    contents: Dict[Tuple[int, int], Any] = {}
    reference: Dict[Tuple[int, int], Any] = {}
    sessions = _Sessions(contents)
    for i, (start, gap) in enumerate(adds):
        new = TimeWindow(start, start + gap)
        got = sessions.merge(contents, new, None)
        cover, members = merge_windows([TimeWindow(*b) for b in reference], new)
        combined = [r for m in members for r in reference.pop((m.start, m.end))]
        reference[(cover.start, cover.end)] = combined
        assert got == cover
        contents.setdefault((got.start, got.end), []).append(i)  # as _add does with the record
        reference[(cover.start, cover.end)].append(i)
        assert contents == reference and sessions.order == sorted(reference)
        assert all(a[1] < b[0] for a, b in zip(sessions.order, sessions.order[1:], strict=False))
    for ts in sorted(fires):
        due, gone = sessions.fired(ts, lateness)
        assert due == sorted(b for b in reference if b[1] - 1 == ts)
        assert gone == sorted(b for b in reference if b[1] - 1 + lateness <= ts)
        for b in gone:
            del reference[b]
        assert sessions.order == sorted(reference)


def test_a_key_whose_every_record_is_late_leaves_nothing_behind_in_the_session_index() -> None:
    """The sessions kept beside the state are per key: a key that only ever sends late
    records must not keep an (empty) entry there."""
    env = pe.StreamEnvironment(parallelism=1, buffer_size=64, monitoring=None)
    records = [{"k": "on time", "ts": t} for t in range(0, 5000, 10)] + [{"k": i, "ts": 1} for i in range(300)]
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(0).with_timestamp_assigner("ts")
    seen: List[Any] = []
    from pyengine.runtime.windows import WindowOperator

    original = WindowOperator.process

    def spy(self: Any, batch: Any) -> Any:
        out = original(self, batch)
        seen.append(len(self._sessions))
        return out

    WindowOperator.process = spy  # type: ignore[method-assign]
    try:
        # keyed by a function: the per-record WindowOperator (a column key takes the vectorised one)
        env.from_collection(records, watermark_strategy=strategy).key_by(lambda r: r["k"]).window(
            pe.windows.session(100)
        ).aggregate(pe.agg.count()).sink_to(pe.sinks.CollectSink())
        result = env.execute("late-keys")
    finally:
        WindowOperator.process = original  # type: ignore[method-assign]
    assert result.event_time.late_records_dropped == 300
    assert seen and max(seen[-3:]) <= 1, seen  # the on-time key at most


@pytest.mark.parametrize("lateness", [0, 50])
def test_a_growing_session_keeps_one_pending_timer_per_key(lateness: int) -> None:
    """A session that every record of its key extends: the merged windows' timers are
    deleted (Flink does so on merge), so a key has one pending timer, not one per record
    fired for nothing later. With allowed lateness a window has two timers, which may
    coincide with another window's: those stay and fire for nothing, as before."""
    from pyengine.runtime.windows import WindowOperator

    env = pe.StreamEnvironment(parallelism=1, buffer_size=50, monitoring=None)
    # 20 keys, each record 20 ms after its key's last: one session per key, never closed
    records = [{"k": i % 20, "ts": i} for i in range(2_000)]
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    pending: List[int] = []
    original = WindowOperator.process

    def spy(self: Any, batch: Any) -> Any:
        out = original(self, batch)
        queue = self._timers.event
        pending.append(len(queue))  # live timers (the order keeps deleted ones' entries; the sets do not)
        return out

    WindowOperator.process = spy  # type: ignore[method-assign]
    sink = pe.sinks.CollectSink()
    try:
        env.from_collection(records, watermark_strategy=strategy).key_by(lambda r: r["k"]).window(
            pe.windows.session(100)
        ).allowed_lateness(lateness).aggregate(pe.agg.count()).sink_to(sink)
        assert env.execute("growing-sessions").status == "FINISHED"
    finally:
        WindowOperator.process = original  # type: ignore[method-assign]
    assert sorted((r["key"], r["count"]) for r in sink.records) == [(k, 100) for k in range(20)]
    if lateness == 0:
        assert max(pending) == 20, pending
    else:
        assert max(pending) > 20
