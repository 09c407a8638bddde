"""Jobs and runs in checkpoint storage: who owns a job directory, and whether it is alive.

A job directory ``<storage>/<dir-id>/`` holds the checkpoints of one *lineage*:
a fresh run and every run that resumed it (``execute(resume="auto")``). Its
``_job.json`` records the job's name and each run (id, start, end, status, host,
pid, heartbeat), so that

- a re-run of an unfinished job finds the run to resume (Spark's rule for a
  reused ``checkpointLocation``),
- a root holding several jobs is never restored from blindly, and
- two live runs never write one directory: the second is refused, naming the first.

Liveness: a run is alive while its record says RUNNING and either its process is
alive (same host) or its heartbeat, refreshed every ``HEARTBEAT_S``, is younger
than ``STALE_S`` (another host). A killed process leaves RUNNING behind, which
then reads as "crashed": resumable.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import pyarrow.fs as pafs

from .filesystem import _CHK_DIR, METADATA_FILE, guarded, resolve

__all__ = [
    "JOB_FILE",
    "JobDirectory",
    "JobLease",
    "RunRecord",
    "describe_jobs",
    "list_jobs",
    "read_job",
]

JOB_FILE = "_job.json"
JOB_FORMAT = "pyengine-job"
HEARTBEAT_S = 5.0
STALE_S = 60.0
_LEASED: set = set()  # run ids whose lease this process holds


def _now_ms() -> int:
    return int(time.time() * 1000)


def _utc(ms: Optional[int]) -> str:
    if not ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a run's lock holds while it
    does). A zombie does not: a process killed with ``kill -9`` whose parent has not
    reaped it (a container without an init, a parent killed with it) still answers
    signal 0, and its lock held until its heartbeat went stale, a minute on (a
    new-user trial's killed job could not be resumed meanwhile)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, someone else's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no /proc (not Linux), or it ended just now: signal 0 answered
        return True
    state_at = stat.rfind(b")") + 2  # "pid (comm) S ...": comm may hold ")"
    return stat[state_at : state_at + 1] != b"Z"


@dataclass
class RunRecord:
    run_id: str
    started_ms: int
    status: str = "RUNNING"  # RUNNING, FINISHED, FAILED, CANCELED
    ended_ms: Optional[int] = None
    host: str = ""
    pid: int = 0
    heartbeat_ms: int = 0
    restored_from: Optional[str] = None

    def alive(self) -> bool:
        """Whether the run may still be writing (see the module docstring). In this
        process, only a run whose lease is held; on this host, a live pid with a fresh
        heartbeat (a reused pid, after a restart, says nothing); elsewhere, the heartbeat."""
        if self.status != "RUNNING":
            return False
        fresh = _now_ms() - self.heartbeat_ms < STALE_S * 1000
        if self.host == socket.gethostname() and self.pid:
            if self.pid == os.getpid():
                return self.run_id in _LEASED
            return fresh and pid_alive(self.pid)
        return fresh


@dataclass
class JobDirectory:
    """What ``_job.json`` and the ``chk-<n>`` directories say about one job directory."""

    uri: str  # the directory, as a URI or path a user can pass back
    dir_id: str
    job_name: str
    lineage_id: str
    runs: List[RunRecord] = field(default_factory=list)
    checkpoints: List[int] = field(default_factory=list)  # completed (with _metadata), oldest first
    output: str = ""  # where the job's sink writes (its identity), so a resume is not another pipeline's

    @property
    def last_run(self) -> Optional[RunRecord]:
        return self.runs[-1] if self.runs else None

    @property
    def started_ms(self) -> int:
        return self.runs[0].started_ms if self.runs else 0

    @property
    def finished(self) -> bool:
        last = self.last_run
        return last is not None and last.status == "FINISHED"

    @property
    def state(self) -> str:
        last = self.last_run
        if last is None:
            return "UNKNOWN"
        if last.status == "RUNNING":
            return "RUNNING" if last.alive() else "CRASHED"
        return last.status

    @property
    def latest_checkpoint(self) -> Optional[int]:
        return self.checkpoints[-1] if self.checkpoints else None


def read_job(uri: str) -> Optional[JobDirectory]:
    """The job directory at ``uri``, or None when it has neither ``_job.json`` nor
    checkpoints (not a job directory). A directory from before ``_job.json``
    existed reads as a job with an empty name."""
    fs, root, prefix = resolve(uri)
    root = root.rstrip("/")
    dir_id = root.rsplit("/", 1)[-1]
    checkpoints = []
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError:
        return None
    for info in infos:
        m = _CHK_DIR.match(info.base_name)
        if m and info.type == pafs.FileType.Directory:
            if fs.get_file_info(f"{info.path}/{METADATA_FILE}").type == pafs.FileType.File:
                checkpoints.append(int(m.group(1)))
    data: Dict[str, Any] = {}
    try:
        with fs.open_input_stream(f"{root}/{JOB_FILE}") as f:
            data = json.loads(f.read())
    except (FileNotFoundError, ValueError, OSError):
        if not checkpoints:
            return None
    if data and data.get("format") != JOB_FORMAT:
        data = {}
    runs = []
    for r in data.get("runs", []):
        try:
            runs.append(RunRecord(**{k: r[k] for k in r if k in RunRecord.__dataclass_fields__}))
        except TypeError:
            continue
    return JobDirectory(
        uri=prefix + root,
        dir_id=dir_id,
        job_name=str(data.get("job_name", "")),
        lineage_id=str(data.get("lineage_id", dir_id)),
        runs=runs,
        checkpoints=sorted(checkpoints),
        output=str(data.get("output", "")),
    )


def list_jobs(storage_uri: str) -> List[JobDirectory]:
    """Every job directory directly under a checkpoint storage root, oldest first."""
    fs, root, prefix = resolve(storage_uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(root.rstrip("/"), allow_not_found=True))
    except OSError:
        return []
    jobs = []
    for info in infos:
        if info.type == pafs.FileType.Directory and not info.base_name.startswith(("_", ".")):
            job = read_job(prefix + info.path)
            if job is not None:
                jobs.append(job)
    return sorted(jobs, key=lambda j: (j.started_ms, j.dir_id))


def describe_jobs(jobs: List[JobDirectory]) -> str:
    """A table of jobs for error messages and ``pyengine checkpoints list``."""
    lines = [f"  {'name':<24} {'id':<34} {'started (UTC)':<20} {'latest':>7}  state"]
    for j in jobs:
        latest = f"chk-{j.latest_checkpoint}" if j.latest_checkpoint is not None else "-"
        name = j.job_name or "(unnamed)"
        lines.append(f"  {name:<24} {j.dir_id:<34} {_utc(j.started_ms):<20} {latest:>7}  {j.state}")
    return "\n".join(lines)


class JobLease:
    """This run's record in its job directory, from start to end: written at
    ``acquire`` (refusing a directory another live run holds), refreshed by a
    heartbeat thread, closed with the run's status at ``release``."""

    def __init__(self, directory_uri: str, job_name: str, lineage_id: str, run_id: str, output: str = "") -> None:
        self.fs, self.root, _ = resolve(directory_uri)
        self.root = self.root.rstrip("/")
        self.job_name = job_name
        self.lineage_id = lineage_id
        self.output = output
        self.record = RunRecord(
            run_id=run_id, started_ms=_now_ms(), host=socket.gethostname(), pid=os.getpid(), heartbeat_ms=_now_ms()
        )
        self._runs: List[RunRecord] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._acquired = False

    def acquire(self, restored_from: Optional[str] = None) -> None:
        self.record.restored_from = restored_from
        if isinstance(self.fs, pafs.LocalFileSystem):
            self.fs.create_dir(self.root, recursive=True)
        # the read-judge-write of _job.json under one guard: two runs resuming one
        # job at once never both find it free
        with guarded(self.fs, f"{self.root}/.{JOB_FILE}.guard"):
            self._acquire_guarded()
        _LEASED.add(self.record.run_id)
        self._thread = threading.Thread(target=self._beat, name="pyengine-job-heartbeat", daemon=True)
        self._thread.start()

    def _acquire_guarded(self) -> None:
        from ..errors import OutputInUseError

        existing = read_job(self.root)
        if existing is not None:
            live = [r for r in existing.runs if r.alive() and r.run_id != self.record.run_id]
            if live:
                r = live[-1]
                raise OutputInUseError(
                    f"checkpoint directory {existing.uri} is in use by run {r.run_id} of job "
                    f"{existing.job_name!r} (host {r.host}, pid {r.pid}, started {_utc(r.started_ms)} UTC): "
                    "wait for it to end or stop it, or start a fresh run with execute(..., resume='never')"
                )
            self._runs = existing.runs
        self._runs = [*self._runs, self.record]
        self._write()
        self._acquired = True

    def note_restored_from(self, path: Optional[str]) -> None:
        """Records the checkpoint this run restores, at once: a resumed run learns it
        only after ``acquire`` (its coordinator reads the directory it leases), and a
        run killed before its first heartbeat must not leave ``restored_from: null``
        behind, which reads as a run that started from nothing."""
        self.record.restored_from = path
        if self._acquired:
            self._write()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.record.heartbeat_ms = _now_ms()
            try:
                self._write()
            except OSError:
                pass  # storage hiccup: the next beat tries again; staleness takes a minute

    def _write(self) -> None:
        body = {
            "format": JOB_FORMAT,
            "version": 1,
            "job_name": self.job_name,
            "lineage_id": self.lineage_id,
            "output": self.output,
            "runs": [asdict(r) for r in self._runs],
        }
        with self._lock:
            temp = f"{self.root}/.{JOB_FILE}.{uuid.uuid4().hex[:8]}.tmp"
            with self.fs.open_output_stream(temp) as out:
                out.write(json.dumps(body, indent=1).encode())
            self.fs.move(temp, f"{self.root}/{JOB_FILE}")

    def release(self, status: str) -> None:
        """Records the run's end; nothing when the lease was refused (the record there
        is another run's)."""
        if not self._acquired:
            return
        self._acquired = False
        _LEASED.discard(self.record.run_id)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.record.status = status
        self.record.ended_ms = _now_ms()
        try:
            self._write()
        except OSError:
            pass
