"""A misspelt setting says what was meant (#38): an unknown keyword to
``StreamEnvironment``, ``CheckpointConfig``, ``Monitoring``, a sink or a source (a
user's own too) raises Python's TypeError with "did you mean ...", while the
signatures stay as written for editors and type checkers."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from typing import Any, Callable, List

import pytest

import pyengine as pe
from pyengine.connectors.base import Source
from pyengine.connectors.collection import CollectionSource, GeneratorSource
from pyengine.connectors.files import FileSource
from pyengine.errors import suggest_keywords
from pyengine.sinks import Sink

TYPOS: List[Any] = [
    (lambda: pe.StreamEnvironment(paralellism=2), "StreamEnvironment()", "paralellism", "parallelism"),
    (
        lambda: pe.StreamEnvironment(checkpoint_storag="x"),
        "StreamEnvironment()",
        "checkpoint_storag",
        "checkpoint_storage",
    ),
    (lambda: pe.CheckpointConfig(intervall_ms=100), "CheckpointConfig()", "intervall_ms", "interval_ms"),
    (lambda: pe.CheckpointConfig(unalligned=True), "CheckpointConfig()", "unalligned", "unaligned"),
    (lambda: pe.Monitoring(prot=8081), "Monitoring()", "prot", "port"),
    (lambda: pe.sinks.FileSink("out", fromat="csv"), "FileSink()", "fromat", "format"),
    (lambda: pe.sinks.PrintSink(prefx=">"), "PrintSink()", "prefx", "prefix"),
    (lambda: FileSource("in", colums=["a"]), "FileSource()", "colums", "columns"),
    (lambda: GeneratorSource(lambda i: i, 10, rate_per_sec=5), "GeneratorSource()", "rate_per_sec", "rate_per_s"),
    (
        lambda: pe.StreamEnvironment().from_collection([1], watermark_strategey=None),
        "StreamEnvironment.from_collection()",
        "watermark_strategey",
        "watermark_strategy",
    ),
    (
        lambda: pe.StreamEnvironment().read_files("in", monitor_interval=100),
        "StreamEnvironment.read_files()",
        "monitor_interval",
        "monitor_interval_ms",
    ),
    (
        lambda: pe.StreamEnvironment().from_generator(lambda i: i, cout=3),
        "StreamEnvironment.from_generator()",
        "cout",
        "count",
    ),
]


@pytest.mark.parametrize("make, call, typo, meant", TYPOS, ids=[t[2] for t in TYPOS])
def test_a_misspelt_keyword_says_what_was_meant(make: Callable[[], Any], call: str, typo: str, meant: str) -> None:
    with pytest.raises(TypeError) as err:
        make()
    # Python's own words first (code that matches them keeps working), then the hint
    assert str(err.value) == f"{call} got an unexpected keyword argument {typo!r}; did you mean {meant!r}?"


def test_a_keyword_nothing_resembles_lists_what_is_taken() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'; it takes host, port, token, history"):
        pe.Monitoring(zzz=1)
    with pytest.raises(TypeError, match=r"CollectSink\(\) got an unexpected keyword .*'x'; it takes no keyword"):
        pe.sinks.CollectSink(x=1)  # type: ignore[call-arg]


def test_a_users_own_sink_and_source_get_the_hint() -> None:
    class MySink(Sink):
        def __init__(self, table: str, batch_rows: int = 100) -> None:
            self.table, self.batch_rows = table, batch_rows

    class MySource(Source):
        def __init__(self, topic: str, *, partitions: int = 1) -> None:
            self.topic, self.partitions = topic, partitions

    with pytest.raises(TypeError, match=r"MySink\(\) got .* 'batch_row'; did you mean 'batch_rows'\?"):
        MySink("t", batch_row=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"MySource\(\) got .* 'partition'; did you mean 'partitions'\?"):
        MySource("t", partition=2)  # type: ignore[call-arg]
    assert MySink("t", batch_rows=5).batch_rows == 5 and MySource(topic="t", partitions=3).partitions == 3


def test_right_calls_and_other_errors_are_untouched() -> None:
    env = pe.StreamEnvironment(2, checkpointing=pe.CheckpointConfig(interval_ms=50))
    assert env.parallelism == 2 and env.checkpointing is not None and env.checkpointing.interval_ms == 50
    # a TypeError of a known keyword's value keeps its own message
    with pytest.raises(TypeError, match=r"^CheckpointConfig.retained must be an int, got 'x'$"):
        pe.CheckpointConfig(retained="x")  # type: ignore[arg-type]
    # too many positional arguments: Python's error, as before
    with pytest.raises(TypeError, match="positional"):
        CollectionSource([], [])  # type: ignore[call-arg]
    # the frozen dataclasses still copy, compare and pickle
    config = dataclasses.replace(pe.CheckpointConfig(), interval_ms=7)
    assert pickle.loads(pickle.dumps(config)) == config == pe.CheckpointConfig(interval_ms=7)
    assert pickle.loads(pickle.dumps(pe.Monitoring(port=0))) == pe.Monitoring()


def test_signatures_stay_as_written() -> None:
    """Editors and ``help()`` see the real parameters, not ``*args, **kwargs``."""
    assert list(inspect.signature(pe.StreamEnvironment).parameters)[:3] == [
        "parallelism",
        "max_parallelism",
        "checkpointing",
    ]
    assert "interval_ms" in inspect.signature(pe.CheckpointConfig).parameters
    assert list(inspect.signature(pe.sinks.FileSink).parameters)[:2] == ["path", "format"]
    assert "watermark_strategy" in inspect.signature(pe.StreamEnvironment.from_collection).parameters
    assert pe.StreamEnvironment.__init__.__doc__ == inspect.unwrap(pe.StreamEnvironment.__init__).__doc__


def test_the_helper_leaves_kwargs_alone_and_wraps_once() -> None:
    def takes_anything(a: int, **options: Any) -> int:
        return a + len(options)

    assert suggest_keywords(takes_anything) is takes_anything

    @suggest_keywords
    def scale(value: float, factor: float = 2.0) -> float:
        return value * factor

    assert scale(value=1.0, factor=3.0) == 3.0
    with pytest.raises(TypeError, match=r"scale\(\) got .* 'factr'; did you mean 'factor'\?"):
        scale(1.0, factr=3.0)  # type: ignore[call-arg]
    assert suggest_keywords(scale) is scale
