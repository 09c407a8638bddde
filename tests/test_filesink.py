"""FileSink and CollectSink under the run contract (begin_run / recover / stage /
commit / end_run), driven directly as a runner would: a run's output is named by
the run, a directory records who wrote it and refuses another job's use unless
asked, a restore leaves exactly what its checkpoint covered, and records that
cannot be written as they are stop the job instead of being changed."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Any, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pyengine.connectors import filesink
from pyengine.errors import NonRetryableError, OutputInUseError
from pyengine.sinks import FINAL, CollectSink, FileSink, RecordRejectedError, RunInfo, run_tag


def new_run(job: str = "etl", lineage: Optional[str] = None, restored: Tuple[Tuple[str, int], ...] = ()) -> RunInfo:
    run_id = uuid.uuid4().hex
    return RunInfo(job, run_id, lineage or run_id, restored)


def rows(run: str, subtask: int, checkpoint: int, n: int = 3) -> List[Any]:
    return [{"run": run, "sub": subtask, "chk": checkpoint, "i": i} for i in range(n)]


def write(sink: FileSink, run: RunInfo, checkpoints: List[int], label: str, subtasks: int = 2) -> List[Any]:
    """Stages and commits ``checkpoints`` for every subtask, as a run's tasks would."""
    out = []
    for cid in checkpoints:
        for sub in range(subtasks):
            batch = rows(label, sub, cid)
            sink.stage(sub, cid, batch)
            out.extend(batch)
        for sub in range(subtasks):
            sink.commit(sub, cid)
    return out


def key(records: List[Any]) -> List[Tuple[Any, ...]]:
    return sorted((r["run"], int(r["sub"]), int(r["chk"]), int(r["i"])) for r in records)


def crash(sink: FileSink) -> None:
    """What a killed driver leaves: no end_run, its lock and its RUNNING record in
    place; the run that held the lock is gone from this process."""
    assert sink._heartbeat is not None and sink._token is not None
    sink._heartbeat.stop()
    filesink._LIVE_TOKENS.discard(sink._token)
    sink._token = None
    sink._heartbeat = None


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def out(tmp_path) -> str:
    return str(tmp_path / "out")


# -- reruns and modes ----------------------------------------------------------------------------------------------


def test_rerun_of_a_fresh_run_into_a_used_directory_is_refused_naming_the_job(out) -> None:
    first = FileSink(out)
    r1 = new_run("daily-etl")
    first.begin_run(r1)
    first.recover(())
    write(first, r1, [1, 2], "first")
    first.end_run("FINISHED")

    second = FileSink(out)
    with pytest.raises(OutputInUseError) as err:
        second.begin_run(new_run("daily-etl"))
    message = str(err.value)
    assert "daily-etl" in message and r1.run_id in message and "FINISHED" in message
    assert 'mode="append"' in message and 'mode="overwrite"' in message and "another path" in message
    assert "resume=" not in message  # that run finished: nothing to resume
    assert isinstance(err.value, NonRetryableError)
    # Refused before it wrote anything: no lock left, the first run's output and record intact.
    assert not os.path.exists(os.path.join(out, "_pyengine", "lock.json"))
    assert len(json.load(open(os.path.join(out, "_pyengine", "runs.json")))["runs"]) == 1
    assert len(first.read_committed()) == 12
    second.end_run("FAILED")  # a runner's finally: harmless after a refusal
    assert len(first.read_committed()) == 12


def test_refusal_offers_resume_when_the_same_job_did_not_finish(out) -> None:
    first = FileSink(out)
    r1 = new_run("etl")
    first.begin_run(r1)
    first.recover(())
    write(first, r1, [1], "first")
    crash(first)

    with pytest.raises(OutputInUseError) as err:
        FileSink(out).begin_run(new_run("etl"))
    assert "resume='auto'" in str(err.value) and r1.run_id in str(err.value)
    assert "did not finish" in str(err.value)

    with pytest.raises(OutputInUseError) as other_job:  # another job's unfinished run: not resumable by this one
        FileSink(out).begin_run(new_run("report"))
    assert "resume=" not in str(other_job.value) and "'etl'" in str(other_job.value)


