"""Every code block in README.md and docs/ runs.

- ```python blocks run, a page's blocks in order in one fresh interpreter (so a
  later block uses what an earlier one defined), in a temporary directory;
- ```console blocks run there too, at their place in the page: each ``$ `` line is
  a shell command that must succeed (the lines after it are its output, shown, not
  compared);
- ```bash blocks are the commands CI runs as its own steps: each must be part of a
  line of ``.ci/run``;
- any other fence (text, toml, json) is not code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
RUN = ("python", "console")
NOT_CODE = ("", "text", "toml", "json", "yaml", "ini")


def blocks(page: Path) -> List[Tuple[str, str, int]]:
    """(language, code, line) of each fenced block."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        body = "\n".join(line[indent:] for line in m.group("body").splitlines())
        out.append((m.group("lang"), body, text.count("\n", 0, m.start()) + 1))
    return out


def script(page: Path) -> str:
    """The page's python and console blocks as one Python script."""
    parts = ["import subprocess as _sp, sys as _sys"]
    for lang, code, line in blocks(page):
        if lang == "python":
            parts.append(f"# {page.name}:{line}\n{code}")
        elif lang == "console":
            for command in (c[2:] for c in code.splitlines() if c.startswith("$ ")):
                parts.append(
                    f"_done = _sp.run({command!r}, shell=True, text=True, capture_output=True)\n"
                    f"assert _done.returncode == 0, ({page.name!r}, {line}, {command!r}, _done.stdout, _done.stderr)"
                )
    return "\n\n".join(parts) + "\n"


def runnable(page: Path) -> bool:
    return any(lang in RUN for lang, _, _ in blocks(page))


def test_pages_found() -> None:
    assert ROOT / "README.md" in PAGES and len(PAGES) > 5
    assert any(runnable(p) for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_block_is_known(page: Path) -> None:
    for lang, _, line in blocks(page):
        assert lang in RUN or lang in NOT_CODE or lang == "bash", f"{page.name}:{line}: unknown fence {lang!r}"


# Pages whose code starts a local Spark or runs a tune search (12-45 s each on two cores):
# the slow tier runs them (python -m pytest --full, CI).
SLOW_PAGES = {"docs/guide/spark.md", "docs/guide/coming-from-spark.md", "docs/guide/tuning.md", "docs/guide/cli.md"}


# Pages whose code writes to a PostgreSQL (CI starts one: .ci/postgres); skipped, saying so, without one.
NEEDS_POSTGRES = {"docs/guide/connectors.md"}


def _no_postgres() -> str:
    dsn = os.environ.get("PYENGINE_TEST_PG_DSN", "postgresql://pyengine:pyengine@127.0.0.1:5432/pyengine_test")
    try:
        import psycopg

        psycopg.connect(dsn, connect_timeout=3).close()
        return ""
    except Exception as exc:
        if os.environ.get("CI") == "true":
            raise
        from pyengine.connectors.postgres import _safe_dsn

        why = " ".join(str(exc).split())[:160]
        return f"there is none at {_safe_dsn(dsn)} ({why}); start one with: sudo bash .ci/postgres"


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=[pytest.mark.slow] if str(p.relative_to(ROOT)) in SLOW_PAGES else [])
        for p in PAGES
        if runnable(p)
    ],
    ids=[str(p.relative_to(ROOT)) for p in PAGES if runnable(p)],
)
def test_page_runs(page: Path, tmp_path: Path) -> None:
    if str(page.relative_to(ROOT)) in NEEDS_POSTGRES and _no_postgres():
        pytest.skip(f"{page.name} writes to PostgreSQL, and {_no_postgres()}")
    code = script(page)
    (tmp_path / "page.py").write_text(code)
    # `pyengine` and `python` in console blocks: this interpreter's
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    done = subprocess.run(
        [sys.executable, "page.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{page.relative_to(ROOT)}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def test_bash_blocks_are_ci_steps() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    for page in PAGES:
        for lang, code, line in blocks(page):
            if lang != "bash":
                continue
            for command in code.splitlines():
                command = command.split("  #", 1)[0].strip()
                if command and not command.startswith("#"):
                    assert command in ci, f"{page.name}:{line}: {command!r} is not run by .ci/run"
