"""What ``_job.json`` says about a run from the moment it starts (issue 37, item 11):
a resumed run killed before its first heartbeat still names the checkpoint it
restored."""

from __future__ import annotations

import json
import time
from typing import Any, List, Optional

from test_runs import RECORDS, _crash, counting_env, counting_job, expected_pairs, pairs

from pyengine.storage.jobs import HEARTBEAT_S, JOB_FILE, list_jobs


class ReadJobFile:
    """At its first record, reads what ``_job.json`` says of the running (last) run:
    what a run killed then would leave behind."""

    def __init__(self, path: str, seen: List[Optional[str]]) -> None:
        self.path, self.seen = path, seen
        self.at_ms = 0.0

    def __deepcopy__(self, memo: Any) -> ReadJobFile:
        return self  # one observer for every subtask

    def __call__(self, record: Any) -> Any:
        if not self.seen:
            with open(self.path) as f:
                runs = json.load(f)["runs"]
            self.seen.append(runs[-1]["restored_from"])
            self.at_ms = time.time() * 1000
        return record


def test_a_resumed_run_names_its_restored_checkpoint_before_its_first_heartbeat(tmp_path) -> None:
    _crash(tmp_path)
    [crashed] = list_jobs(str(tmp_path / "ckpt"))
    assert crashed.checkpoints, "the crashed run completed no checkpoint: nothing to resume from"
    seen: List[Optional[str]] = []
    observer = ReadJobFile(str(tmp_path / "ckpt" / crashed.dir_id / JOB_FILE), seen)
    env = counting_env(tmp_path / "ckpt")
    sink = counting_job(env, str(tmp_path / "out"), step=observer)
    result = env.execute("crashy")  # resume="auto"
    assert result.checkpoints.counts["restored"] == 1
    assert seen and seen[0] is not None, "_job.json said restored_from: null while the resumed run ran"
    assert seen[0].rstrip("/").endswith(f"chk-{crashed.checkpoints[-1]}"), seen
    assert pairs(sink) == expected_pairs(RECORDS)
    [job] = list_jobs(str(tmp_path / "ckpt"))
    assert observer.at_ms - job.runs[-1].started_ms < HEARTBEAT_S * 1000, "read after a heartbeat: tested nothing"
    assert job.runs[-1].restored_from == seen[0]