def test_files_pyengine_did_not_write_are_an_unknown_writers_output(out) -> None:
    os.makedirs(out)
    with open(os.path.join(out, "part-0-1-0.jsonl"), "w") as f:  # the previous naming scheme
        f.write('{"a":1}\n')
    with pytest.raises(OutputInUseError, match="unknown writer"):
        FileSink(out).begin_run(new_run())
    # Refused: nothing a reader sees changed, no lock and no record of the refused run.
    assert sorted(os.listdir(out)) == ["_pyengine", "part-0-1-0.jsonl"]
    assert os.listdir(os.path.join(out, "_pyengine")) == [".guard"]
    os.remove(os.path.join(out, "part-0-1-0.jsonl"))
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("mine")
    with pytest.raises(OutputInUseError, match=r"unknown writer.*notes\.txt|notes\.txt.*unknown writer"):
        FileSink(out).begin_run(new_run())


def test_append_keeps_both_runs_rows_exactly(out) -> None:
    first = FileSink(out)
    r1 = new_run()
    first.begin_run(r1)
    first.recover(())
    expected = write(first, r1, [1, 2, 3], "first")
    first.end_run("FINISHED")

    second = FileSink(out, mode="append")
    r2 = new_run()
    second.begin_run(r2)
    second.recover(())
    expected += write(second, r2, [1, 2, 3], "second")  # the same checkpoint ids: names must not clash
    second.end_run("FINISHED")

    assert key(second.read_committed()) == key(expected)
    files = second.committed_files()
    assert len(files) == 12
    # Run start order: the first run's files, then the second's.
    tags = [os.path.basename(p).split("-")[1] for p in files]
    assert tags == [run_tag(r1.run_id)] * 6 + [run_tag(r2.run_id)] * 6


def test_overwrite_keeps_only_the_new_runs_rows(out) -> None:
    first = FileSink(out)
    r1 = new_run()
    first.begin_run(r1)
    first.recover(())
    write(first, r1, [1, 2], "first")
    first.stage(0, 3, rows("first", 0, 3))  # staged, never committed
    crash(first)
    with open(os.path.join(out, "part-0-1-0.jsonl"), "w") as f:
        f.write('{"run":"legacy","sub":0,"chk":1,"i":0}\n')

    second = FileSink(out, mode="overwrite")
    r2 = new_run()
    second.begin_run(r2)
    second.recover(())
    expected = write(second, r2, [1, 2], "second")
    second.end_run("FINISHED")

    assert key(second.read_committed()) == key(expected)
    assert os.listdir(os.path.join(out, "_staging")) == []
    runs = json.load(open(os.path.join(out, "_pyengine", "runs.json")))["runs"]
    assert list(runs) == [run_tag(r2.run_id)]


def test_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        FileSink("/tmp/x", mode="ignore")
    with pytest.raises(ValueError, match="parquet and csv"):
        FileSink("/tmp/x", schema=pa.schema([("a", pa.int64())]))


# -- restores ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["error", "append", "overwrite"])
def test_restoring_an_older_checkpoint_leaves_exactly_what_it_covered(out, mode) -> None:
    """Run X committed checkpoints 1..5; a run restoring X's checkpoint 3 must remove
    X's 4 and 5 (the restored state replays their records) and keep 1..3."""
    x = FileSink(out)
    rx = new_run()
    x.begin_run(rx)
    x.recover(())
    kept = write(x, rx, [1, 2, 3], "X")
    write(x, rx, [4, 5], "X")
    x.stage(0, 6, rows("X", 0, 6))
    x.end_run("FAILED")

    y = FileSink(out, mode=mode)  # its own lineage: never refused, never overwritten
    ry = new_run(lineage=rx.run_id, restored=((rx.run_id, 3),))
    y.begin_run(ry)
    y.recover(ry.restored)
    kept += write(y, ry, [4, 5, 6], "Y")
    y.end_run("FINISHED")

    assert key(y.read_committed()) == key(kept)
    assert os.listdir(os.path.join(out, "_staging")) == []


