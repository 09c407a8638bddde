"""``Monitoring``: where a job's monitoring server listens and who may read it.

Checked where it is made, as every setting is: a server that would listen beyond
this machine without a token fails at ``Monitoring(...)``, not when the job starts."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Optional

from ..errors import suggest_keywords

__all__ = ["MIN_TOKEN_LENGTH", "Monitoring", "is_loopback"]

# A token is a shared secret sent with every request: short ones are guessable.
MIN_TOKEN_LENGTH = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine: ``localhost`` or an address in
    127.0.0.0/8 or ::1. Anything else (a name, 0.0.0.0, a LAN address) may be
    reached from elsewhere and so needs a token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@suggest_keywords  # an unknown keyword says "did you mean"
@dataclass(frozen=True)
class Monitoring:
    """A job's monitoring server: Flink's REST paths, Prometheus ``/metrics`` and a
    dashboard at ``/``, served from the job's process (the driver under Spark).

    ``host``/``port``: where it listens; loopback and a free port by default.
    ``token``: required for any host but loopback; clients send it as
    ``Authorization: Bearer <token>`` (or ``?token=`` for a browser's first visit).
    ``history``: how many samples of throughput and watermark the dashboard and
    ``/jobs/:id/recent-progress`` keep (one per ``sample_interval_s``).
    ``progress``: a live progress line while ``execute`` runs, on a terminal only.
    ``announce``: print the server's address when the job starts.
    ``request_timeout_s``: the deadline of one request, from its connection to the
    last byte of its answer (a slow client is closed at it, so it holds a connection
    for this long at most, however it trickles its bytes)."""

    host: str = "127.0.0.1"
    port: int = 0
    token: Optional[str] = None
    history: int = 300
    sample_interval_s: float = 1.0
    progress: bool = True
    announce: bool = True
    request_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"Monitoring.host must be a host name or address, got {self.host!r}")
        if type(self.port) is not int or not 0 <= self.port <= 65535:
            raise ValueError(f"Monitoring.port must be an int in 0..65535 (0: any free port), got {self.port!r}")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < MIN_TOKEN_LENGTH):
            raise ValueError(f"Monitoring.token must be a string of at least {MIN_TOKEN_LENGTH} characters")
        if self.token is None and not is_loopback(self.host):
            raise ValueError(
                f"Monitoring(host={self.host!r}) would serve the job's monitoring beyond this machine: give it a "
                "token (Monitoring(host=..., token=secrets.token_urlsafe(32))), or keep the default loopback host"
            )
        if type(self.history) is not int or self.history < 1:
            raise ValueError(f"Monitoring.history must be an int >= 1, got {self.history!r}")
        if not isinstance(self.sample_interval_s, (int, float)) or not 0.05 <= self.sample_interval_s <= 60:
            raise ValueError(f"Monitoring.sample_interval_s must be in 0.05..60 s, got {self.sample_interval_s!r}")
        if (
            not isinstance(self.request_timeout_s, (int, float))
            or isinstance(self.request_timeout_s, bool)
            or not 0.05 <= self.request_timeout_s <= 600
        ):
            raise ValueError(f"Monitoring.request_timeout_s must be in 0.05..600 s, got {self.request_timeout_s!r}")
