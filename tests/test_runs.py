"""A run's identity: failures that raise, resume after a crash, restore targets that
are never another job's, runs that never share a directory (issue #11, #12)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from typing import Any, List

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.errors import JobFailedError, NonRetryableError, OutputInUseError
from pyengine.state import ValueStateDescriptor
from pyengine.storage.jobs import list_jobs

COUNT = ValueStateDescriptor("count", 0, pa.int64())
RECORDS = [{"user": i % 13, "i": i} for i in range(3000)]


class Count(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "n": n, "i": value["i"]}


def expected_pairs(records: List[Any]) -> Counter:
    per_user = Counter(r["user"] for r in records)
    return Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})


def counting_env(storage: Any, **kwargs: Any) -> pe.StreamEnvironment:
    settings: dict = dict(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(storage),
        buffer_size=32,
        buffer_timeout_ms=1,
        restart_attempts=0,
    )
    settings.update(kwargs)
    return pe.StreamEnvironment(**settings)


def counting_job(env: pe.StreamEnvironment, out: str, *, step: Any = None) -> Any:
    sink = pe.sinks.FileSink(out)
    stream = env.from_collection(RECORDS)
    if step is not None:
        stream = stream.map(step).uid("step")
    stream.key_by("user").process(Count()).uid("counter").sink_to(sink)
    return sink


def pairs(sink: Any) -> Counter:
    return Counter((r["user"], r["n"]) for r in sink.read_committed())


# -- failures raise, and some fail at once -------------------------------------------------


def test_a_failed_job_raises_job_failed_error_with_the_users_exception_and_result(tmp_path) -> None:
    def poison(r: Any) -> Any:
        if r["i"] == 1500:
            raise ZeroDivisionError("poison record 1500")
        return r

    env = pe.StreamEnvironment(restart_attempts=1)
    env.from_collection(RECORDS).map(poison).sink_to(pe.sinks.CollectSink())
    with pytest.raises(JobFailedError, match="poison record 1500") as info:
        env.execute("poisoned")
    err = info.value
    assert isinstance(err.cause, ZeroDivisionError)
    assert err.__cause__ is err.cause
    assert err.result.status == "FAILED" and err.result.restarts == 1
    frames = [f.name for f in __import__("traceback").extract_tb(err.cause.__traceback__)]
    assert "poison" in frames, frames


def test_a_non_retryable_error_fails_the_job_without_restarts() -> None:
    calls = [0]

    def refuse(r: Any) -> Any:
        calls[0] += 1
        raise NonRetryableError("this record can never be processed")

    env = pe.StreamEnvironment(restart_attempts=5)
    env.from_collection(RECORDS[:10]).map(refuse).sink_to(pe.sinks.CollectSink())
    with pytest.raises(JobFailedError) as info:
        env.execute("refused")
    assert info.value.result.restarts == 0
    assert calls[0] == 1


def test_a_nan_key_is_refused_at_once_not_given_state_per_record() -> None:
    records = [{"k": float("nan"), "i": i} for i in range(50)]
    env = pe.StreamEnvironment(restart_attempts=3)
    env.from_collection(records).key_by("k").process(Count()).sink_to(pe.sinks.CollectSink())
    with pytest.raises(JobFailedError, match="NaN") as info:
        env.execute("nan-keys")
    assert info.value.result.restarts == 0


def test_the_embedded_runner_refuses_a_parallelism_it_cannot_run() -> None:
    env = pe.StreamEnvironment(parallelism=1024, max_parallelism=2048)
    env.from_collection([1, 2, 3]).rebalance().map(lambda x: x).sink_to(pe.sinks.CollectSink())
    with pytest.raises(ValueError, match="embedded runner"):
        env.execute("too-wide")


def test_local_recovery_leaves_no_temporary_directory(tmp_path, monkeypatch) -> None:
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen: List[str] = []

    def look(r: Any) -> Any:
        if r["i"] == 2999:
            seen.extend(p for p in os.listdir(scratch) if p.startswith("pyengine-local-recovery-"))
        return r

    env = counting_env(tmp_path / "ckpt", local_recovery=True, parallelism=1)
    counting_job(env, str(tmp_path / "out"), step=look)
    env.execute("local-copies")
    assert seen, "the run kept no local copy"
    assert not [p for p in os.listdir(scratch) if p.startswith("pyengine-local-recovery-")]


# -- restore targets ----------------------------------------------------------------------


def test_a_storage_root_with_two_jobs_is_refused_unless_the_name_picks_one(tmp_path, caplog) -> None:
    root = tmp_path / "ckpt"
    for name in ("alpha", "beta"):
        env = counting_env(root)
        counting_job(env, str(tmp_path / f"out-{name}"))
        env.execute(name)
    env = counting_env(root)
    counting_job(env, str(tmp_path / "out-gamma"))
    with pytest.raises(ValueError, match=r"holding 2 job\(s\)") as info:
        env.execute("gamma", restore_from=str(root))
    assert "alpha" in str(info.value) and "beta" in str(info.value)

    env = counting_env(root)
    sink = counting_job(env, str(tmp_path / "out-beta"))
    result = env.execute("beta", restore_from=str(root))
    restored = result.checkpoints.latest_restored
    beta_dir = next(j for j in list_jobs(str(root)) if j.job_name == "beta" and j.finished)
    assert restored is not None and beta_dir.dir_id in restored["external_path"]
    # beta's final checkpoint covered all its input: nothing is produced twice.
    assert pairs(sink) == expected_pairs(RECORDS)


def test_restoring_a_job_directory_falls_back_past_a_damaged_latest_checkpoint(tmp_path, caplog) -> None:
    root = tmp_path / "ckpt"

    def paced(r: Any) -> Any:
        # long enough for several checkpoints on a loaded machine: the final checkpoint is
        # the job's last, so an unpaced run of 3,000 records may complete only that one
        time.sleep(0.0001)
        return r

    env = counting_env(root, checkpointing=pe.CheckpointConfig(interval_ms=5, retained=3))
    counting_job(env, str(tmp_path / "out"), step=paced)
    first = env.execute("damaged")
    job_dir = first.checkpoint_dir
    ids = sorted(int(p[4:]) for p in os.listdir(job_dir) if p.startswith("chk-"))
    assert len(ids) >= 2
    with open(os.path.join(job_dir, f"chk-{ids[-1]}", "_metadata"), "r+b") as f:
        f.write(b"garbage")
    env = counting_env(root, checkpointing=pe.CheckpointConfig(interval_ms=5, retained=3))
    counting_job(env, str(tmp_path / "out"), step=paced)
    with caplog.at_level(logging.WARNING):
        result = env.execute("damaged", restore_from=job_dir)
    assert f"chk-{ids[-2]}" in result.checkpoints.latest_restored["external_path"]
    assert any("cannot be restored" in r.getMessage() for r in caplog.records)


# -- resume after a crash ----------------------------------------------------------------

CRASHING_JOB = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import pyengine as pe
    from test_runs import RECORDS, counting_env, counting_job

    def step(r):
        if r["i"] == 2000:
            # Wait until a checkpoint has completed, then die as a killed process does.
            root = {root!r}
            deadline = time.time() + 20
            while time.time() < deadline:
                done = [d for d, _, files in os.walk(root) if "_metadata" in files]
                if done:
                    break
                time.sleep(0.01)
            os._exit(9)
        time.sleep(0.0002)
        return r

    env = counting_env({root!r})
    counting_job(env, {out!r}, step=step)
    env.execute("crashy")
    """
)


