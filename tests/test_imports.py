"""Every module imports on its own, first: an import cycle between the state,
snapshot and storage packages shows only when a user imports a module first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pyengine"
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if p.name not in ("__main__.py",)
)


NAMES = [m.removesuffix(".__init__") for m in MODULES]

# One interpreter imports the third-party libraries pyengine builds on, then forks a child
# per module, which imports that module first of all pyengine: what the test is about (a
# cycle between pyengine's own modules) is the same, and a child costs milliseconds where
# a fresh interpreter that imports pyarrow again cost about a second (90 modules: 80 s).
FORK_SERVER = r"""
import importlib, os, sys, traceback
out = sys.argv[1]
for name in ("numpy", "pyarrow", "pyarrow.compute", "pyarrow.fs", "pyarrow.parquet", "pyarrow.ipc",
             "pyarrow.dataset", "lz4.frame", "msgpack", "xxhash", "cloudpickle", "prometheus_client"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
assert not [m for m in sys.modules if m == "pyengine" or m.startswith("pyengine.")]
for module in sys.argv[2:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
            code = 0
        except BaseException:
            with open(os.path.join(out, module + ".err"), "w") as f:
                f.write(traceback.format_exc())
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(out, module + ".rc"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""


@pytest.fixture(scope="module")
def imported_first(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Tuple[int, str]]:
    """Each module's exit code and error, imported first in a process of its own."""
    if not hasattr(os, "fork"):  # a fresh interpreter per module
        results = {}
        for module in NAMES:
            done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
            results[module] = (done.returncode, done.stderr)
        return results
    out = tmp_path_factory.mktemp("imports")
    subprocess.run([sys.executable, "-c", FORK_SERVER, str(out), *NAMES], check=True, timeout=600)
    return {
        m: (
            int((out / f"{m}.rc").read_text()) if (out / f"{m}.rc").exists() else -1,
            (out / f"{m}.err").read_text() if (out / f"{m}.err").exists() else "",
        )
        for m in NAMES
    }


@pytest.mark.parametrize("module", NAMES)
def test_module_imports_first(module: str, imported_first: Dict[str, Tuple[int, str]]) -> None:
    code, error = imported_first[module]
    assert code == 0, error or f"import {module} ended with {code}"
