"""Writes test_join_buffers' fixture ``tests/data/savepoint-interval-join-v1``: a
savepoint of a per-record interval join whose buffers are in the layout of the
release before the join buffers went by entry (one ``interval-join/left`` and
``interval-join/right`` value per key, ``{timestamp: [records]}``, and a timer per
buffered timestamp). Run from the repository's root with that release's pyengine
first on ``PYTHONPATH`` (made at e145a3c): ``python tests/data/make_join_savepoint.py``.
Beside it, ``first-run.json``: what the sink committed before the savepoint."""

import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_join_buffers import FIRST_RUN, FIXTURE, join_job

import pyengine as pe

if __name__ == "__main__":
    scratch = Path(tempfile.mkdtemp())
    sink = pe.sinks.CollectSink()
    client = join_job(2, threading.Event(), sink, scratch).execute_async("join-v1")
    time.sleep(4)  # the held part read and joined long before this
    savepoint = client.stop_with_savepoint(str(scratch / "savepoint"))
    client.wait(30)
    if FIXTURE.exists():
        shutil.rmtree(FIXTURE)
    shutil.copytree(savepoint, FIXTURE)
    FIRST_RUN.write_text(json.dumps(sorted(list(r) for r in sink.records)))
    print("written", FIXTURE, len(sink.records), "records before the savepoint, by", pe.__file__)