def test_restored_run_commits_covered_staged_pieces_and_takes_over_a_dead_processes_lock(out) -> None:
    """A driver killed after checkpoint 2 completed but before its commit ran: the
    restored run commits checkpoint 2's staged pieces, drops checkpoint 3's, takes
    over the dead process's lock, and removes the half-written temp file."""
    rx = new_run("etl")
    child = textwrap.dedent(
        f"""
        import os
        from pyengine.sinks import FileSink, RunInfo
        s = FileSink({out!r})
        run = RunInfo("etl", {rx.run_id!r}, {rx.run_id!r})
        s.begin_run(run)
        s.recover(())
        for cid in (1, 2, 3):
            for sub in (0, 1):
                s.stage(sub, cid, [{{"run": "X", "sub": sub, "chk": cid, "i": i}} for i in range(3)])
            if cid == 1:
                s.commit(0, 1)
                s.commit(1, 1)
        open(os.path.join({out!r}, "_staging", ".part-{run_tag(rx.run_id)}-0-4-0.jsonl.abc.tmp"), "w").write("{{")
        os._exit(9)
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    lock = json.load(open(os.path.join(out, "_pyengine", "lock.json")))
    assert lock["run_id"] == rx.run_id and lock["job_name"] == "etl" and lock["pid"] != os.getpid()

    y = FileSink(out)
    ry = new_run("etl", lineage=rx.run_id, restored=((rx.run_id, 2),))
    y.begin_run(ry)  # the lock's pid is dead: taken over
    assert json.load(open(os.path.join(out, "_pyengine", "lock.json")))["run_id"] == ry.run_id
    y.recover(ry.restored)
    assert os.listdir(os.path.join(out, "_staging")) == []
    expected = [r for cid in (1, 2) for sub in (0, 1) for r in rows("X", sub, cid)]
    assert key(y.read_committed()) == key(expected)
    expected += write(y, ry, [3], "Y")
    y.end_run("FINISHED")
    assert key(y.read_committed()) == key(expected)


def test_falling_back_past_a_later_run_removes_the_abandoned_branch(out) -> None:
    """W committed 1..4; X restored W's 4 and committed its own 1..2; a third run
    restores W's 2 (an older checkpoint): nothing of X and nothing of W after 2 stays."""
    w = FileSink(out)
    rw = new_run()
    w.begin_run(rw)
    w.recover(())
    kept = write(w, rw, [1, 2], "W")
    write(w, rw, [3, 4], "W")
    w.end_run("FAILED")

    x = FileSink(out)
    rx = new_run(lineage=rw.run_id, restored=((rw.run_id, 4),))
    x.begin_run(rx)
    x.recover(rx.restored)
    write(x, rx, [1, 2], "X")
    x.stage(1, 3, rows("X", 1, 3))
    x.end_run("FAILED")

    z = FileSink(out)
    rz = new_run(lineage=rw.run_id, restored=((rw.run_id, 2),))
    z.begin_run(rz)
    z.recover(rz.restored)
    kept += write(z, rz, [1], "Z")
    z.end_run("FINISHED")
    assert key(z.read_committed()) == key(kept)


def test_restart_within_a_run_and_lineage_through_two_runs(out) -> None:
    """covered lists several runs: (W, 2), (X, 1); and a restart within X's run covers
    X's own checkpoint (recover called again with the current run in covered)."""
    w = FileSink(out)
    rw = new_run()
    w.begin_run(rw)
    w.recover(())
    kept = write(w, rw, [1, 2], "W")
    w.end_run("FAILED")

    x = FileSink(out)
    rx = new_run(lineage=rw.run_id, restored=((rw.run_id, 2),))
    x.begin_run(rx)
    x.recover(rx.restored)
    kept += write(x, rx, [1], "X")
    write(x, rx, [2], "X")  # committed, but the attempt falls back past a damaged checkpoint 2
    x.stage(0, 3, rows("X", 0, 3))
    x.recover(((rw.run_id, 2), (rx.run_id, 1)))  # the next attempt of the same run
    assert key(x.read_committed()) == key(kept)
    kept += write(x, rx, [4], "X")  # the next attempt's checkpoint ids go on
    x.end_run("FINISHED")
    assert key(x.read_committed()) == key(kept)


def test_other_lineages_files_are_never_touched_by_recover(out) -> None:
    a = FileSink(out)
    ra = new_run()
    a.begin_run(ra)
    a.recover(())
    a_rows = write(a, ra, [1, 2], "A")
    a.stage(0, 3, rows("A", 0, 3))
    crash(a)
    a_staged = sorted(os.listdir(os.path.join(out, "_staging")))

    b = FileSink(out, mode="append")
    rb = new_run()
    b.begin_run(rb)
    b.recover(())  # a fresh start of B: deletes all of B's lineage, none of A's
    b_rows = write(b, rb, [1], "B")
    b.recover(())  # B restarts from scratch: its own output goes, A's stays
    assert key(b.read_committed()) == key(a_rows)
    assert sorted(os.listdir(os.path.join(out, "_staging"))) == a_staged
    b_rows = write(b, rb, [2], "B")
    b.end_run("FINISHED")
    assert key(b.read_committed()) == key(a_rows + b_rows)


def test_without_checkpoints_a_restart_discards_the_final_commit(out) -> None:
    s = FileSink(out)
    run = new_run()
    s.begin_run(run)
    s.recover(())
    s.stage(0, FINAL, rows("R", 0, 0))
    s.commit(0, FINAL)  # subtask 0 ended its input and committed; subtask 1 then failed
    s.stage(1, FINAL, rows("R", 1, 0))
    s.recover(())  # the restart replays everything
    assert s.read_committed() == [] and os.listdir(os.path.join(out, "_staging")) == []
    expected = write(s, run, [FINAL], "R")
    s.end_run("FINISHED")
    assert key(s.read_committed()) == key(expected)


# -- one writer at a time ------------------------------------------------------------------------------------------


def test_a_second_live_writer_is_refused_naming_the_first(out) -> None:
    first = FileSink(out)
    r1 = new_run("ingest")
    first.begin_run(r1)
    first.recover(())
    write(first, r1, [1], "first")

    with pytest.raises(OutputInUseError) as err:
        FileSink(out, mode="append").begin_run(new_run("other-job"))
    message = str(err.value)
    assert "ingest" in message and r1.run_id in message and f"pid {os.getpid()}" in message
    # A second run resuming the same lineage at the same time is refused too.
    with pytest.raises(OutputInUseError, match=r1.run_id):
        FileSink(out).begin_run(new_run("ingest", lineage=r1.run_id, restored=((r1.run_id, 1),)))
    with pytest.raises(OutputInUseError):
        FileSink(out, mode="overwrite").begin_run(new_run("ingest"))
    assert len(first.read_committed()) == 6  # nothing of the first run was touched

    first.end_run("FINISHED")
    assert not os.path.exists(os.path.join(out, "_pyengine", "lock.json"))
    later = FileSink(out, mode="append")
    later.begin_run(new_run("other-job"))  # the directory is free again
    later.end_run("FINISHED")


def _plant_lock(out: str, **fields: Any) -> None:
    os.makedirs(os.path.join(out, "_pyengine"), exist_ok=True)
    body = {
        "run_id": "f" * 32,
        "job_name": "ghost",
        "lineage_id": "f" * 32,
        "host": "some-other-host",
        "pid": 1,
        "started_ms": int(time.time() * 1000),
        "heartbeat_ms": int(time.time() * 1000),
        "token": "t",
    }
    body.update(fields)
    with open(os.path.join(out, "_pyengine", "lock.json"), "w") as f:
        json.dump(body, f)


def test_stale_locks_are_taken_over_and_live_ones_refused(out) -> None:
    import socket

    _plant_lock(out, host=socket.gethostname(), pid=dead_pid())  # this host, process gone
    s = FileSink(out)
    run = new_run()
    s.begin_run(run)
    assert json.load(open(os.path.join(out, "_pyengine", "lock.json")))["run_id"] == run.run_id
    s.end_run("FINISHED")

    _plant_lock(out, heartbeat_ms=int(time.time() * 1000) - 61_000)  # another host, silent for a minute
    s = FileSink(out, mode="append")
    s.begin_run(new_run())
    s.end_run("FINISHED")

    _plant_lock(out)  # another host, beating: alive
    with pytest.raises(OutputInUseError, match=r"ghost.*some-other-host"):
        FileSink(out, mode="append").begin_run(new_run())


@pytest.mark.parametrize("stale", [False, True])
def test_runs_racing_for_one_directory_leave_exactly_one_writer(out, stale) -> None:
    import socket

    if stale:
        _plant_lock(out, host=socket.gethostname(), pid=dead_pid())
    contenders = [FileSink(out, mode="append") for _ in range(8)]
    start = threading.Barrier(len(contenders))
    won: List[FileSink] = []
    refused: List[BaseException] = []

    def take(sink: FileSink) -> None:
        start.wait()
        try:
            sink.begin_run(new_run())
            won.append(sink)
        except OutputInUseError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=take, args=(s,)) for s in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1 and len(refused) == len(contenders) - 1
    assert json.load(open(os.path.join(out, "_pyengine", "lock.json")))["run_id"][:12] == won[0].run_tag
    won[0].end_run("FINISHED")


