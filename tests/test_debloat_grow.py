"""Adaptive buffers that grow (issue #40, ``pyengine.runtime.debloat.grow``): the
growing rule and its bounds (the latency target, bytes per buffer and per channel),
a channel fed synthetic measurements growing while it is not latency-bound and
giving way to the shrinking rule when it is, an ``Output`` cutting Python records at
the grown size and telling an Arrow source what to read, a ``FileSource`` whose slice
size changes mid-split giving the same rows, and a job: an explicit ``buffer_size``
never grows, the defaults do, and both deliver the same output."""

from __future__ import annotations

import threading
from typing import Any, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pyengine as pe
import pyengine.runtime.debloat as debloat_module
from pyengine.connectors.files import FileSource
from pyengine.io import CheckpointedInputGate
from pyengine.runtime.debloat import (
    GROW_FILL_MS,
    MAX_BUFFER_BYTES,
    MAX_IN_FLIGHT_BYTES,
    MIN_IN_FLIGHT,
    ChannelDebloater,
    Plan,
    grow,
)
from pyengine.runtime.outputs import Output

# -- the growing rule -------------------------------------------------------------------------


def test_a_fast_channel_grows_in_doublings_up_to_its_flow_of_the_fill_time() -> None:
    # 200,000 records/s: 20,000 in GROW_FILL_MS (100 ms); Arrow rows of 24 bytes
    assert GROW_FILL_MS == 100
    p = grow(200_000, 0.0, 1000, size=1024, floor=1024, capacity=8, row_bytes=24, busy=False)
    assert p == Plan(16_384, 8)  # the largest 1,024 * 2^k under 20,000
    # a floor that is no power of two (an Arrow source's slices): doublings of it
    assert grow(200_000, 0.0, 1000, size=5000, floor=5000, capacity=8, row_bytes=24, busy=False).size == 20_000


def test_growing_keeps_two_buffers_within_the_latency_target() -> None:
    # the consumer is the bottleneck at 10,000 records/s, target 1 s: 10,000 records may
    # be in flight, so at most 5,000 per buffer (MIN_IN_FLIGHT of them), whatever the flow
    p = grow(1_000_000, 10_000, 1000, size=1024, floor=1024, capacity=8, row_bytes=24, busy=True)
    assert p == Plan(4096, MIN_IN_FLIGHT)
    assert p.size * p.in_flight <= 10_000
    # the same flow with a target of 5 ms: not even two configured buffers fit, nothing grows
    assert grow(1_000_000, 10_000, 5, size=1024, floor=1024, capacity=8, row_bytes=24, busy=True) == Plan(1024, 8)


def test_growing_keeps_to_the_byte_bounds() -> None:
    # wide rows: a buffer stays under MAX_BUFFER_BYTES, a channel under MAX_IN_FLIGHT_BYTES
    row = 1000
    p = grow(10_000_000, 0.0, 1000, size=64, floor=64, capacity=8, row_bytes=row, busy=False)
    assert p.size * row <= MAX_BUFFER_BYTES and p.size > MAX_BUFFER_BYTES // row // 2
    assert p.in_flight * p.size * row <= MAX_IN_FLIGHT_BYTES
    # Python records are reckoned at PY_RECORD_BYTES: 16,384 records a buffer at most
    p = grow(10_000_000, 0.0, 1000, size=1024, floor=1024, capacity=8, row_bytes=256, busy=False)
    assert p == Plan(16_384, 4)


def test_a_grown_size_shrinks_back_with_some_hysteresis() -> None:
    # grown to 8,192: the flow drops so that the fill time holds 7,000 (over 3/4): kept
    assert grow(70_000, 0.0, 1000, size=8192, floor=1024, capacity=8, row_bytes=24, busy=False).size == 8192
    # 5,000 (under 3/4 of 8,192): halved to 4,096
    assert grow(50_000, 0.0, 1000, size=8192, floor=1024, capacity=8, row_bytes=24, busy=False).size == 4096
    # nothing flows: back to the floor
    assert grow(0.0, 0.0, 1000, size=8192, floor=1024, capacity=8, row_bytes=24, busy=False) == Plan(1024, 8)
    assert grow(float("nan"), 0.0, 1000, size=8192, floor=1024, capacity=8, row_bytes=24, busy=False).size == 1024


# -- one channel, fed synthetic measurements ---------------------------------------------------


def _periods(c: ChannelDebloater, *, records: int, periods: int, queued: int, now: float) -> float:
    """``periods`` periods of ``c``'s current length in which the consumer takes
    ``records`` records (in buffers of ``c.size``) with ``queued`` items at each look."""
    for _ in range(periods):
        taken = 0
        while taken < records:
            piece = min(c.size, records - taken)
            c.pushed(piece)
            taken += piece
        step = c._period_s / 4 * 1.001
        for _ in range(4):
            now += step
            c.observe(queued, now)
    return now


