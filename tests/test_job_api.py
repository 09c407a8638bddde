"""The job API end to end: configuration errors, restore_from, savepoints, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, List

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.cli import main
from pyengine.state import ValueStateDescriptor

COUNT = ValueStateDescriptor("count", 0, pa.int64())


class Count(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "n": n}


def counting_job(env: pe.StreamEnvironment, records: List[Any], out: str, *, slow_s: float = 0.0, fail: Any = None):
    def step(r: Any) -> Any:
        if slow_s:
            time.sleep(slow_s)
        if fail is not None:
            fail(r)
        return r

    sink = pe.sinks.FileSink(out)
    (env.from_collection(records).map(step).uid("step").key_by("user").process(Count()).uid("counter").sink_to(sink))
    return sink


def expected_pairs(records: List[Any]) -> Counter:
    per_user = Counter(r["user"] for r in records)
    return Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})


RECORDS = [{"user": i % 11, "i": i} for i in range(4000)]


# -- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"interval_ms": 0}, "interval_ms"),
        ({"interval_ms": -5}, "interval_ms"),
        ({"interval_ms": 100, "min_pause_ms": -1}, "min_pause_ms"),
        ({"interval_ms": 100, "retained": 0}, "retained"),
        ({"interval_ms": 100, "unaligned": True, "mode": "at_least_once"}, "unaligned"),
        ({"interval_ms": 100, "mode": "twice"}, "mode"),
    ],
)
def test_bad_checkpoint_config_names_the_setting(kwargs, setting) -> None:
    with pytest.raises(ValueError, match=setting):
        pe.CheckpointConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"parallelism": 200, "max_parallelism": 128}, "parallelism"),
        ({"parallelism": 0}, "parallelism"),
        ({"state_backend": "rocksdb"}, "state_backend"),
        ({"buffer_size": 0}, "buffer_size"),
        ({"restart_attempts": -1}, "restart_attempts"),
    ],
)
def test_bad_environment_names_the_setting(kwargs, setting) -> None:
    with pytest.raises(ValueError, match=setting):
        pe.StreamEnvironment(**kwargs)


@pytest.mark.parametrize("uri", ["foo://nowhere/ckpt", "/proc/not-writable/ckpt"])
def test_unreachable_checkpoint_storage_fails_execute_naming_it(uri) -> None:
    env = pe.StreamEnvironment(checkpointing=pe.CheckpointConfig(interval_ms=100), checkpoint_storage=uri)
    env.from_collection([1, 2]).sink_to(pe.sinks.CollectSink())
    with pytest.raises(Exception, match="checkpoint storage") as exc:
        env.execute("unreachable")
    assert uri in str(exc.value)


# -- restore_from --------------------------------------------------------------------------


def test_restore_from_a_path_that_is_not_a_checkpoint_is_refused(tmp_path) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("hello")
    env = pe.StreamEnvironment(checkpointing=pe.CheckpointConfig(interval_ms=50))
    counting_job(env, RECORDS, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="not a checkpoint"):
        env.execute("bad-restore", restore_from=str(tmp_path / "junk"))


def _failing_run(tmp_path, records: List[Any]) -> Any:
    """A run whose restarts are all spent: FAILED, its checkpoints left on disk."""
    seen = [0]
    lock = threading.Lock()

    def fail(r: Any) -> None:
        with lock:
            seen[0] += 1
            if seen[0] > 2500:
                raise RuntimeError("the machine caught fire")

    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=32,
        buffer_timeout_ms=1,
        restart_attempts=0,
    )
    counting_job(env, records, str(tmp_path / "out"), slow_s=0.0001, fail=fail)
    with pytest.raises(pe.errors.JobFailedError, match="caught fire") as info:
        env.execute("dies")
    result = info.value.result
    assert result.status == "FAILED" and "caught fire" in str(result.cause)
    assert result.latest_checkpoint is not None, "no checkpoint completed before the failure"
    return result


def test_a_killed_job_resumes_exactly_once_from_its_checkpoint_directory(tmp_path) -> None:
    failed = _failing_run(tmp_path, RECORDS)
    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=5), checkpoint_storage=str(tmp_path / "ckpt")
    )
    sink = counting_job(env, RECORDS, str(tmp_path / "out"))
    result = env.execute("resumed", restore_from=failed.checkpoint_dir)
    assert result.status == "FINISHED", result.cause
    assert result.checkpoints.counts["restored"] == 1
    got = Counter((r["user"], r["n"]) for r in sink.read_committed())
    assert got == expected_pairs(RECORDS)


def test_restore_from_a_checkpoint_whose_operators_do_not_match_is_refused(tmp_path) -> None:
    failed = _failing_run(tmp_path, RECORDS)
    env = pe.StreamEnvironment(parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=50))
    (
        env.from_collection(RECORDS)
        .key_by("user")
        .process(Count())
        .uid("a-different-counter")
        .sink_to(pe.sinks.CollectSink())
    )
    with pytest.raises(ValueError, match="counter"):
        env.execute("mismatch", restore_from=failed.latest_checkpoint)


# -- savepoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_stop_with_savepoint_then_resume_at_another_parallelism(tmp_path, backend) -> None:
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10),
        checkpoint_storage=str(tmp_path / "ckpt"),
        state_backend=backend,
        buffer_size=16,
        buffer_timeout_ms=1,
    )
    sink = counting_job(env, RECORDS, str(tmp_path / "out"), slow_s=0.0002)
    client = env.execute_async("first")
    first_savepoint = client.trigger_savepoint(str(tmp_path / "sp-live"))
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    first = client.wait(60)
    assert first.status == "FINISHED"
    assert len(sink.read_committed()) < len(RECORDS), "the job ended before the savepoint stopped it"
    # A stopped run delivered exactly what its savepoint covers: each user's counts 1..n,
    # n the count in the savepoint's state (committed even if the tasks stopped first).
    from pyengine.state.reader import read_keyed_state

    state = read_keyed_state(savepoint, "counter", "count").to_pydict()
    counts = dict(zip(state["key"], state["value"], strict=True))
    committed = Counter((r["user"], r["n"]) for r in sink.read_committed())
    assert committed == Counter({(u, n): 1 for u, c in counts.items() for n in range(1, c + 1)})
    # the savepoint is self-contained: it survives the checkpoints being deleted
    import shutil

    shutil.rmtree(tmp_path / "ckpt")
    done = subprocess.run(
        [sys.executable, "-m", "pyengine", "checkpoints", "inspect", savepoint, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["metadata"]["type"] == "savepoint"
    assert first_savepoint != savepoint

    env3 = pe.StreamEnvironment(
        parallelism=3, checkpointing=pe.CheckpointConfig(interval_ms=10), state_backend=backend, buffer_size=16
    )
    counting_job(env3, RECORDS, str(tmp_path / "out"))
    resumed = env3.execute("second", restore_from=savepoint)
    assert resumed.status == "FINISHED", resumed.cause
    got = Counter((r["user"], r["n"]) for r in sink.read_committed())
    assert got == expected_pairs(RECORDS)


# -- the CLI -------------------------------------------------------------------------------


def test_demo_recovers_from_its_failure_and_checks_its_output(tmp_path, capsys) -> None:
    args = ["demo", "--events", "60000", "--users", "500", "--interval-ms", "20", "--workdir", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "OK: all" in out and "after the failure and recovery" in out
    assert "1 restart(s)" in out
    assert "p50" in out and "p99" in out
    listing = subprocess.run(
        [sys.executable, "-m", "pyengine", "checkpoints", "list", str(tmp_path / "checkpoints")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    assert "chk-" in listing.stdout and "checkpoint" in listing.stdout


def test_demo_rejects_bad_arguments(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--events", "0"])
    assert exc.value.code == 2
    assert "--events" in capsys.readouterr().err


def test_checkpoints_commands_fail_clearly_on_a_wrong_path(tmp_path, capsys) -> None:
    assert main(["checkpoints", "inspect", str(tmp_path / "nothing")]) == 1
    assert "not a completed checkpoint" in capsys.readouterr().err
    assert main(["checkpoints", "list", str(tmp_path / "nothing")]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_a_stream_used_twice_branches_and_a_sink_is_not_continued() -> None:
    """``s.filter(...).sink_to(a)`` then ``s.key_by(...)...sink_to(b)`` branches the
    stream (issue #20: job graphs): each branch gets every record. Continuing the
    first line instead sent the second branch's operators the first's output (both
    sinks received nothing) before graphs; what ``sink_to`` returns is not continued."""
    env = pe.StreamEnvironment(monitoring=None)
    s = env.from_collection([{"u": i % 3, "v": i} for i in range(10)])
    evens, counts = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    s.filter(lambda r: r["v"] % 2 == 0).sink_to(evens)
    s.key_by("u").aggregate(pe.agg.count(), emit="final").sink_to(counts)
    done = env.from_collection([{"u": 1}]).map(lambda r: r).sink_to(pe.sinks.CollectSink())
    with pytest.raises(ValueError, match=r"map\(\): this stream is the end of a sink_to\(\)"):
        done.map(lambda r: r)
    env.execute("branches")
    assert sorted(r["v"] for r in evens.records) == [0, 2, 4, 6, 8]
    assert {r["u"]: r["count"] for r in counts.records} == {0: 4, 1: 3, 2: 3}


def test_ctrl_c_during_execute_records_the_run_canceled_before_the_interrupt_goes_on(tmp_path) -> None:
    """Ctrl-C cancels the job and records its run CANCELED before ``execute`` re-raises:
    a script that ends on the interrupt leaves no RUNNING run (and no stale lock) behind.
    (An interrupt inside Thread.join could mark the running job thread stopped.)"""
    import os
    import signal

    from pyengine.storage.jobs import list_jobs

    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=100),
        checkpoint_storage=str(tmp_path / "ckpt"),
        monitoring=None,
    )
    env.from_generator(lambda i: {"k": i % 7}, rate_per_s=5000).key_by("k").aggregate(pe.agg.count()).sink_to(
        pe.sinks.FileSink(str(tmp_path / "out"), format="jsonl")
    )
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        env.execute("interrupted")
    timer.join()
    [job] = list_jobs(str(tmp_path / "ckpt"))
    assert [r.status for r in job.runs] == ["CANCELED"]


def test_buffer_size_auto_is_refused_with_the_way_to_say_it() -> None:
    with pytest.raises(TypeError, match="or None to let each stream choose"):
        pe.StreamEnvironment(buffer_size="auto")  # type: ignore[arg-type]
