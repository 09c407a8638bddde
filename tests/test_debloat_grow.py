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
    MAX_BUFFER_BYTES,
    MAX_IN_FLIGHT_BYTES,
    MIN_IN_FLIGHT,
    ChannelDebloater,
    Plan,
    grow,
)
from pyengine.runtime.outputs import Output

# -- the growing rule -------------------------------------------------------------------------


def _grow(flow: float, rate: float = 0.0, target_ms: float = 1000, **kw: Any) -> Plan:
    args = {"size": 1024, "floor": 1024, "capacity": 8, "row_bytes": 24, "busy": False, **kw}
    return grow(flow, rate, target_ms, **args)


def test_a_throughput_bound_channel_doubles_up_to_twice_a_period() -> None:
    assert debloat_module.GROW_STEPS == 2
    assert _grow(200_000) == Plan(4096, 8)
    assert _grow(200_000, size=4096) == Plan(16_384, 8)
    # a floor that is no power of two (an Arrow source's slices): doublings of it
    assert _grow(200_000, size=5000, floor=5000).size == 20_000
    assert _grow(200_000, size=20_000, floor=5000).size == 80_000
    # only as far as the bounds: 200,000/s x 1 s / 2 buffers = 100,000 records a buffer
    assert _grow(200_000, size=80_000, floor=5000).size == 80_000
    assert _grow(200_000, size=40_000, floor=5000).size == 80_000  # one doubling fits, not two


def test_an_input_bound_channel_halves_back_to_its_floor() -> None:
    assert _grow(200_000, size=8192, input_bound=True).size == 4096
    assert _grow(200_000, size=1024, input_bound=True) == Plan(1024, 8)  # never under the floor
    # nothing flows (a consumer that waited and took nothing): back to the floor
    assert _grow(0.0, size=8192) == Plan(1024, 8)
    assert _grow(float("nan"), size=8192).size == 1024
    # a busy consumer not measured yet: held
    assert _grow(0.0, 0.0, size=8192, busy=True).size == 8192


def test_growing_keeps_two_buffers_within_the_latency_target() -> None:
    # the consumer is the bottleneck at 10,000 records/s, target 1 s: 10,000 records may
    # be in flight, so at most 5,000 per buffer (MIN_IN_FLIGHT of them)
    p = _grow(10_000, 10_000, size=4096, busy=True)
    assert p == Plan(4096, MIN_IN_FLIGHT)
    assert p.size * p.in_flight <= 10_000
    # a grown size past the budget (the consumer slowed) halves until it fits
    assert _grow(10_000, 10_000, size=32_768, busy=True) == Plan(4096, MIN_IN_FLIGHT)
    # the busy rate, averaged over a longer window, lags a consumer that sped up: it takes
    # at least what flowed through the channel lately (40,000/s: 20,000 a buffer)
    assert _grow(40_000, 10_000, size=4096, busy=True) == Plan(16_384, MIN_IN_FLIGHT)
    # the same consumer with a target of 5 ms: not even two configured buffers fit, nothing grows
    assert _grow(10_000, 10_000, 5, busy=True) == Plan(1024, 8)
    # a consumer that waited: the flow is its budget (it takes at least that much)
    assert _grow(4_000, 0.0, size=1024) == Plan(1024, 8)  # 2 x 2,048 > 4,000 in 1 s


def test_growing_keeps_to_the_byte_bounds() -> None:
    # wide rows: a buffer stays under MAX_BUFFER_BYTES, a channel under MAX_IN_FLIGHT_BYTES
    row = 1000
    size = 64
    for _ in range(20):
        p = _grow(10_000_000, size=size, floor=64, row_bytes=row)
        size = p.size
    assert size * row <= MAX_BUFFER_BYTES < 2 * size * row
    assert p.in_flight * p.size * row <= MAX_IN_FLIGHT_BYTES
    # Python records are reckoned at PY_RECORD_BYTES (256): 16,384 records a buffer at most
    size = 1024
    for _ in range(20):
        p = _grow(10_000_000, size=size, row_bytes=256)
        size = p.size
    assert p == Plan(16_384, 4)


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


def test_a_channel_grows_while_throughput_bound_and_gives_way_when_input_or_latency_bound() -> None:
    c = ChannelDebloater(1000, max_size=1024, capacity=8, can_grow=True)
    c._period_start = 0.0
    assert c._period_s == debloat_module.GROW_PERIOD_S  # short periods while it may still grow
    # 400,000 records/s in full buffers, the consumer waiting for data (the producer is
    # the bottleneck: its own per-buffer cost is what bigger buffers save): one doubling
    # a period, up to the byte bound of Python records (16,384), then long periods again
    now = 0.0
    for _ in range(8):
        now = _periods(c, records=int(400_000 * c._period_s), periods=1, queued=0, now=now)
    assert c.grown and c.size == 16_384
    assert c._period_s == debloat_module.PERIOD_S
    assert c.stats()["grown"] and c.stats()["buffer_size"] == 16_384
    # its buffers now leave part-filled on the buffer timeout (short of input): halved
    c.pushed(100)
    c.partial()
    now = _periods(c, records=0, periods=1, queued=0, now=now)
    assert c.size == 8192
    # a period in which nothing went through changes nothing
    now = _periods(c, records=0, periods=1, queued=0, now=now)
    assert c.size == 8192
    # the consumer is the bottleneck at 1,500 records/s: 1,500 may be in flight, under
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


def test_what_tells_a_channel_its_producer_is_short_of_input() -> None:
    gates = [CheckpointedInputGate(1, _Listener(), capacity=8)]
    out = Output(gates, 0, "forward", None, 128, 64, threading.Event(), debloat_target_ms=1000, grow=True)
    (c,) = out._debloat or []
    c.size, c.grown = 256, True
    out.emit(list(range(10)))
    out.flush()  # a barrier's or the end's flush: says nothing
    assert c._partial == 0
    out.emit(list(range(10)))
    out.flush(timed_out=True)  # under the configured 64 at the timeout: short of input
    assert c._partial == 1
    out.emit(list(range(100)))
    out.flush(timed_out=True)  # 100 of a grown 256: the timeout's clock, not a want of input
    assert c._partial == 1
    out.short_read()  # the source read fewer rows than it asked for
    assert c._partial == 2
    # an Output that may not grow counts nothing
    fixed = Output(gates, 0, "forward", None, 128, 64, threading.Event(), debloat_target_ms=1000)
    fixed.emit(list(range(10)))
    fixed.flush(timed_out=True)
    fixed.short_read()
    assert [d._partial for d in fixed._debloat or []] == [0]


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
