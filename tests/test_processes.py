"""The process-parallel embedded runner (``executor="processes"``): the same results as
threads, exactly once across a worker killed with SIGKILL and a user exception,
savepoints that move between executors, and clear errors for what cannot go to a
worker process.

Failures are injected through a marker file (``FailOnce``): every worker has its own
copy of the job, so "fail once" must be decided where all of them and every attempt
see it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chaos import FlakyFiles

import pyengine as pe
from pyengine.errors import NonRetryableError
from pyengine.state import ValueStateDescriptor

COUNT = ValueStateDescriptor("count", 0, pa.int64())
N = 3000
RECORDS = [{"user": i % 13, "v": i} for i in range(N)]


def env(executor: str, **kwargs: Any) -> pe.StreamEnvironment:
    settings: Dict[str, Any] = dict(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10),
        buffer_size=64,
        buffer_timeout_ms=1,
        monitoring=None,
        executor=executor,
    )
    settings.update(kwargs)
    return pe.StreamEnvironment(**settings)


class Count(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "n": n, "v": value["v"]}


def expected_pairs(records: List[Any]) -> Counter:
    per_user = Counter(r["user"] for r in records)
    return Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})


def pairs(records: List[Any]) -> Counter:
    return Counter((r["user"], r["n"]) for r in records)


# -- the same results as threads -----------------------------------------------------------------


def keyed_state(e: pe.StreamEnvironment, sink: Any) -> None:
    e.from_collection(RECORDS).key_by("user").process(Count()).uid("counter").sink_to(sink)


def aggregate(e: pe.StreamEnvironment, sink: Any) -> None:
    e.from_collection(RECORDS).key_by("user").aggregate(pe.agg.count(), pe.agg.sum("v"), emit="final").sink_to(sink)


def window(e: pe.StreamEnvironment, sink: Any) -> None:
    rows = [{"k": i % 5, "ts": i * 3, "v": i} for i in range(N)]
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    stream = e.from_collection(rows).assign_timestamps_and_watermarks(strategy)
    stream.key_by("k").window(pe.windows.tumbling(100)).aggregate(pe.agg.count(), pe.agg.sum("v")).sink_to(sink)


class Enrich(pe.KeyedCoProcessFunction):
    """Both inputs' counts per key, reported by a timer at the end of input."""

    def open(self, ctx: pe.KeyedContext) -> None:
        self.left = ctx.get_state(pe.ValueStateDescriptor("left", 0))
        self.right = ctx.get_state(pe.ValueStateDescriptor("right", 0))

    def process_element1(self, value: Any, ctx: pe.KeyedContext) -> Any:
        self.left.update(self.left.value() + 1)
        ctx.timer_service().register_event_time_timer(1_000_000)

    def process_element2(self, value: Any, ctx: pe.KeyedContext) -> Any:
        self.right.update(self.right.value() + value["v"])
        ctx.timer_service().register_event_time_timer(1_000_000)

    def on_timer(self, timestamp: int, ctx: pe.KeyedContext) -> Any:
        yield (ctx.current_key, self.left.value(), self.right.value())


def two_inputs(e: pe.StreamEnvironment, sink: Any) -> None:
    left = e.from_collection(RECORDS).key_by("user")
    right = e.from_collection([{"user": i % 7, "v": i} for i in range(500)]).map(lambda r: r).key_by("user")
    left.connect(right).process(Enrich()).sink_to(sink)


JOBS = {"keyed-state": keyed_state, "aggregate": aggregate, "window": window, "two-inputs": two_inputs}


def _canonical(records: List[Any]) -> List[str]:
    return sorted(repr(sorted(r.items())) if isinstance(r, dict) else repr(r) for r in records)


@pytest.mark.parametrize("job", list(JOBS))
def test_the_same_records_as_the_threads_executor(job: str) -> None:
    results = {}
    for executor in ("threads", "processes"):
        e = env(executor)
        sink = pe.sinks.CollectSink()
        JOBS[job](e, sink)
        result = e.execute(f"same-{job}")
        assert result.status == "FINISHED", result.cause
        assert result.records == sink.records  # the driver's sink got the workers' records
        results[executor] = (_canonical(sink.records), result)
    assert results["processes"][0] == results["threads"][0]
    assert results["processes"][0], "the job produced nothing to compare"
    if job == "window":  # the workers' watermarks reached the driver
        stats = results["processes"][1].event_time
        assert stats is not None and stats.late_records_dropped == 0


