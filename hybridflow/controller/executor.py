"""Runs one iteration of a dataflow graph over worker groups.

One GRPO iteration, as the shipped graph draws it (``hybridflow graph graphs/grpo.yaml``):

    prompts (controller, ray.put)
       |
    generate      on actor pool   prompts            -> responses       (n samples / prompt)
       |---------------.-------------------.
       |             ref_log_prob         reward      each waits for generate only
       |               |                   |
       |               |               advantage      waits for reward
       '---------------+-------------------'
                 update_actor             waits for all three; syncs weights to the rollout

The executor submits every node whose producers have finished, then waits for the next node to
finish. Nodes on disjoint pools therefore overlap; nodes sharing a pool queue on the same Ray
actors and run one after another. ``serial=True`` submits one node at a time instead (for
measuring what the overlap buys: benchmarks/placement_concurrency.py).

Every node runs through ``ModelWorker.run_op`` with its name; its op record names the body. The
batch is split by the layout of the node's model (``Graph.dispatch_layout``, the 3D protocol):
one chunk per data-parallel rank, the same to that rank's tensor/pipeline peers, collected from
TP rank 0 of the last pipeline stage; a plain data-parallel model (tp = pp = 1) is a DP split.

Submitting ahead: a node whose producers are still running on the *same* worker group is
submitted at once when the producers' output sizes are known in advance (an evenly divisible
batch: every data-parallel rank returns its input rows times the op's expansion). An actor runs
its calls in submission order, so a consumer's rank finds its producer's output ready (or being
made by a peer that is ahead of it) when it starts, and the controller's round trip between the
two (a wake-up, a meta fetch, a submission: a few ms per node) leaves the critical path. The sizes are checked against the
producers' metas when they finish. What moves between nodes are ``ShardedRef``s: object refs of
per-rank TensorDict shards that the consuming workers fetch themselves. The controller only ever
fetches the small per-rank meta dicts (sample counts, metrics, start/end times), through
``controller_get``; ``controller/fetched_tensor_bytes`` is what it materialised in tensors during
the iteration (0 on a healthy graph).

The timeline (``IterationResult.timeline``) holds one entry per node and rank with worker-side
wall-clock start/end and the tensor bytes the rank fetched from and put into the object store
(``transfer/fetched_bytes`` / ``transfer/put_bytes`` are their sums per iteration); ``chrome_trace`` turns it into Chrome-trace JSON (chrome://tracing,
Perfetto): one process row per pool, one thread row per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from tensordict import TensorDictBase

from hybridflow.controller.metrics import reduce_metas
from hybridflow.graph.dag import SOURCE, Graph, Node, refilled_nodes, samples_per_prompt
from hybridflow.spec.layout import ParallelLayout
from hybridflow.workers.group import WorkerGroup
from hybridflow.workers.accounting import FETCHED_BYTES, PUT_BYTES, controller_get, fetched_tensor_bytes
from hybridflow.workers.sharded import PendingShards, ShardedRef
from hybridflow.workers.wire import to_wire

RUN_OP = "run_op"  # the worker method every node is run through (ModelWorker.run_op)
FETCHED_BYTES_METRIC = "controller/fetched_tensor_bytes"
# Tensor bytes the workers fetched from / put into the object store, all nodes and ranks.
TRANSFER_METRICS = {FETCHED_BYTES: "transfer/fetched_bytes", PUT_BYTES: "transfer/put_bytes"}
# Counts every rank reports in an op's meta, summed over the ranks and nodes of an iteration:
# the bytes moved through the object store, and the rollout engines colocation moved.
COUNTED_METRICS = {
    **TRANSFER_METRICS,
    "rollout_offloads": "colocation/rollout_offloads",
    "rollout_reloads": "colocation/rollout_reloads",
}


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


def _call_args(graph: Graph, node: Node, record: dict[str, str]) -> dict:
    """Keyword arguments of ``run_op`` for a node: its name, whether its op reads per-sample
    strings, its options when they are not the graph's (validation's greedy generate), and
    the directory to record it in when ``record`` (node name -> directory) names it."""
    kwargs = {"node": node.name, "with_text": graph.op(node).text}
    if node.spec != graph.node(node.name).spec:
        kwargs["options"] = node.spec.options
    if node.name in record:
        kwargs["record"] = record[node.name]
    return kwargs


@dataclass
class _Pending:
    handle: object  # PendingShards
    started: float
    group_size: int  # of the node's output
    group: WorkerGroup
    # The output's shard sizes when known before it finishes (see "Submitting ahead").
    ahead: ShardedRef | None


def _predict_output(
    layout: ParallelLayout, inputs: list[ShardedRef], input_group_size: int, output_group_size: int, handle
) -> ShardedRef | None:
    """The output ShardedRef of a just-submitted node (one shard per data-parallel rank of
    ``layout``), when no rank gets padding."""
    total = inputs[0].total
    if total % (input_group_size * layout.dp):
        return None  # uneven: padded ranks report fewer real rows
    # rows out per row in: a generate node's samples per prompt (its input is prompts, group
    # size 1); 1 for every other op (output_group_size == input_group_size)
    expansion = output_group_size // input_group_size
    rows = total // layout.dp * expansion
    return ShardedRef(refs=list(handle.data_refs), sizes=[rows] * layout.dp)


def _submit(
    graph: Graph, node: Node, groups: dict[str, WorkerGroup], inputs: list[tuple[ShardedRef, int]],
    record: dict[str, str],
) -> _Pending:
    """Submit ``node`` on its group with its producers' outputs (and their group sizes)."""
    group = groups[graph.pool_of(node)]
    group_size = max(size for _, size in inputs)
    data = [sharded for sharded, _ in inputs]
    layout = graph.dispatch_layout(node)
    handle = group.call(RUN_OP, data, group_size=group_size, layout=layout, **_call_args(graph, node, record))
    output_group_size = samples_per_prompt(graph.spec, node, group_size)
    return _Pending(
        handle, time.perf_counter(), output_group_size, group,
        None if graph.op(node).refills else _predict_output(layout, data, group_size, output_group_size, handle),
    )