def _crash(tmp_path) -> None:
    script = CRASHING_JOB.format(
        tests=os.path.dirname(__file__), root=str(tmp_path / "ckpt"), out=str(tmp_path / "out")
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]


def test_rerunning_a_crashed_job_resumes_it_and_its_output_is_exact(tmp_path) -> None:
    _crash(tmp_path)
    [crashed] = list_jobs(str(tmp_path / "ckpt"))
    assert crashed.job_name == "crashy" and crashed.state == "CRASHED" and crashed.checkpoints

    env = counting_env(tmp_path / "ckpt")
    sink = counting_job(env, str(tmp_path / "out"), step=lambda r: r)
    result = env.execute("crashy")  # resume="auto": the default
    assert result.checkpoints.counts["restored"] == 1
    assert pairs(sink) == expected_pairs(RECORDS)
    # The resumed run continued in the crashed run's directory: one job, now finished.
    [job] = list_jobs(str(tmp_path / "ckpt"))
    assert job.dir_id == crashed.dir_id and job.finished and len(job.runs) == 2
    assert job.runs[0].status == "RUNNING" and job.runs[1].status == "FINISHED"


def test_resume_never_starts_fresh_and_the_used_output_directory_is_refused(tmp_path) -> None:
    _crash(tmp_path)
    env = counting_env(tmp_path / "ckpt")
    counting_job(env, str(tmp_path / "out"), step=lambda r: r)
    with pytest.raises(OutputInUseError, match="crashy") as info:
        env.execute("crashy", resume="never")
    assert "append" in str(info.value) and "overwrite" in str(info.value)
    # Refused before it ran: it left no job directory behind, only the crashed run's.
    assert [j.job_name for j in list_jobs(str(tmp_path / "ckpt"))] == ["crashy"]


