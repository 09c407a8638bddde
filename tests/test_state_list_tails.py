"""Typed list state by entry (issue #43): copy-on-write by tail and list tails in deltas.

A typed list state without a TTL keeps each key's elements in an array.array. After a
snapshot's freeze, the first append to a key records the array's length instead of
copying it (``StateTable.grow``), and the snapshot writes each array up to its length at
the freeze (``GrowingLists``). An incremental delta writes a key that was only appended
to since the last snapshot as its new elements (a column marked ``appends``, format
version 5), which a restore, a rescale and ``read_keyed_state`` append to the lists the
chain's earlier files hold.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import pyengine as pe
from pyengine.snapshot.columns import GrowingLists, _value_child
from pyengine.snapshot.format import FORMAT_VERSION_LIST_TAILS, StateColumn
from pyengine.state import (
    KeyGroupRange,
    ListStateDescriptor,
    ValueStateDescriptor,
    create_keyed_backend,
    key_group_range_for_subtask,
    read_keyed_state,
)
from pyengine.storage import checkpoint_storage
from pyengine.storage.metadata import CheckpointMetadata, OperatorState, SubtaskState
from pyengine.storage.store import CompletedCheckpointStore

AMOUNTS = ListStateDescriptor("amounts", pa.float64())
IDS = ListStateDescriptor("ids", pa.int64())
COUNT = ValueStateDescriptor("count", type=pa.int64())
FIXTURE = Path(__file__).parent / "data" / "checkpoint-list-tails"


def _lists(backend: Any, descriptor: Any = AMOUNTS) -> Dict[Any, List[Any]]:
    state = backend.get_state(descriptor)
    out = {}
    for k in list(backend.keys(descriptor.name)):
        backend.set_current_key(k)
        out[k] = list(state.get())
    return out


def _written(table_name: str, frozen: Any) -> Dict[Any, List[float]]:
    """What a snapshot's writer makes of ``frozen`` (a table's frozen key groups)."""
    column = StateColumn(table_name, "list", pa.float64(), None, "msgpack", False)
    keys = [k for group in frozen for k in group]
    values = [v for group in frozen for v in group.values()]
    if not keys:
        return {}
    lengths = frozen.frozen_lengths if isinstance(frozen, GrowingLists) else None
    child = _value_child(column, values, None, lengths)
    return dict(zip(keys, child.to_pylist(), strict=True))


@pytest.mark.parametrize("kind", ["heap", "incremental"])
@pytest.mark.parametrize("seed", range(12))
def test_nothing_done_after_a_freeze_changes_what_the_snapshot_writes(kind: str, seed: int) -> None:
    """Random appends, add_all, updates and clears of a typed list, interleaved with
    freezes and releases in any order: each unfinished snapshot writes exactly what
    the state held at its freeze, and the live state is what a backend never frozen
    holds."""
    rng = random.Random(seed)
    live = create_keyed_backend(kind, max_parallelism=4)
    plain = create_keyed_backend("heap", max_parallelism=4)
    states = [b.get_state(AMOUNTS) for b in (live, plain)]
    table = live._tables["amounts"]
    assert table.tails is not None  # a typed list: copy-on-write by tail
    snapshots: List[Any] = []  # (generation, frozen, what it must write)
    for _ in range(300):
        op = rng.random()
        key = rng.randrange(6)
        if op < 0.1:
            frozen = table.freeze()
            generation = table.generation
            grown = GrowingLists(frozen, lambda g=generation: table.frozen_lengths(g))
            snapshots.append((generation, grown, _lists(plain)))
            continue
        if op < 0.17:
            if snapshots:
                generation, _, _ = snapshots.pop(rng.randrange(len(snapshots)))
                table.release(generation)
            continue
        arg = float(rng.randrange(100))
        n = rng.randrange(3)
        for backend, state in zip((live, plain), states, strict=True):
            backend.set_current_key(key)
            if op < 0.7:
                state.add(arg)
            elif op < 0.8:
                state.add_all([arg, arg + 0.5])
            elif op < 0.88:
                state.update([arg] * n)
            elif op < 0.95:
                state.clear()
            else:
                view = state.get()
                if view:
                    view.append(-1.0)  # the view's own copy: never the state
        for _, frozen, model in snapshots:
            assert _written("amounts", frozen) == model
        assert _lists(live) == _lists(plain)


def test_the_first_append_after_a_freeze_copies_nothing() -> None:
    """Copy-on-write by tail: the key's array stays the stored one (before, the
    first write after a freeze copied the key's whole list)."""
    b = create_keyed_backend("heap", max_parallelism=4)
    state = b.get_state(AMOUNTS)
    b.set_current_key(1)
    state.add_all([float(i) for i in range(1000)])
    table = b._tables["amounts"]
    stored = table.groups[b._key_index][1]
    frozen = table.freeze()
    state.add(1000.0)  # the C path
    state.add_all([1001.0, 1002.0])  # the Python path
    assert table.groups[b._key_index][1] is stored and len(stored) == 1003
    grown = GrowingLists(frozen, lambda: table.frozen_lengths(table.generation))
    assert _written("amounts", grown)[1] == [float(i) for i in range(1000)]