def test_on_a_pyarrow_filesystem_the_lock_is_checked_then_written(monkeypatch) -> None:
    """memory:// (pyarrow's mock filesystem) has no exclusive create: the lock is
    checked, written and read back; the rest of the contract is the same."""
    out = f"memory://filesink-{uuid.uuid4().hex[:8]}/out"
    x = FileSink(out)
    rx = new_run("mem")
    x.begin_run(rx)
    x.recover(())
    kept = write(x, rx, [1, 2], "X")
    write(x, rx, [3], "X")
    with pytest.raises(OutputInUseError, match="mem"):
        FileSink(out, mode="append").begin_run(new_run())
    crash(x)  # same host, this process: stale once its run is gone
    y = FileSink(out)
    ry = new_run("mem", lineage=rx.run_id, restored=((rx.run_id, 2),))
    y.begin_run(ry)
    y.recover(ry.restored)
    kept += write(y, ry, [3], "Y")
    y.end_run("FINISHED")
    assert key(y.read_committed()) == key(kept)
    with pytest.raises(OutputInUseError, match="mem"):
        FileSink(out).begin_run(new_run("other"))


def test_heartbeat_refreshes_the_lock_and_stops_at_end_run(out, monkeypatch) -> None:
    monkeypatch.setattr(filesink, "HEARTBEAT_S", 0.02)
    s = FileSink(out)
    s.begin_run(new_run())
    path = os.path.join(out, "_pyengine", "lock.json")
    first = json.load(open(path))["heartbeat_ms"]
    deadline = time.time() + 5
    while json.load(open(path))["heartbeat_ms"] == first and time.time() < deadline:
        time.sleep(0.01)
    assert json.load(open(path))["heartbeat_ms"] > first
    s.end_run("CANCELED")
    assert not os.path.exists(path)
    assert not any(t.name == "pyengine-filesink-heartbeat" and t.is_alive() for t in threading.enumerate())
    runs = json.load(open(os.path.join(out, "_pyengine", "runs.json")))["runs"]
    assert [r["status"] for r in runs.values()] == ["CANCELED"]