def test_a_finished_job_run_again_starts_fresh(tmp_path) -> None:
    env = counting_env(tmp_path / "ckpt")
    counting_job(env, str(tmp_path / "out"))
    env.execute("once")
    env = counting_env(tmp_path / "ckpt")
    counting_job(env, str(tmp_path / "out2"))
    result = env.execute("once")
    assert result.checkpoints.counts["restored"] == 0
    assert len(list_jobs(str(tmp_path / "ckpt"))) == 2


def test_a_second_live_run_of_a_job_is_refused_naming_the_first(tmp_path) -> None:
    gate = threading.Event()

    def slow(r: Any) -> Any:
        gate.wait(30)
        return r

    env = counting_env(tmp_path / "ckpt")
    counting_job(env, str(tmp_path / "out"), step=slow)
    client = env.execute_async("busy")
    try:
        deadline = time.time() + 20
        while not [j for j in list_jobs(str(tmp_path / "ckpt")) if j.state == "RUNNING"]:
            assert time.time() < deadline
            time.sleep(0.01)
        env2 = counting_env(tmp_path / "ckpt")
        counting_job(env2, str(tmp_path / "out2"))
        with pytest.raises(OutputInUseError, match="busy") as info:
            env2.execute("busy")
        assert str(os.getpid()) in str(info.value)
    finally:
        gate.set()
        client.wait(60)