def launch(
    graph: Graph, nodes: list[Node], groups: dict[str, WorkerGroup], prompts: ShardedRef,
    record: dict[str, str] | None = None,
) -> dict[str, _Pending]:
    """Submit ``nodes`` (each reading only the prompts) now, without waiting; hand the result
    to ``run_nodes(..., launched=...)`` later. Their worker groups run them before any call
    submitted after this one. ``record``: as for ``run_nodes``."""
    return {node.name: _submit(graph, node, groups, [(prompts, 1)], record or {}) for node in nodes}


def relaunch(data: list[TensorDictBase], metas: list[dict], all_metas: list[dict], group_size: int) -> _Pending:
    """A launched node's finished output brought back (a checkpoint's buffered generation):
    its per-rank shards ``data`` and metas put into the object store again, to hand to
    ``run_nodes(..., launched=...)`` as if the node had just finished."""
    handle = PendingShards(data_refs=[ray.put(to_wire(td)) for td in data], meta_refs=[ray.put(m) for m in metas],
                           all_meta_refs=[ray.put(m) for m in all_metas])
    return _Pending(handle, time.perf_counter(), group_size, group=None, ahead=None)


def run_nodes(
    graph: Graph,
    nodes: list[Node],
    groups: dict[str, WorkerGroup],
    prompts: ShardedRef,
    *,
    serial: bool = False,
    more_prompts: Callable[[], ShardedRef] | None = None,
    launched: dict[str, _Pending] | None = None,
    record: dict[str, str] | None = None,
) -> IterationResult:
    """Run ``nodes`` (a topologically ordered subset of the graph) on ``prompts``.

    ``serial``: submit one node at a time, each after the previous one finished.
    ``more_prompts``: fresh prompts (as many as ``prompts``) for a refilling node (dynamic
    sampling, see ``run_refilling``); needed only when ``nodes`` hold one.
    ``launched``: nodes of ``nodes`` already submitted on ``prompts`` (``launch``), e.g. an
    iteration ago (one-step off-policy); they are waited for, not submitted again.
    ``record``: node name -> directory: those nodes' workers record their inputs, state and
    outputs there (``trainer.record``; ``hybridflow.workers.recording``).
    """
    record = record or {}
    refilling = [node for node in nodes if graph.op(node).refills]
    given = {SOURCE: NodeResult(prompts, 1, [], time.perf_counter(), time.perf_counter())}
    if not refilling:
        return _run(graph, nodes, groups, given, serial, record, launched or {})
    if launched:
        raise ValueError("a graph with a refilling node cannot run its generation ahead")
    if more_prompts is None:
        raise ValueError(f"node {refilling[0].name!r} refills its batch: run_nodes needs more_prompts")
    return run_refilling(graph, nodes, refilling[0], groups, prompts, serial, more_prompts, record)