def test_pickled_after_begin_run_it_writes_run_tagged_parts_and_leaves_the_lock_to_the_driver(out) -> None:
    driver = FileSink(out, format="parquet")
    run = new_run()
    driver.begin_run(run)
    driver.recover(())
    executor = pickle.loads(pickle.dumps(driver))  # what a Spark executor gets
    assert executor._heartbeat is None and executor._token is None
    executor.open(0)
    executor.stage(0, 1, [{"a": 1}])
    executor.commit(0, 1)
    names = [os.path.basename(p) for p in driver.committed_files()]
    assert names == [f"part-{run_tag(run.run_id)}-0-1-0.parquet"] and run_tag(run.run_id) == run.run_id[:12]
    executor.end_run("FINISHED")  # a copy holds no lock: the driver's stays
    assert os.path.exists(os.path.join(out, "_pyengine", "lock.json"))
    driver.end_run("FINISHED")
    assert not os.path.exists(os.path.join(out, "_pyengine", "lock.json"))
    assert driver.read_committed() == [{"a": 1}]


def test_a_zombie_attempts_late_piece_is_never_committed(out) -> None:
    """On Spark a failed attempt's task can outlive the restart: a piece it stages
    after the driver's ``recover`` must not be published by the new attempt's commit
    (its records are past the restored checkpoint, which the new attempt replays)."""
    driver = FileSink(out, format="parquet")
    run = new_run()
    driver.begin_run(run)
    driver.recover(())
    zombie = pickle.loads(pickle.dumps(driver))
    zombie.open(0)
    zombie.stage(0, 1, [{"who": "zombie", "chk": 1}])
    driver.recover(())  # the restart: nothing completed, so nothing is covered
    fresh = pickle.loads(pickle.dumps(driver))
    fresh.open(0)
    zombie.stage(0, 2, [{"who": "zombie", "chk": 2}])  # late, after recover
    fresh.stage(0, 3, [{"who": "fresh", "chk": 3}])
    fresh.commit(0, 3)
    assert driver.read_committed() == [{"who": "fresh", "chk": 3}]
    driver.recover(((run.run_id, 3),))  # the next restart clears what the zombie left
    assert driver.read_committed() == [{"who": "fresh", "chk": 3}]
    assert not [n for n in os.listdir(os.path.join(out, "_staging")) if n.startswith("part-")]
    driver.end_run("FINISHED")