def test_a_channel_grows_while_its_consumer_keeps_up_and_shrinks_when_it_is_the_bottleneck() -> None:
    c = ChannelDebloater(1000, max_size=1024, capacity=8, can_grow=True)
    c._period_start = 0.0
    assert c._period_s == debloat_module.GROW_PERIOD_S  # short periods while it may still grow
    # 400,000 records/s, the consumer waiting for data: grows to 32,768 (40,000 in 100 ms)
    # over a few periods, then the periods are long again
    now = 0.0
    for _ in range(8):
        now = _periods(c, records=int(400_000 * c._period_s), periods=1, queued=0, now=now)
    assert c.grown and c.size == 16_384  # PY_RECORD_BYTES: 16,384 Python records at most
    assert c._period_s == debloat_module.PERIOD_S
    assert c.stats()["grown"] and c.stats()["buffer_size"] == 16_384
    # now the consumer is the bottleneck at 1,500 records/s: 1,500 may be in flight, under
    # two buffers of the configured 1,024: the shrinking rule takes over from growing
    now = _periods(c, records=150, periods=25, queued=3, now=now)
    assert not c.grown and c.shrunk and c.size < 1024 and c.in_flight == MIN_IN_FLIGHT
    assert c.size * c.in_flight <= 1_500 * 1.05


def test_a_channel_that_may_not_grow_never_does() -> None:
    c = ChannelDebloater(1000, max_size=1024, capacity=8)
    c._period_start = 0.0
    _periods(c, records=100_000, periods=30, queued=0, now=0.0)
    assert (c.size, c.grown) == (1024, False)


# -- the Output --------------------------------------------------------------------------------


class _Listener:
    def trigger_checkpoint_on_barrier(self, barrier: Any, metrics: Any) -> None:
        pass

    def abort_checkpoint_on_barrier(self, checkpoint_id: int, reason: Any) -> None:
        pass


def test_an_output_sends_python_records_in_grown_buffers_and_tells_the_source_what_to_read() -> None:
    gates = [CheckpointedInputGate(1, _Listener(), capacity=8) for _ in range(2)]
    out = Output(gates, 0, "hash", lambda r: r, 128, 64, threading.Event(), debloat_target_ms=1000, grow=True)
    assert out.read_rows() is None  # nothing grown yet: the task's own slice
    for c in out._debloat or []:
        c.size, c.grown = 256, True
    out.emit(list(range(1000)))
    sent: List[int] = []
    for gate in gates:
        while gate.queued(0):
            (item,) = [x for x in gate.poll_batch(1)]
            sent.append(len(item[1]) if isinstance(item, tuple) else len(item))
    assert sent and all(n >= 256 for n in sent), sent  # never the configured 64
    assert out.read_rows() == 512  # a hash exchange splits a read over both channels
    out.exchange = "forward"
    assert out.read_rows() == 256


# -- the file source -----------------------------------------------------------------------------


def test_a_file_source_whose_slice_size_changes_gives_the_same_rows(tmp_path) -> None:
    n = 50_000
    table = pa.table({"k": np.arange(n, dtype=np.int64), "v": np.arange(n, dtype=np.int64) * 3})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=20_000)
    source = FileSource(str(tmp_path / "t.parquet"))
    sizes = [1000, 4000, 4000, 16_000, 16_000, 2000, 65_536, 65_536]
    got, position, readers = [], 0, set()
    for size in sizes:
        batch = source.read(0, 1, position, size)
        if batch is None:
            break
        readers.add(id(source._readers[(0, 1)]))
        got.append(batch)
        position += batch.num_rows
    assert pa.Table.from_batches(got).equals(table)
    assert len(readers) == 1  # one reader throughout: never decoded again from the start


# -- a job ----------------------------------------------------------------------------------------


def _run(tmp_path, name: str, buffer_size: Any) -> Any:
    rng = np.random.default_rng(0)
    n = 400_000
    path = tmp_path / "in.parquet"
    if not path.exists():
        pq.write_table(
            pa.table({"user": rng.integers(0, 1000, n), "v": rng.integers(0, 10, n)}), path, row_group_size=100_000
        )
    env = pe.StreamEnvironment(parallelism=2, buffer_size=buffer_size, monitoring=None)
    sink = pe.sinks.CollectSink()
    env.read_files(str(path)).key_by("user").aggregate(pe.agg.count(), pe.agg.sum("v")).uid("agg").sink_to(sink)
    result = env.execute(name, resume="never")
    assert result.status == "FINISHED"
    return sink


@pytest.mark.parametrize("buffer_size", [None, 1024])
def test_a_job_delivers_the_same_output_grown_or_not(tmp_path, buffer_size: Any) -> None:
    sink = _run(tmp_path, f"grow-{buffer_size}", buffer_size)
    last = {}
    for r in sink.records:  # the aggregate's updates: the last one per key is its total
        last[r["user"]] = (r["count"], r["sum_v"])
    table = pq.read_table(tmp_path / "in.parquet").to_pandas()
    want = table.groupby("user")["v"].agg(["count", "sum"])
    assert last == {int(u): (int(c), int(s)) for u, (c, s) in want.iterrows()}


def test_an_explicit_buffer_size_is_a_ceiling_and_the_default_grows() -> None:
    env = pe.StreamEnvironment(parallelism=1, buffer_size=1024, monitoring=None)
    assert "buffer_size" not in env.engine_chosen  # the local runner passes grow=False then
    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    assert env.engine_chosen["buffer_size"] == 1024
