"""Every source and sink, one module per system, on the protocol of
``pyengine.connectors.base`` (``Source``: replay by position; ``Sink``: two-phase
commit tied to checkpoints; its module docstring is the contract a third-party
connector implements).

- ``base``: the ``Source`` and ``Sink`` protocol, ``RunInfo``, ``RecordRejectedError``.
- ``files``: ``FileSource`` and ``MonitoredFileSource`` (``env.read_files``).
- ``filesink``: ``FileSink`` (``pe.sinks.FileSink``), with its writer's lock and run manifest.
- ``records``: records as JSON lines or as an Arrow table that fits a schema (shared by the sinks).
- ``collection``: ``CollectionSource`` and ``GeneratorSource`` (``env.from_collection``,
  ``env.from_generator``).
- ``console``: ``CollectSink``, ``PrintSink``, ``DiscardSink``.
- ``dataframe``: ``DataFrameSource`` (``env.from_dataframe``, ``pe.spark.DataFrameSource``);
  a Spark DataFrame is read through its own methods, so pyspark is not imported here.
- ``delta``: ``DeltaSink``, an exactly-once Delta Lake table (also ``pe.sinks.DeltaSink``).
  Needs ``deltalake`` (``pip install deltalake``, the ``delta`` extra).
- ``delta_source``: ``DeltaSource``, a Delta table's versions as an exactly-once stream
  (``env.read_delta``). Needs ``deltalake``.
- ``postgres``: ``PostgresSink``, an exactly-once PostgreSQL table (``pe.sinks.PostgresSink``).
  Needs ``psycopg`` 3 (the ``postgres`` extra).

The user's names are elsewhere: ``pe.sinks.*`` re-exports the sinks, and the
environment's builders make the sources. A connector's own library is loaded when
the connector is first used, and ``import pyengine`` imports none of ``delta``,
``delta_source`` and ``postgres``."""

__all__: list = []
