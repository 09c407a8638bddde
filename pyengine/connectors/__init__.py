"""Sources and sinks for outside systems, one module per system, on the
two-phase-commit base of ``pyengine.sinks``.

- ``pyengine.connectors.delta``: ``DeltaSink``, an exactly-once Delta Lake table
  (also ``pe.sinks.DeltaSink``). Needs ``deltalake`` (``pip install deltalake``, the ``delta`` extra).

Nothing here is imported by ``import pyengine``: a connector's library is loaded
when its connector is first used."""

__all__: list = []
