from __future__ import annotations

import subprocess
import sys

import pytest

from pyengine.cli import main


def test_demo_checks_every_mode_and_says_so(capsys) -> None:
    assert main(["gate-demo", "--channels", "3", "--buffers", "600", "--checkpoints", "3"]) == 0
    out = capsys.readouterr().out
    for mode in ("exactly-once, aligned", "exactly-once, unaligned", "at-least-once"):
        line = next(line for line in out.splitlines() if line.startswith(mode))
        assert " OK " in line
        assert line[len(mode) :].split()[0] == "3"  # completed checkpoints
    assert "all checks passed" in out


def test_demo_rejects_bad_arguments(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["gate-demo", "--channels", "0"])
    assert exc.value.code == 2
    assert "--channels" in capsys.readouterr().err


def test_console_entry_point_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pyengine", "gate-demo", "--buffers", "200", "--checkpoints", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "all checks passed" in done.stdout
