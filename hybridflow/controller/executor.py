"""Runs one iteration of a dataflow graph over worker groups.

One GRPO iteration, as the shipped graph draws it (``hybridflow graph graphs/grpo.yaml``):

    prompts (controller, ray.put)
       |
    generate      on actor pool   prompts            -> responses       (n samples / prompt)
       |---------------.-------------------.
    old_log_prob     ref_log_prob         reward      each waits for generate only
       |               |                   |
       |               |               advantage      waits for reward
       '---------------+-------------------'
                 update_actor             waits for all four; syncs weights to the rollout

The executor submits every node whose producers have finished, then waits for the next node to
finish. Nodes on disjoint pools therefore overlap; nodes sharing a pool queue on the same Ray
actors and run one after another. ``serial=True`` submits one node at a time instead (for
measuring what the overlap buys: benchmarks/placement_concurrency.py). What moves between nodes are ``ShardedRef``s: object refs of
per-rank TensorDict shards that the consuming workers fetch themselves. The controller only ever
fetches the small per-rank meta dicts (sample counts, metrics, start/end times), through
``controller_get``; ``controller/fetched_tensor_bytes`` is what it materialised in tensors during
the iteration (0 on a healthy graph).

The timeline (``IterationResult.timeline``) holds one entry per node and rank with worker-side
wall-clock start/end; ``chrome_trace`` turns it into Chrome-trace JSON (chrome://tracing,
Perfetto): one process row per pool, one thread row per rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

from hybridflow.controller.metrics import reduce_metas
from hybridflow.graph.dag import SOURCE, Graph, Node
from hybridflow.workers.group import WorkerGroup
from hybridflow.workers.protocols import ShardedRef, controller_get, fetched_tensor_bytes

FETCHED_BYTES_METRIC = "controller/fetched_tensor_bytes"


@dataclass
class NodeResult:
    data: ShardedRef
    group_size: int  # samples per prompt group in data (1 for prompts)
    metas: list[dict]  # of the collected ranks
    started: float  # submission time on the controller
    finished: float  # when the controller saw it finish


@dataclass
class IterationResult:
    metrics: dict[str, float] = field(default_factory=dict)
    timeline: list[dict] = field(default_factory=list)  # per node and rank: start/end
    outputs: dict[str, NodeResult] = field(default_factory=dict)


def _call_args(graph: Graph, node: Node) -> tuple[str, dict]:
    """Worker method and keyword arguments for a node."""
    options = node.spec.options.model_dump()
    actor_rollout = graph.spec.models[graph.actor].rollout
    temperature = actor_rollout.temperature if actor_rollout is not None else 1.0
    if node.op == "generate":
        return "generate", {"model": node.model, "greedy": options["greedy"]}
    if node.op == "log_prob":
        return "log_prob", {"model": node.model, "output_key": node.outputs[0], "temperature": temperature}
    if node.op == "values":
        return "compute_values", {"model": node.model, "output_key": node.outputs[0]}
    if node.op == "score":
        return "score", {"model": node.model, "options": options, "output_key": node.outputs[0]}
    if node.op == "advantage":
        keys = {"node": node.name, "inputs": list(node.inputs), "outputs": list(node.outputs)}
        return "advantage", {"options": options, **keys}
    if node.op == "update":
        return "update", {
            "model": node.model, "options": options, "temperature": temperature,
            "node": node.name, "inputs": list(node.inputs),
        }
    raise AssertionError(f"op {node.op} has no worker method")


def _output_group_size(graph: Graph, node: Node, input_group_size: int) -> int:
    if node.op == "generate":
        rollout = graph.spec.models[node.model].rollout
        return 1 if node.spec.options.greedy else rollout.n
    return input_group_size


def run_nodes(
    graph: Graph,
    nodes: list[Node],
    groups: dict[str, WorkerGroup],
    prompts: ShardedRef,
    *,
    serial: bool = False,
) -> IterationResult:
    """Run ``nodes`` (a topologically ordered subset of the graph) on ``prompts``.

    ``serial``: submit one node at a time, each after the previous one finished.
    """
    fetched_before = fetched_tensor_bytes()
    result = IterationResult()
    rank_metas: dict[str, list[dict]] = {}
    results: dict[str, NodeResult] = {
        SOURCE: NodeResult(prompts, 1, [], time.perf_counter(), time.perf_counter())
    }
    pending: dict[str, tuple[object, float, int]] = {}  # name -> (PendingShards, start, group size)
    remaining = list(nodes)
    by_name = {n.name: n for n in nodes}

    def producers_of(node: Node) -> list[str]:
        return list(dict.fromkeys(graph.producers(node).values()))

    while remaining or pending:
        for node in list(remaining):
            if serial and pending:
                break
            srcs = producers_of(node)
            if not all(src in results for src in srcs):
                continue
            method, kwargs = _call_args(graph, node)
            group_size = max(results[s].group_size for s in srcs)
            group = groups[graph.placement[node.model]]
            handle = group.call(
                method, [results[s].data for s in srcs], group_size=group_size, **kwargs
            )
            pending[node.name] = (handle, time.perf_counter(), group_size)
            remaining.remove(node)
        if not pending:
            raise RuntimeError(f"nodes {[n.name for n in remaining]} can never run")
        all_refs = [ref for handle, _, _ in pending.values() for ref in handle.meta_refs]
        ray.wait(all_refs, num_returns=1)
        for name, (handle, started, group_size) in list(pending.items()):
            ready, _ = ray.wait(handle.meta_refs, num_returns=len(handle.meta_refs), timeout=0)
            if len(ready) < len(handle.meta_refs):
                continue
            data, metas = handle.result()
            rank_refs = handle.all_meta_refs  # every rank's meta, for the timeline
            rank_metas[name] = controller_get(list(rank_refs)) if rank_refs else metas
            node = by_name[name]
            results[name] = NodeResult(
                data, _output_group_size(graph, node, group_size), metas, started, time.perf_counter()
            )
            del pending[name]

    for node in nodes:
        node_result = results[node.name]
        result.outputs[node.name] = node_result
        metas = node_result.metas
        result.metrics.update(reduce_metas(metas))
        start = min(m["t_start"] for m in metas)
        end = max(m["t_end"] for m in metas)
        result.metrics[f"timing/{node.name}"] = end - start
        for rank, meta in enumerate(rank_metas[node.name]):
            result.timeline.append(
                {"node": node.name, "pool": graph.placement[node.model],
                 "rank": meta.get("rank", rank), "start": meta["t_start"], "end": meta["t_end"]}
            )
    result.metrics[FETCHED_BYTES_METRIC] = float(fetched_tensor_bytes() - fetched_before)
    return result


def node_spans(timeline: list[dict]) -> dict[str, tuple[float, float]]:
    """Node name -> (first rank's start, last rank's end), wall-clock seconds."""
    spans: dict[str, tuple[float, float]] = {}
    for event in timeline:
        lo, hi = spans.get(event["node"], (event["start"], event["end"]))
        spans[event["node"]] = (min(lo, event["start"]), max(hi, event["end"]))
    return spans


def chrome_trace(timeline: list[dict], iteration: int | None = None) -> dict:
    """Chrome-trace JSON for a timeline: a complete ("X") event per node and rank, in us."""
    pools = list(dict.fromkeys(event["pool"] for event in timeline))
    origin = min((event["start"] for event in timeline), default=0.0)
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"pool {pool}"}}
        for pid, pool in enumerate(pools)
    ]
    for event in timeline:
        events.append(
            {
                "ph": "X",
                "name": event["node"],
                "cat": event["pool"],
                "pid": pools.index(event["pool"]),
                "tid": event["rank"],
                "ts": (event["start"] - origin) * 1e6,
                "dur": (event["end"] - event["start"]) * 1e6,
                "args": {"iteration": iteration, "wall_start": event["start"]},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
