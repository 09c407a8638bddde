"""Channels over Arrow Flight (the Spark runner's data plane), in one process."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, List

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import pyengine.runners.flight as flight_module
from pyengine.io import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointedInputGate,
    CheckpointOptions,
    CheckpointType,
    EndOfPartition,
)
from pyengine.runners.flight import (
    ChannelServer,
    JobTls,
    RemoteChannel,
    call_options,
    decode_event,
    encode_event,
    first_call,
    listening_server,
    serve,
)
from pyengine.runtime.outputs import END_OF_DATA
from pyengine.testing import RecordingListener

TOKEN = "s3cr3t-job-token"


@pytest.fixture
def endpoint():
    listener = RecordingListener()
    gate = CheckpointedInputGate(2, listener, capacity=4)
    server, _ = serve(gate, TOKEN)
    yield gate, server, listener
    server.shutdown()


def drain(gate: Any, until_eop_on: int = 1, timeout: float = 10) -> List[Any]:
    out, ended = [], 0
    deadline = time.monotonic() + timeout
    while ended < until_eop_on:
        assert time.monotonic() < deadline, f"only {len(out)} items arrived"
        got = gate.next(timeout=0.1)
        if got is None:
            continue
        out.append(got)
        if isinstance(got[1], EndOfPartition):
            ended += 1
    return out


def test_events_round_trip_through_their_metadata_encoding() -> None:
    events = [
        CheckpointBarrier(7, 123, CheckpointOptions(unaligned=True)),
        CheckpointBarrier(8, 456, CheckpointOptions(CheckpointType.SAVEPOINT)),
        CancelCheckpointMarker(9),
        EndOfPartition(),
        END_OF_DATA,
    ]
    for e in events:
        assert decode_event(encode_event(e)) == e
    with pytest.raises(ValueError, match="corrupt"):
        decode_event(b"{not json")
    with pytest.raises(ValueError, match="corrupt"):
        decode_event(b"[" * 3000)
    with pytest.raises(ValueError, match="at most 4096"):
        decode_event(b" " * 5000)
    with pytest.raises(TypeError):
        encode_event("data")


def test_servers_alive_together_never_share_a_port() -> None:
    """gRPC binds port 0 with SO_REUSEPORT, and Linux may give it a port another such
    socket of the user holds: two servers on one port. Servers are given a port no
    socket holds; each answers at its own."""
    servers = [serve(CheckpointedInputGate(1, RecordingListener()), TOKEN)[0] for _ in range(16)]
    try:
        assert len({s.port for s in servers}) == len(servers)
        for server in servers[::5]:
            RemoteChannel(server.location, 0, TOKEN).close()  # its hello answered
    finally:
        for server in servers:
            server.shutdown()


class _SlowToReturn(flight_module.ChannelServer):
    """A server whose serve() is still busy after shutdown() has stopped it, as
    pyarrow's is while gRPC tears the server down."""

    def serve(self) -> None:
        super().serve()
        time.sleep(0.3)
        self.returned = True


def test_shutdown_returns_once_the_serving_thread_has() -> None:
    """A server made while another's serve() is still returning could lose its listener
    to that teardown and refuse every connection (1 in ~3,000 back to back; a CI run's
    channel refused for 30 s). shutdown() waits for the serving thread."""
    server = _SlowToReturn(CheckpointedInputGate(1, RecordingListener()), TOKEN)
    thread = server.serve_in_background("test-slow")
    server.shutdown()
    assert not thread.is_alive() and server.returned
    # serve() called on a thread of the caller's own is joined as well
    other = _SlowToReturn(CheckpointedInputGate(1, RecordingListener()), TOKEN)
    own = threading.Thread(target=other.serve, daemon=True)
    own.start()
    deadline = time.monotonic() + 5
    while other._serving is not own:  # serve() has begun (a shutdown before it could not know the thread)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    other.shutdown()
    assert not own.is_alive() and other.returned


_CTRL_C_AFTER_OVERLAPPING_SERVERS = """
import os, signal, sys, time
from pyengine.io import CheckpointedInputGate
from pyengine.runners.flight import serve
from pyengine.testing import RecordingListener

# Two servers whose serving overlaps, shut down in the order they started: with pyarrow's
# serve() the second restored the first one's C handler, long gone, and Ctrl-C was lost.
a, _ = serve(CheckpointedInputGate(1, RecordingListener()), "t" * 32)
b, _ = serve(CheckpointedInputGate(1, RecordingListener()), "t" * 32)
time.sleep(0.2)
a.shutdown()
b.shutdown()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    print("interrupted")
    sys.exit(0)
print("Ctrl-C was swallowed")
sys.exit(1)
"""


