"""Writes a savepoint fixture of test_format_compat: run from the repository's root,
with the pyengine of the commit whose format it keeps first on ``PYTHONPATH`` (a
worktree of that commit, built):

- ``tests/data/savepoint-dense-unions``, dense unions (5eb38d5 or before):
  ``python tests/data/make_dense_savepoint.py``;
- ``tests/data/savepoint-int64-timers``, timers as a ``timers`` state with int64
  timestamps, format version 3 (fb255f5): ``python tests/data/make_dense_savepoint.py
  savepoint-int64-timers``.

The job is test_format_compat's, stopped with a savepoint once each of its two
splits has read HALF records."""

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_format_compat import FIXTURE, build, environment

import pyengine as pe

if __name__ == "__main__":
    scratch = Path(tempfile.mkdtemp())
    held = threading.Event()  # never set: the source stops at HALF records a split
    env = environment(scratch)
    build(env, held, pe.sinks.CollectSink())
    client = env.execute_async("dense-unions")
    time.sleep(3)  # a few hundred records: read and processed long before this
    savepoint = client.stop_with_savepoint(str(scratch / "savepoint"))
    client.wait(30)
    target = FIXTURE.parent / sys.argv[1] if len(sys.argv) > 1 else FIXTURE
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(savepoint, target)
    print("written", target, "by", pe.__file__)