def test_parallelism_one_and_a_discard_and_print_sink_report_on_the_driver(capsys) -> None:
    e = env("processes", parallelism=1, checkpointing=None)
    discard, printed = pe.sinks.DiscardSink(), pe.sinks.PrintSink(prefix="got ")
    s = e.from_collection(list(range(100)))
    s.map(lambda x: x * 2).sink_to(discard)
    s.filter(lambda x: x % 50 == 0).sink_to(printed)
    assert e.execute("discard").status == "FINISHED"
    assert discard.count == 100
    assert sorted(line for line in capsys.readouterr().out.splitlines() if line.startswith("got")) == [
        "got 0",
        "got 50",
    ]


# -- exactly once across failures -----------------------------------------------------------------


class FailOnce:
    """Fails the ``at``-th record a worker sees, once across all workers and attempts
    (the first to create ``marker`` fails): by raising, or by killing its own process
    with SIGKILL (the worker dies without a word, as out of memory would)."""

    def __init__(self, marker: str, at: int, how: str) -> None:
        self.marker, self.at, self.how = marker, at, how
        self.seen = 0

    def __call__(self, record: Any) -> Any:
        self.seen += 1
        if self.seen == self.at:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return record
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure")
        return record


def run_failing(tmp_path: Any, tag: str, how: str, at: int, backend: str = "heap", unaligned: bool = False) -> Any:
    e = env(
        "processes",
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / f"ckpt-{tag}"),
        state_backend=backend,
        restart_attempts=3,
        restart_delay_ms=0,
        channel_capacity=4,
    )
    sink = pe.sinks.FileSink(str(tmp_path / f"out-{tag}"))
    fail = FailOnce(str(tmp_path / f"fired-{tag}"), at, how)
    (
        e.from_collection(RECORDS)
        .map(lambda r: r)
        .key_by("user")
        .process(Count())
        .uid("counter")
        .map(fail)
        .rebalance()
        .map(lambda r: r)
        .sink_to(sink)
    )
    result = e.execute(f"failing-{tag}")
    assert os.path.exists(tmp_path / f"fired-{tag}"), f"{tag}: the failure was never injected"
    return result, sink.read_committed()


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_exactly_once_across_a_killed_worker_and_a_user_exception(tmp_path, how: str) -> None:
    result, committed = run_failing(tmp_path, how, how, at=N // 4)
    assert result.status == "FINISHED", result.cause
    assert result.restarts == 1
    assert pairs(committed) == expected_pairs(RECORDS)
    assert result.checkpoints.counts["restored"] >= 1 or result.latest_checkpoint is not None


@pytest.mark.slow
def test_soak_random_failures_stay_exactly_once(tmp_path) -> None:
    """The threads runner's soak (test_exactly_once), reduced: random failure points,
    both ways of failing, both backends, aligned and unaligned."""
    for seed in range(4):
        rng = random.Random(seed)
        how = ("kill", "raise")[seed % 2]
        backend = ("heap", "incremental")[(seed // 2) % 2]
        unaligned = rng.random() < 0.5
        at = rng.randint(1, N // 2)
        tag = f"soak-{seed}"
        result, committed = run_failing(tmp_path, tag, how, at, backend, unaligned)
        where = f"seed {seed} ({how} at {at}, {backend}, unaligned={unaligned})"
        assert result.status == "FINISHED", f"{where}: {result.cause}"
        assert pairs(committed) == expected_pairs(RECORDS), where


def _read_error_run(tmp_path, seed: int) -> None:
    """The soak's file-source fault on processes: the ``at``-th read a worker makes of
    the parquet files fails, once across workers and attempts (a marker file), and the
    restarted workers reopen the files at the checkpointed position; odd seeds also
    kill a worker at a record later on."""
    root = tmp_path / "in"
    root.mkdir()
    table = pa.Table.from_pylist(RECORDS)
    for k in range(3):  # 12 row groups, 6 for each of the 2 workers
        pq.write_table(table.slice(k * (N // 3), N // 3), str(root / f"part-{k}.parquet"), row_group_size=N // 12)
    rng = random.Random(500 + seed)
    at, unaligned = rng.randint(1, 6), rng.random() < 0.5
    backend = ("heap", "incremental")[seed % 2]
    tag = f"read-{seed}"
    files = FlakyFiles(str(tmp_path / f"read-failed-{tag}"), at)
    e = env(
        "processes",
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / f"ckpt-{tag}"),
        state_backend=backend,
        restart_attempts=3,
        restart_delay_ms=0,
        channel_capacity=4,
    )
    sink = pe.sinks.FileSink(str(tmp_path / f"out-{tag}"))
    stream = e.read_files(str(root), filesystem=files.filesystem()).map(lambda r: r)
    if seed % 2:
        stream = stream.map(FailOnce(str(tmp_path / f"fired-{tag}"), rng.randint(1, N // 4), "kill"))
    stream.key_by("user").process(Count()).uid("counter").rebalance().map(lambda r: r).sink_to(sink)
    files.arm()
    result = e.execute(f"read-errors-{tag}")
    where = f"seed {seed} (read #{at} fails, {backend}, unaligned={unaligned}, also a kill: {bool(seed % 2)})"
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    assert files.fired(), f"{where}: the read error was never injected"
    assert pairs(sink.read_committed()) == expected_pairs(RECORDS), where


def test_soak_transient_read_errors_in_a_file_source_stay_exactly_once(tmp_path) -> None:
    _read_error_run(tmp_path, 0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_soak_transient_read_errors_in_a_file_source_stay_exactly_once_more(tmp_path, seed: int) -> None:
    _read_error_run(tmp_path, seed)


class Refused(NonRetryableError, ValueError):
    pass


def _refuse(r: Any) -> Any:
    if r["v"] == 100:
        raise Refused(f"record {r['v']} refused")
    return r


def test_a_user_exception_reaches_the_driver_with_its_type_and_worker_traceback() -> None:
    e = env("processes", restart_attempts=3)
    e.from_collection(RECORDS).map(_refuse).sink_to(pe.sinks.CollectSink())
    result = e.execute_async("refused").wait(60, raise_failure=False)
    assert result.status == "FAILED"
    assert result.restarts == 0  # non-retryable: no restart
    cause = result.cause
    while cause is not None and not isinstance(cause, Refused):
        cause = cause.__cause__
    assert isinstance(cause, Refused), result.cause
    assert "record 100 refused" in str(cause)
    assert any("worker process" in note and "_refuse" in note for note in getattr(cause, "__notes__", []))


# -- savepoints across executors ------------------------------------------------------------------


def _slow(r: Any) -> Any:
    time.sleep(0.0003)
    return r


def counting_job(e: pe.StreamEnvironment, out: str, slow: bool) -> Any:
    sink = pe.sinks.FileSink(out)
    stream = e.from_collection(RECORDS)
    step = stream.map(_slow if slow else (lambda r: r)).uid("step")
    step.key_by("user").process(Count()).uid("counter").sink_to(sink)
    return sink


@pytest.mark.parametrize(("first", "second"), [("threads", "processes"), ("processes", "threads")])
def test_stop_with_savepoint_then_resume_on_the_other_executor(tmp_path, first: str, second: str) -> None:
    e = env(first, checkpoint_storage=str(tmp_path / "ckpt"), buffer_size=16)
    sink = counting_job(e, str(tmp_path / "out"), slow=True)
    client = e.execute_async("moving")
    time.sleep(0.3)
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"))
    stopped = client.wait(60)
    assert stopped.status == "FINISHED"
    assert len(sink.read_committed()) < N, "the job ended before the savepoint stopped it"
    e2 = env(second, parallelism=3)
    counting_job(e2, str(tmp_path / "out"), slow=False)
    resumed = e2.execute("moved", restore_from=savepoint)
    assert resumed.status == "FINISHED", resumed.cause
    assert pairs(sink.read_committed()) == expected_pairs(RECORDS)


# -- errors ------------------------------------------------------------------------------------------


def test_a_function_that_cannot_be_pickled_is_named_with_the_fix() -> None:
    lock = threading.Lock()

    def guarded(r: Any) -> Any:
        with lock:
            return r

    e = env("processes")
    e.from_collection(RECORDS).map(guarded).sink_to(pe.sinks.CollectSink())
    with pytest.raises(TypeError) as raised:
        e.execute("unpicklable")
    message = str(raised.value)
    assert "captured variable 'lock'" in message and "guarded" in message, message
    assert "executor='threads'" in message and "open()" in message


def test_too_many_workers_are_refused_naming_the_way_out() -> None:
    e = env("processes", parallelism=40, max_parallelism=128)
    e.from_collection(RECORDS).key_by("user").process(Count()).sink_to(pe.sinks.CollectSink())
    with pytest.raises(ValueError, match=r"worker processes.*lower parallelism"):
        e.execute("too-wide")


SCRIPT = """
import pyengine as pe
env = pe.StreamEnvironment(parallelism=2, executor="processes", monitoring=None)
sink = pe.sinks.CollectSink()
env.from_collection(list(range(1000))).map(lambda x: x + 1).sink_to(sink)
result = env.execute("script")
print("RESULT", result.status, len(sink.records), sum(sink.records))
"""


def test_a_script_without_a_main_guard_runs_its_job_once(tmp_path) -> None:
    """multiprocessing would run the script again in every worker (its main module);
    the runner's workers never import it, so there is exactly one job and one result."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines == [f"RESULT FINISHED 1000 {sum(range(1, 1001))}"], done.stdout + done.stderr


def test_worker_start_up_is_measured_and_quick() -> None:
    """Workers fork from a fork server that has pyengine imported: a warm start of a
    two-vertex job's two workers takes well under a second (a fresh interpreter
    each would take about a second apiece)."""
    e = env("processes", checkpointing=None)
    e.from_collection(RECORDS).key_by("user").process(Count()).sink_to(pe.sinks.CollectSink())
    e.execute("warm-up")
    times: List[Tuple[float, float]] = []
    for _ in range(2):
        e = env("processes", checkpointing=None)
        sink = pe.sinks.CollectSink()
        e.from_collection(RECORDS).key_by("user").process(Count()).sink_to(sink)
        job = e._runner("warm", None, "auto", "processes")
        began = time.monotonic()
        result = job.run()
        times.append((time.monotonic() - began, sum(job.worker_start_s)))
        assert result.status == "FINISHED" and len(sink.records) == N
    assert min(start for _, start in times) < 0.5, times


def test_monitoring_sees_every_worker_s_counters() -> None:
    e = env("processes", monitoring=pe.Monitoring(sample_interval_s=0.2, progress=False, announce=False))
    e.from_collection(RECORDS).key_by("user").process(Count()).sink_to(pe.sinks.DiscardSink())
    client = e.execute_async("monitored")
    assert client.monitoring_url is not None
    result = client.wait(60)
    assert result.status == "FINISHED"
    last = client._runner.monitor.history.latest
    by_vertex: Dict[str, int] = {}
    for (vertex, _), sample in last.subtasks.items():
        by_vertex[vertex] = by_vertex.get(vertex, 0) + sample.records_in
    assert by_vertex == {"v0": N, "v1": N}, by_vertex


class Unpickled:
    """A record that leaves a file named after the process that unpickles it."""

    def __init__(self, v: int, where: str) -> None:
        self.v, self.where = v, where

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        open(os.path.join(self.where, str(os.getpid())), "a").close()


def test_a_collections_records_go_only_to_the_worker_that_reads_them(tmp_path) -> None:
    """A collection is read by its source's first subtask alone: its records are sent to
    that worker, not to every worker of the job (two at parallelism 2 here)."""
    where = tmp_path / "unpickled"
    where.mkdir()
    e = env("processes")
    sink = pe.sinks.CollectSink()
    records = [Unpickled(i, str(where)) for i in range(500)]
    e.from_collection(records).map(lambda r: r.v).rebalance().map(lambda v: v).sink_to(sink)
    result = e.execute("collection-to-its-reader")
    assert result.status == "FINISHED"
    assert sorted(sink.records) == list(range(500))
    assert len(os.listdir(where)) == 1, os.listdir(where)  # one process unpickled them: the source's


def test_a_collection_source_without_its_records_refuses_to_be_read() -> None:
    from pyengine.runners import shipping

    source = shipping._collection_source(0, None)  # in a worker that was not sent the records
    assert source.read(1, 2, 0, 10) is None  # the other subtasks read nothing anyway
    with pytest.raises(RuntimeError, match="only to the worker process of the source's first subtask"):
        source.read(0, 2, 0, 10)


TRACEBACK_SCRIPT = """
import traceback
import pyengine as pe

def check(record):
    if record == 7:
        raise ValueError("seven")  # the line the traceback must show
    return record

if __name__ == "__main__":
    env = pe.StreamEnvironment(parallelism=2, executor="processes", restart_attempts=0)
    env.from_collection(list(range(20))).map(check).sink_to(pe.sinks.DiscardSink())
    result = env.execute_async("tb").wait(60, raise_failure=False)
    print("".join(traceback.format_exception(result.cause)))
"""


def test_a_worker_traceback_names_the_scripts_file_and_shows_its_line(tmp_path) -> None:
    """A function of the job's script travels by value (cloudpickle); cloudpickle 3.1
    names its code's file ``<dynamic-code>``, so a worker's traceback showed neither
    the file nor the line's source. The runner keeps the file: the workers are on the
    driver's machine."""
    script = tmp_path / "job.py"
    script.write_text(TRACEBACK_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f'File "{script}", line 7, in check' in done.stdout, done.stdout
    assert "# the line the traceback must show" in done.stdout
    assert "<dynamic-code>" not in done.stdout


# -- a worker per slot ------------------------------------------------------------------------


class Tallied:
    """A record that adds a line to a file named after each process that unpickles it."""

    def __init__(self, key: int, where: str) -> None:
        self.key, self.where = key, where

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        with open(os.path.join(self.where, str(os.getpid())), "a") as out:
            out.write("x\n")


class KeyOf(pe.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        yield (value.key, os.getpid())


def test_a_worker_runs_its_slot_and_pickles_only_what_crosses_slots(tmp_path) -> None:
    """Parallelism 2, three vertices (source, keyed function, sink): two worker
    processes, worker s running subtask s of each. The collection is read by the
    source's subtask 0, so its records are unpickled once, in worker 0 (the payload);
    of those, exactly the ones whose key belongs to subtask 1 are pickled again, to
    worker 1. With a worker per subtask every record crossed a process (three
    processes unpickled them, the keyed ones all N between them)."""
    from pyengine.state.keygroups import assign_to_key_group

    where = tmp_path / "unpickled"
    where.mkdir()
    e = env("processes", checkpointing=None)
    sink = pe.sinks.CollectSink()
    records = [Tallied(i % 50, str(where)) for i in range(600)]
    e.from_collection(records).key_by(lambda r: r.key).process(KeyOf()).sink_to(sink)
    result = e.execute("slots")
    assert result.status == "FINISHED"
    to_second = sum(1 for r in records if assign_to_key_group(r.key, 128) * 2 // 128 == 1)
    assert 0 < to_second < len(records)
    counts = sorted(len((where / name).read_text().splitlines()) for name in os.listdir(where))
    assert counts == sorted([len(records), to_second]), counts
    assert len({pid for _, pid in sink.records}) == 2  # the keyed subtasks: one in each worker
    assert sorted(k for k, _ in sink.records) == sorted(r.key for r in records)


def test_workers_are_pinned_when_they_fill_the_cores(monkeypatch) -> None:
    from pyengine.runners import processes

    monkeypatch.setattr(processes.os, "sched_getaffinity", lambda _: {3, 5}, raising=False)
    assert processes._cores_for(2) == [3, 5]
    assert processes._cores_for(4) == [3, 5, 3, 5]  # round the cores
    assert processes._cores_for(3) == [None] * 3  # one core would run two workers, the other one
    assert processes._cores_for(1) == [None]  # fewer workers than cores: other jobs may use the first

    def unsupported(_: int) -> Any:
        raise OSError("no affinity here")

    monkeypatch.setattr(processes.os, "sched_getaffinity", unsupported, raising=False)
    assert processes._cores_for(2) == [None, None]
    with pytest.raises(ValueError, match="pin_workers must be True or False"):
        processes.ProcessRunner(pin_workers="yes")  # type: ignore[arg-type]


class Affinity(pe.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        yield (os.getpid(), tuple(sorted(os.sched_getaffinity(0))))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
@pytest.mark.parametrize("pin", [True, False])
def test_a_pinned_worker_runs_all_its_threads_on_its_core(monkeypatch, pin: bool) -> None:
    """The driver picks the cores (here: both workers on the first core this process may
    use, whatever the machine); each worker pins itself before its threads start, so its
    tasks' threads inherit the core. ``pin_workers=False`` leaves them anywhere."""
    from pyengine.runners import processes

    first = min(os.sched_getaffinity(0))
    monkeypatch.setattr(processes, "_cores_for", lambda count: [first] * count)
    e = env("processes", checkpointing=None)
    sink = pe.sinks.CollectSink()
    e.from_collection(list(range(200))).key_by(lambda x: x % 7).process(Affinity()).sink_to(sink)
    result = e.execute("pinned", runner=processes.ProcessRunner(pin_workers=pin))
    assert result.status == "FINISHED"
    seen = set(sink.records)
    assert len({pid for pid, _ in seen}) == 2
    expected = (first,) if pin else tuple(sorted(os.sched_getaffinity(0)))
    assert {cores for _, cores in seen} == {expected}


def test_the_workers_own_defaults_only_where_the_job_left_them_to_the_engine() -> None:
    from pyengine.runners.processes import WORKER_BUFFER_SIZE, WORKER_CHANNEL_CAPACITY, worker_environment

    chosen = pe.StreamEnvironment(executor="processes")
    assert (chosen.buffer_size, chosen.channel_capacity) == (WORKER_BUFFER_SIZE, WORKER_CHANNEL_CAPACITY)
    assert worker_environment(chosen) is chosen  # what the environment says is what the workers get
    threads = pe.StreamEnvironment()  # run with runner="processes" later
    assert (threads.buffer_size, threads.channel_capacity) == (1024, 8)
    shipped = worker_environment(threads)
    assert (shipped.buffer_size, shipped.channel_capacity) == (WORKER_BUFFER_SIZE, WORKER_CHANNEL_CAPACITY)
    assert (threads.buffer_size, threads.channel_capacity) == (1024, 8)  # a copy went to the workers
    given = pe.StreamEnvironment(executor="processes", buffer_size=2048, channel_capacity=16)
    assert worker_environment(given) is given
    half = worker_environment(pe.StreamEnvironment(executor="processes", channel_capacity=16))
    assert (half.buffer_size, half.channel_capacity) == (WORKER_BUFFER_SIZE, 16)
    later = pe.StreamEnvironment()
    later.buffer_size, later.channel_capacity = 1024, 8  # set after construction, to the threads' values
    assert worker_environment(later) is later  # still the user's
    with pytest.raises(ValueError, match="channel_capacity"):
        pe.StreamEnvironment(channel_capacity=0)


def test_a_socket_channel_pickles_a_buffer_when_pushed_and_gives_back_records_when_overtaken() -> None:
    """Buffers wait in a socket channel's queue pickled (their records die at once); an
    unaligned barrier that overtakes them gets them back as the records they were, for
    the checkpoint, while events stay as they are."""
    from pyengine.runners.sockets import SocketChannel, _Pickled

    channel = SocketChannel.__new__(SocketChannel)  # the queue's side only: no socket, no sender thread
    channel.capacity, channel.error, channel._closed, channel._sending = 2, None, False, 0
    channel._queue, channel._cond = __import__("collections").deque(), threading.Condition()
    first, second = [{"k": 1}, {"k": 2}], [("a", 3)]
    assert channel.push(0, first) and channel.put(0, second, timeout=1)
    first.append({"k": 99})  # changed after it was emitted: what was sent stays as it was
    assert [type(item) for item in channel._queue] == [_Pickled, _Pickled]
    assert not channel.push(0, [{"k": 3}])  # full: backpressure, nothing pickled
    assert len(channel._queue) == 2
    barrier = object()
    overtaken = channel.push_overtaking(barrier)
    assert overtaken == [[{"k": 1}, {"k": 2}], [("a", 3)]]
    assert channel._queue[0] is barrier


CLASS_SCRIPT = """
from dataclasses import dataclass
import pyengine as pe

@dataclass
class Click:  # a record class of the script itself: it reaches the workers by value
    user: int
    n: int

def make(i):
    return Click(i % 7, i)

if __name__ == "__main__":
    for p, source in ((1, "generator"), (2, "generator"), (2, "collection")):
        env = pe.StreamEnvironment(parallelism=p, executor="processes", monitoring=None, restart_attempts=0)
        sink = pe.sinks.CollectSink()
        if source == "generator":
            stream = env.from_generator(make, 300)
        else:
            stream = env.from_collection([make(i) for i in range(300)])
        stream.rebalance().map(lambda c: Click(c.user, c.n + 1)).sink_to(sink)
        result = env.execute_async("clicks").wait(60, raise_failure=False)
        ok = all(type(c) is Click for c in sink.records) and sorted(c.n for c in sink.records) == list(range(1, 301))
        print("RESULT", p, source, result.status, ok, result.cause)
"""


def test_records_of_a_class_defined_in_the_script_cross_workers_and_reach_the_driver(tmp_path) -> None:
    """A class of the job's script reaches the workers by value (cloudpickle), but its
    records are pickled by reference after that: between workers and back to a
    ``CollectSink``. Before, such a record could leave no worker (``attribute lookup
    Click on __main__ failed``), at any parallelism; the driver's sink gets the script's
    own class."""
    script = tmp_path / "clicks.py"
    script.write_text(CLASS_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines == [
        "RESULT 1 generator FINISHED True None",
        "RESULT 2 generator FINISHED True None",
        "RESULT 2 collection FINISHED True None",
    ], done.stdout + done.stderr


class Locked:
    def __init__(self, i: int) -> None:
        self.i, self.lock = i, threading.Lock()


def test_records_that_cannot_be_pickled_fail_once_naming_the_cause_and_the_way_out() -> None:
    e = env("processes", checkpointing=None, restart_attempts=2)
    e.from_generator(Locked, 200).rebalance().map(lambda r: r.i).sink_to(pe.sinks.DiscardSink())
    result = e.execute_async("locked").wait(60, raise_failure=False)
    assert result.status == "FAILED" and result.restarts == 0  # the same records would fail again
    assert isinstance(result.cause, NonRetryableError)
    message = str(result.cause)
    assert "records going to another worker process cannot be pickled" in message and "Locked" in message
    assert "attribute 'lock'" in message, message  # down to the part that does not pickle
    assert "executor='threads'" in message


def test_more_workers_than_cores_is_warned_with_the_parallelism_that_fits(monkeypatch, caplog) -> None:
    from pyengine.runners import processes

    monkeypatch.setattr(processes.os, "sched_getaffinity", lambda _: {0}, raising=False)  # one usable core
    e = env("processes", checkpointing=None)
    e.from_collection(RECORDS).key_by("user").process(Count()).sink_to(pe.sinks.CollectSink())
    with caplog.at_level("WARNING", logger="pyengine.runners.processes"):
        assert e.execute("crowded").status == "FINISHED"
    warned = [r.getMessage() for r in caplog.records if "worker processes on 1 core" in r.getMessage()]
    assert len(warned) == 1 and "fastest at parallelism=1" in warned[0], caplog.text


@pytest.mark.parametrize("seed", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_soak_ints_then_floats_stay_exact_and_readable(tmp_path, seed: int) -> None:
    """The soak's column of whole numbers that later holds fractions (issue #37), on
    worker processes: keyed aggregates and the records into parquet directories that
    read back whole, exact across a killed worker (seed 0) and a user exception (1)."""
    from test_exactly_once import PRICED, check_priced

    rng = random.Random(100 + seed)
    how = ("kill", "raise")[seed % 2]
    backend = ("heap", "incremental")[seed % 2]
    unaligned = rng.random() < 0.5
    at = rng.randint(N // 8, N // 2)
    tag = f"priced-{seed}"
    e = env(
        "processes",
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / f"ckpt-{tag}"),
        state_backend=backend,
        restart_attempts=3,
        restart_delay_ms=0,
        channel_capacity=4,
    )
    totals = pe.sinks.FileSink(str(tmp_path / f"totals-{tag}"), format="parquet")
    rows = pe.sinks.FileSink(str(tmp_path / f"rows-{tag}"), format="parquet")
    priced = e.from_collection(PRICED).map(FailOnce(str(tmp_path / f"fired-{tag}"), at, how))
    aggs = (pe.agg.sum("price"), pe.agg.max("price"), pe.agg.min("price"), pe.agg.count())
    priced.key_by("user").aggregate(*aggs).uid("agg").sink_to(totals)
    priced.rebalance().map(lambda r: r).sink_to(rows)
    result = e.execute(f"priced-{tag}")
    where = f"seed {seed} ({how} at {at}, {backend}, unaligned={unaligned})"
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    assert os.path.exists(tmp_path / f"fired-{tag}"), f"{where}: the failure was never injected"
    check_priced(tmp_path, tag, where)
