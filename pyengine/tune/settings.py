"""The settings ``pyengine tune`` searches, as one value: what a job's buffers and
checkpoints are set to, and how to write that back into a job."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["DEFAULT_SPACE", "Setting"]


@dataclass(frozen=True)
class Setting:
    """One point of the search: ``StreamEnvironment``'s ``buffer_size``,
    ``buffer_timeout_ms`` and ``channel_capacity``, and ``CheckpointConfig``'s
    ``interval_ms``, ``unaligned`` and ``aligned_timeout_ms``. The defaults are the
    engine's own defaults, so ``Setting()`` is what a job gets when nobody tuned it
    (``buffer_size=None``: the engine chooses per stream, 1,024 Python records per
    buffer and slices of about 256 KiB from a source of Arrow batches)."""

    buffer_size: Optional[int] = None
    buffer_timeout_ms: int = 100
    channel_capacity: int = 8
    interval_ms: int = 500
    unaligned: bool = False
    aligned_timeout_ms: int = 0

    def __post_init__(self) -> None:
        # aligned_timeout_ms only means something for unaligned checkpoints (CheckpointConfig
        # refuses it otherwise): normalise here so that one point has one spelling
        if not self.unaligned and self.aligned_timeout_ms:
            object.__setattr__(self, "aligned_timeout_ms", 0)

    def environment_kwargs(self) -> Dict[str, Optional[int]]:
        """The ``StreamEnvironment(...)`` arguments of this setting."""
        return {
            "buffer_size": self.buffer_size,
            "buffer_timeout_ms": self.buffer_timeout_ms,
            "channel_capacity": self.channel_capacity,
        }

    def checkpoint_kwargs(self) -> Dict[str, Any]:
        """The ``CheckpointConfig(...)`` arguments of this setting."""
        return {
            "interval_ms": self.interval_ms,
            "unaligned": self.unaligned,
            "aligned_timeout_ms": self.aligned_timeout_ms,
        }

    def with_(self, **changes: Any) -> Setting:
        return replace(self, **changes)

    @property
    def label(self) -> str:
        """A short name for tables, figures and benchmark rows."""
        mode = "unaligned" if self.unaligned else "aligned"
        if self.unaligned and self.aligned_timeout_ms:
            mode = f"aligned→unaligned@{self.aligned_timeout_ms}ms"
        buf = "auto" if self.buffer_size is None else self.buffer_size
        return (
            f"buf={buf} timeout={self.buffer_timeout_ms}ms cap={self.channel_capacity} "
            f"interval={self.interval_ms}ms {mode}"
        )

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
            f"    channel_capacity={self.channel_capacity},\n"
            f"    checkpointing=pe.CheckpointConfig({checkpoint}),\n"
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
    "channel_capacity": (2, 8, 32),
    "interval_ms": (200, 500, 1000, 2000),
    "unaligned": (False, True),
    "aligned_timeout_ms": (0, 50),
}


def check_space(space: Mapping[str, Sequence[Any]]) -> Dict[str, Tuple[Any, ...]]:
    """The space with each value checked once, before any job runs (a typo fails here,
    not after minutes of search)."""
    known = set(Setting.__dataclass_fields__)
    out: Dict[str, Tuple[Any, ...]] = {}
    for name, values in space.items():
        if name not in known:
            raise ValueError(f"tune: unknown setting {name!r}; the settings are {', '.join(sorted(known))}")
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
