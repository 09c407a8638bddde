"""The settings ``pyengine tune`` searches, as one value: what a job's buffers and
checkpoints are set to, and how to write that back into a job."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["DEFAULT_SPACE", "Setting"]


AUTO_TRIAL_INTERVAL_MS = 2000  # the longest interval a trial of interval_ms="auto" is planned for


@dataclass(frozen=True)
class Setting:
    """One point of the search: ``StreamEnvironment``'s ``buffer_size``,
    ``buffer_timeout_ms``, ``channel_capacity`` and adaptive buffers
    (``buffer_debloat``, ``buffer_debloat_target_ms``), and ``CheckpointConfig``'s
    ``interval_ms`` (a number, or ``"auto"``: chosen from ``max_recovery_s``),
    ``unaligned`` and ``aligned_timeout_ms``. The defaults are the engine's own
    defaults, so ``Setting()`` is what a job gets when nobody tuned it
    (``buffer_size=None``: the engine chooses per stream, 1,024 Python records per
    buffer and slices of about 256 KiB from a source of Arrow batches;
    ``channel_capacity=None``: 8 buffers a channel on threads, 2 in worker processes)."""

    buffer_size: Optional[int] = None
    buffer_timeout_ms: int = 100
    channel_capacity: Optional[int] = None
    interval_ms: Union[int, str] = 500
    unaligned: bool = False
    aligned_timeout_ms: int = 0
    buffer_debloat: bool = True
    buffer_debloat_target_ms: int = 1000
    max_recovery_s: Optional[float] = None  # the goal of interval_ms="auto" (None: the engine's default)

    def __post_init__(self) -> None:
        if self.interval_ms != "auto" and (isinstance(self.interval_ms, bool) or not isinstance(self.interval_ms, int)):
            raise TypeError(f"Setting.interval_ms must be an int or 'auto', got {self.interval_ms!r}")
        if self.interval_ms != "auto" and self.max_recovery_s is not None:
            object.__setattr__(self, "max_recovery_s", None)  # only auto has a goal: one spelling per point
        # aligned_timeout_ms only means something for unaligned checkpoints (CheckpointConfig
        # refuses it otherwise): normalise here so that one point has one spelling
        if not self.unaligned and self.aligned_timeout_ms:
            object.__setattr__(self, "aligned_timeout_ms", 0)

    def environment_kwargs(self) -> Dict[str, Any]:
        """The ``StreamEnvironment(...)`` arguments of this setting."""
        return {
            "buffer_size": self.buffer_size,
            "buffer_timeout_ms": self.buffer_timeout_ms,
            "channel_capacity": self.channel_capacity,
            "buffer_debloat": self.buffer_debloat,
            "buffer_debloat_target_ms": self.buffer_debloat_target_ms,
        }

    def checkpoint_kwargs(self) -> Dict[str, Any]:
        """The ``CheckpointConfig(...)`` arguments of this setting."""
        out: Dict[str, Any] = {
            "interval_ms": self.interval_ms,
            "unaligned": self.unaligned,
            "aligned_timeout_ms": self.aligned_timeout_ms,
        }
        if self.interval_ms == "auto" and self.max_recovery_s is not None:
            out["max_recovery_s"] = self.max_recovery_s
        return out

    @property
    def nominal_interval_ms(self) -> int:
        """The interval to plan a trial's length by: the number, or for ``"auto"`` the
        one the coordinator starts with (a quarter of the goal's budget, before it has
        measured anything), at most ``AUTO_TRIAL_INTERVAL_MS``: a long goal would
        otherwise make one trial last minutes (its checkpoints may then not complete
        within the trial, and it ranks as unmeasured)."""
        if self.interval_ms != "auto":
            return int(self.interval_ms)
        from ..coordinator.config import DEFAULT_MAX_RECOVERY_S
        from ..coordinator.interval import HEADROOM, MIN_INTERVAL_MS

        goal = self.max_recovery_s if self.max_recovery_s is not None else DEFAULT_MAX_RECOVERY_S
        return int(min(AUTO_TRIAL_INTERVAL_MS, max(MIN_INTERVAL_MS, goal * HEADROOM * 1000 / 4)))

    def with_(self, **changes: Any) -> Setting:
        return replace(self, **changes)

    @property
    def label(self) -> str:
        """A short name for tables, figures and benchmark rows."""
        mode = "unaligned" if self.unaligned else "aligned"
        if self.unaligned and self.aligned_timeout_ms:
            mode = f"aligned→unaligned@{self.aligned_timeout_ms}ms"
        buf = "auto" if self.buffer_size is None else self.buffer_size
        cap = "auto" if self.channel_capacity is None else self.channel_capacity
        interval = "auto" if self.interval_ms == "auto" else f"{self.interval_ms}ms"
        debloat = "" if self.buffer_debloat else " debloat=off"
        if self.buffer_debloat and self.buffer_debloat_target_ms != 1000:
            debloat = f" debloat={self.buffer_debloat_target_ms}ms"
        return f"buf={buf} timeout={self.buffer_timeout_ms}ms cap={cap} interval={interval} {mode}{debloat}"

    def snippet(self, parallelism: int = 1) -> str:
        """The setting as code to paste into a job."""
        checkpoint = ", ".join(f"{k}={v!r}" for k, v in self.checkpoint_kwargs().items() if k != "aligned_timeout_ms")
        if self.unaligned and self.aligned_timeout_ms:
            checkpoint += f", aligned_timeout_ms={self.aligned_timeout_ms}"
        return (
            "env = pe.StreamEnvironment(\n"
            f"    parallelism={parallelism},\n"
            + (f"    buffer_size={self.buffer_size},\n" if self.buffer_size is not None else "")
            + f"    buffer_timeout_ms={self.buffer_timeout_ms},\n"
            + (f"    channel_capacity={self.channel_capacity},\n" if self.channel_capacity is not None else "")
            + ("" if self.buffer_debloat else "    buffer_debloat=False,\n")
            + (
                f"    buffer_debloat_target_ms={self.buffer_debloat_target_ms},\n"
                if self.buffer_debloat and self.buffer_debloat_target_ms != 1000
                else ""
            )
            + f"    checkpointing=pe.CheckpointConfig({checkpoint}),\n"
            ")\n"
        )

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


# What the search may try for each setting. Buffer sizes start at 64 records: a buffer is a
# batch of records here (not Flink's bytes), and much smaller batches spend the time on the
# per-buffer overhead that Flink's 256-byte debloated buffers ran into (FLINK-33077).
DEFAULT_SPACE: Dict[str, Tuple[Any, ...]] = {
    "buffer_size": (None, 256, 1024, 4096, 16384),
    "buffer_timeout_ms": (1, 10, 100),
    # None ("auto", the default, so the search starts from what the job gets untuned): 8 on
    # threads (so 8, 2 and 32 there), 2 in worker processes (where 8 measured far slower)
    "channel_capacity": (None, 2, 32),
    # "auto": the coordinator picks the interval from max_recovery_s (tune's own goal when given)
    "interval_ms": (200, 500, 1000, 2000, "auto"),
    "unaligned": (False, True),
    "aligned_timeout_ms": (0, 50),
    # adaptive buffers on (the default) or off: one more short race, cheap
    "buffer_debloat": (True, False),
}


def check_space(space: Mapping[str, Sequence[Any]]) -> Dict[str, Tuple[Any, ...]]:
    """The space with each value checked once, before any job runs (a typo fails here,
    not after minutes of search)."""
    known = set(Setting.__dataclass_fields__)
    out: Dict[str, Tuple[Any, ...]] = {}
    for name, values in space.items():
        if name not in known:
            raise ValueError(f"tune: unknown setting {name!r}; the settings are {', '.join(sorted(known))}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise TypeError(
                f"tune: setting {name!r} takes the values to try as a tuple or list, got {values!r}: "
                f"write {{{name!r}: ({values!r},)}} to try that value alone"
            )
        values = tuple(values)
        if not values:
            raise ValueError(f"tune: setting {name!r} has no values to try")
        for v in values:
            Setting(**{name: v})  # type errors surface here
        out[name] = values
    return out


def grid(space: Dict[str, Sequence[Any]], base: Setting = Setting()) -> List[Setting]:
    """Every point of ``space`` (what the search avoids; tests compare against it)."""
    points = [base]
    for name, values in space.items():
        points = [p.with_(**{name: v}) for p in points for v in values]
    unique: Dict[Setting, None] = dict.fromkeys(points)
    return list(unique)
