"""The typed state API as a user's type checker sees it (#16): a descriptor's type
parameters reach the state object through ``ctx.get_state``, so a wrong value is
reported by mypy, and the right use (typed or untyped) is clean."""

from __future__ import annotations

import textwrap

import pytest

# mypy comes with the test extra; a run without it skips this file, saying so, rather
# than stopping the collection of the whole suite.
mypy_api = pytest.importorskip("mypy.api", reason="needs mypy (pip install -e '.[test]' brings it)")

HEADER = """
from typing import Iterator, Optional
import pyengine as pe
from pyengine.runtime.keyed import KeyedContext, KeyedProcessFunction
from pyengine.state import (
    ListState, ListStateDescriptor, ListView, MapState, MapStateDescriptor, ValueState,
    ValueStateDescriptor,
)
"""

CORRECT = """
class Sessions(KeyedProcessFunction):
    def open(self, ctx: KeyedContext) -> None:
        self.count = ctx.get_state(ValueStateDescriptor[int]("count", 0))
        self.amounts = ctx.get_list_state(ListStateDescriptor[float]("amounts"))
        self.pages = ctx.get_state(MapStateDescriptor[str, int]("pages"))
        self.untyped = ctx.get_state(ValueStateDescriptor("anything"))

    def process_element(self, value: dict, ctx: KeyedContext) -> Iterator[dict]:
        n: Optional[int] = self.count.value()
        self.count.update((n or 0) + 1)
        self.amounts.add(2.5)
        total: float = sum(self.amounts.get())
        seen: ListView[float] = self.amounts.view()
        self.pages.put("home", (self.pages.get("home") or 0) + 1)
        self.untyped.update({"any": ["thing"]})
        yield {"n": n, "total": total, "seen": list(seen)}


def typed(ctx: KeyedContext) -> None:
    v: ValueState[int] = ctx.get_state(ValueStateDescriptor[int]("v"))
    lst: ListState[str] = ctx.get_state(ListStateDescriptor[str]("l"))
    m: MapState[str, int] = ctx.get_state(MapStateDescriptor[str, int]("m"))
    reveal_type(v.value())


class ThroughPe(pe.KeyedProcessFunction):  # what `import pyengine as pe` gives an editor
    def open(self, ctx: pe.KeyedContext) -> None:
        self.total = ctx.get_state(pe.ValueStateDescriptor[float]("total", ttl=pe.StateTtlConfig(60_000)))
        self.seen: pe.MapState[str, int] = ctx.get_map_state(pe.MapStateDescriptor[str, int]("seen"))

    def process_element(self, value: float, ctx: pe.KeyedProcessFunction.Context) -> Iterator[float]:
        total = (self.total.value() or 0.0) + value
        self.total.update(total)
        yield total
"""


WRONG = """
def wrong(ctx: KeyedContext) -> None:
    count = ctx.get_state(ValueStateDescriptor[int]("count", 0))
    count.update("one")
    pages = ctx.get_map_state(MapStateDescriptor[str, int]("pages"))
    pages.put(1, 1)
    doubled: str = count.value()
    amounts = ctx.get_list_state(pe.ListStateDescriptor[float]("amounts"))
    amounts.add("2.5")
"""


@pytest.fixture(scope="module")
def mypy_output(tmp_path_factory) -> tuple[str, int]:
    """One mypy run over both snippets (mypy reads pyengine and pyarrow once: ~10 s)."""
    tmp = tmp_path_factory.mktemp("typing")
    for name, source in (("correct.py", CORRECT), ("wrong.py", WRONG)):
        (tmp / name).write_text(textwrap.dedent(HEADER + source))
    out, err, status = mypy_api.run(
        [
            str(tmp / "correct.py"),
            str(tmp / "wrong.py"),
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp / ".mypy_cache"),
            "--disable-error-code",
            "type-arg",
        ]
    )
    return out + err, status


