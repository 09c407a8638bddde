"""The ``pyengine`` command: the demo job, the gate demo, checkpoint inspection, and tuning."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from .storage.metadata import CheckpointMetadata

from . import __version__


def main(argv: Optional[List[str]] = None) -> int:
    """The ``pyengine`` command. Its output piped into a reader that stops early
    (``pyengine checkpoints list ... | head``) ends the command quietly, as Unix tools
    do, instead of a BrokenPipeError traceback."""
    try:
        try:
            code = _main(argv)
        finally:  # --help and --version end in SystemExit: their output is flushed here too
            sys.stdout.flush()  # a closed pipe shows here, still inside the handler
        return code
    except BrokenPipeError:
        # Python's own advice: stdout goes to devnull, so the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a command ended by SIGPIPE (128 + 13)


def _main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pyengine", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pyengine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a stateful job, crash it mid-run, recover, and check the output")
    demo.add_argument("--events", type=int, default=2_000_000, help="clicks in the stream (default 2,000,000)")
    demo.add_argument("--users", type=int, default=50_000, help="distinct users (default 50,000)")
    demo.add_argument("--parallelism", type=int, default=2, help="subtasks per operator (default 2)")
    demo.add_argument("--interval-ms", type=int, default=200, help="checkpoint interval (default 200 ms)")
    demo.add_argument("--seed", type=int, default=7, help="clickstream seed (default 7)")
    demo.add_argument("--no-failure", action="store_true", help="do not inject the failure")
    demo.add_argument("--workdir", help="keep checkpoints and output here (default: a temporary directory)")

    gate = sub.add_parser("gate-demo", help="run the checkpointed input gate in every mode and check its snapshots")
    gate.add_argument("--channels", type=int, default=4, help="upstream channels (default 4)")
    gate.add_argument("--buffers", type=int, default=4000, help="buffers per channel (default 4000)")
    gate.add_argument("--checkpoints", type=int, default=5, help="checkpoints per run (default 5)")

    checkpoints = sub.add_parser("checkpoints", help="list or inspect checkpoints and savepoints")
    what = checkpoints.add_subparsers(dest="action", required=True)
    listing = what.add_parser(
        "list", help="the jobs under a checkpoint storage root, or the completed checkpoints of one job's directory"
    )
    listing.add_argument("dir", help="a checkpoint storage root or a job's checkpoint directory (path or URI)")
    listing.add_argument("--json", action="store_true", help="print the jobs or checkpoints as JSON")
    inspect = what.add_parser("inspect", help="what one checkpoint or savepoint holds")
    inspect.add_argument("path", help="a chk-<n> or savepoint directory, or its _metadata file")
    inspect.add_argument("--json", action="store_true", help="print the metadata as JSON")
    stats = what.add_parser("stats", help="a finished run's checkpoint statistics (counts, summary, history)")
    stats.add_argument("dir", help="a job's checkpoint directory (path or URI)")
    stats.add_argument("--json", action="store_true", help="print them as the REST API shapes them (Flink's)")

    tune = sub.add_parser(
        "tune",
        help="measure a job across buffer and checkpoint settings and recommend some",
        description="Runs the job (short runs, a coordinate search with successive halving) across buffer size, "
        "buffer timeout, channel capacity, checkpoint interval and aligned/unaligned checkpoints, measures "
        "throughput, latency, checkpoint duration and recovery for each, and recommends settings for the goal.",
    )
    tune.add_argument(
        "job",
        nargs="?",
        default="keyed-count",
        help="module:function that builds the pipeline on the environment it is given (build(env)), "
        "or a built-in job (default: keyed-count)",
    )
    tune.add_argument("--goal", choices=("throughput", "latency"), default="throughput", help="what to optimise")
    tune.add_argument("--max-latency-ms", type=float, help="constraint: end-to-end latency p99")
    tune.add_argument("--max-recovery-s", type=float, help="constraint: restore plus replay of one interval")
    tune.add_argument(
        "--budget-s",
        type=float,
        default=120.0,
        help="time for the search (default 120 s); the finalists' and the confirming runs come after it",
    )
    tune.add_argument("--trial-s", type=float, default=1.0, help="length of the shortest run (default 1 s)")
    tune.add_argument("--parallelism", type=int, default=2, help="subtasks per operator (default 2)")
    tune.add_argument("--latency-field", help="a column or key holding each record's creation time (s since epoch)")
    tune.add_argument("--input-rate", type=float, help="the job's input rate in production (records/s), for recovery")
    tune.add_argument("--report", default="pyengine-tune-report", help="directory for report.html and its figures")
    tune.add_argument("--benchmark-json", help="also write the runs as pytest-benchmark JSON here")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag, values in (
        ("buffer-sizes", "buffer sizes ('auto': the engine's choice)"),
        ("buffer-timeouts-ms", "buffer timeouts"),
        ("channel-capacities", "channel capacities ('auto': the engine's choice)"),
        ("intervals-ms", "checkpoint intervals"),
    ):
        tune.add_argument(f"--{flag}", help=f"the {values} to try, comma-separated (default: a built-in range)")
    tune.add_argument("--aligned-only", action="store_true", help="do not try unaligned checkpoints")

    args = parser.parse_args(argv)
    if args.command == "tune":
        return _tune(parser, args)
    if args.command == "demo":
        from . import demo as demo_module

        for name in ("events", "users", "parallelism", "interval_ms"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1")
        ok = demo_module.run(
            sys.stdout,
            events=args.events,
            users=args.users,
            parallelism=args.parallelism,
            interval_ms=args.interval_ms,
            seed=args.seed,
            workdir=args.workdir,
            fail=not args.no_failure,
        )
        return 0 if ok else 1
    if args.command == "gate-demo":
        from . import gate_demo

        if args.channels < 1 or args.buffers < 1 or args.checkpoints < 1:
            parser.error("--channels, --buffers and --checkpoints must be >= 1")
        if args.buffers < 2 * args.checkpoints:
            parser.error(f"--buffers must be at least twice --checkpoints ({2 * args.checkpoints})")
        return 0 if gate_demo.run(sys.stdout, args.channels, args.buffers, args.checkpoints) else 1
    if args.command == "checkpoints":
        try:
            if args.action == "list":
                return _list(args.dir, args.json)
            if args.action == "stats":
                from .monitoring.history import load_statistics, render_statistics

                data = load_statistics(args.dir)
                print(json.dumps(data, indent=2, sort_keys=True) if args.json else render_statistics(data))
                return 0
            return _inspect(args.path, args.json)
        except BrokenPipeError:
            raise  # the reader left: main() ends quietly
        except (OSError, ValueError) as exc:
            print(f"pyengine checkpoints {args.action}: {exc}", file=sys.stderr)
            return 1
    return 2  # pragma: no cover - argparse enforces a command


def _tune(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import os

    from rich.console import Console

    from .tune import tune
    from .tune.report import print_table

    if args.parallelism < 1:
        parser.error("--parallelism must be >= 1")
    for name in ("max_latency_ms", "max_recovery_s", "budget_s", "trial_s", "input_rate"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    from .tune.settings import DEFAULT_SPACE

    space = dict(DEFAULT_SPACE)
    for option, setting in (
        ("buffer_sizes", "buffer_size"),
        ("buffer_timeouts_ms", "buffer_timeout_ms"),
        ("channel_capacities", "channel_capacity"),
        ("intervals_ms", "interval_ms"),
    ):
        given = getattr(args, option)
        if given is not None:
            try:
                space[setting] = tuple(
                    (None if setting in ("buffer_size", "channel_capacity") else "auto")
                    if setting in ("buffer_size", "channel_capacity", "interval_ms") and v.strip() == "auto"
                    else int(v)
                    for v in given.split(",")
                    if v.strip()
                )
            except ValueError:
                parser.error(
                    f"--{option.replace('_', '-')} takes integers (or auto, for sizes, capacities and intervals) "
                    f"separated by commas, got {given!r}"
                )
    if args.aligned_only:
        space["unaligned"] = (False,)
    if os.getcwd() not in sys.path:  # module:function names the user's module, as `python -m` finds it
        sys.path.insert(0, os.getcwd())
    try:
        result = tune(
            args.job,
            goal=args.goal,
            max_latency_ms=args.max_latency_ms,
            max_recovery_s=args.max_recovery_s,
            budget_s=args.budget_s,
            trial_s=args.trial_s,
            parallelism=args.parallelism,
            latency_field=args.latency_field,
            input_rate_per_s=args.input_rate,
            report_dir=args.report,
            benchmark_json=args.benchmark_json,
            progress=not args.no_progress,
            space=space,
        )
    except (ImportError, ValueError, TypeError, RuntimeError) as exc:
        message = str(exc)
        # the library's messages start "tune: ", which the command's prefix already says
        print(f"pyengine tune: {message.removeprefix('tune: ')}", file=sys.stderr)
        return 1
    # a pipe or a file gets the whole table, not one squeezed to 80 columns
    print_table(result, Console() if sys.stdout.isatty() else Console(width=200))
    for what, path in sorted(result.files.items()):
        print(f"{what}: {path}")
    return 0 if all(result.honoured.values()) else 3


def _list(directory: str, as_json: bool = False) -> int:
    from pyarrow.fs import FileSelector

    from .storage.filesystem import resolve
    from .storage.jobs import describe_jobs, list_jobs, read_job
    from .storage.metadata import load_metadata

    fs, root, prefix = resolve(directory)
    info = fs.get_file_info(root)
    if info.type.name != "Directory":
        raise ValueError(f"{directory} is not a directory")
    job = read_job(directory)
    if job is None:
        jobs = list_jobs(directory)
        if jobs and as_json:
            print(json.dumps({"jobs": [_job_json(j) for j in jobs]}, indent=2))
            return 0
        if jobs:  # a storage root: one line per job, then `list` one of them for its checkpoints
            print(f"{len(jobs)} job(s) under {directory}:")
            print(describe_jobs(jobs))
            return 0
    elif not as_json:
        runs = ", ".join(f"{r.run_id} {r.status.lower()}" for r in job.runs) or "none recorded"
        print(f"job {job.job_name or '(unnamed)'!r} in {job.uri} ({job.state}); runs: {runs}")
    found: List[Tuple[int, str, Optional[CheckpointMetadata], str]] = []
    for entry in fs.get_file_info(FileSelector(root, recursive=True)):
        if entry.base_name != "_metadata":
            continue
        path = prefix + entry.path.rsplit("/", 1)[0]
        try:
            loaded = load_metadata(path)
        except (OSError, ValueError) as exc:
            found.append((0, path, None, str(exc)))
            continue
        found.append((loaded.checkpoint_id, path, loaded, ""))
    if as_json:
        checkpoints = [
            {"id": c, "path": p, "error": e}
            if m is None
            else {
                "id": c,
                "path": p,
                "type": m.type,
                "timestamp": m.timestamp,
                "operators": len(m.operators),
                "state_size": sum(getattr(h, "state_size", 0) for h in m.handles()),
            }
            for c, p, m, e in sorted(found, key=lambda f: (f[0], f[1]))
        ]
        print(json.dumps({"job": None if job is None else _job_json(job), "checkpoints": checkpoints}, indent=2))
        return 0 if found else 1
    if not found:
        print(f"no completed checkpoints under {directory}")
        return 1
    print(f"{'id':>5}  {'type':<10} {'taken (UTC)':<20} {'operators':>9} {'size':>12}  path")
    for cid, path, meta, error in sorted(found, key=lambda f: (f[0], f[1])):
        if meta is None:
            print(f"{'?':>5}  {'unreadable':<10} {'':<20} {'':>9} {'':>12}  {path}: {error}")
            continue
        size = sum(getattr(h, "state_size", 0) for h in meta.handles())
        print(
            f"{cid:>5}  {meta.type:<10} {_utc(meta.timestamp):<20} {len(meta.operators):>9} "
            f"{size / 1024:>9,.1f} KiB  {path}"
        )
    return 0


def _job_json(job: Any) -> Dict[str, Any]:
    return {
        "name": job.job_name,
        "uri": job.uri,
        "state": job.state,
        "checkpoints": list(job.checkpoints),
        "runs": [{"run_id": r.run_id, "status": r.status} for r in job.runs],
    }


def _inspect(path: str, as_json: bool) -> int:
    from .storage.metadata import load_metadata

    meta = load_metadata(path)
    if as_json:
        print(json.dumps(meta.to_json(), indent=2, sort_keys=True))
        return 0
    name = f"job {meta.job_name!r}, run {meta.job_id}" if meta.job_name else f"run {meta.job_id}"
    print(f"{meta.type} {meta.checkpoint_id} of {name}, taken {_utc(meta.timestamp)} UTC")
    if meta.runs:
        print("  output lineage: " + " -> ".join(f"{r[:12]} to chk-{c}" for r, c in meta.runs))
    if meta.shared:
        print(f"  shares {len(meta.shared)} incremental file(s) with earlier checkpoints")
    for uid, op in sorted(meta.operators.items()):
        keyed = [h for s in op.subtasks.values() for h in s.keyed]
        operator = [h for s in op.subtasks.values() for h in s.operator]
        size = sum(getattr(h, "state_size", 0) for h in keyed + operator)
        detail: Dict[str, Any] = {"keyed handles": len(keyed), "operator handles": len(operator)}
        print(
            f"  {uid}: parallelism {op.parallelism}/{op.max_parallelism}, {size / 1024:,.1f} KiB, "
            + ", ".join(f"{v} {k}" for k, v in detail.items())
        )
    return 0


def _utc(timestamp_ms: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(timestamp_ms / 1000, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


if __name__ == "__main__":
    sys.exit(main())
