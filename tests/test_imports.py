"""Every module imports on its own, first: an import cycle between the state,
snapshot and storage packages shows only when a user imports a module first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pyengine"
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if p.name not in ("__main__.py",)
)


@pytest.mark.parametrize("module", [m.removesuffix(".__init__") for m in MODULES])
def test_module_imports_first(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
