"""The import contracts in pyproject.toml ([tool.importlinter]) hold, and they bite:
a copy of the package with one injected import (a cycle, an upward import, pyspark
below the Spark runner) breaks the contract that forbids it.

Needs import-linter (the ``lint`` extra); skipped without it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Set, Tuple

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
RUNTIME_FACE = "The runtime never imports the face (the graph builders)"
TOP_CYCLES = "No import cycles between pyengine's top-level modules and packages"
STATE_KINDS = "State kinds never import the backends that store them"
TWS_SHIMS = "The tws handle and schemas never import their driver"
CONNECTORS = "Connectors build on their protocol only: never on a runner, nor on the face"
API_MODULES = "The job API: environment above streams above graph and client"


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
    ("state/maps.py", lazy("from . import incremental"), STATE_KINDS),
    ("spark/tws_schema.py", lazy("from . import tws"), TWS_SHIMS),
    ("runtime/sources.py", lazy("import pyspark"), PYSPARK),
    ("sinks.py", lazy("from .spark import foreach_batch"), PYSPARK_BELOW),
    ("runtime/windows.py", lazy("from .. import windows"), RUNTIME_FACE),
    ("runtime/joins.py", lazy("from ..joins import JoinedStreams"), RUNTIME_FACE),
    ("runtime/aligned_windows.py", lazy("from ..api import DataStream"), RUNTIME_FACE),
    # api imports joins and windows at the top: an import back, even in a function, is a circle
    ("joins.py", lazy("from .api import DataStream"), TOP_CYCLES),
    ("windows.py", lazy("from . import api"), TOP_CYCLES),
    ("runners/shipping.py", lazy("from . import processes"), CYCLES),
    ("api/graph.py", lazy("from .datastream import DataStream"), API_MODULES),
    ("api/client.py", lazy("from .environment import StreamEnvironment"), API_MODULES),
    ("api/datastream.py", lazy("from . import environment"), API_MODULES),
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


def _function_level_imports(path: Path, package: str) -> List[Tuple[int, str]]:
    """(line, module) of every import of a pyengine module inside a function of ``path``
    (a module of ``package``), relative imports resolved."""
    tree = ast.parse(path.read_text())
    out: List[Tuple[int, str]] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    name = ".".join([*base, node.module] if node.module else base)
                else:
                    name = node.module or ""
                out.append((node.lineno, name))
            elif isinstance(node, ast.Import):
                out.extend((node.lineno, alias.name) for alias in node.names)
    return [(line, name) for line, name in out if name == "pyengine" or name.startswith("pyengine.")]


# In the face a function may import only what brings an optional dependency (pyspark) or is
# chosen when the job runs: the runners (the Spark runner, the process runner's workers).
DEFERRED_IN_THE_FACE = ("pyengine.spark", "pyengine.runners")


FACE = ["api/__init__", "api/environment", "api/datastream", "api/graph", "api/client", "joins", "windows"]


@pytest.mark.parametrize("module", FACE)
def test_the_face_imports_what_it_builds_at_the_top(module: str) -> None:
    """api, joins and windows build graphs from the operators below them: they take those
    at import time, so no call (``key_by(...).window(...)``, ``a.join(b)``) imports a
    module, and no import circle among them can hide in a function."""
    package = "pyengine.api" if module.startswith("api/") else "pyengine"
    found = _function_level_imports(ROOT / "pyengine" / f"{module}.py", package)
    deferred = [(line, name) for line, name in found if not name.startswith(DEFERRED_IN_THE_FACE)]
    assert not deferred, f"pyengine/{module}.py imports in a function: {deferred}"


def test_the_runtime_reaches_the_native_module_directly() -> None:
    """``from .. import _native`` in the runtime is an import of the top-level package,
    which names the whole API (the face above the runtime): the runtime imports
    ``pyengine._native`` by its own name instead."""
    graph = grimp.build_graph("pyengine", exclude_type_checking_imports=True)
    importers = graph.find_modules_that_directly_import("pyengine")
    importers = {m for m in importers if m.startswith("pyengine.runtime")}
    assert not importers, f"the runtime imports the top-level package: {sorted(importers)}"


def test_monitoring_submodules_do_not_import_their_package() -> None:
    """``pyengine.monitoring`` imports ``monitor`` at its top, so a ``from . import x``
    there is an import of the package that is importing it (a circle that works only
    because Python falls back to the submodule): its modules name the module they use."""
    package = ROOT / "pyengine" / "monitoring"
    through_package = [
        (path.name, node.lineno)
        for path in sorted(package.glob("*.py"))
        if path.name != "__init__.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None
    ]
    assert not through_package, f"imports through pyengine.monitoring: {through_package}"