def complete(store: Any, backend: Any, checkpoint_id: int, handles: Any, max_p: int) -> None:
    op = OperatorState(1, max_p, {0: SubtaskState(keyed=handles)})
    store.complete(CheckpointMetadata("job", checkpoint_id, 0, operators={"op": op}))
    backend.notify_checkpoint_complete(checkpoint_id)


def _versions(handles: Any) -> List[int]:
    out = []
    for h in handles:
        path = getattr(h.stream, "path", None)
        data = ipc.open_file(path).schema if path else ipc.open_file(pa.py_buffer(h.stream.data)).schema
        out.append(json.loads(data.metadata[b"pyengine"])["version"])
    return out


def test_a_delta_writes_only_the_appended_tails(tmp_path: Path) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    store = CompletedCheckpointStore(storage)
    b = create_keyed_backend("incremental", max_parallelism=16)
    state = b.get_state(AMOUNTS)
    rng = random.Random(3)
    for k in range(2_000):
        b.set_current_key(k)
        state.add_all([rng.random() for _ in range(200)])
    first = b.snapshot(1, storage.location(1)).run()
    complete(store, b, 1, first.handles, 16)
    for k in range(2_000):  # one element more per key, each key's first append since the freeze
        b.set_current_key(k)
        state.add(-1.0)
    second = b.snapshot(2, storage.location(2)).run()
    assert len(second.handles) == 2  # the base and one delta
    assert _versions(second.handles[1:]) == [FORMAT_VERSION_LIST_TAILS]
    # 2,000 elements, not 402,000: before, the delta held every changed key's whole list
    assert second.checkpointed_size < 0.05 * first.checkpointed_size
    restored = create_keyed_backend("heap", max_parallelism=16)
    restored.restore(second.handles)
    assert _lists(restored) == _lists(b)


@pytest.mark.parametrize("seed", range(5))
def test_chains_of_tails_restore_rescale_and_read(tmp_path: Path, seed: int) -> None:
    """Checkpoints whose asynchronous part runs after more appends (as on the task's
    pool), some aborted: the latest completed one restores to the state at its
    freeze, at the same and at another parallelism, and read_keyed_state reads it."""
    rng = random.Random(seed)
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    store = CompletedCheckpointStore(storage, retained=2)
    b = create_keyed_backend("incremental", max_parallelism=8, max_chain=4)
    amounts, ids, count = (b.get_state(d) for d in (AMOUNTS, IDS, COUNT))
    expected: Dict[int, Any] = {}
    versions = set()

    def work(n: int) -> None:
        for _ in range(n):
            k = rng.randrange(400)
            b.set_current_key(k)
            op = rng.random()
            count.update(k)
            if op < 0.7:
                amounts.add(rng.random())
                ids.add(rng.randrange(10**12))
            elif op < 0.8:
                amounts.add_all([1.5, 2.5])
            elif op < 0.9:
                amounts.update([0.25])
            else:
                rng.choice((amounts, ids)).clear()

    for checkpoint_id in range(1, 16):
        work(rng.randrange(100, 600))
        snapshot = b.snapshot(checkpoint_id, storage.location(checkpoint_id))
        expected[checkpoint_id] = (_lists(b), _lists(b, IDS))
        work(rng.randrange(0, 300))  # between the synchronous part and the asynchronous one
        result = snapshot.run()
        versions.update(_versions(result.handles))
        if rng.random() < 0.2:
            b.notify_checkpoint_aborted(checkpoint_id)
        else:
            complete(store, b, checkpoint_id, result.handles, 8)
        latest = store.latest()
        if latest is None:
            continue
        handles = latest.operators["op"].keyed_handles()
        want = expected[latest.checkpoint_id]
        r = create_keyed_backend("incremental", max_parallelism=8)
        r.restore(handles)
        assert (_lists(r), _lists(r, IDS)) == want
        parts = [
            create_keyed_backend("heap", max_parallelism=8, key_group_range=key_group_range_for_subtask(8, 3, i))
            for i in range(3)
        ]
        for p in parts:
            p.restore(handles)
        rescaled: Dict[Any, Any] = {}
        for p in parts:
            rescaled.update(_lists(p))
        assert rescaled == want[0]
        table = read_keyed_state(storage.checkpoint_dir(latest.checkpoint_id), "op", "amounts")
        read = dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True))
        assert read == want[0]
    assert FORMAT_VERSION_LIST_TAILS in versions  # tails were written


