"""The job graph: the steps a job's builders record (``_Step``) and the ``JobGraph`` they
compile to, vertices (chains of operators run by one task per subtask) joined by edges.

As Flink's ``StreamGraph``/``JobGraph``: the builders (``pyengine.api.datastream``) only
record steps; this module cuts them into vertices at exchanges (``key_by``, ``rebalance``,
``broadcast``) and chains the operators between two exchanges into one task. Operators are
created per subtask and per attempt from factories, so a restart never sees state a failed
attempt left in memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..connectors.base import Sink, Source
from ..runtime.base import Operator, OutputTag
from ..time.strategy import TimestampAssigner


@dataclass(eq=False)
class _Step:
    """A node of the job being built: an operator ("op"), an exchange ("exchange":
    key_by, rebalance, broadcast), a union of streams ("union"), or the side output
    of an operator ("side"). ``inputs`` are the nodes it reads (two for a connect)."""

    kind: str  # "op", "exchange", "union" or "side"
    name: str
    factory: Optional[Callable[[str, str, bool], Operator]] = None
    exchange: str = "forward"
    key: Optional[Callable[[Any], Any]] = None
    uid: Optional[str] = None
    event_time: bool = False  # this step needs watermarks (a strategy, a window, timers)
    inputs: List[_Step] = field(default_factory=list)
    tag: Optional[OutputTag] = None  # a "side" node's tag
    sink: Optional[Sink] = None  # a sink_to's sink
    source: Optional[Source] = None  # a source's
    named: bool = False  # name(...) set its name: not renamed to be unique
    seq: int = 0  # creation order (inputs come first), so builds are deterministic
    schema: Any = None  # the records' pyarrow.Schema while a step keeps it known
    # Where a record's event time is (a TimestampAssigner), once a strategy or a
    # window gave the stream timestamps. Records carry no timestamp of their own:
    # time-aware operators downstream read it with this, so it must still find its
    # column or field after a map (or assign timestamps again after the map).
    timestamps: Optional[TimestampAssigner] = None
    effective_uid: str = ""  # the uid its state goes by, set when a graph is built
    # False for an operator that never sends to a side output (map, filter, a sink...):
    # get_side_output on it is refused rather than read as an empty stream
    side_outputs: bool = True
    # Keeps broadcast state (a broadcast_process): an unaligned checkpoint of it restores
    # only at the parallelism it was taken at (LocalRunner._check_restore says why)
    broadcast_state: bool = False


@dataclass(eq=False)
class Edge:
    """An edge of the job graph into a vertex: records of vertex ``source``'s last
    operator (its side output ``tag``, or its main output when None), partitioned by
    ``exchange`` (``key_selector`` for "hash"), into input ``input`` of the vertex's
    head operator (1 only for a connect's second stream)."""

    source: int  # index of the producing vertex in JobGraph.vertices
    exchange: str
    key_selector: Optional[Callable[[Any], Any]]
    input: int = 0
    tag: Optional[str] = None


@dataclass
class Vertex:
    name: str
    exchange: str  # how records reach this vertex (its first input edge's)
    key_selector: Optional[Callable[[Any], Any]]
    steps: List[_Step] = field(default_factory=list)
    event_time_interval_ms: Optional[int] = None  # set when the job uses event time
    inputs: List[Edge] = field(default_factory=list)  # none for a source's vertex

    def uids(self) -> List[str]:
        return [s.effective_uid or s.uid or s.name for s in self.steps]

    def create_chain(self, checkpointing: bool) -> List[Operator]:
        out = []
        for step, uid in zip(self.steps, self.uids(), strict=True):
            assert step.factory is not None
            op = step.factory(uid, step.name, checkpointing)
            op.event_time_interval_ms = self.event_time_interval_ms  # type: ignore[attr-defined]
            out.append(op)
        return out


def _resolve(
    node: _Step, exchange: Optional[str] = None, key: Optional[Callable[[Any], Any]] = None
) -> List[Tuple[_Step, Optional[str], str, Optional[Callable[[Any], Any]]]]:
    """Where a node's records come from: (operator, side output tag or None, exchange,
    key), through exchanges (the one nearest the consumer wins, as when a line had
    two in a row) and unions."""
    if node.kind == "exchange":
        if exchange is None:
            exchange, key = node.exchange, node.key
        return _resolve(node.inputs[0], exchange, key)
    if node.kind == "union":
        return [edge for i in node.inputs for edge in _resolve(i, exchange, key)]
    if node.kind == "side":
        assert node.tag is not None
        return [(node.inputs[0], node.tag.name, exchange or "forward", key)]
    return [(node, None, exchange or "forward", key)]


class JobGraph:
    """The job as vertices (chains of operators run by one task per subtask) joined by
    edges: a DAG from any number of sources to any number of sinks. An operator is
    chained to the one before it when it is that one's only consumer, reads it without
    an exchange and has one input; anything else (an exchange, a union, a connect, a
    fan-out, a side output) starts a vertex with an edge per input."""

    def __init__(
        self,
        sinks: List[_Step],
        sources: Optional[List[Source]] = None,
        auto_watermark_interval_ms: int = 200,
    ) -> None:
        reachable: Dict[int, _Step] = {}
        todo = list(sinks)
        while todo:
            node = todo.pop()
            if id(node) not in reachable:
                reachable[id(node)] = node
                todo.extend(node.inputs)
        nodes = sorted(reachable.values(), key=lambda n: n.seq)
        ops = [n for n in nodes if n.kind == "op"]
        self.sinks: List[Sink] = [n.sink for n in sorted(sinks, key=lambda n: n.seq) if n.sink is not None]
        used = [n.source for n in ops if n.source is not None]
        if sources is None:
            self.sources: List[Source] = used
        else:  # prepared by the runner when a run starts: the ones this graph reads
            self.sources = [s for s in sources if any(s is u for u in used)]
        self.event_time = any(n.event_time for n in ops)
        resolved = {id(n): [_resolve(i) for i in n.inputs] for n in ops}
        consumers: Dict[int, int] = {}
        for n in ops:
            for sources_of_input in resolved[id(n)]:
                for producer, _tag, _exchange, _key in sources_of_input:
                    consumers[id(producer)] = consumers.get(id(producer), 0) + 1
        self._assign_uids(ops)
        self.vertices: List[Vertex] = []
        vertex_of: Dict[int, int] = {}
        for n in ops:
            inputs = n.inputs
            if len(inputs) == 1 and inputs[0].kind == "op" and consumers.get(id(inputs[0])) == 1:
                v_index = vertex_of[id(inputs[0])]
                self.vertices[v_index].steps.append(n)
                vertex_of[id(n)] = v_index
                continue
            edges = [
                Edge(vertex_of[id(producer)], exchange, key, which, tag)
                for which, resolved_input in enumerate(resolved[id(n)])
                for producer, tag, exchange, key in resolved_input
            ]
            first = edges[0] if edges else None
            vertex = Vertex(
                f"v{len(self.vertices)}",
                first.exchange if first else "forward",
                first.key_selector if first else None,
                [n],
                inputs=edges,
            )
            vertex_of[id(n)] = len(self.vertices)
            self.vertices.append(vertex)
        if self.event_time:  # every task takes part: watermarks must reach each time-aware operator
            for vertex in self.vertices:
                vertex.event_time_interval_ms = auto_watermark_interval_ms
        uids = [u for v in self.vertices for u in v.uids()]
        duplicates = sorted({u for u in uids if uids.count(u) > 1})
        if duplicates:
            raise ValueError(
                f"operator uids must be unique in a job; repeated: {duplicates}. An operator without .uid(...) "
                "takes its .name(...) as its state's uid: give each of them its own .uid(...)"
            )

    @staticmethod
    def _assign_uids(ops: List[_Step]) -> None:
        """Each operator's state uid: its ``uid(...)``, else its name; a default name
        that an earlier operator already has (two branches' ``map`` at the same depth,
        two ``from_collection``) gets ``-2``, ``-3``... by creation order, so the same
        program always gives the same uids. Names given with ``uid``/``name`` are
        kept as they are (a repeat is refused below)."""
        taken = {n.uid or n.name for n in ops if n.uid is not None or n.named}
        for n in ops:
            if n.uid is not None or n.named:
                n.effective_uid = n.uid or n.name
                continue
            uid, k = n.name, 1
            while uid in taken:
                k += 1
                uid = f"{n.name}-{k}"
            taken.add(uid)
            n.effective_uid = uid

    @property
    def sink(self) -> Sink:
        """The first sink (a job with one sink: its sink)."""
        return self.sinks[0]

    def consumers(self, v_index: int) -> List[Tuple[int, int, Edge]]:
        """The edges out of vertex ``v_index``: (consumer vertex, the edge's position
        among the consumer's inputs, the edge), in a stable order."""
        return [
            (c, k, edge)
            for c, vertex in enumerate(self.vertices)
            for k, edge in enumerate(vertex.inputs)
            if edge.source == v_index
        ]

    def nonlinear_features(self) -> List[str]:
        """What makes this graph more than one line (empty for a line): for runners
        that run lines only."""
        features = []
        if len(self.sinks) > 1:
            features.append("several sinks")
        if sum(1 for v in self.vertices if not v.inputs) > 1:
            features.append("several sources")
        if any(e.tag is not None for v in self.vertices for e in v.inputs):
            features.append("side outputs (get_side_output)")
        if any(e.input == 1 for v in self.vertices for e in v.inputs):
            features.append("connect")
        elif any(len(v.inputs) > 1 for v in self.vertices):
            features.append("union")
        if any(len(self.consumers(i)) > 1 for i in range(len(self.vertices))):
            features.append("a stream continued more than once (fan-out)")
        return features

    def state_uids(self) -> List[str]:
        return [u for v in self.vertices for u in v.uids()] + [f"__channel_state__{v.name}" for v in self.vertices]
