"""The Spark runner's control plane over Arrow Flight, in one process."""

from __future__ import annotations

import threading
import time
from typing import Any, List

import pytest

from pyengine.coordinator import ExecutionAttempt, SubtaskMetrics, TaskStateSnapshot
from pyengine.runners.control import ControlClient, ControlServer, attempt_from_json, attempt_to_json
from pyengine.storage.handles import ByteStreamStateHandle, KeyGroupsStateHandle, StreamStateHandle
from pyengine.storage.metadata import SubtaskState

TOKEN = "driver-secret"
ME = ExecutionAttempt("v1", 1, 2)


class FakeCoordinator:
    def __init__(self) -> None:
        self.acks: List[Any] = []
        self.declines: List[Any] = []

    def receive_acknowledge_message(self, cid: int, attempt: Any, snapshot: Any, metrics: Any) -> None:
        self.acks.append((cid, attempt, snapshot, metrics))

    def receive_decline_message(self, cid: int, attempt: Any, cause: Any) -> None:
        self.declines.append((cid, attempt, str(cause)))


@pytest.fixture
def control():
    coordinator = FakeCoordinator()
    events: List[Any] = []
    server = ControlServer(
        coordinator,
        TOKEN,
        on_register=lambda a, loc: events.append(("register", a, loc)),
        on_drained=lambda a: events.append(("drained", a)),
        on_failed=lambda a, msg: events.append(("failed", a, msg)),
    )
    yield server, coordinator, events
    server.shutdown()


def test_attempts_round_trip() -> None:
    assert attempt_from_json(attempt_to_json(ME)) == ME


def test_a_task_registers_acknowledges_and_reports(control) -> None:
    server, coordinator, events = control
    client = ControlClient(server.location, TOKEN, ME)
    client.register("grpc://10.0.0.7:4242")
    keyed = KeyGroupsStateHandle(StreamStateHandle("/ckpt/chk-3/a", 120, "xxh3:00ff"), 64, 127)
    inline = ByteStreamStateHandle("op", b"\x00\x01", "xxh3:0102")
    snapshot = TaskStateSnapshot(operators={"counter": SubtaskState(keyed=[keyed], operator=[])})
    snapshot.operators["source"] = SubtaskState(keyed=[], operator=[])
    metrics = SubtaskMetrics(sync_duration_ms=1.5, async_duration_ms=20.0, unaligned=True, persisted_data=7)
    client.acknowledge(3, snapshot, metrics)
    client.decline(4, RuntimeError("disk full"))
    client.drained()
    client.failed("boom in map (subtask 1)")
    assert events == [
        ("register", ME, "grpc://10.0.0.7:4242"),
        ("drained", ME),
        ("failed", ME, "boom in map (subtask 1)"),
    ]
    cid, attempt, got, got_metrics = coordinator.acks[0]
    assert (cid, attempt) == (3, ME)
    assert got.operators["counter"].keyed == [keyed] and got.operators["source"].operator == []
    assert got_metrics == metrics
    assert coordinator.declines == [(4, ME, "disk full")]
    assert inline.to_json()["kind"] == "inline"
    client.close()


def test_commands_reach_the_polling_task_and_only_it(control) -> None:
    server, _, _ = control
    client = ControlClient(server.location, TOKEN, ME)
    other = ControlClient(server.location, TOKEN, ExecutionAttempt("v1", 0, 2))
    assert client.poll(wait_ms=10) == []
    got: List[Any] = []
    poller = threading.Thread(target=lambda: got.extend(client.poll(wait_ms=3000)))
    poller.start()
    time.sleep(0.05)
    started = time.monotonic()
    server.send(ME, {"cmd": "trigger", "checkpoint_id": 5, "timestamp": 99, "unaligned": False})
    poller.join(5)
    assert time.monotonic() - started < 1, "a long poll returns as soon as a command is queued"
    assert got == [{"cmd": "trigger", "checkpoint_id": 5, "timestamp": 99, "unaligned": False}]
    assert other.poll(wait_ms=10) == []
    server.send(ME, {"cmd": "complete", "checkpoint_id": 5})
    server.send(ME, {"cmd": "end"})
    assert client.poll() == [{"cmd": "complete", "checkpoint_id": 5}, {"cmd": "end"}]
    client.close()
    other.close()


def test_a_call_with_a_wrong_token_is_refused_before_the_coordinator_sees_it(control) -> None:
    server, coordinator, events = control
    intruder = ControlClient(server.location, "guessed", ME)
    with pytest.raises(PermissionError, match="token"):
        intruder.acknowledge(1, TaskStateSnapshot(), SubtaskMetrics())
    with pytest.raises(PermissionError, match="token"):
        intruder.register("grpc://evil:1")
    assert coordinator.acks == [] and events == []
    intruder.close()


