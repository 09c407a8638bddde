"""Randomized: runs that reuse output directories and checkpoint storage, restore an
older checkpoint, fall back past a damaged ``_metadata``, or resume after a kill.
Every run that reports FINISHED must have delivered exactly its output (issue #11)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from typing import Any, Callable, List, Optional

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.state import ValueStateDescriptor
from pyengine.storage.jobs import list_jobs

COUNT = ValueStateDescriptor("count", 0, pa.int64())
N = 3000


class Count(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "n": n}


def records(keys: int) -> List[Any]:
    return [{"user": i % keys, "i": i} for i in range(N)]


def expected(rows: List[Any]) -> Counter:
    per_user = Counter(r["user"] for r in rows)
    return Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})


class Setup:
    """One seed's settings, shared by every run of its scenario."""

    def __init__(self, seed: int, tmp_path: Any) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.backend = rng.choice(["heap", "incremental"])
        self.unaligned = rng.random() < 0.5
        self.interval = rng.choice([3, 5, 10])
        self.parallelism = rng.choice([1, 2])
        self.keys = rng.choice([13, 200])
        self.storage = str(tmp_path / "ckpt")
        self.out = str(tmp_path / "out")
        self.rows = records(self.keys)
        self.where = (
            f"seed {seed}: {self.backend}, unaligned={self.unaligned}, interval {self.interval} ms, "
            f"parallelism {self.parallelism}, {self.keys} keys"
        )

    def env(self, **kwargs: Any) -> pe.StreamEnvironment:
        settings: dict = dict(
            parallelism=self.parallelism,
            checkpointing=pe.CheckpointConfig(interval_ms=self.interval, unaligned=self.unaligned, retained=3),
            checkpoint_storage=self.storage,
            state_backend=self.backend,
            buffer_size=32,
            buffer_timeout_ms=1,
            restart_attempts=0,
        )
        settings.update(kwargs)
        return pe.StreamEnvironment(**settings)

    def job(
        self, env: pe.StreamEnvironment, out: Optional[str] = None, step: Optional[Callable] = None, **sink: Any
    ) -> Any:
        fs = pe.sinks.FileSink(out or self.out, **sink)
        stream = env.from_collection(self.rows)
        stream.map(step or _slow).uid("step").key_by("user").process(Count()).uid("counter").sink_to(fs)
        return fs


def _slow(r: Any) -> Any:
    time.sleep(0.0001)  # a little time per record, so checkpoints land mid-stream
    return r


def _poison_at(at: int) -> Callable[[Any], Any]:
    seen = [0]
    lock = threading.Lock()

    def step(r: Any) -> Any:
        with lock:
            seen[0] += 1
            if seen[0] == at:
                raise RuntimeError(f"poison at record {at}")
        return _slow(r)

    return step


def _failed_run(s: Setup, name: str) -> Any:
    """A run that fails for good after some checkpoints completed."""
    env = s.env()
    s.job(env, step=_poison_at(s.rng.randrange(N // 2, N - N // 8)))
    with pytest.raises(pe.JobFailedError) as info:
        env.execute(name)
    return info.value.result


def _pairs(sink: Any) -> Counter:
    return Counter((r["user"], r["n"]) for r in sink.read_committed())


def scenario_append(s: Setup) -> None:
    """Two different jobs write one directory in append mode: both outputs, exactly."""
    for name in ("first", "second"):
        env = s.env()
        s.job(env, mode="append")
        env.execute(name)
    sink = pe.sinks.FileSink(s.out)
    assert _pairs(sink) == Counter({k: 2 for k in expected(s.rows)}), s.where


def scenario_older(s: Setup) -> None:
    """A failed run restored from an older retained checkpoint than its latest."""
    failed = _failed_run(s, "older")
    ids = sorted(int(d[4:]) for d in os.listdir(failed.checkpoint_dir) if d.startswith("chk-"))
    assert len(ids) >= 2, f"{s.where}: only {len(ids)} checkpoint(s) before the failure"
    target = os.path.join(failed.checkpoint_dir, f"chk-{ids[-2]}")
    env = s.env()
    sink = s.job(env)
    env.execute("older", resume=target)
    assert _pairs(sink) == expected(s.rows), s.where


def scenario_damaged(s: Setup) -> None:
    """A failed run whose latest _metadata is damaged, resumed with resume='auto'."""
    failed = _failed_run(s, "damaged")
    ids = sorted(
        int(d[4:])
        for d in os.listdir(failed.checkpoint_dir)
        if d.startswith("chk-") and os.path.exists(os.path.join(failed.checkpoint_dir, d, "_metadata"))
    )
    with open(os.path.join(failed.checkpoint_dir, f"chk-{ids[-1]}", "_metadata"), "r+b") as f:
        f.write(b"{damaged")
    env = s.env()
    sink = s.job(env)
    env.execute("damaged")
    assert _pairs(sink) == expected(s.rows), s.where


KILLED = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    from test_runs_soak import Setup, _slow
    import pathlib
    s = Setup({seed}, pathlib.Path({tmp!r}))
    at = {at}
    seen = [0]

    def step(r):
        seen[0] += 1
        if seen[0] >= at and any("_metadata" in f for _, _, f in os.walk(s.storage)):
            os._exit(9)
        return _slow(r)

    env = s.env()
    s.job(env, step=step)
    env.execute("killed")
    """
)


def scenario_killed(s: Setup, seed: int, tmp_path: Any) -> None:
    """The process is killed mid-run; running the job again resumes it."""
    script = KILLED.format(tests=os.path.dirname(__file__), seed=seed, tmp=str(tmp_path), at=N // 2)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    env = s.env()
    sink = s.job(env)
    result = env.execute("killed")
    assert result.checkpoints.counts["restored"] == 1, s.where
    assert _pairs(sink) == expected(s.rows), s.where
    [job] = list_jobs(s.storage)
    assert job.finished


SCENARIOS = ["append", "older", "damaged", "killed"]


# Four seeds in the fast tier (each of the four scenarios once), the other eight in the slow one.
@pytest.mark.parametrize(
    "seed", [s if s < len(SCENARIOS) else pytest.param(s, marks=pytest.mark.slow) for s in range(12)]
)
def test_every_finished_run_delivers_exactly_its_output(tmp_path, seed) -> None:
    s = Setup(seed, tmp_path)
    which = SCENARIOS[seed % len(SCENARIOS)]
    if which == "append":
        scenario_append(s)
    elif which == "older":
        scenario_older(s)
    elif which == "damaged":
        scenario_damaged(s)
    else:
        scenario_killed(s, seed, tmp_path)
