"""A Structured Streaming ``foreachBatch`` handler that runs the stateful step on pyengine.

``query = df.writeStream.foreachBatch(handler).option("checkpointLocation", ...).start()``:
Spark keeps its sources, offsets and sinks; every micro-batch goes into ONE
long-running pyengine job (an embedded job in the driver process, state kept
across batches), and the handler returns when pyengine has checkpointed the
batch.

How batch ids map to checkpoints. The handler feeds batch ``N`` to the job's
source, waits until the source has read all of it, and triggers a checkpoint
(the job has no periodic ones). The source's checkpointed state records the
last batch id it had read completely, so the completed checkpoint says "state
and output cover Spark batches up to ``N``". Spark replays a batch after a
failure when its commit log lacks it (the handler did not return, or Spark died
before recording it). A replayed ``batch_id``:

- at or below the last batch the restored checkpoint covers: not fed again; its
  output was committed by that checkpoint (a pyengine ``sink``), or is read back
  from where the handler kept it (the output returned to Spark);
- the next one: fed and checkpointed as usual;
- past the next one while pyengine has state: refused (``NonRetryableError``), since
  pyengine's state would miss a batch (its checkpoint storage is not the one this
  query wrote with). Without any pyengine checkpoint, any first batch id is taken:
  that is how a handler is put into a query that ran before.

Spark must replay a batch with the same rows (its offsets make that so for
replayable sources), as for any exactly-once foreachBatch sink.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyarrow as pa
import pyarrow.fs as pafs

from ..connectors.base import Covered, RunInfo, Sink, Source, run_tag
from ..errors import NonRetryableError
from ..storage.filesystem import resolve

__all__ = ["ForeachBatchHandler"]

log = logging.getLogger(__name__)

# Checkpoints come only from the handler, one per micro-batch: the periodic scheduler
# gets an interval of ~31 years (its first tick is drawn uniformly below it).
_NEVER_MS = 10**12
_KEEP_OUTPUTS = 10  # batch outputs kept for replays (Spark replays only its latest batch)


class _MicroBatchSource(Source):
    """The job's source: the micro-batches the handler feeds, read by split 0 in order.

    Its position counts rows over the whole lineage; the rows of a batch stay in
    memory until a completed checkpoint covers the batch, so an in-process restart
    rewinds into them. ``split_state`` (checkpointed with the position) is the last
    batch the split had read completely and where it ended."""

    def __init__(self, schema: Optional[pa.Schema]) -> None:
        self.schema = schema
        self._cond = threading.Condition()
        self._pending: List[Tuple[int, int, pa.RecordBatch]] = []  # (batch id, start, rows) not yet covered
        self._base: Tuple[Optional[int], int] = (None, 0)  # (batch id, end) of the last batch dropped or restored
        self._fed_end = 0
        self._read_to = 0  # where the reader is: every row before it has been emitted
        self._fed_any = False
        self.restored = threading.Event()
        self.restored_batch: Optional[int] = None

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("a ForeachBatchHandler's job runs embedded, in the Spark driver; it does not travel")

    # -- the handler's side ------------------------------------------------------------------

    def feed(self, batch_id: int, rows: pa.RecordBatch) -> int:
        """Adds a micro-batch; returns the position after it."""
        with self._cond:
            start = self._fed_end
            self._pending.append((batch_id, start, rows))
            self._fed_end = start + rows.num_rows
            self._fed_any = True
            return self._fed_end

    def wait_read(self, end: int, alive: Callable[[], bool]) -> bool:
        """Waits until the reader has emitted every row before ``end``; False when the job ended."""
        with self._cond:
            while self._read_to < end:
                if not alive():
                    return False
                self._cond.wait(0.05)
            return True

    def covered(self, batch_id: int) -> None:
        """A completed checkpoint covers batches up to ``batch_id``: their rows go."""
        with self._cond:
            done = [p for p in self._pending if p[0] <= batch_id]
            if done:
                last = done[-1]
                self._base = (last[0], last[1] + last[2].num_rows)
            self._pending = [p for p in self._pending if p[0] > batch_id]

    # -- the job's side ----------------------------------------------------------------------

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if subtask != 0:
            return None  # one split: batches keep Spark's order
        with self._cond:
            out: Any = []
            for _, start, rows in self._pending:
                if start <= position < start + rows.num_rows:
                    out = rows.slice(position - start, n)
                    break
            else:
                first = self._pending[0][1] if self._pending else self._fed_end
                if position < first:
                    raise NonRetryableError(
                        f"foreachBatch source: the restored position {position} is before the rows kept ({first}); "
                        "the job was restored from a checkpoint older than the batches it has dropped"
                    )
            self._read_to = position + len(out)
            self._cond.notify_all()
            return out

    def split_state(self, subtask: int, parallelism: int) -> Any:
        if subtask != 0:
            return None
        with self._cond:
            batch, end = self._base
            for batch_id, start, rows in self._pending:
                if start + rows.num_rows <= self._read_to:
                    batch, end = batch_id, start + rows.num_rows
            return None if batch is None else {"spark_batch_id": batch, "end": end}

    def restore_split_state(self, subtask: int, parallelism: int, state: Any) -> None:
        if subtask != 0:
            return
        with self._cond:
            batch = None if state is None else int(state["spark_batch_id"])
            end = 0 if state is None else int(state["end"])
            if not self._fed_any:  # a new handler resuming: positions continue after the batch
                self._base, self._fed_end = (batch, end), end
            # The reader starts again from the restored position (an in-process restart
            # rewinds it): rows it emitted before the failure are in no state now, so a
            # batch counts as read, for wait_read and split_state, only once it is read
            # again. `end` is at or before that position; the first read moves it there.
            self._read_to = end
            self.restored_batch = batch
        self.restored.set()


class _BatchOutputSink(Sink):
    """The job's sink when the output goes back to Spark: what each micro-batch's
    checkpoint staged, kept in memory for the handler and written as Arrow files
    under ``<root>/batch-<id>/`` for replays. A batch's files count only once its
    ``_COMMITTED`` marker names the run and checkpoint that staged them."""

    def __init__(self, root: str, schema: Optional[pa.Schema]) -> None:
        self._lock = threading.Lock()
        self.fs, self.root, _ = resolve(root)
        self.schema = schema
        self.current_batch = -1  # the batch being fed: the handler sets it before feeding
        self._run = ""
        self._staged: Dict[int, List[pa.Table]] = {}  # checkpoint id -> tables (this run)

    def begin_run(self, run: RunInfo) -> None:
        self._run = run.run_id
        self.fs.create_dir(self.root, recursive=True)

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        table = _table(records, self.schema)
        directory = f"{self.root}/batch-{self.current_batch}"
        self.fs.create_dir(directory, recursive=True)
        name = f"{directory}/{run_tag(self._run)}-{checkpoint_id}-{subtask}.arrow"
        with self.fs.open_output_stream(name) as out, pa.ipc.new_file(out, table.schema) as writer:
            writer.write_table(table)
        with self._lock:
            self._staged.setdefault(checkpoint_id, []).append(table)

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        pass  # the handler marks the batch committed once the checkpoint completes

    def recover(self, covered: Covered) -> None:
        with self._lock:  # what an aborted attempt staged is staged again by the next
            self._staged.clear()

    def take(self, checkpoint_id: int) -> Tuple[Optional[pa.Table], List[int]]:
        """The output ``checkpoint_id`` commits, and the checkpoint ids it was staged
        under: every id up to it since the last take (a checkpoint that was declined
        after the sink staged at its barrier left its output to the next one)."""
        with self._lock:
            ids = sorted(c for c in self._staged if c <= checkpoint_id)
            tables = [t for c in ids for t in self._staged.pop(c)]
        return _concat(tables, self.schema), ids

    def mark(self, batch_id: int, run_id: str, checkpoint_id: int, staged: Optional[List[int]] = None) -> None:
        directory = f"{self.root}/batch-{batch_id}"
        self.fs.create_dir(directory, recursive=True)
        body = {"run_id": run_id, "checkpoint_id": checkpoint_id, "staged": staged or [checkpoint_id]}
        temp = f"{directory}/._COMMITTED.tmp"  # written whole, then moved: a reader never sees half
        with self.fs.open_output_stream(temp) as out:
            out.write(json.dumps(body).encode())
        self.fs.move(temp, f"{directory}/_COMMITTED")
        old = f"{self.root}/batch-{batch_id - _KEEP_OUTPUTS}"
        if self.fs.get_file_info(old).type == pafs.FileType.Directory:
            self.fs.delete_dir(old)

    def marked(self, batch_id: int) -> bool:
        return self.fs.get_file_info(f"{self.root}/batch-{batch_id}/_COMMITTED").type == pafs.FileType.File

    def read(self, batch_id: int) -> Optional[pa.Table]:
        """The committed output of a batch (a replay), from its files."""
        directory = f"{self.root}/batch-{batch_id}"
        try:
            with self.fs.open_input_stream(f"{directory}/_COMMITTED") as f:
                marker = json.loads(f.read())
            ids = [int(c) for c in marker.get("staged", [marker["checkpoint_id"]])]
        except (FileNotFoundError, OSError, ValueError, KeyError, TypeError):
            raise NonRetryableError(
                f"foreachBatch: Spark replays batch {batch_id}, which pyengine's checkpoint covers, but its "
                f"output is no longer kept in {directory} (the last {_KEEP_OUTPUTS} batches are)"
            ) from None
        prefixes = tuple(f"{run_tag(marker['run_id'])}-{c}-" for c in ids)
        tables = []
        for info in sorted(self.fs.get_file_info(pafs.FileSelector(directory)), key=lambda i: i.path):
            if info.base_name.startswith(prefixes) and info.base_name.endswith(".arrow"):
                with self.fs.open_input_file(info.path) as f:
                    tables.append(pa.ipc.open_file(f).read_all())
        return _concat(tables, self.schema)


def _table(records: Any, schema: Optional[pa.Schema]) -> pa.Table:
    if isinstance(records, pa.Table):
        return records if schema is None else records.select(schema.names).cast(schema)
    rows = list(records)
    if schema is not None and rows and not isinstance(rows[0], dict):
        rows = [dict(zip(schema.names, r, strict=True)) for r in rows]
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise NonRetryableError(
            f"foreachBatch: the pipeline's output cannot become the batch's DataFrame ({exc}): emit dicts, or "
            "give output_schema= for tuples"
        ) from None


def _concat(tables: List[pa.Table], schema: Optional[pa.Schema]) -> Optional[pa.Table]:
    if not tables:
        return None if schema is None else schema.empty_table()
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


def _session_time_zone(df: Any) -> str:
    """The session's time zone (how Spark shows the micro-batches' timestamps), or UTC."""
    try:
        return str(df.sparkSession.conf.get("spark.sql.session.timeZone") or "UTC")
    except Exception:  # a session without the setting (or a stand-in DataFrame): instants are UTC anyway
        return "UTC"


def _arrow_schema(schema: Any) -> Optional[pa.Schema]:
    """``output_schema`` as Arrow: a ``pyarrow.Schema``, a Spark ``StructType`` or a DDL string."""
    if schema is None or isinstance(schema, pa.Schema):
        return schema
    from pyspark.sql.types import StructType, _parse_datatype_string

    from .tws_schema import spark_arrow_schema

    struct = _parse_datatype_string(schema) if isinstance(schema, str) else schema
    if not isinstance(struct, StructType):
        raise TypeError(f"output_schema must be a pyarrow.Schema, a StructType or a DDL string, got {schema!r}")
    return spark_arrow_schema(struct)


class ForeachBatchHandler:
    """``df.writeStream.foreachBatch(handler)``: each micro-batch through one long-running
    pyengine job, exactly once against Spark's batch ids (see the module docstring).

    ``build(stream)`` gets the micro-batches as a ``DataStream`` of Arrow batches (the
    DataFrame's columns; per-record operators see dicts) and returns the stream to
    output, without ``sink_to``; it runs when the handler starts its job, on the
    first batch (the schema is known then: columns are checked).

    Where the output goes:

    - ``sink=`` a pyengine sink (``FileSink``, ``DeltaSink``): committed by the batch's
      checkpoint, two-phase, as in any pyengine job; the handler returns None;
    - otherwise back to Spark: ``handler(df, batch_id)`` returns the batch's output as
      a DataFrame (dicts become columns; tuples need ``output_schema``) and calls
      ``output(out_df, batch_id)`` when given, where the user writes it with Spark.
      A replayed batch gets the same output again, so a Spark write keyed by the
      batch id (Delta's ``txnAppId``/``txnVersion``, an overwrite of the batch's
      partition) is exactly once end to end.

    ``checkpoint_storage``: where the job checkpoints (a path or URI); the job is
    called ``name`` there, and a handler made again with the same two (a restarted
    driver) resumes it. ``env``: a ``pe.StreamEnvironment`` whose settings the job
    takes (parallelism, state backend, restarts...); its checkpointing is replaced
    by one checkpoint per batch. The job runs embedded, in the driver process, so a
    micro-batch is collected to the driver (``df.toArrow()``). Spark Connect runs
    foreachBatch functions elsewhere (in a server-side Python process): use a
    classic session.

    ``close()`` (or ``with``) stops the job; its state stays in the last checkpoint."""

    def __init__(
        self,
        build: Callable[[Any], Any],
        *,
        name: str,
        checkpoint_storage: str,
        sink: Optional[Sink] = None,
        output: Optional[Callable[[Any, int], None]] = None,
        output_schema: Any = None,
        env: Any = None,
    ) -> None:
        if not callable(build):
            raise TypeError(f"ForeachBatchHandler build must be a function of the stream, got {build!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"ForeachBatchHandler needs a job name, got {name!r}")
        if not isinstance(checkpoint_storage, str) or not checkpoint_storage:
            raise ValueError(
                f"ForeachBatchHandler needs checkpoint_storage (a path or URI), got {checkpoint_storage!r}"
            )
        if sink is not None and not isinstance(sink, Sink):
            raise TypeError(f"ForeachBatchHandler sink must be a pyengine sink, got {sink!r}")
        if sink is not None and output is not None:
            raise ValueError("ForeachBatchHandler: give sink= (pyengine writes) or output= (Spark writes), not both")
        if output is not None and not callable(output):
            raise TypeError(f"ForeachBatchHandler output must be a function (out_df, batch_id), got {output!r}")
        self.build = build
        self.name = name
        self.checkpoint_storage = checkpoint_storage
        self.sink = sink
        self.output = output
        self.output_schema = _arrow_schema(output_schema)
        self._template = env
        self._lock = threading.Lock()
        self._client: Any = None
        self._source: Optional[_MicroBatchSource] = None
        self._capture: Optional[_BatchOutputSink] = None
        self._last: Optional[int] = None  # the last batch a completed checkpoint covers
        self._unmarked: Optional[Tuple[int, str, int, List[int], Optional[pa.Table]]] = None
        self.batch_times_s: List[float] = []  # per fed batch: feed to checkpoint completed

    # -- the job -----------------------------------------------------------------------------

    def _environment(self) -> Any:
        """A fresh environment with the template's settings: every start of the job
        needs its own (an environment runs one pipeline). The handler builds on the
        public API (``pe.StreamEnvironment``, looked up now, as a user's code would):
        this package sits below ``pyengine.api`` in the layer order."""
        import pyengine as pe

        settings: Dict[str, Any] = {}
        if self._template is not None:
            for param in list(inspect.signature(type(self._template).__init__).parameters)[1:]:
                if hasattr(self._template, param):
                    settings[param] = getattr(self._template, param)
        settings["checkpoint_storage"] = self.checkpoint_storage
        settings["checkpointing"] = pe.CheckpointConfig(interval_ms=_NEVER_MS, min_pause_ms=0, max_concurrent=1)
        return pe.StreamEnvironment(**settings)

    def _alive(self) -> bool:
        return self._client is not None and not self._client.done()

    def _start(self, df: Any) -> None:
        from .tws_schema import spark_arrow_schema

        env = self._environment()
        source = _MicroBatchSource(spark_arrow_schema(df.schema, _session_time_zone(df)))
        stream = self.build(env.from_source(source, "spark-micro-batches"))
        if stream is None or not hasattr(stream, "sink_to"):
            raise TypeError(f"ForeachBatchHandler build must return the stream to output, got {stream!r}")
        capture = None
        if self.sink is None:
            root = f"{self.checkpoint_storage.rstrip('/')}/_foreach_batch/{self.name}"
            capture = _BatchOutputSink(root, self.output_schema)
        stream.sink_to(self.sink if self.sink is not None else capture)
        client = env.execute_async(self.name, resume="auto")
        self._client, self._source, self._capture = client, source, capture
        while not source.restored.wait(0.05):
            if client.done():
                client.wait()  # raises why it failed
                raise RuntimeError(f"foreachBatch job {self.name!r} ended before it started")
        self._last = source.restored_batch
        if capture is not None and self._last is not None and not capture.marked(self._last):
            # The checkpoint completed but the handler died before marking its batch:
            # its files are the ones staged by the restored checkpoint.
            run_id, checkpoint_id = client._runner.run_info.restored[-1]
            capture.mark(self._last, run_id, checkpoint_id)
        log.info("foreachBatch job %r running; pyengine covers Spark batches up to %s", self.name, self._last)

    def _checkpoint(self, batch_id: int, end: int) -> int:
        """One completed checkpoint after the source has read the whole batch (see the
        module docstring); returns its id. A restart of the job in between rewinds the
        source, so the wait and the checkpoint are taken again."""
        from ..coordinator import CheckpointException

        client = self._client
        runner = client._runner  # the embedded runner: its coordinator triggers, its restarts count
        while self._alive():
            restarts = runner.restarts
            if not self._source.wait_read(end, self._alive):  # type: ignore[union-attr]
                break
            future = runner.coordinator.trigger_checkpoint(aligned=True)
            while not future.done() and self._alive():
                time.sleep(0.001)
            if not future.done():
                break
            try:
                metadata = future.result()
            except CheckpointException as exc:
                log.info("checkpoint for Spark batch %d did not complete (%s); again", batch_id, exc)
                time.sleep(0.01)
                continue
            if runner.restarts == restarts:
                return int(metadata.checkpoint_id)
        client.wait()  # the job ended: raises its failure
        raise RuntimeError(f"foreachBatch job {self.name!r} ended while Spark batch {batch_id} was in it")

    # -- foreachBatch ------------------------------------------------------------------------

    def __call__(self, df: Any, batch_id: int) -> Any:
        """Spark's foreachBatch function: the batch's output DataFrame, or None with ``sink``."""
        with self._lock:
            if not self._alive():
                if self._client is not None:
                    self._client.wait(raise_failure=False)
                self._start(df)
            out = self._process(df, int(batch_id))
        if self._capture is None:
            return None
        out_df = df.sparkSession.createDataFrame(out) if out is not None else None
        if out_df is not None and self.output is not None:
            self.output(out_df, int(batch_id))
        return out_df

    def _process(self, df: Any, batch_id: int) -> Optional[pa.Table]:
        last = self._last
        if last is not None and batch_id <= last:
            log.info("foreachBatch %r: Spark replays batch %d, which pyengine covers already", self.name, batch_id)
            if self._capture is None:
                return None
            if self._unmarked is not None and self._unmarked[0] == batch_id:
                _, run_id, checkpoint_id, staged, out = self._unmarked
                self._capture.mark(batch_id, run_id, checkpoint_id, staged)
                self._unmarked = None
                return out
            return self._capture.read(batch_id)
        if last is not None and batch_id != last + 1:
            raise NonRetryableError(
                f"foreachBatch {self.name!r}: Spark sends batch {batch_id}, but pyengine's state in "
                f"{self.checkpoint_storage} covers batches up to {last}: batches {last + 1}..{batch_id - 1} would "
                "be missing from it. Is this the checkpoint storage this query ran with?"
            )
        assert self._source is not None
        table = df.toArrow()
        schema = self._source.schema
        if schema is not None and table.schema != schema:
            table = table.cast(schema)  # a timestamp's zone named otherwise (Etc/UTC, UTC): the same instants
        rows = table.combine_chunks().to_batches()
        batch = rows[0] if len(rows) == 1 else pa.RecordBatch.from_pylist([], table.schema)
        if len(rows) > 1:  # combine_chunks gives one chunk; kept general
            batch = pa.concat_batches(rows)
        if self._capture is not None:
            self._capture.current_batch = batch_id
        started = time.perf_counter()
        end = self._source.feed(batch_id, batch)
        checkpoint_id = self._checkpoint(batch_id, end)
        self._source.covered(batch_id)
        self._last = batch_id
        out = None
        if self._capture is not None:
            out, staged = self._capture.take(checkpoint_id)
            # kept until marked: if the mark fails (storage), Spark retries the batch, and
            # the retry marks it and gets this output instead of a refusal
            self._unmarked = (batch_id, self._client._runner.job_id, checkpoint_id, staged, out)
            self._capture.mark(batch_id, self._client._runner.job_id, checkpoint_id, staged)
            self._unmarked = None
        self.batch_times_s.append(time.perf_counter() - started)
        return out

    @property
    def last_batch_id(self) -> Optional[int]:
        """The last Spark batch id pyengine's checkpoints cover (None: none yet)."""
        return self._last

    @property
    def job(self) -> Any:
        """The running job's ``JobClient`` (None before the first batch)."""
        return self._client

    def close(self) -> None:
        """Stops the job (its state stays in the last checkpoint; a handler made again
        with the same name and storage resumes it)."""
        with self._lock:
            client, self._client = self._client, None
            if client is not None and not client.done():
                client.cancel()
                client.wait(60, raise_failure=False)

    def __enter__(self) -> ForeachBatchHandler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