def test_temp_names_are_unique_per_writer(out, monkeypatch) -> None:
    """Two writers staging the same piece name never share a temp file."""
    s = FileSink(out)
    s.begin_run(new_run())
    twin = pickle.loads(pickle.dumps(s))  # same run, same sequence numbers: the same staged name
    temps: List[str] = []
    real = FileSink._fs

    class Spy:
        def __init__(self, fs: Any) -> None:
            self.fs = fs

        def __getattr__(self, name: str) -> Any:
            return getattr(self.fs, name)

        def open_output_stream(self, path: str, *args: Any, **kwargs: Any) -> Any:
            temps.append(path)
            return self.fs.open_output_stream(path, *args, **kwargs)

    def spied(self: FileSink) -> Tuple[Any, str]:
        fs, root = real(self)
        return Spy(fs), root

    monkeypatch.setattr(FileSink, "_fs", spied)
    s.stage(0, 1, [{"a": 1}])
    twin.stage(0, 1, [{"a": 1}])
    staged = [t for t in temps if "/_staging/" in t]
    assert len(staged) == 2 and staged[0] != staged[1]
    assert all(os.path.basename(t).startswith(f".part-{s.run_tag}-0-1-0.jsonl.") for t in staged)
    monkeypatch.undo()
    s.end_run("FAILED")


# -- records the sink cannot write as they are ---------------------------------------------------------------------


