"""Writes tests/data/savepoint-dense-unions: run from the repository's root, at a
commit whose keyed-state files use dense unions (5eb38d5 or before), as
``python tests/data/make_dense_savepoint.py``. The job is test_format_compat's,
stopped with a savepoint once each of its two splits has read HALF records."""

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
    if FIXTURE.exists():
        shutil.rmtree(FIXTURE)
    shutil.copytree(savepoint, FIXTURE)
    print("written", FIXTURE)
