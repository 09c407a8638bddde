"""How many keyed states one operator may have, and how they share a file: an
Arrow union has at most 128 children (int8 type codes), so a state file of more
states shares the value union's children by storage type (format version 2,
written only then); several states of at most four storage types share them in
a sparse union (version 3: no offset per row); other files of up to 128 states
stay version 1, byte for byte the layout every pyengine reads."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pytest

import pyengine as pe
from pyengine.snapshot.format import (
    FORMAT_VERSION,
    MAX_STATES_PER_FILE,
    MAX_UNION_CHILDREN,
    StateColumn,
    check_state_count,
)
from pyengine.snapshot.reader import read_keyed_state
from pyengine.snapshot.writer import write_keyed_state
from pyengine.state import KeyGroupRange, ValueStateDescriptor
from pyengine.state import read_keyed_state as read_checkpoint_state
from pyengine.storage.filesystem import CheckpointStateOutputStream, CorruptStateError

MAX_P = 8
ALL_GROUPS = KeyGroupRange(0, MAX_P - 1)


def _column(i: int) -> StateColumn:
    """Five kinds of state in turn: typed int64, float64 and string values, an untyped
    (msgpack) value, and a typed list."""
    kind, arrow_type = [
        ("value", pa.int64()),
        ("value", pa.float64()),
        ("value", pa.string()),
        ("value", None),
        ("list", pa.int64()),
    ][i % 5]
    return StateColumn(f"s{i}", kind, arrow_type, None, "msgpack", False)


def _value(i: int, key: int) -> Any:
    return [key * 1000 + i, key + i / 4, f"{key}-{i}", {"k": key, "i": [i, "x"]}, [key, i, key + i]][i % 5]


def _write(tmp_path: Any, columns: List[StateColumn], keys: int = 20) -> Any:
    groups: List[List[Dict[Any, Any]]] = []
    for i in range(len(columns)):
        per_group: List[Dict[Any, Any]] = [{} for _ in range(MAX_P)]
        for key in range(keys):
            if (key + i) % 3:  # not every key in every state
                per_group[key % MAX_P][key] = _value(i, key)
        groups.append(per_group)
    stream = CheckpointStateOutputStream(pafs.LocalFileSystem(), str(tmp_path / f"state-{len(columns)}"))
    handle = write_keyed_state(
        stream,
        backend="heap",
        max_parallelism=MAX_P,
        key_group_range=KeyGroupRange(0, MAX_P - 1),
        columns=columns,
        groups=groups,
    )
    return handle, groups


def _read_all(handle: Any, key_groups: KeyGroupRange = ALL_GROUPS) -> Dict[str, Dict[Any, Any]]:
    _, entries = read_keyed_state(handle, key_groups)
    out: Dict[str, Dict[Any, Any]] = {}
    for _, spec, keys, values in entries:
        out.setdefault(spec.name, {}).update(zip(keys, values, strict=True))
    return out


def _metadata(handle: Any) -> Dict[str, Any]:
    with open(handle.stream.path, "rb") as f:
        return json.loads(ipc.open_file(pa.py_buffer(f.read())).schema.metadata[b"pyengine"])


@pytest.mark.parametrize("count", [MAX_UNION_CHILDREN + 1, 300])
def test_more_states_than_a_union_has_children_round_trip(tmp_path: Any, count: int) -> None:
    columns = [_column(i) for i in range(count)]
    handle, groups = _write(tmp_path, columns)
    meta = _metadata(handle)
    assert (meta["version"], meta["value_encoding"]) == (2, "union_by_type")
    assert len(meta["value_children"]) == count and max(meta["value_children"]) == 4  # five storage types
    expected = {c.name: {k: v for g in groups[i] for k, v in g.items()} for i, c in enumerate(columns)}
    assert _read_all(handle) == expected
    # a subtask reading only some key groups (a rescale) gets exactly its entries
    part = _read_all(handle, KeyGroupRange(2, 3))
    assert part["s299" if count == 300 else "s128"] == {
        k: v for k, v in expected["s299" if count == 300 else "s128"].items() if k % MAX_P in (2, 3)
    }
    # typed states keep their declared Arrow types through the shared children
    _, entries = read_keyed_state(handle, KeyGroupRange(0, MAX_P - 1))
    specs = {spec.name: spec for _, spec, _, _ in entries}
    assert specs["s1"].arrow_type == pa.float64() and specs["s4"].storage_type == pa.list_(pa.int64())


def test_up_to_128_states_are_still_written_as_version_1(tmp_path: Any) -> None:
    columns = [_column(i) for i in range(MAX_UNION_CHILDREN)]
    handle, groups = _write(tmp_path, columns, keys=5)
    meta = _metadata(handle)
    assert (meta["version"], meta["value_encoding"]) == (FORMAT_VERSION, "union") == (1, "union")
    assert "value_children" not in meta
    with open(handle.stream.path, "rb") as f:
        value_type = ipc.open_file(pa.py_buffer(f.read())).schema.field("value").type
    assert value_type.num_fields == MAX_UNION_CHILDREN  # one child per state, as version 1 says
    assert _read_all(handle)["s127"] == {k: v for g in groups[127] for k, v in g.items()}


def test_a_corrupt_state_to_child_map_is_refused(tmp_path: Any) -> None:
    from pyengine.snapshot.format import read_schema_info

    handle, _ = _write(tmp_path, [_column(i) for i in range(200)], keys=3)
    with open(handle.stream.path, "rb") as f:
        schema = ipc.open_file(pa.py_buffer(f.read())).schema
    meta = json.loads(schema.metadata[b"pyengine"])
    for bad in ([0] * 199, [0] * 199 + [5], [0] * 199 + [-1], [0] * 199 + [True], None, "0"):
        broken = schema.with_metadata({b"pyengine": json.dumps({**meta, "value_children": bad}).encode()})
        with pytest.raises(CorruptStateError, match="value_children"):
            read_schema_info(broken, where="test file")
    unknown = schema.with_metadata({b"pyengine": json.dumps({**meta, "version": 7}).encode()})
    with pytest.raises(CorruptStateError, match="version 7; this pyengine reads versions 1, 2, 3, 4, 5, 6"):
        read_schema_info(unknown, where="test file")
    split = schema.with_metadata({b"pyengine": json.dumps({**meta, "version": 4}).encode()})
    with pytest.raises(CorruptStateError, match="version 4 without its timers encoding"):
        read_schema_info(split, where="test file")


def test_the_limits_that_remain_are_named() -> None:
    check_state_count(MAX_STATES_PER_FILE)  # fine
    with pytest.raises(ValueError, match=r"op 'big': 32768 keyed states.*at most 32767"):
        check_state_count(MAX_STATES_PER_FILE + 1, where="op 'big'")
    # more than 128 states of more than 128 distinct types: no union holds them
    distinct = [pa.binary(n) for n in range(1, MAX_UNION_CHILDREN + 2)]
    with pytest.raises(ValueError, match=r"129 keyed states of 129 distinct Arrow types.*at most 128 distinct"):
        check_state_count(len(distinct), distinct)
    check_state_count(MAX_UNION_CHILDREN, distinct[:MAX_UNION_CHILDREN])  # one child per state: fine
    with pytest.raises(ValueError, match="at most 128 distinct"):
        write_keyed_state(
            None,
            backend="heap",
            max_parallelism=MAX_P,
            key_group_range=KeyGroupRange(0, MAX_P - 1),
            columns=[StateColumn(f"s{i}", "value", t, None, "msgpack", False) for i, t in enumerate(distinct)],
            groups=[[{}] * MAX_P for _ in distinct],
        )


def test_a_state_no_file_could_hold_is_refused_when_declared() -> None:
    """Past 128 states, a 129th distinct storage type is refused by ``get_state`` (in the
    function's ``open``), naming the state, not at the job's first checkpoint."""
    from pyengine.state import create_keyed_backend

    backend = create_keyed_backend("heap", max_parallelism=MAX_P)
    for n in range(1, MAX_UNION_CHILDREN + 1):
        backend.get_state(ValueStateDescriptor(f"s{n}", None, pa.binary(n)))
    with pytest.raises(ValueError, match=r"state 's129'.*at most 128 distinct"):
        backend.get_state(ValueStateDescriptor("s129", None, pa.binary(MAX_UNION_CHILDREN + 1)))
    backend.get_state(ValueStateDescriptor("s129", None, pa.binary(1)))  # a type already there: room


STATES = 150


class ManyStates(pe.KeyedProcessFunction):
    """One operator with 150 keyed states (typed and untyped): each record bumps all."""

    def open(self, ctx: Any) -> None:
        self.states = [
            ctx.get_state(ValueStateDescriptor(f"c{i}", 0, pa.int64() if i % 2 else None)) for i in range(STATES)
        ]

    def process_element(self, value: Any, ctx: Any) -> Any:
        for i, state in enumerate(self.states):
            state.update(state.value() + i + 1)
        if value["v"] == FAIL_AT and not FAILED:
            FAILED.append(1)
            raise RuntimeError("injected failure")
        yield {"k": ctx.current_key, "v": value["v"], "c149": self.states[-1].value()}


FAIL_AT = 120
FAILED: List[int] = []


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_an_operator_with_150_states_checkpoints_restores_and_reads_back(tmp_path: Any, backend: str) -> None:
    FAILED.clear()
    records = [{"k": i % 7, "v": i} for i in range(300)]
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=20),
        checkpoint_storage=str(tmp_path / "ckpt"),
        state_backend=backend,
        buffer_size=8,
        buffer_timeout_ms=1,
        restart_attempts=1,
    )
    sink = pe.sinks.CollectSink()
    env.from_collection(records).key_by("k").process(ManyStates()).uid("many").sink_to(sink)
    result = env.execute("many-states")
    assert result.status == "FINISHED" and FAILED, result.cause
    assert result.checkpoints.counts["completed"] >= 1
    # failed ones were only cut short (the failover, the end of the job), never declined by a task
    reasons = [h.get("failure_message") for h in result.checkpoints_json()["history"] if h["status"] == "FAILED"]
    assert not [r for r in reasons if "declined" in str(r).lower()], reasons
    # exactly once across the restore: each key's n-th record saw n * 150 in c149
    seen: Dict[int, List[int]] = {}
    for r in sorted(result.records, key=lambda r: r["v"]):
        seen.setdefault(r["k"], []).append(r["c149"])
    assert seen == {k: [n * STATES for n in range(1, 300 // 7 + (k < 300 % 7) + 1)] for k in range(7)}
    # the final checkpoint's state, read back as any reader would
    table = read_checkpoint_state(result.latest_checkpoint, "many", "c149")
    assert dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True)) == {
        k: len(v) * STATES for k, v in seen.items()
    }


@pytest.mark.parametrize("count", [2, 4, 40])
def test_states_of_a_few_types_share_a_sparse_union(tmp_path: Any, count: int, monkeypatch: Any) -> None:
    """Several states of at most ``SPARSE_MAX_CHILDREN`` storage types: version 3, a
    sparse union by type, which round-trips as the others do and is smaller than the
    dense union it replaces by the offsets' 4 bytes a row (which LZ4 cannot shrink).
    Four states are four types (int64, float64, string, binary); 40 are five (with a
    typed list), written sparse here with the threshold raised to five."""
    from pyengine.snapshot import format as fmt

    if count > 4:
        monkeypatch.setattr(fmt, "SPARSE_MAX_CHILDREN", 5)
    columns = [_column(i) for i in range(count)]
    handle, groups = _write(tmp_path, columns, keys=3000)
    meta = _metadata(handle)
    assert (meta["version"], meta["value_encoding"]) == (3, "union_by_type")
    with open(handle.stream.path, "rb") as f:
        value_type = ipc.open_file(pa.py_buffer(f.read())).schema.field("value").type
    assert value_type.mode == "sparse" and value_type.num_fields == min(count, 5)
    expected = {c.name: {k: v for g in groups[i] for k, v in g.items()} for i, c in enumerate(columns)}
    assert _read_all(handle) == expected
    last = columns[-1].name
    part = _read_all(handle, KeyGroupRange(2, 3))  # a rescale: only these key groups' batches
    assert part[last] == {k: v for k, v in expected[last].items() if k % MAX_P in (2, 3)}
    _, entries = read_keyed_state(handle, ALL_GROUPS)
    specs = {spec.name: spec for _, spec, _, _ in entries}
    assert specs["s0"].arrow_type == pa.int64() and specs["s1"].arrow_type == pa.float64()
    if count > 4:
        assert specs["s4"].storage_type == pa.list_(pa.int64())

    monkeypatch.setattr(fmt, "SPARSE_MAX_CHILDREN", 0)  # the same states, written as before: dense
    (tmp_path / "dense").mkdir()
    dense, _ = _write(tmp_path / "dense", columns, keys=3000)
    assert _metadata(dense)["version"] == 1
    assert _read_all(dense) == expected
    rows = sum(len(expected[c.name]) for c in columns)
    assert dense.stream.size - handle.stream.size >= 3 * rows, (dense.stream.size, handle.stream.size, rows)
