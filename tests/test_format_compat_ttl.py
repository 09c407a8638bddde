"""TTL state files of the older layout still restore. ``tests/data/savepoint-ttl-serialized``
is a savepoint written at e145a3c (format versions up to 4), the last commit that wrote
every TTL entry serialized with its stamps (a value as ``[value, stamp]``, a list as a
list of them, a map's values as them); pyengine now writes TTL state as columns of
values and stamps (version 6, ``snapshot/stamped.py``). The job keeps six TTL states,
typed and untyped, of each kind; ``tests/data/make_ttl_savepoint.py`` made it (with the
pyengine of e145a3c first on ``PYTHONPATH``). Its TTL is a century: what it holds stays
live whenever the test runs.

Also here: the same job through a savepoint of this version, rescaled 2 -> 3, and the
files' layout (version 6, the states marked stamped)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from test_timers import Held  # records dealt to splits, held at a count until released

import pyengine as pe
from pyengine.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor, read_keyed_state
from pyengine.state.serializers import SafeSerializer

_SAFE = SafeSerializer()

FIXTURE = Path(__file__).parent / "data" / "savepoint-ttl-serialized"
RECORDS = [{"user": f"u{i % 7}", "page": f"p{i % 3}", "i": i} for i in range(400)]
HALF = 100  # records per split (of 2) before the savepoint
TTL_MS = 100 * 365 * 24 * 3600 * 1000

COUNT = ValueStateDescriptor("count", 0, pa.int64(), ttl=TTL_MS)
LAST = ValueStateDescriptor("last", ttl=TTL_MS)  # untyped: serialized values
PAGES = MapStateDescriptor("pages", pa.string(), pa.int64(), ttl=TTL_MS)
TAGS = MapStateDescriptor("tags", ttl=TTL_MS)
SEEN = ListStateDescriptor("seen", pa.int64(), ttl=TTL_MS)
NOTES = ListStateDescriptor("notes", ttl=TTL_MS)


PROCESSED = [0]  # records the job's function has processed (its copies share this module)


class TtlTally(pe.KeyedProcessFunction):
    """Per user: a count, the last record, page counts (typed map), tags (untyped map),
    record numbers (typed list) and notes (untyped list), all with a TTL."""

    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)
        self.last = ctx.get_state(LAST)
        self.pages = ctx.get_map_state(PAGES)
        self.tags = ctx.get_map_state(TAGS)
        self.seen = ctx.get_list_state(SEEN)
        self.notes = ctx.get_list_state(NOTES)

    def process_element(self, value: Any, ctx: Any) -> Any:
        PROCESSED[0] += 1
        n = self.count.value() + 1
        self.count.update(n)
        self.last.update({"i": value["i"], "page": value["page"]})
        self.pages.put(value["page"], (self.pages.get(value["page"]) or 0) + 1)
        self.tags.put(value["i"] % 5, [value["page"], value["i"]])
        self.seen.add(value["i"])
        self.notes.add(f"n{value['i']}")
        yield {"user": ctx.current_key, "i": value["i"], "n": n, "seen": len(list(self.seen.get()))}


def build(env: pe.StreamEnvironment, release: threading.Event, sink: Any) -> None:
    env.from_source(Held(RECORDS, HALF, release), name="held").uid("held").key_by("user").process(TtlTally()).uid(
        "tally"
    ).sink_to(sink)


def environment(tmp_path: Path, parallelism: int = 2) -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=50),
        checkpoint_storage=str(tmp_path / "ckpt"),
    )


def _schemas(root: Path) -> List[pa.Schema]:
    """The keyed state files' schemas of a savepoint (inline in _metadata or files)."""
    with open(root / "_metadata", "rb") as f:
        operators = json.loads(f.read())["metadata"]["operators"]
    streams = [h["stream"] for op in operators.values() for s in op["subtasks"].values() for h in s["keyed"]]
    out = []
    for s in streams:
        if s["kind"] == "inline":
            out.append(ipc.open_file(pa.py_buffer(bytes.fromhex(s["data"]))).schema)
    for path in root.rglob("*"):
        if path.is_file() and path.name != "_metadata":
            try:
                out.append(ipc.open_file(str(path)).schema)
            except pa.ArrowInvalid:
                continue
    return [s for s in out if b"pyengine" in (s.metadata or {})]


def _keyed_meta(root: Path) -> List[Dict[str, Any]]:
    metas = [json.loads(s.metadata[b"pyengine"]) for s in _schemas(root)]
    return [m for m in metas if m.get("format") == "pyengine-keyed-state"]


def test_the_fixture_holds_serialized_ttl_entries() -> None:
    metas = _keyed_meta(FIXTURE)
    assert metas, f"no keyed state in {FIXTURE}"
    for meta in metas:
        assert meta["version"] <= 4 and "ttl_encoding" not in meta
        ttl_states = [s for s in meta["states"] if s["ttl"]]
        assert {s["name"] for s in ttl_states} == {"count", "last", "pages", "tags", "seen", "notes"}
        assert not any(s["typed"] or "stamped" in s for s in ttl_states)


