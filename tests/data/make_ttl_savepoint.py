"""Writes ``tests/data/savepoint-ttl-serialized`` for test_format_compat_ttl: run from the
repository's root with the pyengine of the commit whose format it keeps first on
``PYTHONPATH`` (e145a3c, the last to serialize TTL entries with their stamps):
``python tests/data/make_ttl_savepoint.py``. The job is test_format_compat_ttl's,
stopped with a savepoint once each of its two splits has read HALF records."""

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_format_compat_ttl import FIXTURE, build, environment

import pyengine as pe

if __name__ == "__main__":
    scratch = Path(tempfile.mkdtemp())
    held = threading.Event()  # never set: the source stops at HALF records a split
    env = environment(scratch)
    build(env, held, pe.sinks.CollectSink())
    client = env.execute_async("ttl-tally")
    time.sleep(3)  # a few hundred records: read and processed long before this
    savepoint = client.stop_with_savepoint(str(scratch / "savepoint"))
    client.wait(30)
    if FIXTURE.exists():
        shutil.rmtree(FIXTURE)
    shutil.copytree(savepoint, FIXTURE)
    print("written", FIXTURE, "by", pe.__file__)
