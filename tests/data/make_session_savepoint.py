"""Writes ``tests/data/savepoint-session-windows`` (test_session_windows): a session-window
aggregate as the per-record ``WindowOperator`` kept it (``window-contents`` and event-time
timers), the layout of every release before ``SessionWindowAggregateOperator``. Run from
the repository's root with the pyengine of such a commit first on ``PYTHONPATH`` (a
worktree of it, built), e.g. ``git archive e145a3c | tar -x -C /tmp/old`` and
``PYTHONPATH=/tmp/old python tests/data/make_session_savepoint.py``.

The job is ``session_job`` of test_session_windows at parallelism 2, two key columns
(int ``k``, str ``name``: the columnar and the per-key layouts), stopped with a
savepoint once each split has read ``HELD`` records and the watermark has closed some
sessions but not all."""

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from session_fixture import SESSION_FIXTURE, session_job

import pyengine as pe

if __name__ == "__main__":
    scratch = Path(tempfile.mkdtemp())
    held = threading.Event()  # never set: the source stops at HELD records a split
    env = session_job(scratch, 2, held, pe.sinks.CollectSink(), pe.sinks.CollectSink())
    client = env.execute_async("sessions")
    time.sleep(4)  # a few hundred records: read and processed long before this
    savepoint = client.stop_with_savepoint(str(scratch / "savepoint"))
    client.wait(30)
    if SESSION_FIXTURE.exists():
        shutil.rmtree(SESSION_FIXTURE)
    shutil.copytree(savepoint, SESSION_FIXTURE)
    print("written", SESSION_FIXTURE, "by", pe.__file__)
