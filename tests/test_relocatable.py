"""Checkpoints and savepoints that move: a copy reads its own files, never the
original's, and restores once the original is gone (issue #12)."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.state import ValueStateDescriptor

COUNT = ValueStateDescriptor("count", 0, pa.int64())
RECORDS = [{"user": i % 300, "i": i} for i in range(3000)]


class Count(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "n": n}


def job(env: pe.StreamEnvironment, out: str, slow: bool = False) -> Any:
    import time

    def step(r: Any) -> Any:
        if slow:
            time.sleep(0.0002)
        return r

    sink = pe.sinks.FileSink(out)
    env.from_collection(RECORDS).map(step).uid("step").key_by("user").process(Count()).uid("counter").sink_to(sink)
    return sink


def env_for(tmp_path: Any, backend: str, **kwargs: Any) -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10),
        state_backend=backend,
        buffer_size=16,
        buffer_timeout_ms=1,
        **kwargs,
    )


def _paths(body: Any) -> list:
    if isinstance(body, dict):
        out = [v for k, v in body.items() if k == "path"]
        return out + [p for v in body.values() for p in _paths(v)]
    if isinstance(body, list):
        return [p for v in body for p in _paths(v)]
    return []


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_a_copied_savepoint_restores_after_the_original_is_deleted(tmp_path, backend) -> None:
    env = env_for(tmp_path, backend, checkpoint_storage=str(tmp_path / "ckpt"))
    sink = job(env, str(tmp_path / "out"), slow=True)
    client = env.execute_async("moving")
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    client.wait(60)
    with open(os.path.join(savepoint, "_metadata")) as f:
        assert not [p for p in _paths(json.load(f)) if p.startswith("/") or "://" in p], "absolute paths"
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "sp", moved)
    shutil.rmtree(tmp_path / "sp")
    shutil.rmtree(tmp_path / "ckpt")
    copy = str(moved / os.path.relpath(savepoint, tmp_path / "sp"))
    env2 = env_for(tmp_path, backend)
    job(env2, str(tmp_path / "out"))
    env2.execute("moving", restore_from=copy)
    got = Counter((r["user"], r["n"]) for r in sink.read_committed())
    per_user = Counter(r["user"] for r in RECORDS)
    assert got == Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_a_copied_checkpoint_directory_reads_its_own_files(tmp_path, backend, monkeypatch) -> None:
    import pyengine.snapshot.strategies as strategies
    import pyengine.state.incremental as incremental

    for module in (strategies, incremental):  # state in files, not inside _metadata
        monkeypatch.setattr(module, "INLINE_THRESHOLD", 0)
    env = env_for(tmp_path, backend, checkpoint_storage=str(tmp_path / "ckpt"))
    job(env, str(tmp_path / "out"))
    result = env.execute("copied")
    moved = tmp_path / "moved"
    shutil.copytree(result.checkpoint_dir, moved)
    shutil.rmtree(tmp_path / "ckpt")  # the original is gone: the copy must not need it
    latest = sorted((p for p in os.listdir(moved) if p.startswith("chk-")), key=lambda p: int(p[4:]))[-1]
    with open(moved / latest / "_metadata") as f:
        paths = _paths(json.load(f))
    assert paths and not [p for p in paths if p.startswith("/") or "://" in p], paths
    if backend == "incremental":
        assert [p for p in paths if p.startswith("../shared/")], paths
    from pyengine.state.reader import read_keyed_state

    table = read_keyed_state(str(moved / latest), "counter", "count")
    assert dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True)) == {
        u: 10 for u in range(300)
    }