def _lines(out: str, file: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(file) or f"/{file}:" in line]


def test_typed_state_is_clean_and_value_is_optional_of_the_descriptors_type(mypy_output) -> None:
    out, _ = mypy_output
    lines = _lines(out, "correct.py")
    assert any('Revealed type is "int | None"' in line or '"builtins.int | None"' in line for line in lines), out
    assert not [line for line in lines if ": error:" in line], out


def test_a_wrong_value_for_a_typed_state_is_reported(mypy_output) -> None:
    out, status = mypy_output
    errors = "\n".join(line for line in _lines(out, "wrong.py") if ": error:" in line)
    assert status == 1, out
    assert 'Argument 1 to "update" of "ValueState" has incompatible type "str"' in errors, out
    assert 'Argument 1 to "put" of "MapState" has incompatible type "int"' in errors, out
    assert 'expression has type "int | None", variable has type "str"' in errors, out
    assert 'Argument 1 to "add" of "ListState" has incompatible type "str"; expected "float"' in errors, out


@pytest.mark.parametrize("key", [7, "seven", (7,)])
def test_an_int_written_to_a_float_state_reads_as_a_float_before_and_after_a_restore(tmp_path, key) -> None:
    """A new-user trial: a float64 value state with str keys returned 1 before a
    failure and 1.0 after it (a parquet column turned from int64 to double); with int
    keys (columns) it was 1.0 all along. Now every floating state stores floats."""
    import pyarrow as pa

    from pyengine.state import (
        ListStateDescriptor,
        MapStateDescriptor,
        ReducingStateDescriptor,
        ValueStateDescriptor,
        create_keyed_backend,
    )
    from pyengine.storage import checkpoint_storage

    def add(a, b):
        return a + b

    descriptors = {
        "value": ValueStateDescriptor("value", 0, pa.float64()),
        "list": ListStateDescriptor("list", pa.float32()),
        "map": MapStateDescriptor("map", pa.string(), pa.float64()),
        "float_keys": MapStateDescriptor("float_keys", pa.float64(), pa.float64()),
        "reducing": ReducingStateDescriptor("reducing", add, pa.float64()),
        "ttl": ValueStateDescriptor("ttl", None, pa.float64(), ttl=3_600_000),
    }

    def read(backend):
        backend.set_current_key(key)
        s = {name: backend.get_state(d) for name, d in descriptors.items()}
        return [
            s["value"].value(),
            list(s["list"].get()),
            s["map"].get("a"),
            s["map"].get("b"),
            s["reducing"].get(),
            s["ttl"].value(),
            s["float_keys"].items(),
        ]

    backend = create_keyed_backend("heap")
    backend.set_current_key(key)
    states = {name: backend.get_state(d) for name, d in descriptors.items()}
    assert type(states["value"].value()) is float  # the int default, as stored
    states["value"].update(1)
    states["list"].add(2)
    states["list"].add_all([3])
    states["map"].put("a", 4)
    states["map"].put_all({"b": 5})
    states["reducing"].add(6)
    states["ttl"].update(7)
    states["float_keys"].put(8, 9)
    states["float_keys"].put_all({10: 11})
    before = read(backend)
    assert before == [1.0, [2.0, 3.0], 4.0, 5.0, 6.0, 7.0, [(8.0, 9.0), (10.0, 11.0)]]
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "floats")
    restored = create_keyed_backend("heap")
    restored.restore(backend.snapshot(1, storage.location(1)).run().handles)
    after = read(restored)
    assert after == before

    def flat(values):
        out = []
        for v in values:
            for x in v if isinstance(v, list) else [v]:
                out.extend(x if isinstance(x, tuple) else [x])
        return out

    assert [type(x) for x in flat(before)] == [type(x) for x in flat(after)] == [float] * 11
    with pytest.raises(TypeError, match="is not a double value"):
        states["value"].update(2**2000)  # no float holds it
