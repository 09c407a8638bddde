"""A finished job's checkpoint history, kept beside its checkpoints.

The coordinator's statistics live in memory and end with the job; a run that
took checkpoints writes them, in the REST API's shape (Flink's
``CheckpointingStatistics`` plus the job's name, state and restarts), to
``_checkpoint_stats.json`` in its job directory when it ends, so
``pyengine checkpoints stats <job dir>`` shows them afterwards (``--json``: as
written). JSON only: the file is read back with ``json.loads`` and nothing else."""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, List, Optional

__all__ = ["STATS_FILE", "MAX_STATS_BYTES", "load_statistics", "render_statistics", "save_run_statistics"]

log = logging.getLogger(__name__)

STATS_FILE = "_checkpoint_stats.json"
MAX_STATS_BYTES = 16 * 1024 * 1024  # a history of ten checkpoints is a few KiB; more is not ours


def run_statistics(job: Any, status: str) -> Dict[str, Any]:
    """What a run leaves: its identity and end, and its checkpoints as ``/jobs/:id/checkpoints`` shows them."""
    from .monitor import vertices_of
    from .rest import checkpointing_statistics

    coordinator = job.coordinator
    config = getattr(job.env, "checkpointing", None)
    store = getattr(coordinator, "store", None)
    return {
        "job": {
            "jid": str(job.job_id),
            "name": str(job.name),
            "state": status,
            "restarts": int(getattr(job, "restarts", 0) or 0),
        },
        "checkpoints": checkpointing_statistics(
            coordinator.stats,
            vertices_of(job.graph, job.env),
            unaligned_by_config=bool(config is not None and config.unaligned),
            retained_ids=None if store is None else [m.checkpoint_id for m in store.checkpoints],
        ),
    }


def save_run_statistics(job: Any, status: str) -> Optional[str]:
    """Writes the run's statistics into its job directory; returns the file's path,
    or None (logged) when there is nothing to write or it cannot be written: the
    job's outcome never depends on this file."""
    coordinator = getattr(job, "coordinator", None)
    storage = getattr(coordinator, "storage", None)
    if storage is None:
        return None
    try:
        body = json.dumps(run_statistics(job, status), indent=1, default=str).encode()
        path = f"{storage.root}/{STATS_FILE}"
        with storage.fs.open_output_stream(path) as out:
            out.write(body)
        return str(storage.uri_of(path))
    except Exception as exc:
        log.warning("could not keep the checkpoint statistics of job %r: %s", getattr(job, "name", "?"), exc)
        return None


def load_statistics(directory: str) -> Dict[str, Any]:
    """A job directory's ``_checkpoint_stats.json``; ``ValueError`` saying why when
    there is none or it is not what a run writes."""
    from ..storage.filesystem import resolve

    fs, root, _ = resolve(directory)
    path = f"{root.rstrip('/')}/{STATS_FILE}"
    info = fs.get_file_info(path)
    if info.type.name != "File":
        raise ValueError(
            f"{directory} has no {STATS_FILE}: it is not a job's checkpoint directory, or its run took no "
            "checkpoint or has not ended (a running job's statistics are on its monitoring server)"
        )
    if info.size is not None and info.size > MAX_STATS_BYTES:
        raise ValueError(f"{path} is {info.size} bytes, more than a run's statistics ({MAX_STATS_BYTES})")
    with fs.open_input_stream(path) as stream:
        data = json.loads(stream.read(MAX_STATS_BYTES + 1))
    if not isinstance(data, dict) or not isinstance(data.get("checkpoints"), dict):
        raise ValueError(f"{path} is not a run's checkpoint statistics")
    return data


def _size(n: Any) -> str:
    from .console import human_bytes

    return human_bytes(float(n or 0))


def render_statistics(data: Dict[str, Any]) -> str:
    """The text view of ``pyengine checkpoints stats``."""
    job = data.get("job", {})
    cps = data["checkpoints"]
    counts = cps.get("counts", {})
    lines: List[str] = [
        f"job {job.get('name', '?')!r}, run {job.get('jid', '?')}: {job.get('state', '?')}, "
        f"{job.get('restarts', 0)} restart(s)",
        f"checkpoints: {counts.get('total', 0)} triggered, {counts.get('completed', 0)} completed, "
        f"{counts.get('failed', 0)} failed, {counts.get('in_progress', 0)} in progress, "
        f"{counts.get('restored', 0)} restored",
    ]
    summary = cps.get("summary", {})
    if counts.get("completed", 0):
        lines.append(f"{'over completed ones':<22}{'min':>10}{'avg':>10}{'p50':>10}{'p99':>10}{'max':>10}")
        for key, label, fmt in (
            ("end_to_end_duration", "end to end (ms)", lambda v: f"{float(v):,.0f}"),
            ("checkpointed_size", "written", _size),
            ("state_size", "full state", _size),
            ("processed_data", "processed in alignment", _size),
            ("persisted_data", "persisted in flight", _size),
        ):
            s = summary.get(key)
            if isinstance(s, dict):
                cells = "".join(f"{fmt(s.get(k, 0)):>10}" for k in ("min", "avg", "p50", "p99", "max"))
                lines.append(f"{label:<22}{cells}")
    latest = cps.get("latest", {})
    for key in ("completed", "savepoint", "failed"):
        cp = latest.get(key)
        if cp:
            extra = cp.get("external_path") or cp.get("failure_message") or ""
            lines.append(f"latest {key}: #{cp['id']} {cp['end_to_end_duration']} ms {extra}".rstrip())
    restored = latest.get("restored")
    if restored:
        lines.append(f"restored from: #{restored['id']} {restored.get('external_path', '')}".rstrip())
    history = cps.get("history", [])
    if history:
        lines.append(
            f"{'id':>5}  {'type':<20} {'status':<11} {'acked':>7} {'duration':>10} {'written':>11} {'full':>11}"
        )
        for cp in history:
            acked = f"{cp.get('num_acknowledged_subtasks', 0)}/{cp.get('num_subtasks', 0)}"
            lines.append(
                f"{cp['id']:>5}  {cp.get('checkpoint_type', ''):<20} {cp.get('status', ''):<11} {acked:>7} "
                f"{cp.get('end_to_end_duration', 0):>7,} ms {_size(cp.get('checkpointed_size')):>11} "
                f"{_size(cp.get('state_size')):>11}"
            )
    return "\n".join(lines)