def test_a_malformed_call_is_an_error_naming_it(control) -> None:
    import pyarrow.flight as flight

    from pyengine.runners.flight import call_options, first_call

    server, _, _ = control
    client = flight.FlightClient(server.location)
    options = call_options(TOKEN)
    with pytest.raises(flight.FlightServerError, match="bad 'ack' call: KeyError") as bad:
        # first_call: a refused connection a closed server left on this port is retried
        first_call(
            lambda: list(client.do_action(flight.Action("ack", b'{"attempt": {"vertex": "v0"}}'), options=options))
        )
    assert "Traceback" not in str(bad.value)
    with pytest.raises(flight.FlightServerError, match="bad 'ack' call: JSONDecodeError"):
        list(client.do_action(flight.Action("ack", b"not json"), options=options))
    with pytest.raises(flight.FlightServerError, match="not a JSON object"):
        list(client.do_action(flight.Action("ack", b"[1, 2]"), options=options))
    with pytest.raises(flight.FlightUnauthenticatedError):  # the token goes in the header, not the body
        list(client.do_action(flight.Action("ack", b'{"token": "driver-secret", "attempt": {}}')))
    client.close()


def test_the_driver_s_own_failure_reaches_the_task_named_without_a_traceback(control) -> None:
    server, coordinator, _ = control

    def broken(*args: Any) -> None:
        raise OSError("/secret/driver/path is full")

    coordinator.receive_decline_message = broken
    client = ControlClient(server.location, TOKEN, ME)
    import pyarrow.flight as flight

    with pytest.raises(flight.FlightServerError, match="the driver failed on a 'decline' call: OSError") as err:
        client.decline(3, None)
    assert "Traceback" not in str(err.value) and "control.py" not in str(err.value)
    client.close()


def test_a_control_message_over_the_limit_is_refused_before_it_is_parsed() -> None:
    coordinator = FakeCoordinator()
    server = ControlServer(
        coordinator,
        TOKEN,
        on_register=lambda a, loc: None,
        on_drained=lambda a: None,
        on_failed=lambda a, msg: None,
        max_message_bytes=4096,
    )
    client = ControlClient(server.location, TOKEN, ME)
    import pyarrow.flight as flight

    with pytest.raises(
        flight.FlightServerError, match=r"a 'failed' call of \d+ bytes \(the driver takes at most 4096\)"
    ):
        client.failed("x" * 5000)
    client.failed("short")  # and the next call is served
    client.close()
    server.shutdown()


def test_the_control_plane_over_tls_on_loopback() -> None:
    """Mutual TLS with the job's certificate: a task holding it gets through with its
    token; a plain client, or one holding another job's certificate, does not connect."""
    import pyarrow.flight as flight

    from pyengine.runners.flight import JobTls, call_options

    tls = JobTls.generate("job-1")
    assert "PRIVATE" not in repr(tls)
    coordinator = FakeCoordinator()
    events: List[Any] = []
    server = ControlServer(
        coordinator,
        TOKEN,
        on_register=lambda a, loc: events.append(("register", a, loc)),
        on_drained=lambda a: None,
        on_failed=lambda a, msg: None,
        tls=tls,
    )
    assert server.location.startswith("grpc+tls://127.0.0.1:")
    client = ControlClient(server.location, TOKEN, ME, tls=tls)
    client.register("grpc+tls://10.0.0.7:4242")
    server.send(ME, {"cmd": "end"})
    assert client.poll(wait_ms=1000) == [{"cmd": "end"}]
    assert events == [("register", ME, "grpc+tls://10.0.0.7:4242")]
    with pytest.raises(ValueError, match="speaks TLS"):
        ControlClient(server.location, TOKEN, ME)
    plain = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    other = JobTls.generate("job-2")
    stranger = flight.FlightClient(server.location, **other.client_options())
    for intruder in (plain, stranger):
        with pytest.raises(flight.FlightUnavailableError):
            list(intruder.do_action(flight.Action("register", b"{}"), options=call_options(TOKEN)))
        intruder.close()
    assert len(events) == 1
    client.close()
    server.shutdown()


def test_off_loopback_the_control_server_makes_the_job_s_certificate_and_speaks_only_tls() -> None:
    """Advertising a non-loopback host, the server listens on every interface over TLS
    with a certificate it made; tasks reach it with that certificate, whatever address
    they dial (they check the certificate's own name)."""
    import pyarrow.flight as flight

    server = ControlServer(
        FakeCoordinator(),
        TOKEN,
        on_register=lambda a, loc: None,
        on_drained=lambda a: None,
        on_failed=lambda a, m: None,
        host="driver.example",
    )
    try:
        assert server.tls is not None
        assert server.location == f"grpc+tls://driver.example:{server.port}"
        client = ControlClient(f"grpc+tls://127.0.0.1:{server.port}", TOKEN, ME, tls=server.tls)
        assert client.poll(wait_ms=10) == []
        client.close()
        plain = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
        with pytest.raises(flight.FlightUnavailableError):
            list(plain.do_action(flight.Action("poll", b"{}")))
        plain.close()
    finally:
        server.shutdown()
    plain_server = ControlServer(
        FakeCoordinator(),
        TOKEN,
        on_register=lambda a, loc: None,
        on_drained=lambda a: None,
        on_failed=lambda a, m: None,
        host="driver.example",
        plaintext=True,
    )
    assert plain_server.tls is None and plain_server.location.startswith("grpc://driver.example:")
    plain_server.shutdown()