def run_refilling(
    graph: Graph,
    nodes: list[Node],
    filt: Node,
    groups: dict[str, WorkerGroup],
    prompts: ShardedRef,
    serial: bool,
    more_prompts: Callable[[], ShardedRef],
    record: dict[str, str],
) -> IterationResult:
    """Dynamic sampling: run the nodes before ``filt`` (its ancestors) and ``filt`` itself on
    ``prompts``, then on fresh prompts, round after round, until the kept groups fill a batch
    of ``prompts.total`` groups or ``max_rounds`` rounds are done (the last round's dropped
    groups then fill it); then the nodes after ``filt`` run on that batch.

    The filter's body returns each rank's rows reordered, kept groups first, and how many rows
    it kept (``kept_rows``); the batch is prefixes of those shards, so the controller never
    handles a tensor. Metrics: the first round's (the policy's plain rewards, before any
    filtering), ``timing/*`` and ``rollout/num_tokens`` summed over the rounds, and
    ``filter/rounds`` and ``filter/*_groups``: ``generated`` (all rounds), ``filtered`` (dropped:
    all-equal scores), ``kept`` (informative groups in the batch; a round's surplus is left
    out) and ``filled`` (dropped groups put back after the last round).
    """
    before = {node.name for node in refilled_nodes(graph, filt)}
    upstream = [node for node in nodes if node.name in before] + [filt]
    downstream = [node for node in nodes if node.name not in before and node is not filt]
    wanted = prompts.total  # groups in a full batch
    refs, sizes, have = [], [], 0
    counts = {"generated": 0, "kept": 0, "filtered": 0, "filled": 0}
    merged: IterationResult | None = None
    rounds = filt.spec.options.max_rounds
    for round_index in range(rounds):
        batch = prompts if round_index == 0 else more_prompts()
        now = time.perf_counter()
        done = _run(graph, upstream, groups, {SOURCE: NodeResult(batch, 1, [], now, now)}, serial, record)
        out = done.outputs[filt.name]
        size = out.group_size
        kept = [int(meta["kept_rows"]) for meta in out.metas]
        counts["generated"] += batch.total
        counts["filtered"] += (out.data.total - sum(kept)) // size
        # Each shard is its rank's rows, kept groups first: take a prefix of it, kept rows only,
        # and after the last round also dropped ones to fill the batch.
        prefix = [0] * len(kept)
        for fill in (False, True) if round_index == rounds - 1 else (False,):
            for shard, (total_rows, kept_rows) in enumerate(zip(out.data.sizes, kept)):
                take = min((total_rows if fill else kept_rows) - prefix[shard], (wanted - have) * size)
                if take > 0:
                    prefix[shard] += take
                    have += take // size
                    counts["filled" if fill else "kept"] += take // size
        refs += [ref for ref, rows in zip(out.data.refs, prefix) if rows]
        sizes += [rows for rows in prefix if rows]
        merged = done if merged is None else _add_round(merged, done)
        if have == wanted:
            break
    merged.metrics["filter/rounds"] = float(round_index + 1)
    merged.metrics.update({f"filter/{name}_groups": float(value) for name, value in counts.items()})
    now = time.perf_counter()
    filtered = NodeResult(ShardedRef(refs=refs, sizes=sizes), size, merged.outputs[filt.name].metas, now, now)
    rest = _run(graph, downstream, groups, {filt.name: filtered}, serial, record)
    for key, value in rest.metrics.items():
        merged.metrics[key] = merged.metrics.get(key, 0.0) + value if _additive(key) else value
    merged.timeline += rest.timeline
    merged.outputs.update(rest.outputs)
    return merged


