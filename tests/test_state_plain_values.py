"""Values a checkpoint cannot hold, in state without a declared type (issue #37, item 9).

Such a state's values go through the safe serializer. A lock or a socket was taken by
``update()`` and failed only at the next checkpoint, after which the job restarted
``restart_attempts`` times on the same error. Now a value of a type the serializer
cannot encode is refused where it is written, naming the state and the type; one
hidden in a container (a write does not look inside) fails the checkpoint, and the
job fails at once in both cases (``StateSerializationError`` is non-retryable)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import pyengine as pe
from pyengine.errors import NonRetryableError, is_non_retryable
from pyengine.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateSerializationError,
    ValueStateDescriptor,
    create_keyed_backend,
)

LOCK = r"a value of type _thread\.lock cannot be checkpointed"


@pytest.mark.parametrize("backend_name", ["heap", "incremental"])
def test_a_lock_is_refused_at_the_write_naming_the_state_and_the_type(backend_name: str) -> None:
    backend = create_keyed_backend(backend_name, max_parallelism=8)
    backend.set_current_key("k")
    value = backend.get_state(ValueStateDescriptor("conn"))
    items = backend.get_state(ListStateDescriptor("held"))
    pages = backend.get_state(MapStateDescriptor("pages"))
    total = backend.get_state(ReducingStateDescriptor("total", lambda a, b: b))
    lock = threading.Lock()
    calls = [
        (lambda: value.update(lock), "value state 'conn'"),
        (lambda: items.add(lock), "list state 'held'"),
        (lambda: items.add_all([1, lock]), "list state 'held'"),
        (lambda: items.update([lock]), "list state 'held'"),
        (lambda: pages.put("a", lock), "map state 'pages' value"),
        (lambda: pages.put(lock, 1), "map state 'pages' key"),
        (lambda: pages.put_all({"a": lock}), "map state 'pages' value"),
        (lambda: total.add(lock), "reducing state 'total'"),
    ]
    for call, state in calls:
        with pytest.raises(StateSerializationError, match=f"{state}: {LOCK}.*serializer='pickle'") as err:
            call()
        assert isinstance(err.value, NonRetryableError)
    # nothing of them was stored
    assert value.value() is None and list(items.get()) == [] and pages.get("a") is None and total.get() is None
    # what the safe serializer takes still goes in, in C and in Python
    import datetime
    import decimal

    plain = [1, 2.5, "s", b"b", True, [1, {"a": (2, None)}], (1,), {"x": 1}, 2**70]
    plain += [datetime.datetime(2024, 1, 1), datetime.date(2024, 1, 1), decimal.Decimal("1.5")]
    for v in plain:
        value.update(v)
        assert value.value() == v
        items.add(v)
        pages.put("a", v)
    items.add_all(plain)
    pages.put_all({i: v for i, v in enumerate(plain)})
    assert list(items.get()) == plain + plain


def test_a_numpy_number_is_refused_with_the_conversion_to_make() -> None:
    """The safe serializer takes exact types: a np.float64 failed the checkpoint too."""
    backend = create_keyed_backend("heap", max_parallelism=8)
    backend.set_current_key(1)
    state = backend.get_state(ValueStateDescriptor("mean"))
    with pytest.raises(StateSerializationError, match=r"numpy\.float64 cannot be checkpointed.*float\(x\)"):
        state.update(np.float64(1.5))


def test_a_state_that_opted_in_to_pickle_takes_a_lock_object() -> None:
    backend = create_keyed_backend("heap", max_parallelism=8)
    backend.set_current_key(1)
    state = backend.get_state(ValueStateDescriptor("anything", serializer="pickle"))
    event = threading.Event()
    state.update(event)
    assert state.value() is event


class KeepsALock(pe.KeyedProcessFunction):
    def __init__(self, nested: bool) -> None:
        self.nested = nested

    def open(self, ctx: Any) -> None:
        self.conn = ctx.get_state(ValueStateDescriptor("conn"))

    def process_element(self, value: Any, ctx: Any) -> Any:
        lock = threading.Lock()
        self.conn.update({"lock": lock} if self.nested else lock)
        yield value


@pytest.mark.parametrize("executor", ["threads", "processes"])
@pytest.mark.parametrize("nested", [False, True], ids=["at-update", "in-a-dict-at-the-checkpoint"])
def test_a_job_with_a_lock_in_state_fails_at_once(executor: str, nested: bool) -> None:
    """It restarted three times, each failing on the next checkpoint the same way."""
    env = pe.StreamEnvironment(
        parallelism=1, executor=executor, restart_attempts=3, checkpointing=pe.CheckpointConfig(interval_ms=50)
    )
    env.from_generator(lambda i: {"k": i % 3}, count=100_000, rate_per_s=5_000).key_by("k").process(
        KeepsALock(nested)
    ).sink_to(pe.sinks.DiscardSink())
    with pytest.raises(pe.JobFailedError) as err:
        env.execute("lock-in-state")
    result = err.value.result
    assert result.status == "FAILED" and result.restarts == 0 and is_non_retryable(result.cause)
    message = str(err.value)
    assert "StateSerializationError" in message and "'conn'" in message and "_thread.lock" in message, message
    if not nested:
        assert "value state 'conn': a value of type _thread.lock cannot be checkpointed" in message
