"""The control plane of the Spark runner and the process runner: the driver's coordinator,
reached over Arrow Flight (by Spark tasks, or by the process runner's workers on loopback).

The driver runs a ``ControlServer`` beside its ``CheckpointCoordinator``. Each task
registers (its attempt and the address of its own ``ChannelServer``), then
long-polls for its commands — trigger a checkpoint, a checkpoint completed or
was aborted, end, cancel — and reports acknowledgements (its state handles and
metrics), declines, its end of input and its failure. Every call is a Flight
action with a JSON body. Nothing is ever unpickled: state handles travel as the
same JSON as in ``_metadata``.

The driver is the one process every task reaches, so it is guarded as the channel
servers are (``flight.py`` says how, and what must be reachable): the job's token
travels in a call header and is checked before the handler runs, so a call without
it never has its body copied or parsed; a body over ``max_message_bytes`` is refused
before it is parsed; a malformed one (bad JSON, JSON nested past Python's recursion
limit, missing fields) gets one plain sentence, never a traceback; off loopback the
server speaks mutual TLS with the job's certificate, which it makes when not given
one and exposes as ``ControlServer.tls`` for the tasks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import defaultdict, deque
from typing import Any, Callable, Deque, Dict, List, Optional

import pyarrow.flight as flight

from ..coordinator import ExecutionAttempt, SubtaskMetrics, TaskStateSnapshot
from ..coordinator.coordinator import CheckpointException
from ..io import CheckpointFailureReason
from ..storage.handles import handle_from_json
from ..storage.metadata import SubtaskState
from .flight import (
    MAX_CONTROL_MESSAGE_BYTES,
    MEMORY_TRIM,
    GuardedServer,
    JobTls,
    authenticated,
    call_options,
    connect,
    first_call,
)

__all__ = ["ControlClient", "ControlServer", "attempt_from_json", "attempt_to_json"]

log = logging.getLogger(__name__)

_CALLS = frozenset({"register", "poll", "ack", "decline", "drained", "failed"})


def attempt_to_json(attempt: ExecutionAttempt) -> Dict[str, Any]:
    return {"vertex": attempt.vertex, "subtask": attempt.subtask, "attempt": attempt.attempt}


def attempt_from_json(data: Dict[str, Any]) -> ExecutionAttempt:
    return ExecutionAttempt(str(data["vertex"]), int(data["subtask"]), int(data["attempt"]))


def _snapshot_to_json(snapshot: TaskStateSnapshot) -> Dict[str, Any]:
    return {
        uid: {"keyed": [h.to_json() for h in s.keyed], "operator": [h.to_json() for h in s.operator]}
        for uid, s in snapshot.operators.items()
    }


def _snapshot_from_json(data: Dict[str, Any], where: str) -> TaskStateSnapshot:
    return TaskStateSnapshot(
        operators={
            uid: SubtaskState(
                keyed=[handle_from_json(h, where=where) for h in s.get("keyed", [])],
                operator=[handle_from_json(h, where=where) for h in s.get("operator", [])],
            )
            for uid, s in data.items()
        }
    )


class ControlServer(GuardedServer):
    """The driver's end. ``coordinator`` receives acks and declines; the runner's
    callbacks hear of registrations, drained tasks and failures; ``send`` queues a
    command for a task.

    Advertised as ``host``: on loopback it speaks plain gRPC unless ``tls`` is given;
    on any other host it listens on every interface over mutual TLS, with ``tls`` or
    else a certificate it makes for this run (``self.tls``: every task needs it, with
    the token, to connect), unless ``plaintext=True`` says the network is trusted.
    Every executor must reach this host at ``self.port``."""

    # Set by the runner when the job is monitored: hears each task's counters.
    on_counters: Optional[Callable[[ExecutionAttempt, Any], None]] = None

    def __init__(
        self,
        coordinator: Any,
        token: str,
        *,
        on_register: Callable[[ExecutionAttempt, str], None],
        on_drained: Callable[[ExecutionAttempt], None],
        on_failed: Callable[[ExecutionAttempt, str], None],
        host: str = "127.0.0.1",
        port: int = 0,
        tls: Optional[JobTls] = None,
        plaintext: bool = False,
        max_message_bytes: int = MAX_CONTROL_MESSAGE_BYTES,
    ) -> None:
        super().__init__(token, host, port, tls=tls, plaintext=plaintext, make_tls=True, what="the control server")
        self.coordinator = coordinator
        self.max_message_bytes = max_message_bytes
        self._on_register = on_register
        self._on_drained = on_drained
        self._on_failed = on_failed
        self._commands: Dict[ExecutionAttempt, Deque[Dict[str, Any]]] = defaultdict(deque)
        self._cond = threading.Condition()
        self.serve_in_background("pyengine-control")

    def send(self, attempt: ExecutionAttempt, command: Dict[str, Any]) -> None:
        """Queues ``command`` for ``attempt``'s next poll (never blocks)."""
        with self._cond:
            self._commands[attempt].append(command)
            self._cond.notify_all()

    def forget(self, attempt: ExecutionAttempt) -> None:
        with self._cond:
            self._commands.pop(attempt, None)

    def do_action(self, context: Any, action: flight.Action) -> Any:
        authenticated(context)  # TokenCheck let it in: the body is the job's own task's
        kind = action.type[:40]
        if kind not in _CALLS:  # before the body is looked at
            raise flight.FlightServerError(f"pyengine: the control server has no call {kind!r}")
        size = action.body.size
        if size > self.max_message_bytes:  # refused before it is copied into Python or parsed
            MEMORY_TRIM.soon()  # gRPC received it whole: give that memory back once it is freed
            raise flight.FlightServerError(
                f"pyengine: a {kind!r} call of {size} bytes (the driver takes at most {self.max_message_bytes})"
            )
        try:
            body = json.loads(action.body.to_pybytes())
            if not isinstance(body, dict):
                raise TypeError("the body is not a JSON object")
            attempt = attempt_from_json(body["attempt"])
            result = self._dispatch(kind, attempt, body)
        except flight.FlightError:
            raise
        except RecursionError:
            raise flight.FlightServerError(f"pyengine: bad {kind!r} call: JSON nested too deeply") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise flight.FlightServerError(
                f"pyengine: bad {kind!r} call: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None
        except Exception as exc:  # the driver's own trouble: logged here, named there, no traceback sent
            log.exception("the control server failed on a %r call", kind)
            raise flight.FlightServerError(
                f"pyengine: the driver failed on a {kind!r} call: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None
        return [json.dumps(result).encode()] if result is not None else []

    def _dispatch(self, kind: str, attempt: ExecutionAttempt, body: Dict[str, Any]) -> Any:
        if kind == "register":
            self._on_register(attempt, str(body["location"]))
            return None
        if kind == "poll":
            if "counters" in body and self.on_counters is not None:  # the task's own: see monitoring.metrics
                self.on_counters(attempt, body["counters"])
            wait_s = min(max(float(body.get("wait_ms", 100)), 0.0), 5000.0) / 1000
            with self._cond:
                self._cond.wait_for(lambda: bool(self._commands.get(attempt)), wait_s)
                queued = self._commands.get(attempt)
                commands = list(queued) if queued else []
                if queued:
                    queued.clear()
            return commands
        if kind == "ack":
            snapshot = _snapshot_from_json(body["state"], where=f"the acknowledgement of {attempt}")
            metrics = SubtaskMetrics(**body.get("metrics", {}))
            self.coordinator.receive_acknowledge_message(int(body["checkpoint_id"]), attempt, snapshot, metrics)
            return None
        if kind == "decline":
            message = str(body.get("message", "declined"))
            cause: BaseException = RuntimeError(message)
            reason = body.get("reason")
            if isinstance(reason, str) and reason in CheckpointFailureReason.__members__:
                # The task's reason, as the embedded runner's coordinator gets it: one the
                # tolerable-failure budget ignores (an input that ended while aligning, a
                # cancellation barrier, a subsumed checkpoint) must not fail a Spark job.
                cause = CheckpointException(CheckpointFailureReason[reason])
            self.coordinator.receive_decline_message(int(body["checkpoint_id"]), attempt, cause)
            return None
        if kind == "drained":
            self._on_drained(attempt)
            return None
        if kind == "failed":
            self._on_failed(attempt, str(body.get("message", "task failed")))
            return None
        raise flight.FlightServerError(f"pyengine: the control server has no call {kind!r}")


class ControlClient:
    """A task's end: the same calls, with the job token in each call's header, over
    TLS with the job's certificate (``tls``) when the driver's location is ``grpc+tls``."""

    def __init__(self, location: str, token: str, attempt: ExecutionAttempt, tls: Optional[JobTls] = None) -> None:
        self.location = location
        self.attempt = attempt
        self._options = call_options(token)
        self._client = connect(location, tls)
        self._answered = False  # until the driver has answered once, a refused connection is retried

    def _call(self, kind: str, **body: Any) -> Any:
        body.update(attempt=attempt_to_json(self.attempt))
        try:
            action = flight.Action(kind, json.dumps(body).encode())

            def call() -> List[Any]:
                return list(self._client.do_action(action, options=self._options))

            results = call() if self._answered else first_call(call)
            self._answered = True
        except flight.FlightUnauthenticatedError as exc:
            raise PermissionError(f"the control endpoint {self.location} refused {kind!r}: {exc}") from None
        return json.loads(results[0].body.to_pybytes()) if results else None

    def register(self, channel_location: str) -> None:
        self._call("register", location=channel_location)

    def poll(self, wait_ms: int = 100, counters: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
        """Commands queued for this task, waiting up to ``wait_ms`` for the first;
        ``counters`` (the task's metrics, for the driver's monitoring) ride along."""
        if counters is None:
            return list(self._call("poll", wait_ms=wait_ms) or [])
        return list(self._call("poll", wait_ms=wait_ms, counters=counters) or [])

    def acknowledge(self, checkpoint_id: int, snapshot: TaskStateSnapshot, metrics: SubtaskMetrics) -> None:
        self._call(
            "ack",
            checkpoint_id=checkpoint_id,
            state=_snapshot_to_json(snapshot),
            metrics=dataclasses.asdict(metrics),
        )

    def decline(self, checkpoint_id: int, cause: Optional[BaseException]) -> None:
        reason = getattr(cause, "reason", None)
        self._call(
            "decline",
            checkpoint_id=checkpoint_id,
            message=str(cause) if cause is not None else "declined",
            reason=reason.name if isinstance(reason, CheckpointFailureReason) else None,
        )

    def drained(self) -> None:
        self._call("drained")

    def failed(self, message: str) -> None:
        self._call("failed", message=message)

    def close(self) -> None:
        self._client.close()
