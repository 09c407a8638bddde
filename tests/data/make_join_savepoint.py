"""Writes test_join_buffers' fixtures, savepoints in the layouts of the release
before the join buffers went by entry (made at e145a3c):

- ``tests/data/savepoint-interval-join-v1``: a per-record interval join (one
  ``interval-join/left`` and ``interval-join/right`` value per key,
  ``{timestamp: [records]}``, and a timer per buffered timestamp);
- ``tests/data/savepoint-window-join-v1``: a per-record window join whose elements
  are ``(side, record)`` tuples.

Run from the repository's root with that release's pyengine first on ``PYTHONPATH``:
``python tests/data/make_join_savepoint.py [fixture name ...]``. Beside each, a
``.first-run.json``: what the sink committed before the savepoint."""

import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_join_buffers import FIRST_RUN, FIXTURE, WINDOW_FIRST_RUN, WINDOW_FIXTURE, join_job, window_job

import pyengine as pe

if __name__ == "__main__":
    for job, fixture, first_run in ((join_job, FIXTURE, FIRST_RUN), (window_job, WINDOW_FIXTURE, WINDOW_FIRST_RUN)):
        if len(sys.argv) > 1 and fixture.name not in sys.argv[1:]:
            continue
        scratch = Path(tempfile.mkdtemp())
        sink = pe.sinks.CollectSink()
        client = job(2, threading.Event(), sink, scratch).execute_async("join-v1")
        time.sleep(4)  # the held part read and joined long before this
        savepoint = client.stop_with_savepoint(str(scratch / "savepoint"))
        client.wait(30)
        if fixture.exists():
            shutil.rmtree(fixture)
        shutil.copytree(savepoint, fixture)
        first_run.write_text(json.dumps(sorted(list(r) for r in sink.records)))
        print("written", fixture, len(sink.records), "records before the savepoint, by", pe.__file__)