@pytest.mark.parametrize("format", ["parquet", "csv"])
def test_schema_is_the_union_of_the_records_fields(out, format) -> None:
    records = [{"a": 0}] + [{"a": i, "b": f"v{i}"} for i in range(1, 5000)]
    s = FileSink(out, format=format)
    s.begin_run(new_run())
    s.recover(())
    s.stage(0, 1, records)
    s.commit(0, 1)
    s.end_run("FINISHED")
    got = s.read_committed()
    assert len(got) == 5000
    values = [r["b"] for r in got]
    assert values[1:] == [f"v{i}" for i in range(1, 5000)] and values[0] in (None, "")
    if format == "parquet":
        assert pq.read_schema(s.committed_files()[0]).names == ["a", "b"]


def test_declared_schema_fits_records_and_refuses_what_does_not_fit(out) -> None:
    schema = pa.schema([("a", pa.int64()), ("b", pa.string()), ("c", pa.float64())])
    s = FileSink(out, format="parquet", schema=schema)
    s.begin_run(new_run())
    s.recover(())
    s.stage(0, 1, [{"a": 1}, {"a": 2, "b": "x", "c": 1}])  # missing nullable fields: null
    s.stage(0, 1, pa.table({"a": pa.array([3], pa.int32()), "b": ["y"]}))  # a table cast safely
    s.commit(0, 1)
    assert pq.read_schema(s.committed_files()[0]) == schema
    assert s.read_committed() == [
        {"a": 1, "b": None, "c": None},
        {"a": 2, "b": "x", "c": 1.0},
        {"a": 3, "b": "y", "c": None},
    ]
    cases = [
        ([{"a": 1, "d": 2}], "'d'"),  # a field the schema lacks
        ([{"a": "seven"}], "'a'"),  # a str in an integer field
        ([{"a": 1.5}], "'a'"),  # a float Arrow would truncate to 1
        ([{"a": 1, "b": 5}], "'b'"),
        ([{"a": 1, "b": b"raw"}], "'b'"),  # bytes Arrow would decode into the string column
        ([{"a": True}], "'a'"),
        ([{"a": 1, "c": True}], "'c'"),  # a bool Arrow would write as 1.0
        (pa.table({"a": [1], "z": [2]}), "'z'"),
        (pa.table({"a": ["7"]}), "'a'"),  # text a cast would parse
        (pa.table({"a": [1.5]}), "'a'"),  # an unsafe cast
    ]
    for records, field in cases:
        with pytest.raises(RecordRejectedError, match=field) as err:
            s.stage(0, 2, records)
        assert isinstance(err.value, NonRetryableError) and isinstance(err.value, ValueError)
    strict = FileSink(out + "-strict", format="csv", schema=pa.schema([pa.field("a", pa.int64(), nullable=False)]))
    strict.begin_run(new_run())
    with pytest.raises(RecordRejectedError, match=r"'a'.*missing"):
        strict.stage(0, 1, [{"a": 1}, {}])
    strict.end_run("FAILED")
    s.commit(0, 2)
    assert len(s.read_committed()) == 3  # nothing of the refused records was staged
    s.end_run("FAILED")


def test_declared_nested_and_time_fields_take_only_values_of_their_kind(out) -> None:
    import datetime

    schema = pa.schema(
        [("at", pa.timestamp("ms")), ("tags", pa.list_(pa.int64())), ("geo", pa.struct([("lat", pa.float64())]))]
    )
    s = FileSink(out, format="parquet", schema=schema)
    s.begin_run(new_run())
    at = datetime.datetime(2024, 1, 2, 3, 4, 5)
    s.stage(0, 1, [{"at": at, "tags": [1, 2], "geo": {"lat": 1.5}}])
    for bad, field in [
        ({"at": 1_700_000_000_000}, "'at'"),  # an int Arrow would read as a time since the epoch
        ({"tags": [1, 2.5]}, "'tags'"),
        ({"geo": {"lat": 1.0, "lon": 2.0}}, "'geo'.*'lon'"),  # a struct field Arrow would drop
    ]:
        with pytest.raises(RecordRejectedError, match=field):
            s.stage(0, 1, [bad])
    s.commit(0, 1)
    assert s.read_committed() == [{"at": at, "tags": [1, 2], "geo": {"lat": 1.5}}]
    s.end_run("FINISHED")


