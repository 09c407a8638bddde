"""Keyed-state files of older formats still restore. ``tests/data/savepoint-dense-unions``
is a savepoint that pyengine wrote with dense unions (version 1: string keys and four
states, so both the key and the value column are unions), at commit 5eb38d5, the last
one to write dense unions. ``tests/data/savepoint-int64-timers`` holds the same job's
timers as a ``timers`` state with int64 timestamps (version 3), written at fb255f5,
the last commit before they were split (version 4). Both were made by
``tests/data/make_dense_savepoint.py``."""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.ipc as ipc
from test_timers import Held  # records dealt to splits, held at a count until released

import pyengine as pe
from pyengine.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor, read_keyed_state

FIXTURE = Path(__file__).parent / "data" / "savepoint-dense-unions"
TIMERS_FIXTURE = Path(__file__).parent / "data" / "savepoint-int64-timers"
RECORDS = [{"user": f"u{i % 7}", "page": f"p{i % 3}", "i": i} for i in range(400)]
HALF = 100  # records per split (of 2) before the savepoint

COUNT = ValueStateDescriptor("count", 0, pa.int64())
PAGES = MapStateDescriptor("pages")  # untyped: binary values
SEEN = ListStateDescriptor("seen", pa.int64())


class Tally(pe.KeyedProcessFunction):
    """A count, a map of page counts and a list of record numbers per user, and a
    timer per record (so the file also holds the timer slots)."""

    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)
        self.pages = ctx.get_map_state(PAGES)
        self.seen = ctx.get_list_state(SEEN)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        self.pages.put(value["page"], (self.pages.get(value["page"]) or 0) + 1)
        self.seen.add(value["i"])
        ctx.timer_service().register_event_time_timer(10**9 + value["i"])  # never due before the end
        yield {"user": ctx.current_key, "i": value["i"], "n": n}


def build(env: pe.StreamEnvironment, release: threading.Event, sink: Any) -> None:
    env.from_source(Held(RECORDS, HALF, release), name="held").uid("held").key_by("user").process(Tally()).uid(
        "tally"
    ).sink_to(sink)


def environment(tmp_path: Path) -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=50), checkpoint_storage=str(tmp_path / "ckpt")
    )


def _state_files(root: Path) -> List[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and path.name != "_metadata":
            try:
                schema = ipc.open_file(str(path)).schema
            except pa.ArrowInvalid:
                continue
            if b"pyengine" in (schema.metadata or {}):
                found.append(path)
    return found


def test_the_fixture_is_a_dense_union_file() -> None:
    files = _state_files(FIXTURE)
    assert files, f"no keyed state file under {FIXTURE}"
    for path in files:
        schema = ipc.open_file(str(path)).schema
        meta = json.loads(schema.metadata[b"pyengine"])
        if meta["format"] != "pyengine-keyed-state":
            continue
        assert meta["version"] == 1
        assert schema.field("key").type.mode == "dense" and schema.field("value").type.mode == "dense"


def _inline_schemas(root: Path) -> List[pa.Schema]:
    """The schemas of the keyed state files a savepoint keeps inside its _metadata."""
    with open(root / "_metadata", "rb") as f:
        operators = json.loads(f.read())["metadata"]["operators"]
    streams = [h["stream"] for op in operators.values() for s in op["subtasks"].values() for h in s["keyed"]]
    return [ipc.open_file(pa.py_buffer(bytes.fromhex(s["data"]))).schema for s in streams if s["kind"] == "inline"]


def test_the_timers_fixture_holds_int64_timestamps_in_version_3() -> None:
    schemas = _inline_schemas(TIMERS_FIXTURE)
    assert schemas, f"no inline keyed state in {TIMERS_FIXTURE}"
    for schema in schemas:
        meta = json.loads(schema.metadata[b"pyengine"])
        assert meta["version"] == 3 and "timers_encoding" not in meta
        names = [s["name"] for s in meta["states"]]
        timers = names.index("_timer_state/event_timers")
        assert meta["states"][timers]["kind"] == "timers"
        assert schema.field("value").type.field(meta["value_children"][timers]).type == pa.int64()


def test_a_savepoint_with_int64_timer_timestamps_is_read_and_restored(tmp_path: Path) -> None:
    first = RECORDS[0::2][:HALF] + RECORDS[1::2][:HALF]
    timers = read_keyed_state(str(TIMERS_FIXTURE), "tally", "_timer_state/event_timers")
    pending = zip(timers.column("key").to_pylist(), timers.column("value").to_pylist(), strict=True)
    assert sorted(pending) == sorted((r["user"], 10**9 + r["i"]) for r in first)
    _restores(tmp_path, TIMERS_FIXTURE)


def test_a_savepoint_with_dense_unions_is_read_and_restored(tmp_path: Path) -> None:
    _restores(tmp_path, FIXTURE)


def _restores(tmp_path: Path, fixture: Path) -> None:
    """The fixture's state reads as the job's first HALF records a split left it, and
    the job resumed from it goes on from there."""
    savepoint = tmp_path / "savepoint"
    shutil.copytree(fixture, savepoint)
    first = RECORDS[0::2][:HALF] + RECORDS[1::2][:HALF]
    before = Counter(r["user"] for r in first)

    counts = read_keyed_state(str(savepoint), "tally", "count")
    assert dict(zip(counts.column("key").to_pylist(), counts.column("value").to_pylist(), strict=True)) == before
    seen = read_keyed_state(str(savepoint), "tally", "seen")
    assert {
        k: sorted(v) for k, v in zip(seen.column("key").to_pylist(), seen.column("value").to_pylist(), strict=True)
    } == {user: sorted(r["i"] for r in first if r["user"] == user) for user in before}
    pages = read_keyed_state(str(savepoint), "tally", "pages")
    assert sum(len(v) for v in pages.column("value").to_pylist()) == len({(r["user"], r["page"]) for r in first})

    released = threading.Event()
    released.set()
    sink = pe.sinks.CollectSink()
    env = environment(tmp_path)
    build(env, released, sink)
    result = env.execute("dense-unions", restore_from=str(savepoint))
    assert result.status == "FINISHED"
    rest = [r for r in RECORDS if r not in first]
    assert sorted(r["i"] for r in result.records) == sorted(r["i"] for r in rest)
    last_n: Dict[str, int] = {}
    for r in result.records:
        last_n[r["user"]] = max(last_n.get(r["user"], 0), r["n"])
    assert last_n == Counter(r["user"] for r in RECORDS)  # the counts went on from the savepoint's
