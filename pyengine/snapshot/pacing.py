"""Keeps a checkpoint's asynchronous part from starving the task of the interpreter.

The asynchronous part runs on threads of the task's own process. What it does in C
with the interpreter released (Arrow's IPC writer, LZ4, NumPy) runs beside the task
on another core; what it does in Python (one serializer call per untyped value,
pyarrow converting Python lists) holds the interpreter, and the task, which needs it
for every record, waits. Left alone, CPython hands the interpreter over every 5 ms
to whichever thread asks, so two encoding threads took two thirds of it: the task
ran at 0.2-0.4x of its own speed while an asynchronous part ran (issue #43).

So the asynchronous part does its Python work in slices (``SLICE`` values at a time)
and, after each, calls ``pace()``: once a thread has held the interpreter for a
while, it sleeps (releasing it) long enough that its Python work takes at most
``share()`` of the wall time. The task keeps the rest. The price is a longer
asynchronous part, not a slower task: the bulk work in C is not paced.

Pacing applies only on threads marked ``paced()`` (a snapshot's ``run`` and the
encoding threads working for it); the same encoding called directly (a state-processing
tool) is not paced. ``PYENGINE_SNAPSHOT_SHARE`` sets the share (``1`` turns pacing
off). A pause begins with a 2 ms look at whether the task used the time it left (the
CPU time of the process's threads other than the paced ones): when it did not (the
task waits for input, or has finished and waits for this snapshot, or ``run`` was
called with no task running), the next slices run unpaused, so an idle process's
snapshot costs about what it did unpaced.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List

import pyarrow as pa

__all__ = ["SLICE", "is_paced", "pace", "paced", "released", "share", "sliced_binary"]

SLICE = 4096  # values encoded in Python between two calls to pace(): ~1-3 ms of work

# The share of wall time one pacing thread's Python work may take. Two threads encode
# (the writing thread and one pool thread on two cores), so the task keeps >= ~90%.
_DEFAULT_SHARE = 1.0  # off unless PYENGINE_SNAPSHOT_SHARE asks for it (0.05 is what the bench measures)
# Why off by default: whether "the task is busy" is judged by the CPU time of every
# thread of the process but the paced ones, so any other busy thread (a second job, a
# server, a library's pool) makes a snapshot throttle itself to its share. In one CI
# benchmark session a heap snapshot into memory:// fell to 0.20x of raw pyarrow.ipc
# throughput with pacing on, against 0.95x alone. Until the look measures the task
# threads themselves, pacing is an opt-in.
_MIN_BUSY = 0.002  # seconds of Python work before a pause: shorter pauses cost more in switches than they give
_PROBE = 0.002  # seconds of the first pause, which looks whether the task is busy
_IDLE = 0.1  # other threads busy less than this share of it: the task is idle
_IDLE_SLICES = 16  # slices run without pausing once the task was seen idle


def share() -> float:
    """The share of wall time a paced thread's Python work may take (0 < share <= 1)."""
    raw = os.environ.get("PYENGINE_SNAPSHOT_SHARE")
    if not raw:
        return _DEFAULT_SHARE
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"PYENGINE_SNAPSHOT_SHARE={raw!r}: give a share of wall time between 0 and 1 (1 turns pacing off)"
        ) from None
    if not 0 < value <= 1:
        raise ValueError(f"PYENGINE_SNAPSHOT_SHARE={raw!r}: give a share of wall time between 0 and 1 (1: no pacing)")
    return value


class _State(threading.local):
    def __init__(self) -> None:
        self.paced = False
        self.factor = 0.0  # seconds asleep per second of Python work
        self.mark = 0.0  # this thread's CPU time at the last pause
        self.unpaced = 0  # slices left to run without a pause: the task was idle at the last one


_state = _State()
# The CPU clocks of the threads paced now: their CPU time is not the task's.
_clocks: Dict[int, int] = {}
_clocks_lock = threading.Lock()


def _paced_threads_cpu() -> float:
    total = 0.0
    with _clocks_lock:
        clocks = list(_clocks.values())
    for clock in clocks:
        try:
            total += time.clock_gettime(clock)
        except OSError:  # a thread that has just ended
            pass
    return total


def is_paced() -> bool:
    """Whether this thread's Python work is paced (it works for an asynchronous part)."""
    return _state.paced


@contextmanager
def paced(on: bool = True) -> Iterator[None]:
    """Paces this thread's Python work inside the block (``on``), as an asynchronous
    part's; an encoding thread takes on the flag of the thread it works for."""
    state = _state
    before = state.paced
    state.paced = on
    ident = threading.get_ident()
    if on:
        fraction = share()
        state.factor = (1 - fraction) / fraction
        state.mark = time.thread_time()
        clock_of = getattr(time, "pthread_getcpuclockid", None)  # not on every platform
        if not before and clock_of is not None:
            with _clocks_lock:
                _clocks[ident] = clock_of(ident)
    try:
        yield
    finally:
        state.paced = before
        if on and not before:
            with _clocks_lock:
                _clocks.pop(ident, None)


def released() -> None:
    """After work that released the interpreter (pyarrow's IPC writer compressing a
    batch): that CPU time took nothing from the task, so it does not count."""
    _state.mark = time.thread_time()


def pace() -> None:
    """Between two slices of Python work: on a paced thread that has held the
    interpreter for ``_MIN_BUSY`` or more since its last pause, sleeps in proportion,
    so the task thread gets the interpreter. CPU time of this thread is the measure:
    time it spent waiting for the interpreter is not work it did."""
    state = _state
    if not state.paced or state.factor <= 0:
        return
    now = time.thread_time()
    busy = now - state.mark
    if busy < _MIN_BUSY:
        return
    if state.unpaced > 0:
        state.unpaced -= 1
        state.mark = now
        return
    # A first short pause, to see whether the task uses the interpreter at all: when
    # the other threads take little CPU meanwhile (the task waits for input, or has
    # finished and waits for this snapshot), pausing would only make the snapshot
    # longer; the next slices run on, and a later pause looks again.
    asleep = busy * state.factor
    probe = min(asleep, _PROBE)
    others = time.process_time() - _paced_threads_cpu()  # the task's and other threads' CPU so far
    time.sleep(probe)
    if time.process_time() - _paced_threads_cpu() - others < _IDLE * probe:
        state.unpaced = _IDLE_SLICES
    elif asleep > probe:
        time.sleep(asleep - probe)
    state.mark = time.thread_time()


def sliced_binary(values: List[Any], encode: Callable[[List[Any]], List[Any]]) -> pa.Array:
    """A binary column of ``values`` encoded by ``encode`` (Python work that holds
    the interpreter: a serializer call per value) in slices of ``SLICE`` values,
    pacing between them."""
    if len(values) <= SLICE:
        return pa.array(encode(values), pa.binary())
    chunks = []
    for start in range(0, len(values), SLICE):
        chunks.append(pa.array(encode(values[start : start + SLICE]), pa.binary()))
        pace()
    return pa.concat_arrays(chunks)
