"""The DataFlow graph: named nodes, each fed by at most one other node.

Guarantees, checked by ``validate`` before any actor starts:
- names are unique and non-empty; every ``input_from`` names a node of the graph;
- the graph has no cycle and at least one source (a node with ``input_from=None``);
- exactly one node is terminal (nobody consumes it): any other unconsumed node would
  fill its output queue and stall the run, so it is an error that names the node;
- along every edge, what the producer declares it gives fits what the consumer declares
  it takes (``pipeline/contracts.py``: class attributes ``takes``, ``gives``,
  ``takes_fields``, ``gives_fields``); a mismatch is an error that names the edge.

A node fans out to all its consumers (each gets every item). ``replicas`` copies of a
node share its input queue and output queues (e.g. several rollout workers).

    df = DataFlow()
    df.add_node(name="rollout", node_class=MyRollout, input_from=None, n=8)
    df.add_node(name="reward", node_class="my_pkg.reward:Scorer", input_from="rollout")
    df.run()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.contracts import check_edge_contracts, read_contract
from pipeline.plugins import import_object


class GraphError(ValueError):
    """The graph is invalid; the message names the node and the reason."""


@dataclass
class Node:
    name: str
    node_class: Any  # a class, or "module:attr"
    input_from: str | None = None
    replicas: int = 1
    concurrency: int = 1  # items one replica processes at once (outputs then in completion order)
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Custom Ray resources each replica asks for: they pick the nodes it may run on.
    resources: dict[str, float] = field(default_factory=dict)
    # Replica r runs in bundle gpu_bundles[r] (one GPU) of the run's placement group,
    # asking for gpu_shares[r] of it; empty: num_gpus by count (pipeline/placement.py).
    gpu_bundles: tuple[int, ...] = ()
    gpu_shares: tuple[float, ...] = ()
    # Times Ray restarts a replica whose process died (streaming mode; the runner then
    # sets it up again and its input queue delivers what it held again). 0: a death
    # stops the run.
    max_restarts: int = 0
    # Environment variables of the replicas' processes (and of what they start), beside
    # the run's own: e.g. the MPS daemon of GPU stages (``DataFlow.set_gpu_env``).
    env: dict[str, str] = field(default_factory=dict)
    # Nodes whose set-ups end before this one's begins (``setup_waves``): e.g. a GPU stage
    # beside a vLLM engine that sizes its KV cache from the device's free memory.
    setup_after: tuple[str, ...] = ()


class DataFlow:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.queue_sizes: dict[str, int] = {}
        self.default_queue_size = 4
        # Print and check the first micro-batch on every edge (``run(debug=True)``, ``run.debug``).
        self.debug = False

    def add_node(
        self,
        name: str,
        node_class: Any,
        input_from: str | None = None,
        *,
        replicas: int = 1,
        concurrency: int = 1,
        num_cpus: float = 0.0,
        num_gpus: float = 0.0,
        resources: dict[str, float] | None = None,
        queue_size: int | None = None,
        max_restarts: int = 0,
        **kwargs: Any,
    ) -> DataFlow:
        if not name or not isinstance(name, str):
            raise GraphError(f"node name: expected a non-empty string, got {name!r}")
        if name in self.nodes:
            raise GraphError(f"node {name!r}: duplicate name")
        if replicas < 1 or concurrency < 1:
            raise GraphError(f"node {name!r}: replicas and concurrency must be >= 1")
        if max_restarts < 0:
            raise GraphError(f"node {name!r}: max_restarts must be >= 0")
        if max_restarts and input_from is None:
            # A restarted source would start its data again: it is not restartable.
            raise GraphError(f"node {name!r}: a source cannot be restarted (max_restarts must be 0)")
        self.nodes[name] = Node(name, node_class, input_from, replicas, concurrency, num_cpus, num_gpus, kwargs,
                                dict(resources or {}), max_restarts=max_restarts)
        if queue_size is not None and input_from is not None:
            self.queue_sizes[f"{input_from}->{name}"] = queue_size
        return self

    def set_gpu_env(self, env: dict[str, str]) -> None:
        """Give ``env`` to every node whose replicas use a GPU."""
        for node in self.nodes.values():
            if node.gpu_bundles or node.num_gpus:
                node.env.update(env)

    # ---------------------------------------------------------------- structure
    def setup_waves(self) -> list[list[str]]:
        """The nodes in the order their set-ups run: each wave's together, after every
        node a node names in ``setup_after`` (in an earlier wave); a name that is no node,
        or a loop of them, raises ``GraphError``."""
        for node in self.nodes.values():
            unknown = [n for n in node.setup_after if n not in self.nodes or n == node.name]
            if unknown:
                raise GraphError(f"node {node.name!r}: setup_after {unknown} names no other node")
        waves: list[list[str]] = []
        done: set[str] = set()
        while len(done) < len(self.nodes):
            wave = [n for n, node in self.nodes.items() if n not in done and set(node.setup_after) <= done]
            if not wave:
                raise GraphError(f"dataflow: setup_after loops among {sorted(set(self.nodes) - done)}")
            waves.append(wave)
            done.update(wave)
        return waves

    def consumers(self, name: str) -> list[str]:
        return [n.name for n in self.nodes.values() if n.input_from == name]

    @property
    def edges(self) -> list[tuple[str, str]]:
        return [(n.input_from, n.name) for n in self.nodes.values() if n.input_from is not None]

    def downstream_of_restartable(self, name: str) -> bool:
        """Whether an ancestor of ``name`` may be restarted (its outputs may then arrive twice)."""
        node = self.nodes[name].input_from
        while node is not None:
            if self.nodes[node].max_restarts > 0:
                return True
            node = self.nodes[node].input_from
        return False

    def queue_bound(self, producer: str, consumer: str) -> int:
        return self.queue_sizes.get(f"{producer}->{consumer}", self.default_queue_size)

    @property
    def sources(self) -> list[str]:
        return [n.name for n in self.nodes.values() if n.input_from is None]

    @property
    def terminal(self) -> str:
        self.validate()
        return next(n for n in self.nodes if not self.consumers(n))

    def validate(self) -> None:
        if not self.nodes:
            raise GraphError("dataflow: no nodes")
        for node in self.nodes.values():
            if node.input_from is not None and node.input_from not in self.nodes:
                raise GraphError(
                    f"node {node.name!r}: input_from {node.input_from!r} is not a node "
                    f"(known: {', '.join(self.nodes)})"
                )
            if node.input_from == node.name:
                raise GraphError(f"node {node.name!r}: consumes its own output (cycle)")
        for node in self.nodes.values():
            seen = [node.name]
            cur = node.input_from
            while cur is not None:
                if cur in seen:
                    raise GraphError(f"dataflow: cycle {' <- '.join([*seen, cur])}")
                seen.append(cur)
                cur = self.nodes[cur].input_from
        if not self.sources:
            raise GraphError("dataflow: no source node (a node with input_from=None)")
        unconsumed = [n for n in self.nodes if not self.consumers(n)]
        if len(unconsumed) > 1:
            raise GraphError(
                f"dataflow: nodes {', '.join(repr(n) for n in unconsumed)} are not consumed by "
                f"any node; exactly one terminal node is allowed (its output would fill a queue "
                f"nobody reads)"
            )
        for edge in self.queue_sizes:
            producer, _, consumer = edge.partition("->")
            if (producer, consumer) not in self.edges:
                raise GraphError(f"queue size for {edge!r}: no such edge (edges: {self.edge_names})")
        self.check_contracts()

    def check_contracts(self) -> None:
        """What each node declares it takes and gives fits along every edge
        (``pipeline/contracts.py``); a ``module:attr`` node class is imported to read it."""
        contracts = {}
        for node in self.nodes.values():
            node_class = node.node_class
            try:
                if isinstance(node_class, str):
                    node_class = import_object(node_class, f"node {node.name!r} node_class")
                contracts[node.name] = read_contract(node_class, node.name)
            except (ImportError, ValueError) as exc:
                raise GraphError(str(exc)) from None
        problems = check_edge_contracts(contracts, {n.name: n.input_from for n in self.nodes.values()})
        if problems:
            raise GraphError("dataflow: edges that do not fit: " + "; ".join(problems))

    @property
    def edge_names(self) -> list[str]:
        return [f"{p}->{c}" for p, c in self.edges]

    def topological_order(self) -> list[str]:
        self.validate()
        order: list[str] = []
        ready = list(self.sources)
        while ready:
            name = ready.pop(0)
            order.append(name)
            ready.extend(self.consumers(name))
        return order

    def describe(self) -> dict[str, Any]:
        """Stages and queues as plain data (``conveyor status``)."""
        return {
            "stages": [
                {
                    "name": n.name,
                    "class": n.node_class if isinstance(n.node_class, str)
                    else f"{n.node_class.__module__}:{n.node_class.__qualname__}",
                    "input_from": n.input_from,
                    "replicas": n.replicas,
                    "concurrency": n.concurrency,
                    "num_cpus": n.num_cpus,
                    "num_gpus": n.num_gpus,
                    "gpus": list(n.gpu_bundles),
                }
                for n in (self.nodes[k] for k in self.topological_order())
            ],
            "queues": [
                {"queue": f"{p}->{c}", "producer": p, "consumer": c, "bound": self.queue_bound(p, c)}
                for p, c in self.edges
            ],
        }

    def run(self, config: Any = None, *, debug: bool = False, **runner_kwargs: Any) -> Any:
        """Validate, start every node as a Ray actor, stream to the end; see ``pipeline.runner``.
        ``debug``: print the first micro-batch on every edge and check it against what its
        consumer declares (``pipeline/contracts.py``); a mismatch stops the run."""
        from pipeline.runner import run_dataflow

        self.debug = debug or self.debug
        return run_dataflow(self, config, **runner_kwargs)