def _check_state(savepoint: Path, first: List[Dict[str, Any]]) -> None:
    """What read_keyed_state gives of a savepoint taken after ``first``."""
    users = sorted({r["user"] for r in first})

    def table(name: str) -> Dict[Any, Any]:
        t = read_keyed_state(str(savepoint), "tally", name)
        return dict(zip(t.column("key").to_pylist(), t.column("value").to_pylist(), strict=True))

    assert table("count") == Counter(r["user"] for r in first)
    mine = {u: [r for r in first if r["user"] == u] for u in users}
    assert {k: sorted(v) for k, v in table("seen").items()} == {u: sorted(r["i"] for r in rs) for u, rs in mine.items()}
    assert {k: sorted(v) for k, v in table("notes").items()} == {
        u: sorted(f"n{r['i']}" for r in rs) for u, rs in mine.items()
    }
    pages = {k: dict(v) for k, v in table("pages").items()}
    assert pages == {u: dict(Counter(r["page"] for r in rs)) for u, rs in mine.items()}
    last = table("last")
    assert set(last) == set(users) and all(v["i"] in {r["i"] for r in mine[u]} for u, v in last.items())
    tags = {k: _SAFE.loads(v) for k, v in table("tags").items()}  # mixed values: read_keyed_state serializes them
    # the last write of each tag wins; which record was last depends on how the two splits interleaved
    assert tags == {
        u: {r["i"] % 5: [r["page"], r["i"]] for r in rs if [r["page"], r["i"]] in tags[u].values()}
        for u, rs in mine.items()
    }
    assert {u: set(t) for u, t in tags.items()} == {u: {r["i"] % 5 for r in rs} for u, rs in mine.items()}


def _resume(tmp_path: Path, savepoint: Path, first: List[Dict[str, Any]], parallelism: int) -> None:
    released = threading.Event()
    released.set()
    sink = pe.sinks.CollectSink()
    env = environment(tmp_path, parallelism)
    build(env, released, sink)
    result = env.execute("ttl-tally", restore_from=str(savepoint))
    assert result.status == "FINISHED"
    rest = [r for r in RECORDS if r not in first]
    assert sorted(r["i"] for r in result.records) == sorted(r["i"] for r in rest)
    last_n: Dict[str, int] = {}
    last_seen: Dict[str, int] = {}
    for r in result.records:
        last_n[r["user"]] = max(last_n.get(r["user"], 0), r["n"])
        last_seen[r["user"]] = max(last_seen.get(r["user"], 0), r["seen"])
    everything = Counter(r["user"] for r in RECORDS)
    assert last_n == everything  # the counts went on from the savepoint's
    assert last_seen == everything  # and so did the lists


def test_a_savepoint_with_serialized_ttl_entries_is_read_and_restored(tmp_path: Path) -> None:
    savepoint = tmp_path / "savepoint"
    shutil.copytree(FIXTURE, savepoint)
    first = RECORDS[0::2][:HALF] + RECORDS[1::2][:HALF]
    _check_state(savepoint, first)
    _resume(tmp_path, savepoint, first, 2)


@pytest.mark.parametrize("parallelism", [2, 3])
def test_a_savepoint_of_stamped_columns_is_read_restored_and_rescaled(tmp_path: Path, parallelism: int) -> None:
    """This version's layout: written, read back by read_keyed_state, resumed at the same
    parallelism and at another (key groups redistributed)."""
    held = threading.Event()
    env = environment(tmp_path / "first")
    build(env, held, pe.sinks.CollectSink())
    PROCESSED[0] = 0
    client = env.execute_async("ttl-tally")
    first = RECORDS[0::2][:HALF] + RECORDS[1::2][:HALF]
    deadline = time.monotonic() + 60
    while PROCESSED[0] < len(first) and time.monotonic() < deadline:  # both splits held at HALF
        time.sleep(0.05)
    assert PROCESSED[0] == len(first), f"{PROCESSED[0]} of {len(first)} records processed in 60 s"
    savepoint = Path(client.stop_with_savepoint(str(tmp_path / "savepoint")))
    client.wait(30)
    metas = _keyed_meta(savepoint)
    assert metas and all(m["version"] == 6 and m["ttl_encoding"] == "columns" for m in metas)
    states = {s["name"]: s.get("stamped") for m in metas for s in m["states"] if s["ttl"]}
    assert states == {
        "count": "typed",
        "last": "serialized",
        "pages": "typed",
        "tags": "serialized",
        "seen": "typed",
        "notes": "serialized",
    }
    _check_state(savepoint, first)
    _resume(tmp_path / "second", savepoint, first, parallelism)