def test_ctrl_c_reaches_python_after_flight_servers_that_overlapped() -> None:
    """pyarrow's ``serve()`` installs a C SIGINT handler while it serves and puts back the
    one it found when it returns; servers of one process that overlap (a job's channel and
    control servers, a driver's runs) could leave a dead server's handler in place, and
    Ctrl-C in ``execute()`` did nothing. The serving thread waits without signals."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AFTER_OVERLAPPING_SERVERS], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "interrupted" in done.stdout, done.stdout + done.stderr


def test_servers_made_one_after_another_each_answer() -> None:
    """A smoke test of the case above, end to end: each of 300 servers made right after
    the last one's shutdown answers its port. (Without the join about 1 server in 3,000
    did not, so this alone would catch a regression only sometimes: the test above is
    the one that always does.)"""
    for _ in range(300):
        server, _thread = serve(CheckpointedInputGate(1, RecordingListener()), TOKEN)
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5):
                pass
            RemoteChannel(server.location, 0, TOKEN).close()  # its hello answered
        finally:
            server.shutdown()


def test_a_channel_delivers_rows_batches_and_events_in_order(endpoint) -> None:
    gate, server, listener = endpoint
    out = RemoteChannel(server.location, 0, TOKEN)
    batch_a = pa.record_batch({"k": [1, 2, 3]})
    batch_b = pa.record_batch({"name": ["x", "y"], "v": [1.5, 2.5]})  # another schema: a new stream
    items = [
        [{"user": 1, "n": 1}, {"user": 2, "n": 1}],
        batch_a,
        CheckpointBarrier(1, 5, CheckpointOptions()),
        batch_b,
        [("tuple", 1), None],
        END_OF_DATA,
        EndOfPartition(),
    ]
    for item in items:
        assert out.put(0, item, timeout=5)
    other = RemoteChannel(server.location, 1, TOKEN)
    other.put(1, CheckpointBarrier(1, 5, CheckpointOptions()), timeout=5)
    other.put(1, EndOfPartition(), timeout=5)
    got = [item for ch, item in drain(gate, until_eop_on=2) if ch == 0]
    assert got[0] == [{"user": 1, "n": 1}, {"user": 2, "n": 1}]
    assert got[1].equals(batch_a)
    assert got[2] == CheckpointBarrier(1, 5, CheckpointOptions())
    assert got[3].equals(batch_b)
    assert got[4] == [("tuple", 1), None]  # the safe serializer keeps tuples, and never runs code
    assert got[5] is END_OF_DATA
    assert isinstance(got[6], EndOfPartition)
    assert listener.triggered_ids == [1]
    out.close()
    other.close()


def test_a_stream_with_a_wrong_or_missing_token_is_refused(endpoint) -> None:
    gate, server, _ = endpoint
    client = flight.FlightClient(server.location)
    schema = pa.schema([("k", pa.int64())])
    descriptor = flight.FlightDescriptor.for_command(b'{"channel": 0}')
    for options in (call_options("guess"), None, flight.FlightCallOptions(headers=[(b"x-pyengine-token", b"")])):
        with pytest.raises(flight.FlightUnauthenticatedError, match="token"):
            writer, _ = first_call(lambda options=options: client.do_put(descriptor, schema, options=options))
            writer.write_batch(pa.record_batch({"k": [1]}))
            writer.close()
    with pytest.raises(flight.FlightUnauthenticatedError, match="token"):  # the old way: token in the command
        writer, _ = client.do_put(
            flight.FlightDescriptor.for_command(f'{{"token": "{TOKEN}", "channel": 0}}'.encode()), schema
        )
        writer.write_batch(pa.record_batch({"k": [1]}))
        writer.close()
    assert gate.queued(0) == 0
    with pytest.raises(PermissionError, match="token"):
        RemoteChannel(server.location, 0, "wrong")
    assert server.auth.refused == 5
    client.close()


def test_a_stream_naming_no_channel_or_a_channel_not_there_is_refused_plainly(endpoint) -> None:
    gate, server, _ = endpoint
    client = flight.FlightClient(server.location)
    schema = pa.schema([("k", pa.int64())])
    for command, message in (
        (b"garbage", "must name its channel"),
        (b'{"channel": "0"}', "must name its channel"),
        (b"[" * 200, "must name its channel"),
        (b'{"channel": 7}', "no channel 7"),
    ):
        with pytest.raises(flight.FlightServerError, match=message) as refused:
            # first_call: a refused connection left by a closed server on the same port
            # (a CI run saw one) is retried, as the engine's own clients do.
            writer, _ = first_call(
                lambda command=command: client.do_put(
                    flight.FlightDescriptor.for_command(command), schema, options=call_options(TOKEN)
                )
            )
            writer.write_batch(pa.record_batch({"k": [1]}))
            writer.close()
        assert "Traceback" not in str(refused.value)
    assert gate.queued(0) == 0
    client.close()


def test_a_large_batch_is_sent_in_slices_and_a_batch_over_the_gate_s_bound_is_refused() -> None:
    gate = CheckpointedInputGate(1, RecordingListener(), capacity=64)
    server = ChannelServer(gate, TOKEN, max_batch_bytes=64 * 1024)
    server.serve_in_background("test-flight")
    big = pa.record_batch({"i": list(range(20_000))})  # 160 KB
    out = RemoteChannel(server.location, 0, TOKEN, split_batch_bytes=32 * 1024)
    assert out.put(0, big, timeout=5) and out.flush(timeout=10)
    got: List[int] = []
    while len(got) < big.num_rows:
        item = gate.next(timeout=5)
        assert item is not None
        assert item[1].nbytes <= 32 * 1024
        got.extend(item[1].column(0).to_pylist())
    assert got == list(range(20_000))
    out.close()
    # a sender that does not split (a broken or hostile token holder) is refused, plainly
    unsplit = RemoteChannel(server.location, 0, TOKEN, split_batch_bytes=1 << 30)
    unsplit.put(0, big, timeout=5)
    unsplit.put(0, EndOfPartition(), timeout=5)  # ends the stream: the sender hears the server's verdict
    unsplit.flush(timeout=10)
    with pytest.raises(
        ConnectionError, match=r"a batch of \d+ bytes on channel 0 \(this gate takes at most 65536\)"
    ) as refused:
        unsplit.put(0, [1], timeout=5)
    assert "Traceback" not in str(refused.value.__cause__)
    unsplit.close()
    assert gate.queued(0) == 0
    server.shutdown()


def test_a_channel_over_tls_on_loopback_delivers_exactly_and_a_plain_client_is_refused() -> None:
    tls = JobTls.generate("job-1")
    gate = CheckpointedInputGate(1, RecordingListener(), capacity=64)
    server, _ = serve(gate, TOKEN, tls=tls)
    assert server.location.startswith("grpc+tls://127.0.0.1:")
    out = RemoteChannel(server.location, 0, TOKEN, tls=tls)
    batch = pa.record_batch({"k": [1, 2, 3], "s": ["a", "b", None]})
    for item in ([{"user": 1}, ("t", 2)], batch, CheckpointBarrier(4, 9, CheckpointOptions()), EndOfPartition()):
        assert out.put(0, item, timeout=5)
    got = [item for _, item in drain(gate)]
    assert got[0] == [{"user": 1}, ("t", 2)] and got[1].equals(batch)
    assert got[2] == CheckpointBarrier(4, 9, CheckpointOptions()) and isinstance(got[3], EndOfPartition)
    out.close()
    with pytest.raises(ValueError, match="speaks TLS"):
        RemoteChannel(server.location, 0, TOKEN)
    plain = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    stranger = flight.FlightClient(server.location, **JobTls.generate("job-2").client_options())
    for intruder in (plain, stranger):
        with pytest.raises(flight.FlightUnavailableError):
            list(intruder.do_action(flight.Action("hello", b""), options=call_options(TOKEN)))
        intruder.close()
    server.shutdown()


def test_off_loopback_a_channel_server_needs_the_job_s_certificate() -> None:
    gate = CheckpointedInputGate(1, RecordingListener(), capacity=8)
    with pytest.raises(ValueError, match="in clear"):
        ChannelServer(gate, TOKEN, "executor-3.example")
    tls = JobTls.generate()
    # listens on every interface; made as serve() makes one, again if it does not answer its
    # port (a CI run saw this one refuse 127.0.0.1 for its whole life: listening_server's case)
    server = listening_server(lambda: ChannelServer(gate, TOKEN, "executor-3.example", tls=tls))
    server.serve_in_background("test-flight")
    assert server.location == f"grpc+tls://executor-3.example:{server.port}"
    out = RemoteChannel(f"grpc+tls://127.0.0.1:{server.port}", 0, TOKEN, tls=tls)
    assert out.put(0, [1, 2], timeout=5)
    got = gate.next(timeout=5)
    assert got is not None and got[1] == [1, 2]
    out.close()
    server.shutdown()
    trusted = ChannelServer(gate, TOKEN, "executor-3.example", plaintext=True)
    assert trusted.tls is None and trusted.location.startswith("grpc://")
    trusted.shutdown()


def test_a_full_gate_holds_the_sender_back_and_loses_nothing(endpoint) -> None:
    gate, server, _ = endpoint
    out = RemoteChannel(server.location, 0, TOKEN, capacity=2)
    n = 300
    refused = 0

    def produce() -> None:
        nonlocal refused
        for i in range(n):
            while not out.push(0, [i]):
                refused += 1
                time.sleep(0.0005)
        out.put(0, EndOfPartition(), timeout=10)

    producer = threading.Thread(target=produce)
    producer.start()
    time.sleep(0.3)  # the consumer is slow to start: the ring fills, then the stream, then the queue
    assert gate.queued(0) == 4
    got = []
    for _, item in drain(gate):
        if isinstance(item, list):
            got.extend(item)
        time.sleep(0.0005)
    producer.join(10)
    assert got == list(range(n))
    assert refused > 0, "the sender was never held back"
    out.close()


def test_an_overtaking_barrier_jumps_the_send_queue_and_returns_what_it_passed(endpoint) -> None:
    gate, server, _ = endpoint
    out = RemoteChannel(server.location, 0, TOKEN, capacity=1000)
    # Nobody reads the gate: its ring (4) and the stream's buffers fill, then the queue.
    pad = "x" * 20_000
    sent = 0
    while out.queued(0) < 5:
        assert sent < 500, "the send queue never filled"
        out.put(0, [sent, pad], timeout=5)
        sent += 1
        time.sleep(0.001)
    overtaken = out.push_overtaking(CheckpointBarrier(3, 1, CheckpointOptions(unaligned=True)))
    assert [r[0] for r in overtaken] == list(range(sent - len(overtaken), sent)) and len(overtaken) >= 5
    out.put(0, EndOfPartition(), timeout=5)
    other = RemoteChannel(server.location, 1, TOKEN)  # the aligned gate waits for channel 1's barrier
    other.put(1, CheckpointBarrier(3, 1, CheckpointOptions(unaligned=True)), timeout=5)
    other.put(1, EndOfPartition(), timeout=5)
    items = [item for ch, item in drain(gate, until_eop_on=2, timeout=30) if ch == 0]
    barrier_at = next(i for i, x in enumerate(items) if isinstance(x, CheckpointBarrier))
    before = {x[0] for x in items[:barrier_at] if isinstance(x, list)}
    assert not before & {r[0] for r in overtaken}  # what it overtook came after it
    assert [x[0] for x in items if isinstance(x, list)] == list(range(sent))
    out.close()
    other.close()


@pytest.mark.parametrize("capacity", [1, 2, 3, 8])
def test_a_blocked_put_is_woken_at_every_capacity_and_flush_sees_everything_written(endpoint, capacity) -> None:
    """The sender wakes a waiting producer only once its queue is down to half: at no
    capacity may that leave the producer, or ``flush``, waiting for good."""
    gate, server, _ = endpoint
    out = RemoteChannel(server.location, 0, TOKEN, capacity=capacity)
    n = 200
    got: List[int] = []

    def consume() -> None:
        for _, item in drain(gate):
            if isinstance(item, pa.RecordBatch):
                got.extend(item.column(0).to_pylist())

    consumer = threading.Thread(target=consume)
    consumer.start()
    for i in range(n):
        assert out.put(0, pa.record_batch({"i": [i]}), timeout=10), f"put {i} waited 10 s at capacity {capacity}"
    assert out.flush(timeout=10) and out.queued(0) == 0
    out.put(0, EndOfPartition(), timeout=10)
    consumer.join(15)
    assert got == list(range(n))
    out.close()


def test_a_channel_waits_for_a_server_that_is_about_to_listen(monkeypatch) -> None:
    """A port refused at first (a server starting, or a closed server's connection
    still cached by gRPC) is retried; a port that never accepts is a clear error."""
    from pyengine.runners import flight as channels

    gate = CheckpointedInputGate(1, RecordingListener(), capacity=8)
    first = channels.ChannelServer(gate, TOKEN)
    port = first.port
    first.shutdown()  # the port is free now, and refuses
    late: List[Any] = []

    def start_late() -> None:
        time.sleep(0.3)
        late.append(channels.ChannelServer(gate, TOKEN, port=port))
        late[0].serve_in_background("test-late")

    threading.Thread(target=start_late, daemon=True).start()
    out = RemoteChannel(f"grpc://127.0.0.1:{port}", 0, TOKEN)  # refused for 0.3 s, then connects
    assert out.put(0, pa.record_batch({"x": [1, 2, 3]}), timeout=5)
    got = gate.next(timeout=5)
    assert got is not None and got[1].num_rows == 3
    out.close()
    late[0].shutdown()

    monkeypatch.setattr(channels, "CONNECT_TIMEOUT_S", 0.3)
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}: no server there"):
        RemoteChannel(f"grpc://127.0.0.1:{port}", 0, TOKEN)


def _blocked_on_credit(gate: Any, server: Any) -> Any:
    """A channel whose sender waits for credit: the receiving gate is full and nobody
    takes from it, so the receiver stops reading and gives no credit back."""
    out = RemoteChannel(server.location, 0, TOKEN, capacity=2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # fill the gate, then the credits, then the send queue
        out.push(0, ["record"])  # refused while the queue is full
        if gate.queued(0) == 4 and out._uncredited >= flight_module.CREDITS and out.queued(0) == 2:
            return out
        time.sleep(0.01)
    raise AssertionError(f"the sender is not waiting for credit: {gate.queued(0)}, {out._uncredited}")


def test_closing_a_channel_whose_receiver_takes_nothing_returns(endpoint, monkeypatch) -> None:
    """The sender waits for credit from a receiver that never takes: close() gives up
    after CLOSE_WAIT_S instead of waiting with it (closing the writer from another thread
    would: Arrow drains the reads under the lock the pending read holds), and raises
    nothing, so a task's cleanup goes on to its other channels and its server."""
    gate, server, _ = endpoint
    monkeypatch.setattr(flight_module, "CLOSE_WAIT_S", 0.5)
    out = _blocked_on_credit(gate, server)
    started = time.monotonic()
    out.close()
    assert time.monotonic() - started < 5


