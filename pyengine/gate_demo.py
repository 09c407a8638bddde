"""``pyengine gate-demo``: the checkpointed input gate at work, checking itself.

Producer threads (the upstream subtasks) push buffers of records into one gate
and, at the same points of their streams, a barrier for each checkpoint. Like
sources under a coordinator with one checkpoint at a time, they send barrier k
only once checkpoint k - 1 is done, and end only once the last one is. The
consumer keeps a running total and snapshots it whenever the gate triggers a
checkpoint. The demo then checks the promise of each mode: an exactly-once
snapshot (plus, when unaligned, its in-flight buffers) holds exactly the records
sent before the barriers; an at-least-once snapshot holds at least those.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, TextIO, Tuple

from .io import CheckpointBarrier, CheckpointedInputGate, CheckpointOptions, EndOfPartition

RECORDS_PER_BUFFER = 16


@dataclass
class _Task:
    """The consumer side: state, and the listener the gate calls."""

    total: int = 0
    unaligned_mode: bool = False
    done: Dict[int, threading.Event] = field(default_factory=dict)
    snapshots: Dict[int, int] = field(default_factory=dict)
    in_flight_records: Dict[int, int] = field(default_factory=dict)
    alignment_ns: Dict[int, int] = field(default_factory=dict)
    unaligned: Dict[int, bool] = field(default_factory=dict)
    aborted: List[int] = field(default_factory=list)

    def trigger_checkpoint_on_barrier(self, barrier: CheckpointBarrier, metrics: Any) -> None:
        self.snapshots[barrier.checkpoint_id] = self.total
        self.alignment_ns[barrier.checkpoint_id] = metrics.alignment_duration_ns
        self.unaligned[barrier.checkpoint_id] = metrics.unaligned
        if not metrics.unaligned:
            self.done[barrier.checkpoint_id].set()

    def abort_checkpoint_on_barrier(self, checkpoint_id: int, reason: Any) -> None:
        self.aborted.append(checkpoint_id)
        self.done[checkpoint_id].set()

    def add_input_data(self, checkpoint_id: int, channel: int, buffer: List[int]) -> None:
        self.in_flight_records[checkpoint_id] = self.in_flight_records.get(checkpoint_id, 0) + len(buffer)

    def finish_input(self, checkpoint_id: int) -> None:
        self.done[checkpoint_id].set()


def _run_mode(name: str, gate_options: Dict[str, Any], channels: int, buffers: int, checkpoints: int) -> Dict[str, Any]:
    task = _Task(done={cid: threading.Event() for cid in range(1, checkpoints + 1)})
    gate = CheckpointedInputGate(channels, task, capacity=32, **gate_options)
    interval = buffers // (checkpoints + 1)
    sent_before: Dict[int, List[int]] = {cid: [0] * channels for cid in range(1, checkpoints + 1)}

    def produce(ch: int) -> None:
        sent = 0
        for i in range(1, buffers + 1):
            gate.put(ch, [1] * RECORDS_PER_BUFFER)
            sent += RECORDS_PER_BUFFER
            if i % interval == 0 and i // interval <= checkpoints:
                cid = i // interval
                if cid > 1:
                    task.done[cid - 1].wait(30)
                sent_before[cid][ch] = sent
                gate.put(ch, CheckpointBarrier(cid, int(time.time() * 1000), CheckpointOptions()))
            if ch == 0 and i % 64 == 0:
                time.sleep(0.0005)  # one slow upstream, so alignment has something to wait for
        task.done[checkpoints].wait(30)
        gate.put(ch, EndOfPartition())

    threads = [threading.Thread(target=produce, args=(ch,), daemon=True) for ch in range(channels)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    while (r := gate.next(timeout=30)) is not None:
        item = r[1]
        if type(item) is list:
            task.total += len(item)
    elapsed = time.perf_counter() - start
    for t in threads:
        t.join()

    exactly_once = gate_options.get("mode", "exactly_once") == "exactly_once"
    ok = True
    for cid in task.snapshots:
        if cid in task.aborted:
            continue
        expected = sum(sent_before[cid])
        restored = task.snapshots.get(cid, -1) + task.in_flight_records.get(cid, 0)
        ok &= restored == expected if exactly_once else restored >= expected
    return {
        "mode": name,
        "completed": len(task.snapshots),
        "aborted": len(task.aborted),
        "records": task.total,
        "seconds": elapsed,
        "max_alignment_ms": max(task.alignment_ns.values(), default=0) / 1e6,
        "in_flight": sum(task.in_flight_records.values()),
        "ok": ok and len(task.snapshots) - len(task.aborted) > 0,
        "finished": gate.is_finished,
    }


def run(out: TextIO, channels: int = 4, buffers: int = 4000, checkpoints: int = 5) -> bool:
    """Runs the demo in each mode and prints what happened; True if every check held."""
    modes: List[Tuple[str, Dict[str, Any]]] = [
        ("exactly-once, aligned", {"mode": "exactly_once"}),
        ("exactly-once, unaligned", {"mode": "exactly_once", "unaligned": True}),
        ("at-least-once", {"mode": "at_least_once"}),
    ]
    print(
        f"pyengine gate demo: {channels} upstream channels x {buffers} buffers of {RECORDS_PER_BUFFER} records, "
        f"{checkpoints} checkpoints per run",
        file=out,
    )
    header = (
        f"{'mode':26s} {'completed':>9s} {'aborted':>7s} {'records':>9s} {'rec/s':>10s} "
        f"{'max align':>10s} {'in-flight':>10s}  check"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    all_ok = True
    for name, options in modes:
        r = _run_mode(name, options, channels, buffers, checkpoints)
        relation = "==" if "exactly" in name else ">="
        verdict = f"snapshot {relation} records before barriers"
        status = "OK  " if r["ok"] and r["finished"] else "FAIL"
        print(
            f"{name:26s} {r['completed'] - r['aborted']:>9d} {r['aborted']:>7d} {r['records']:>9d} "
            f"{r['records'] / r['seconds']:>10,.0f} {r['max_alignment_ms']:>8.2f}ms {r['in_flight']:>10d}  "
            f"{status} {verdict}",
            file=out,
        )
        all_ok &= r["ok"] and r["finished"]
    print("all checks passed" if all_ok else "SOME CHECKS FAILED", file=out)
    return all_ok
