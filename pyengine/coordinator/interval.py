"""The checkpoint interval in use: fixed, or chosen from a recovery-time goal.

``CheckpointConfig(interval_ms="auto", max_recovery_s=30)`` hands the interval to
``RecoveryGoalPolicy``. The rule, and why:

A failure rewinds the job to its latest *completed* checkpoint. The worst moment to
fail is just before the next one completes: everything read since the completed one's
barrier, one interval plus one checkpoint duration of input, is read again. So::

    recovery(interval) = restore + (interval + duration) * replay_ratio

- ``restore``: the time from the restart to every task running again with its state.
  Measured when a restore happened (the coordinator times it: from ``restore_latest``
  or ``note_restored_from`` to the scheduler's restart, which waits for every task to
  have restored), and scaled to the state's size now: ``measured + (size - size_then)
  / bandwidth``. Before any restore it is estimated as the time the latest checkpoint
  took to *write* the state (its slowest subtask's synchronous plus asynchronous
  part): reading the Arrow/LZ4 files back into the backend is the same work in
  reverse, and it is what this job measured, on this storage, at this state's size,
  not a constant of ours. ``bandwidth`` is that checkpoint's size over that time.
- ``duration``: the checkpoints' end-to-end duration, the median of the last three
  (one slow checkpoint - a pause of the machine - does not stretch the interval for
  three). The first checkpoint of a run pays one-time costs (threads, imports, the
  storage's first files) and counts only until a second one completes; meanwhile
  the floor (below) is at most the interval it ran at.
- ``replay_ratio``: how long replaying a second of input takes. 1 unless measured:
  a job that reads as fast as it can (a backlog, a benchmark) replays at the pace it
  read. When the runner reports the records its sources read, the ratio is the input
  rate of the latest interval over the catch-up rate, which is only measured while the
  job is known to be catching up (after a restore, until its first checkpoint
  completes; while a source reports a backlog): a job reading a live source at a
  tenth of what it can process replays an interval in a tenth of it.

The interval is the *longest* one that keeps ``recovery`` within the goal: a
checkpoint's cost (its synchronous pause, the files written, the alignment) is paid
once per interval, so the longest interval that meets the goal costs least. The goal
is met with a margin (``HEADROOM``, 80% of it), because every estimate lags the state
by an interval: state that grows between two checkpoints restores slower than the
last one measured.

Two bounds override the goal:

- a floor of ``FLOOR_FACTOR`` (2) times the checkpoint's duration (and at least
  ``MIN_INTERVAL_MS``): checkpoints that run back to back would spend the job on
  checkpointing, and a shorter interval than the checkpoint's own duration does not
  shorten recovery anyway (a checkpoint cannot complete sooner than it takes). When
  the goal needs less than the floor, the floor is used and ``goal_met`` is False,
  with the reason, in the statistics;
- a ceiling of the goal itself (an interval longer than the goal can never meet it).

Changes are damped: a shorter interval is taken at once (safety first), a longer one
at most doubles per step, and a lengthening under 10% is ignored, so the interval does not
jitter with measurement noise. Before the first checkpoint completes nothing is
measured, and the interval is a quarter of the budget.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, List, Optional

__all__ = ["Estimate", "RecoveryGoalPolicy", "HEADROOM", "FLOOR_FACTOR", "MIN_INTERVAL_MS"]

HEADROOM = 0.8  # the share of max_recovery_s the estimate may use
FLOOR_FACTOR = 2.0  # the interval is at least this many checkpoint durations
MIN_INTERVAL_MS = 50  # and never shorter than this
DAMPING = 0.10  # changes smaller than this share are ignored
MAX_GROWTH = 2.0  # a longer interval grows at most this much per step


@dataclass
class Estimate:
    """Why the interval is what it is: the figures of the rule above (seconds, bytes)."""

    interval_ms: int
    max_recovery_s: float
    restore_s: float = 0.0
    restore_measured: bool = False
    replay_s: float = 0.0  # of one interval plus one checkpoint duration, at the ratio below
    replay_ratio: float = 1.0
    checkpoint_duration_ms: float = 0.0
    state_size: int = 0
    write_bytes_per_s: Optional[float] = None
    floor_ms: int = MIN_INTERVAL_MS
    goal_met: bool = True
    reason: str = "nothing measured yet: a quarter of the budget"

    @property
    def recovery_s(self) -> float:
        return self.restore_s + self.replay_s

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        out["recovery_s"] = self.recovery_s
        return out


@dataclass
class _Restore:
    seconds: float
    size: int


@dataclass
class RecoveryGoalPolicy:
    """Picks the checkpoint interval from measurements (see the module's docstring).

    Pure: the coordinator feeds it what it measured (``observe_*``) and asks
    ``decide()``; tests feed it made-up figures."""

    max_recovery_s: float
    headroom: float = HEADROOM
    floor_factor: float = FLOOR_FACTOR
    min_interval_ms: int = MIN_INTERVAL_MS
    _durations: Deque[float] = field(default_factory=lambda: deque(maxlen=3))
    _warmup: bool = False  # the only duration is a run's first checkpoint's
    _write_s: float = 0.0  # the latest checkpoint's slowest subtask write
    _size: int = 0
    _restore: Optional[_Restore] = None
    _input_rate: Optional[float] = None
    _catchup_rates: List[float] = field(default_factory=list)
    _current: Optional[int] = None

    @property
    def budget_s(self) -> float:
        return self.max_recovery_s * self.headroom

    def observe_checkpoint(
        self, duration_ms: float, full_size: int, slowest_write_ms: float = 0.0, *, first: bool = False
    ) -> None:
        """A completed checkpoint: its end-to-end duration, the full size of its state,
        and the slowest subtask's write (synchronous plus asynchronous part). ``first``:
        the first checkpoint of a run (or since a restore), which pays one-time costs."""
        if self._warmup:
            self._durations.clear()
        self._warmup = first and not self._durations
        self._durations.append(max(0.0, float(duration_ms)))
        self._size = max(0, int(full_size))
        self._write_s = max(0.0, float(slowest_write_ms)) / 1000

    def observe_restore(self, seconds: float, size: int) -> None:
        """A restore took ``seconds`` for state of ``size`` bytes."""
        self._restore = _Restore(max(0.0, float(seconds)), max(0, int(size)))

    def observe_input_rate(self, records_per_s: float) -> None:
        """The rate the sources read at over the latest interval."""
        self._input_rate = max(0.0, float(records_per_s))

    def observe_catchup_rate(self, records_per_s: float) -> None:
        """A rate measured while the job was catching up (after a restore, or while a
        source reported a backlog): what it can process, as opposed to what arrives."""
        if records_per_s > 0:
            self._catchup_rates.append(float(records_per_s))
            del self._catchup_rates[:-5]

    def _bandwidth(self) -> Optional[float]:
        return self._size / self._write_s if self._size > 0 and self._write_s > 0 else None

    def _restore_estimate(self) -> tuple[float, bool]:
        if self._restore is not None:
            bandwidth = self._bandwidth()
            grown = max(0, self._size - self._restore.size)
            extra = grown / bandwidth if bandwidth else 0.0
            return self._restore.seconds + extra, True
        return self._write_s, False

    def _replay_ratio(self) -> float:
        if self._input_rate is None or not self._catchup_rates:
            return 1.0
        capacity = max(self._catchup_rates)
        return min(1.0, max(0.01, self._input_rate / capacity))

    def decide(self) -> Estimate:
        """The interval to use now, and why."""
        budget = self.budget_s
        if not self._durations:
            wanted = max(self.min_interval_ms, int(budget * 1000 / 4))
            est = Estimate(wanted, self.max_recovery_s, floor_ms=self.min_interval_ms)
            est.replay_s = wanted / 1000
            return self._damped(est)
        duration = sorted(self._durations)[len(self._durations) // 2]
        restore, measured = self._restore_estimate()
        ratio = self._replay_ratio()
        # a first checkpoint's one-time costs say nothing of how long the next ones take:
        # until a second one completes, the floor is the interval it ran at
        if self._warmup:
            floor = max(self.min_interval_ms, min(self._current or 0, math.ceil(self.floor_factor * duration)))
        else:
            floor = max(self.min_interval_ms, math.ceil(self.floor_factor * duration))
        ceiling = max(floor, int(self.max_recovery_s * 1000))
        # restore + (interval + duration) * ratio <= budget
        room_s = (budget - restore) / ratio - duration / 1000
        wanted = int(room_s * 1000)
        goal_met = True
        if wanted < floor:
            goal_met = False
            why = (
                "the interval the run's first checkpoint ran at: its duration includes one-time costs"
                if self._warmup
                else f"{self.floor_factor:g} x the checkpoint's {duration:.0f} ms"
            )
            reason = (
                f"the goal needs an interval under {max(0, wanted)} ms, below the floor of {floor} ms ({why}"
                + (f"; restore estimated {restore:.2f} s" if restore else "")
                + "): the floor is used"
            )
            wanted = floor
        elif wanted > ceiling:
            wanted = ceiling
            reason = "the goal allows longer: the goal itself is the ceiling"
        else:
            reason = "the longest interval whose estimated recovery stays within the goal's budget"
        est = Estimate(
            wanted,
            self.max_recovery_s,
            restore_s=restore,
            restore_measured=measured,
            replay_ratio=ratio,
            checkpoint_duration_ms=duration,
            state_size=self._size,
            write_bytes_per_s=self._bandwidth(),
            floor_ms=floor,
            goal_met=goal_met,
            reason=reason,
        )
        return self._damped(est)

    def _damped(self, est: Estimate) -> Estimate:
        """Shorter at once, longer at most doubling, small changes ignored; the replay
        estimate is recomputed for the interval actually used."""
        wanted = est.interval_ms
        current = self._current
        if current is not None:
            if wanted > current:
                wanted = min(wanted, int(current * MAX_GROWTH))
                if wanted - current < DAMPING * current:
                    wanted = current
        wanted = max(wanted, est.floor_ms)
        self._current = wanted
        est.interval_ms = wanted
        est.replay_s = (wanted + est.checkpoint_duration_ms) / 1000 * est.replay_ratio
        return est
