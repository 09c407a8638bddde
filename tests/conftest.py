from __future__ import annotations

import os
from typing import Any, Callable, Iterable, List, Optional, Tuple

import pytest

from pyengine.io import CancelCheckpointMarker, CheckpointBarrier, CheckpointedInputGate, EndOfPartition
from pyengine.testing import ManualClock, RecordingListener

# -- the fast tier ----------------------------------------------------------------------------
# ``python -m pytest`` runs the fast tier: every test but the slow ones (marked ``slow``;
# ``spark`` and ``spark_cluster`` imply it): a few minutes, so a newcomer and every change
# learn quickly whether the checkout works. ``--full`` runs the whole suite, ``-m slow`` only
# what the fast tier leaves out (CI runs the fast tier, then ``-m slow``: together, the suite).
# Choosing tests yourself (``-m``, ``-k``, a file or a test id) runs what you chose, slow or not.

pytest_plugins = ("pytester",)  # tests/test_suite_tiers.py runs this file's tiers on a sample project

SLOW_ALSO = ("spark", "spark_cluster")
_LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="run the whole suite: the fast tier and the slow tests (soaks, Spark, the browser), as CI does",
    )


def _fast_tier(config: pytest.Config) -> bool:
    if config.getoption("--full") or config.getoption("markexpr") or config.getoption("keyword"):
        return False
    for arg in config.args:  # a file or a test id names tests; a directory (tests/) does not
        path = arg.split("::", 1)[0]
        if "::" in arg or not os.path.isdir(os.path.join(str(config.invocation_params.dir), path)):
            return False
    return True


@pytest.hookimpl(tryfirst=True)  # before -m is applied, so "-m slow" sees the implied markers
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    for item in items:
        if not item.get_closest_marker("slow") and any(item.get_closest_marker(m) for m in SLOW_ALSO):
            item.add_marker(pytest.mark.slow)
    if not _fast_tier(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
    config.stash[_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"fast tier: {left_out} slow tests (soaks, Spark, the browser) not run; "
            "`python -m pytest --full` runs the whole suite, `python -m pytest -m slow` only those"
        )


@pytest.fixture(params=["native", "reference"])
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def listener() -> RecordingListener:
    return RecordingListener()


@pytest.fixture
def make_gate(impl: str, listener: RecordingListener, clock: ManualClock) -> Callable[..., Any]:
    def make(num_channels: int, **kwargs: Any) -> Any:
        kwargs.setdefault("clock", clock)
        return CheckpointedInputGate(num_channels, listener, implementation=impl, **kwargs)

    return make


def barrier(checkpoint_id: int, timestamp: int = 1, **options: Any) -> CheckpointBarrier:
    from pyengine.io import CheckpointOptions

    return CheckpointBarrier(checkpoint_id, timestamp, CheckpointOptions(**options))


def cancel(checkpoint_id: int) -> CancelCheckpointMarker:
    return CancelCheckpointMarker(checkpoint_id)


def eop() -> EndOfPartition:
    return EndOfPartition()


def drain(gate: Any) -> List[Tuple[int, Any]]:
    out = []
    while (r := gate.poll_next()) is not None:
        out.append(r)
    return out


def feed(
    gate: Any, sequence: Iterable[Tuple[int, Any]], after: Optional[Callable[[], None]] = None
) -> List[Tuple[int, Any]]:
    """Push one event at a time and poll everything available after each push,
    the way Flink's mock input gate hands a fixed sequence to the handler."""
    out: List[Tuple[int, Any]] = []
    for channel, item in sequence:
        assert gate.push(channel, item)
        out.extend(drain(gate))
        if after is not None:
            after()
    return out
