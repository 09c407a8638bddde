"""``spark.read.format("pyengine-state")``: pyengine's keyed state as a Spark DataFrame.

The counterpart of Spark's own ``statestore`` reader (``spark.read.format("statestore")
.option("operatorId", ...).load(checkpointLocation)``), through Spark's Python Data
Source API, on ``pyengine.state.read_keyed_state``::

    pyengine.spark.register_state_source(spark)
    counts = (
        spark.read.format("pyengine-state")
        .option("operator", "counts")        # the operator's uid
        .option("stateName", "count")        # the state's name
        .option("checkpointId", 7)           # optional: default the latest completed
        .load("/checkpoints/clicks")         # a checkpoint, a job's directory, or a storage root
    )

One row per key and state entry: ``key``, ``value`` (the state's Arrow type where it
has one; bytes otherwise) and ``key_group``; a list state one row per element, as
Spark's reader gives it (its ``flattenCollectionTypes`` option, on by default; set it
to ``false`` for one row per key with the list as ``value``). The path is what ``restore_from`` takes:
a ``chk-<n>`` or savepoint directory (or its ``_metadata``), a job's directory (its
latest completed checkpoint, or ``checkpointId``), or a checkpoint storage root holding
one job (``jobName`` picks one of several). The files are read where Spark runs the
read (an executor's Python worker): on a cluster, storage every executor reaches.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from ..state.reader import read_keyed_state
from ..storage.jobs import describe_jobs, list_jobs, read_job

__all__ = ["FORMAT", "StateDataSource", "register_state_source"]

FORMAT = "pyengine-state"

_ALIASES = {  # Spark's statestore reader's names, for users coming from it
    "operatoruid": "operator",
    "statevarname": "statename",
    "batchid": "checkpointid",
}


def _options(options: Dict[str, Any]) -> Dict[str, str]:
    """Options by lower-case name (Spark's are case-insensitive), aliases resolved."""
    out: Dict[str, str] = {}
    for key, value in options.items():
        name = key.lower()
        out[_ALIASES.get(name, name)] = str(value)
    return out


def checkpoint_path(path: str, checkpoint_id: Optional[int] = None, job_name: Optional[str] = None) -> str:
    """The checkpoint directory ``path`` names (see the module docstring)."""
    from ..storage.metadata import load_metadata

    if checkpoint_id is None:
        try:
            load_metadata(path)
            return path
        except (OSError, ValueError):
            pass
    job = read_job(path)
    if job is None:
        jobs = list_jobs(path)
        if job_name is not None:
            jobs = [j for j in jobs if j.job_name == job_name]
        if len(jobs) != 1:
            found = describe_jobs(list_jobs(path)) if list_jobs(path) else "nothing pyengine wrote"
            which = f" named {job_name!r}" if job_name is not None else ""
            raise ValueError(
                f"pyengine-state: {path!r} is not a checkpoint or a job's directory, and holds "
                f"{len(jobs)} job(s){which} (set the jobName option to pick one):\n{found}"
            )
        job = jobs[0]
    if not job.checkpoints:
        raise ValueError(f"pyengine-state: job {job.job_name!r} in {job.uri} has no completed checkpoint")
    if checkpoint_id is None:
        checkpoint_id = job.checkpoints[-1]
    elif checkpoint_id not in job.checkpoints:
        raise ValueError(
            f"pyengine-state: job {job.job_name!r} in {job.uri} has no completed checkpoint {checkpoint_id}; "
            f"it has {job.checkpoints}"
        )
    return f"{job.uri.rstrip('/')}/chk-{checkpoint_id}"


class _Request:
    """The read the options ask for, checked on the driver."""

    def __init__(self, options: Dict[str, Any]) -> None:
        opts = _options(options)
        path = opts.get("path")
        if not path:
            raise ValueError(
                'pyengine-state needs the checkpoint\'s path: spark.read.format("pyengine-state").load(path)'
            )
        for required in ("operator", "statename"):
            if not opts.get(required):
                name = {"operator": "operator", "statename": "stateName"}[required]
                raise ValueError(f"pyengine-state needs the {name!r} option")
        checkpoint_id = opts.get("checkpointid")
        self.path = checkpoint_path(path, int(checkpoint_id) if checkpoint_id else None, opts.get("jobname"))
        self.operator = opts["operator"]
        self.state_name = opts["statename"]
        self.allow_pickle = opts.get("allowpickle", "false").lower() == "true"
        self.flatten = opts.get("flattencollectiontypes", "true").lower() == "true"

    def table(self) -> pa.Table:
        table = read_keyed_state(self.path, self.operator, self.state_name, allow_pickle=self.allow_pickle)
        if self.flatten:
            table = flatten_lists(table)
        return table


def flatten_lists(table: pa.Table) -> pa.Table:
    """A list state's table (``value`` a list per key) as one row per element, its key
    and key group repeated, in the list's order; other tables as they are."""
    import pyarrow.compute as pc

    index = table.schema.get_field_index("value")
    if index < 0 or not (
        pa.types.is_list(table.schema.field(index).type) or pa.types.is_large_list(table.schema.field(index).type)
    ):
        return table
    values = table.column("value").combine_chunks()
    parents = pc.list_parent_indices(values)
    flat = pc.list_flatten(values)
    out = table.take(parents)
    return out.set_column(index, pa.field("value", flat.type), flat)


class StateDataSource(DataSource):
    """The ``pyengine-state`` format; register it with ``register_state_source(spark)``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def __init__(self, options: Dict[str, str]) -> None:
        super().__init__(options)
        self._request = _Request(dict(options))

    def schema(self) -> StructType:
        # The state's types are in its files: read once on the driver for them.
        from pyspark.sql.pandas.types import from_arrow_schema

        return from_arrow_schema(self._request.table().schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        return _StateReader(self._request, schema)


class _StateReader(DataSourceReader):
    def __init__(self, request: _Request, schema: StructType) -> None:
        self.request = request
        self.schema = schema

    def partitions(self) -> Any:
        return [InputPartition(0)]  # read_keyed_state reads a checkpoint whole (incremental chains)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        from .tws_schema import spark_arrow_schema

        table = self.request.table()
        table = table.cast(spark_arrow_schema(self.schema))
        yield from table.to_batches()


def register_state_source(spark: Any) -> None:
    """Makes ``spark.read.format("pyengine-state")`` available in this session."""
    spark.dataSource.register(StateDataSource)
