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


def test_output_into_a_closed_pipe_ends_quietly(tmp_path) -> None:
    """`pyengine checkpoints list ... | head` whose reader has gone: no BrokenPipeError
    traceback, and the exit status a shell gives a command ended by SIGPIPE."""
    import os

    import pyengine as pe

    env = pe.StreamEnvironment(checkpointing=pe.CheckpointConfig(interval_ms=60_000), checkpoint_storage=str(tmp_path))
    env.from_collection(list(range(10))).map(lambda x: x + 1).sink_to(pe.sinks.CollectSink())
    assert env.execute("piped").status == "FINISHED"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before the command wrote anything
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pyengine", "checkpoints", "list", str(tmp_path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)