def test_inferred_columns_that_do_not_make_one_type_are_refused_naming_the_field(out) -> None:
    s = FileSink(out, format="parquet")
    s.begin_run(new_run())
    with pytest.raises(RecordRejectedError, match="'x'"):
        s.stage(0, 1, [{"x": 1}, {"x": "one"}])
    with pytest.raises(RecordRejectedError, match="among dict records"):
        s.stage(0, 1, [{"x": 1}, 5])
    s.end_run("FAILED")


@pytest.mark.parametrize(
    "bad, shown",
    [
        ({"v": math.nan}, "NaN"),
        ({"v": [1, math.inf]}, "NaN/Infinity"),
        ({"v": {1, 2}}, "set"),
        ({"v": b"raw"}, "bytes"),
        ({"v": object()}, "object"),
    ],
)
def test_jsonl_refuses_values_that_are_not_json(out, bad, shown) -> None:
    s = FileSink(out)
    s.begin_run(new_run())
    with pytest.raises(RecordRejectedError, match=shown) as err:
        s.stage(0, 1, [{"v": 1}, bad])
    assert isinstance(err.value, NonRetryableError)
    assert "['v']" in str(err.value)
    assert os.listdir(os.path.join(out, "_staging")) == []
    s.stage(0, 1, [{"v": 1.5, "w": [None, True, "s"]}])
    s.commit(0, 1)
    assert s.read_committed() == [{"v": 1.5, "w": [None, True, "s"]}]
    s.end_run("FINISHED")


def test_jsonl_writes_a_list_state_view_as_the_list_it_shows(out) -> None:
    from pyengine.state import ListStateDescriptor, create_keyed_backend

    backend = create_keyed_backend("heap", max_parallelism=8)
    amounts = backend.get_state(ListStateDescriptor("amounts"))
    backend.set_current_key("u")
    amounts.add_all([1, 2])
    s = FileSink(out)
    s.begin_run(new_run())
    s.stage(0, 1, [{"user": "u", "amounts": amounts.view()}])
    s.commit(0, 1)
    assert s.read_committed() == [{"user": "u", "amounts": [1, 2]}]
    with pytest.raises(RecordRejectedError, match=r"record\['nan'\] is NaN"):  # the culprit, not the view
        s.stage(0, 2, [{"amounts": amounts.view(), "nan": math.nan}])
    s.end_run("FINISHED")


def test_stage_before_begin_run_says_so(out) -> None:
    with pytest.raises(RuntimeError, match="begin_run"):
        FileSink(out).stage(0, 1, [{"a": 1}])


# -- CollectSink ---------------------------------------------------------------------------------------------------


def test_collect_sink_recover_commits_covered_pieces_of_the_run_and_drops_the_rest() -> None:
    c = CollectSink()
    run = new_run()
    c.begin_run(run)
    c.recover(())
    c.stage(0, 1, [1])
    c.stage(1, 1, [2])
    c.stage(0, 2, [3])
    c.stage(1, 3, [4])
    c.commit(0, 1)
    assert c.records == [1]
    # The restart restores checkpoint 2 of this run: 1 and 2 completed, 3 did not.
    c.recover([("another-run", 9), (run.run_id, 2)])
    assert c.records == [1, 2, 3]
    c.stage(0, 4, [5])
    c.recover([(run.run_id, 2)])  # restored the same checkpoint again: 4 is replayed
    c.stage(0, 4, [5])
    c.commit(0, 4)
    assert c.records == [1, 2, 3, 5]
    c.stage(1, 5, [6])
    c.recover(())  # a fresh start drops what is staged
    c.commit(1, 5)
    assert c.records == [1, 2, 3, 5]
