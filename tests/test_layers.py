"""The import contracts in pyproject.toml ([tool.importlinter]) hold, and they bite:
a copy of the package with one injected import (a cycle, an upward import, pyspark
below the Spark runner) breaks the contract that forbids it.

Needs import-linter (the ``lint`` extra); skipped without it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Set

import pytest

pytest.importorskip("importlinter", reason="needs import-linter (pip install -e '.[test]' brings it)")
grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parent.parent
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
]

# Cycles in files this change does not own, each to be removed by its owner (and then
# from here and from the ignore_imports of the "acyclic" contract).
KNOWN_CYCLES: list = []


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LINT, "--config", str(cwd / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_contracts_are_kept() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _cycles(package: str) -> List[Set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=True)
    index: dict = {}
    low: dict = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[Set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return out


def test_no_module_import_cycles() -> None:
    """Module by module, across packages too (the contracts check siblings within a
    package, and layers between packages; state and snapshot share a layer)."""
    unexpected = [c for c in _cycles("pyengine") if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "pyengine", tmp_path / "pyengine", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


CYCLES = "No import cycles between the modules of a package"
LAYERS = "Layers, top to bottom; nothing imports upward"
PYSPARK = "Only the Spark runner and the Spark integrations import pyspark"
PYSPARK_BELOW = "Nothing below the Spark runner reaches pyspark, even indirectly"
CONNECTORS = "Connectors build on their protocol only: never on a runner, nor on the face"


def lazy(statement: str) -> str:
    """An import inside a function: it counts as much as one at the top."""
    return f"def _later():\n    {statement}  # noqa\n"


INJECTIONS = [
    # (module file, injected code, the contract it breaks)
    ("state/keygroups.py", "from . import heap  # noqa\n", CYCLES),
    ("io/events.py", lazy("from . import gate"), CYCLES),
    ("storage/handles.py", "from ..state import keygroups  # noqa\n", LAYERS),
    ("coordinator/stats.py", lazy("from ..runners import local"), LAYERS),
    ("state/heap.py", lazy("from .. import api"), LAYERS),
    ("runtime/sources.py", lazy("import pyspark"), PYSPARK),
    ("sinks.py", lazy("from .spark import foreach_batch"), PYSPARK_BELOW),
    ("connectors/files.py", lazy("from ..runners import local"), CONNECTORS),
    ("connectors/base.py", lazy("from .. import sinks"), CONNECTORS),
    ("connectors/records.py", lazy("from . import filesink"), CYCLES),
    ("connectors/dataframe.py", lazy("import pyspark"), PYSPARK),
]


@pytest.mark.parametrize("path, code, contract", INJECTIONS, ids=[f"{p}-{c.split()[0]}" for p, _, c in INJECTIONS])
def test_an_injected_import_breaks_its_contract(copy: Path, path: str, code: str, contract: str) -> None:
    assert _lint(copy).returncode == 0  # the copy as it is keeps every contract
    target = copy / "pyengine" / path
    target.write_text(target.read_text() + "\n\n" + code)
    done = _lint(copy)
    assert done.returncode == 1, done.stdout + done.stderr
    broken = [line for line in done.stdout.splitlines() if " BROKEN" in line]
    assert any(line.startswith(contract) for line in broken), done.stdout
