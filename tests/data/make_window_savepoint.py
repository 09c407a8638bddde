"""Writes ``tests/data/savepoint-window-slots`` for test_format_compat_windows: run from
the repository's root with the pyengine of a commit whose ``AlignedWindowAggregateOperator``
kept windows in keyed slot states (the fixture: e145a3c, a worktree of it, built) first on
``PYTHONPATH``: ``python tests/data/make_window_savepoint.py``.

Its watermark lags the held records by many windows, so some windows went beyond
the 19 slots a key group has for 5 accumulators into the per-key overflow: the
fixture holds both (test_format_compat_windows checks). The job is stopped with a
savepoint once each of its two splits has read HALF records; the rows emitted before
it go to ``rows.json``."""

import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_format_compat_windows import FIXTURE, WINDOWS, build, environment

import pyengine as pe

if __name__ == "__main__":
    scratch = Path(tempfile.mkdtemp())
    held = threading.Event()  # never set: the source stops at HALF records a split
    sinks = {name: pe.sinks.CollectSink() for name in WINDOWS}
    env = environment(scratch)
    build(env, held, sinks)
    client = env.execute_async("window-slots")
    time.sleep(3)  # read and processed long before this
    savepoint = client.stop_with_savepoint(str(scratch / "savepoint"))
    client.wait(30)
    if FIXTURE.exists():
        shutil.rmtree(FIXTURE)
    shutil.copytree(savepoint, FIXTURE)
    rows = {name: [dict(r) for r in sink.records] for name, sink in sinks.items()}
    (FIXTURE / "rows.json").write_text(json.dumps(rows, sort_keys=True))
    print("written", FIXTURE, "by", pe.__file__, {n: len(r) for n, r in rows.items()})