def test_checkpoints_list_shows_the_jobs_of_a_storage_root(tmp_path, capsys) -> None:
    from pyengine.cli import main

    for name in ("alpha", "beta"):
        env = counting_env(tmp_path / "ckpt")
        counting_job(env, str(tmp_path / f"out-{name}"))
        env.execute(name)
    assert main(["checkpoints", "list", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "beta" in out and "FINISHED" in out
    job_dir = list_jobs(str(tmp_path / "ckpt"))[0].uri
    assert main(["checkpoints", "list", job_dir]) == 0
    assert "alpha" in capsys.readouterr().out
    chk = next(d for d in os.listdir(job_dir) if d.startswith("chk-"))
    assert main(["checkpoints", "inspect", os.path.join(job_dir, chk), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)["metadata"]
    assert body["job_name"] == "alpha" and body["runs"][0][0] == body["job_id"]


# -- what a review found ------------------------------------------------------------------


def test_a_root_holding_one_other_job_is_not_restored_under_another_name(tmp_path) -> None:
    env = counting_env(tmp_path / "ckpt")
    counting_job(env, str(tmp_path / "out-alpha"))
    env.execute("alpha")
    env = counting_env(tmp_path / "ckpt")
    counting_job(env, str(tmp_path / "out-beta"))
    with pytest.raises(ValueError, match="none is named 'beta'"):
        env.execute("beta", restore_from=str(tmp_path / "ckpt"))


def test_resume_refuses_an_unfinished_run_that_wrote_elsewhere(tmp_path) -> None:
    _crash(tmp_path)  # job "crashy" writing to out/
    env = counting_env(tmp_path / "ckpt")
    counting_job(env, str(tmp_path / "elsewhere"), step=lambda r: r)
    with pytest.raises(OutputInUseError, match="another pipeline"):
        env.execute("crashy")


def test_a_dead_run_whose_pid_is_reused_is_not_alive() -> None:
    from pyengine.storage.jobs import RunRecord

    now = int(time.time() * 1000)
    mine = RunRecord("r1", now, host=__import__("socket").gethostname(), pid=os.getpid(), heartbeat_ms=now)
    assert not mine.alive(), "this process holds no lease for r1"
    parent = RunRecord("r2", now, host=mine.host, pid=os.getppid(), heartbeat_ms=now - 600_000)
    assert not parent.alive(), "a live pid with a heartbeat ten minutes old is a reused pid"
    fresh = RunRecord("r3", now, host=mine.host, pid=os.getppid(), heartbeat_ms=now)
    assert fresh.alive()


def test_a_killed_run_not_yet_reaped_is_not_alive(tmp_path) -> None:
    """kill -9 leaves a zombie until the parent reaps it (a container without an init
    may never): it answered signal 0, so its run's lock held and its job could not be
    resumed until the heartbeat went stale, a minute on (a new-user trial). A zombie
    holds nothing: the job's lease and the FileSink's lock are both taken over."""
    import socket
    import subprocess

    from pyengine.sinks import FileSink, RunInfo
    from pyengine.storage.jobs import RunRecord, pid_alive

    child = subprocess.Popen(["sleep", "30"])
    try:
        now = int(time.time() * 1000)
        assert pid_alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        assert not pid_alive(child.pid)  # killed, not reaped: the pid is still taken
        killed = RunRecord("r1", now, host=socket.gethostname(), pid=child.pid, heartbeat_ms=now)
        assert not killed.alive()
        out = tmp_path / "out"
        (out / "_pyengine").mkdir(parents=True)
        lock = {
            "run_id": "f" * 32,
            "job_name": "killed",
            "lineage_id": "f" * 32,
            "host": socket.gethostname(),
            "pid": child.pid,
            "started_ms": now,
            "heartbeat_ms": now,
            "token": "t",
        }
        (out / "_pyengine" / "lock.json").write_text(json.dumps(lock))
        sink = FileSink(str(out), mode="append")
        sink.begin_run(RunInfo("etl", "e" * 32, "e" * 32, ()))  # taken over, not refused
        sink.end_run("FINISHED")
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)


def test_a_refused_lease_leaves_the_live_runs_record(tmp_path) -> None:
    from pyengine.storage.jobs import JobLease, read_job

    first = JobLease(str(tmp_path / "job"), "j", "l", "run-1")
    (tmp_path / "job").mkdir()
    first.acquire()
    try:
        second = JobLease(str(tmp_path / "job"), "j", "l", "run-2")
        with pytest.raises(OutputInUseError, match="run-1"):
            second.acquire()
        second.release("FAILED")
        job = read_job(str(tmp_path / "job"))
        assert job is not None and [r.run_id for r in job.runs] == ["run-1"]
    finally:
        first.release("FINISHED")


def _race_for_lease(directory: str, name: str, barrier: Any, results: Any) -> None:
    from pyengine.storage.jobs import JobLease

    lease = JobLease(directory, "j", "l", name)
    barrier.wait()
    try:
        lease.acquire()
    except OutputInUseError:
        results.put((name, False))
        return
    results.put((name, True))
    time.sleep(1.0)  # hold it while the others judge
    lease.release("FINISHED")


def test_runs_racing_for_one_job_directory_get_one_lease(tmp_path) -> None:
    """Four processes resume one job at the same instant: the read-judge-write of
    ``_job.json`` is guarded, so exactly one takes the lease."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    (tmp_path / "job").mkdir()
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=_race_for_lease, args=(str(tmp_path / "job"), f"run-{i}", barrier, results))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert sum(ok for _, ok in outcomes) == 1, outcomes


def test_a_relative_storage_path_resumes_with_the_incremental_backend(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    seen = [0]
    lock = threading.Lock()

    def poison(r: Any) -> Any:
        with lock:
            seen[0] += 1
            if seen[0] == 2200:
                raise RuntimeError("poison")
        time.sleep(0.0001)
        return r

    env = counting_env("./ckpt", state_backend="incremental")
    counting_job(env, "out", step=poison)
    with pytest.raises(JobFailedError):
        env.execute("relative")
    env = counting_env("./ckpt", state_backend="incremental")
    sink = counting_job(env, "out", step=lambda r: r)
    result = env.execute("relative")
    assert result.checkpoints.counts["restored"] == 1
    assert pairs(sink) == expected_pairs(RECORDS)


def test_large_python_records_are_sent_in_pieces_under_the_batch_cap() -> None:
    from pyengine.runners.flight import _row_payloads
    from pyengine.state.serializers import SafeSerializer

    rows = [{"doc": "x" * 300_000, "i": i} for i in range(40)]
    pieces = list(_row_payloads(rows, 1_000_000))
    assert len(pieces) > 1 and all(len(p) <= 1_000_000 for p in pieces)
    back = [r for p in pieces for r in SafeSerializer().loads(p)]
    assert back == rows
