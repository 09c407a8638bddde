"""The README's test command as a newcomer meets it (#38): ``python -m pytest`` runs the
fast tier (every test not marked slow), ``--full`` the whole suite, ``-m slow`` exactly the
rest; and a test that needs a tool the environment lacks skips with the reason instead of
stopping the collection of everything."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

SAMPLE = """
import pytest

pytestmark = []


def test_fast():
    pass


@pytest.mark.slow
def test_soak():
    pass


@pytest.mark.spark  # implies slow, though not marked so
def test_local_spark():
    pass


@pytest.mark.spark_cluster
@pytest.mark.slow
def test_cluster():
    pass
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project with the suite's conftest.py and markers, and four tests, one fast."""
    tests = pytester.mkdir("tests")
    shutil.copy(TESTS / "conftest.py", tests / "conftest.py")
    (tests / "test_sample.py").write_text(SAMPLE)
    pytester.makeini(
        "[pytest]\ntestpaths = tests\n"
        "addopts = --strict-markers -p no:cacheprovider -p no:hypothesispytest -p no:benchmark\n"
        "markers =\n    slow: slow\n    spark: spark\n    spark_cluster: cluster\n"
    )
    return pytester


def selected(project: pytest.Pytester, *args: str) -> List[str]:
    result = project.runpytest_inprocess("--collect-only", "-q", *args)
    assert result.ret == 0, result.stdout.str()
    return sorted(re.findall(r"::(test_\w+)", result.stdout.str()))


def test_the_default_run_is_the_fast_tier_and_says_what_it_left_out(project: pytest.Pytester) -> None:
    result = project.runpytest_inprocess("-q")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.fnmatch_lines(["fast tier: 3 slow tests * not run; `python -m pytest --full` runs the whole suite*"])
    assert selected(project) == ["test_fast"]
    assert selected(project, "tests") == ["test_fast"]  # a directory is not a choice of tests


def test_full_is_everything_and_slow_is_exactly_the_rest(project: pytest.Pytester) -> None:
    everything = selected(project, "--full")
    assert everything == ["test_cluster", "test_fast", "test_local_spark", "test_soak"]
    slow = selected(project, "-m", "slow")
    assert slow == ["test_cluster", "test_local_spark", "test_soak"]  # spark implies slow
    assert sorted(selected(project) + slow) == everything
    assert selected(project, "-m", "not slow") == ["test_fast"]


def test_tests_you_name_run_slow_or_not(project: pytest.Pytester) -> None:
    assert selected(project, "tests/test_sample.py::test_soak") == ["test_soak"]
    assert len(selected(project, "tests/test_sample.py")) == 4
    assert selected(project, "-k", "local_spark") == ["test_local_spark"]
    assert selected(project, "-m", "spark") == ["test_local_spark"]


def test_a_missing_tool_skips_its_tests_with_the_reason(tmp_path: Path) -> None:
    """Without mypy (a fresh environment of another extra), test_state_typing.py skips,
    saying what it needs; it used to stop the collection of the whole suite."""
    blocked = tmp_path / "blocked"
    (blocked / "mypy").mkdir(parents=True)
    (blocked / "mypy" / "__init__.py").write_text("raise ModuleNotFoundError('No module named mypy', name='mypy')\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_state_typing.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": f"{blocked}:{ROOT}"},
    )
    assert done.returncode in (0, 5), done.stdout[-3000:] + done.stderr[-3000:]  # 5: nothing left to run
    assert "skipped" in done.stdout and "needs mypy" in done.stdout
