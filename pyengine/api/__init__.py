"""The job API: ``StreamEnvironment`` and the stream builders users write jobs with.

A pipeline is cut into vertices at exchanges (``key_by``, ``rebalance``,
``broadcast``); operators between two exchanges are chained into one task.
Operators are created per subtask and per attempt from factories, so a restart
never sees state a failed attempt left in memory.

One module per concept, as Flink names them: ``environment`` (``StreamEnvironment``
and its source builders), ``datastream`` (``DataStream``, ``KeyedStream`` and the
other stream builders), ``graph`` (``JobGraph``: vertices, edges, chaining) and
``client`` (``JobClient``). ``pyengine.api.X`` stays the name of every public X."""

from .client import JobClient
from .datastream import BroadcastConnectedStream, BroadcastStream, ConnectedStreams, DataStream, KeyedStream
from .environment import StreamEnvironment
from .graph import Edge, JobGraph

__all__ = [
    "BroadcastConnectedStream",
    "BroadcastStream",
    "ConnectedStreams",
    "DataStream",
    "Edge",
    "JobClient",
    "JobGraph",
    "KeyedStream",
    "StreamEnvironment",
]