def test_appends_while_the_asynchronous_part_runs_on_another_thread(tmp_path: Path) -> None:
    """The writer reads arrays the task appends to at the same time: lists large
    enough for chunked joins and arrays over a chunk alone; nothing fails with a
    buffer exported, and the file holds the state at the freeze."""
    storage = checkpoint_storage(str(tmp_path), "job")
    b = create_keyed_backend("heap", max_parallelism=8)
    state = b.get_state(AMOUNTS)
    for k in range(3_000):
        b.set_current_key(k)
        state.add_all([float(k)] * (40_000 if k % 1000 == 0 else 50))
    snapshot = b.snapshot(1, storage.location(1))
    want = _lists(b)
    stop = threading.Event()
    out: List[Any] = []
    writer = threading.Thread(target=lambda: out.append(snapshot.run()))
    writer.start()
    n = 0
    while writer.is_alive() or n < 20_000:
        b.set_current_key(n % 3_000)
        state.add(-1.0)
        n += 1
    writer.join()
    stop.set()
    restored = create_keyed_backend("heap", max_parallelism=8)
    restored.restore(out[0].handles)
    assert _lists(restored) == want


def test_the_list_tails_fixture_restores_and_reads() -> None:
    """``tests/data/checkpoint-list-tails``: an incremental chain whose delta holds list
    tails (format version 5), written by ``tests/data/make_list_tails_checkpoint.py``."""
    from pyengine.storage.metadata import load_metadata

    checkpoint = str(next(FIXTURE.rglob("_metadata")).parent)
    handles = load_metadata(checkpoint).operator("op").keyed_handles()
    assert FORMAT_VERSION_LIST_TAILS in _versions(handles)
    expected = {k: [float(i) for i in range(k % 5 + 3)] for k in range(60)}
    table = read_keyed_state(checkpoint, "op", "amounts")
    assert dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True)) == expected
    for kind in ("heap", "incremental"):
        r = create_keyed_backend(kind, max_parallelism=8, key_group_range=KeyGroupRange(0, 7))
        r.restore(handles)
        assert _lists(r) == expected


class _Crash:
    """Fails the job once, at the ``at``-th record processed over every attempt."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen = 0
        self.lock = threading.Lock()

    def hit(self) -> None:
        with self.lock:
            self.seen += 1
            if self.seen == self.at:
                raise RuntimeError("injected crash")


class _Collect(pe.KeyedProcessFunction):
    """Appends each record's amount to its key's typed list; emits the list's length and sum."""

    def __init__(self, crash: _Crash) -> None:
        self.crash = crash

    def __deepcopy__(self, memo: Any) -> _Collect:
        return _Collect(self.crash)  # one crash for every subtask and attempt

    def open(self, ctx: Any) -> None:
        self.amounts = ctx.get_list_state(AMOUNTS)

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.crash.hit()
        if value["i"] % 64 == 0:
            time.sleep(0.001)  # a run long enough for several checkpoints
        self.amounts.add(value["a"])
        got = list(self.amounts.get())
        yield {"k": ctx.current_key, "n": len(got), "s": sum(got)}


@pytest.mark.parametrize("backend", ["incremental", "heap"])
@pytest.mark.parametrize("unaligned", [False, True])
def test_a_job_with_list_tails_survives_a_crash_exactly_once(tmp_path: Path, backend: str, unaligned: bool) -> None:
    """A job appending to typed lists, crashed once mid-run and restored from its latest
    checkpoint (deltas of list tails on the incremental backend): every key's list ends
    with each of its records' amounts once, in order, in the output and in the last
    checkpoint."""
    records = [{"k": i % 40, "i": i, "a": float(i)} for i in range(3_000)]
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=unaligned),
        state_backend=backend,
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=32,
        buffer_timeout_ms=1,
        restart_attempts=2,
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="jsonl")
    env.from_collection(records).key_by("k").process(_Collect(_Crash(1_800))).uid("lists").sink_to(sink)
    result = env.execute("list-tails")
    assert result.succeeded and result.restarts == 1
    expected = {k: [r["a"] for r in records if r["k"] == k] for k in range(40)}
    out = sink.read_committed()
    assert len(out) == len(records)  # exactly once: every record's output, none twice
    last = {}
    for row in out:
        last[row["k"]] = max(last.get(row["k"], (0, 0.0)), (row["n"], row["s"]))
    assert last == {k: (len(v), sum(v)) for k, v in expected.items()}
    table = read_keyed_state(result.latest_checkpoint, "lists", "amounts")
    assert dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True)) == expected


def test_the_spark_state_source_reads_list_tails() -> None:
    """``spark.read.format("pyengine-state")`` reads through ``read_keyed_state``: its
    request's table of the fixture's chain (no Spark session needed for it)."""
    from pyengine.spark.state_source import _Request

    checkpoint = str(next(FIXTURE.rglob("_metadata")).parent)
    expected = {k: [float(i) for i in range(k % 5 + 3)] for k in range(60)}
    options = {"path": checkpoint, "operator": "op", "stateName": "amounts", "flattenCollectionTypes": "false"}
    table = _Request(options).table()
    assert dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True)) == expected
    # Spark's default: one row per element, in the list's order
    flat = _Request({k: v for k, v in options.items() if k != "flattenCollectionTypes"}).table()
    rows: dict = {}
    for key, value in zip(flat.column("key").to_pylist(), flat.column("value").to_pylist(), strict=True):
        rows.setdefault(key, []).append(value)
    assert rows == expected