def test_a_receiver_that_ends_the_stream_releases_a_sender_waiting_for_credit(endpoint) -> None:
    """The receiving task ends (its server shuts down) while the sender waits for credit:
    the sender fails with the receiver named, the task sees it at its next push, and
    close() raises nothing."""
    gate, server, _ = endpoint
    out = _blocked_on_credit(gate, server)
    server.shutdown()
    deadline = time.monotonic() + 10
    while out.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(out.error, ConnectionError) and "receiver ended the stream" in str(out.error), out.error
    with pytest.raises(ConnectionError, match="failed"):
        out.push(0, [1])
    out.close()


def test_a_server_that_refuses_its_own_port_when_started_is_replaced(monkeypatch, caplog) -> None:
    """CI runs saw a just-started loopback server refuse connections at the port it
    reported (once for a whole job's control server). A server is checked at its port
    when started and made again on a new one if it refuses; one that never answers is
    an error naming it, not a job that fails three restarts later."""
    gate = CheckpointedInputGate(1, RecordingListener(), capacity=4)
    real = ChannelServer.listening
    answers = iter([False])

    def flaky(self: Any, within_s: float = 1.0) -> bool:
        return next(answers, None) is not False and real(self, within_s)

    monkeypatch.setattr(ChannelServer, "listening", flaky)
    with caplog.at_level("WARNING", logger="pyengine.runners.flight"):
        server, _ = serve(gate, TOKEN)
    try:
        assert any("refused connections when started" in r.getMessage() for r in caplog.records)
        out = RemoteChannel(server.location, 0, TOKEN)
        out.put(0, [1, 2], timeout=5)
        out.put(0, EndOfPartition(), timeout=5)
        assert next(item for _, item in drain(gate)) == [1, 2]
        out.close()
    finally:
        server.shutdown()
    monkeypatch.setattr(ChannelServer, "listening", lambda self, within_s=1.0: False)
    with pytest.raises(ConnectionError, match="refused connections at every port"):
        serve(gate, TOKEN)