def _additive(metric: str) -> bool:
    """Metrics that add up over the rounds of dynamic sampling (times, counts, bytes)."""
    return metric.startswith(("timing/", "transfer/", "colocation/")) or metric in ("rollout/num_tokens", FETCHED_BYTES_METRIC)


def _add_round(first: IterationResult, later: IterationResult) -> IterationResult:
    """``first`` with a later round's additive metrics and timeline added in."""
    for key, value in later.metrics.items():
        if _additive(key):
            first.metrics[key] = first.metrics.get(key, 0.0) + value
    first.timeline += later.timeline
    return first


def _run(
    graph: Graph,
    nodes: list[Node],
    groups: dict[str, WorkerGroup],
    given: dict[str, NodeResult],
    serial: bool,
    record: dict[str, str],
    launched: dict[str, _Pending] | None = None,
) -> IterationResult:
    """Run ``nodes`` whose producers are among them or in ``given`` (finished results);
    ``launched``: those of ``nodes`` already submitted."""
    fetched_before = fetched_tensor_bytes()
    result = IterationResult()
    rank_metas: dict[str, list[dict]] = {}
    results: dict[str, NodeResult] = dict(given)
    pending: dict[str, _Pending] = dict(launched or {})
    remaining = [node for node in nodes if node.name not in pending]

    def producers_of(node: Node) -> list[str]:
        return list(dict.fromkeys(graph.producers(node).values()))

    def input_of(src: str, group: WorkerGroup) -> tuple[ShardedRef, int] | None:
        """A producer's output and its group size, if this node may read it now."""
        if src in results:
            return results[src].data, results[src].group_size
        waiting = pending.get(src)
        if not serial and waiting is not None and waiting.ahead is not None and waiting.group is group:
            return waiting.ahead, waiting.group_size
        return None

    while remaining or pending:
        for node in list(remaining):
            if serial and pending:
                break
            group = groups[graph.pool_of(node)]
            inputs = [input_of(src, group) for src in producers_of(node)]
            if any(item is None for item in inputs):
                continue
            pending[node.name] = _submit(graph, node, groups, inputs, record)
            remaining.remove(node)
        if not pending:
            raise RuntimeError(f"nodes {[n.name for n in remaining]} can never run")
        all_refs = [ref for waiting in pending.values() for ref in waiting.handle.meta_refs]
        ray.wait(all_refs, num_returns=1)
        for name, waiting in list(pending.items()):
            handle = waiting.handle
            ready, _ = ray.wait(handle.meta_refs, num_returns=len(handle.meta_refs), timeout=0)
            if len(ready) < len(handle.meta_refs):
                continue
            data, metas = handle.result()
            if waiting.ahead is not None and data.sizes != waiting.ahead.sizes:
                raise RuntimeError(
                    f"node {name!r} returned shards of {data.sizes} samples; its consumers were "
                    f"submitted ahead for {waiting.ahead.sizes}"
                )
            rank_refs = handle.all_meta_refs  # every rank's meta, for the timeline
            rank_metas[name] = controller_get(list(rank_refs)) if rank_refs else metas
            results[name] = NodeResult(data, waiting.group_size, metas, waiting.started, time.perf_counter())
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
                {"node": node.name, "pool": graph.pool_of(node),
                 "rank": meta.get("rank", rank), "start": meta["t_start"], "end": meta["t_end"],
                 **{key: meta.get(key, 0) for key in COUNTED_METRICS}}
            )
    for key, metric in COUNTED_METRICS.items():
        result.metrics[metric] = float(sum(event[key] for event in result.timeline))
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
                "args": {
                    "iteration": iteration,
                    "wall_start": event["start"],
                    **{key: event[key] for key in TRANSFER_METRICS if key in event},
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
