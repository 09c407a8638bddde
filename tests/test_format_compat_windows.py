"""Window state of the layout before panes still restores. ``tests/data/savepoint-window-slots``
is a savepoint with open tumbling and sliding windows that pyengine wrote before
``AlignedWindowAggregateOperator`` kept its windows as panes (at commit e145a3c): per
accumulator, value states ``window/<acc>@<slot>`` keyed by the record key, the slot
map ``window-slots``, and windows beyond a key group's slots in ``window/overflow``. Made by
``tests/data/make_window_savepoint.py``; ``rows.json`` beside it holds the rows the
job had emitted before the savepoint."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from test_timers import Held  # records dealt to splits, held at a count until released
from test_windows import AGGS, reference, rows

import pyengine as pe

FIXTURE = Path(__file__).parent / "data" / "savepoint-window-slots"
RECORDS = [{"k": i % 5, "ts": i * 3 + (i * 7) % 20, "v": (i * 37) % 100 - 20} for i in range(400)]
HALF = 100  # records per split (of 2) before the savepoint
WINDOWS = {"tumbling": pe.windows.tumbling(30), "sliding": pe.windows.sliding(60, 20)}


def build(env: pe.StreamEnvironment, release: threading.Event, sinks: Dict[str, Any]) -> None:
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(20).with_timestamp_assigner("ts")
    keyed = env.from_source(Held(RECORDS, HALF, release), watermark_strategy=strategy).uid("held").key_by("k")
    for name, assigner in WINDOWS.items():
        keyed.window(assigner).aggregate(*AGGS).uid(name).sink_to(sinks[name])


def environment(tmp_path: Path, parallelism: int = 2) -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=50),
        checkpoint_storage=str(tmp_path / "ckpt"),
        auto_watermark_interval_ms=1,
    )


class _Rows:
    def __init__(self, records: List[Dict[str, Any]]) -> None:
        self.records = records


def test_the_fixture_holds_windows_in_slots_and_in_overflow() -> None:
    from test_windows_lateness import _keyed_state_names

    names = {name: _keyed_state_names(str(FIXTURE), name) for name in WINDOWS}
    assert all(n for n in names.values()), names
    everything = [n for ns in names.values() for n in ns]
    assert "window/overflow" in everything and any(n.startswith("window/count(*)@") for n in everything), names


@pytest.mark.parametrize("parallelism", [2, 3, 1])
def test_open_windows_of_the_slot_layout_restore_and_fire_exactly(tmp_path: Path, parallelism: int) -> None:
    """Restored at the savepoint's parallelism and rescaled: every window's row, from
    before the savepoint and after, is the reference's, and none twice."""
    savepoint = tmp_path / "savepoint"
    shutil.copytree(FIXTURE, savepoint)
    before: Dict[str, List[Dict[str, Any]]] = json.loads((savepoint / "rows.json").read_text())
    released = threading.Event()
    released.set()
    sinks = {name: pe.sinks.CollectSink() for name in WINDOWS}
    env = environment(tmp_path, parallelism)
    build(env, released, sinks)
    result = env.execute("window-slots", restore_from=str(savepoint))
    assert result.status == "FINISHED", result.cause
    for name, assigner in WINDOWS.items():
        got: List[Tuple[Any, ...]] = rows(_Rows(before[name])) + rows(_Rows(sinks[name].records))
        assert sorted(got) == reference(RECORDS, assigner), name
        assert before[name], f"{name}: no window fired before the savepoint: the fixture proves less than it says"
