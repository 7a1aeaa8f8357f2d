"""The dataflow graph: nodes, edges derived from data keys, and validation.

``build_graph`` turns a ``GraphSpec`` (plus its pool file) into a validated ``Graph`` or raises
a one-line ``SpecError`` naming the file and the field. It imports no Ray, vLLM or megatron.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import networkx as nx

from hybridflow.algos.advantages import zero_without_groups
from hybridflow.graph.batching import batch_plan, spec_reads_pairs
from hybridflow.graph.ops import OPS, SOURCE_WRITES, Op
from hybridflow.graph.plugins import import_plugins, load_graph_spec, plugin_dir
from hybridflow.spec.engines import caps_of, engines_with
from hybridflow.spec.graph import AdvantageOptions, GraphSpec, ModelSpec, NodeBase, UpdateOptions
from hybridflow.spec.layout import ParallelLayout
from hybridflow.spec.loading import SpecError, load_pools, resolve_relative
from hybridflow.spec.pool import PoolSpec

SOURCE = "<data>"  # pseudo-node that produces the data source's keys (``ops.SOURCE_WRITES``)


@dataclass(frozen=True)
class Node:
    """A node with its keys resolved (defaults filled in from the op) and its op's slots filled:
    ``slots[name]`` is the node's key of that kind, or None for an optional one it lacks."""

    name: str
    op: str
    model: str
    role: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    spec: NodeBase
    slots: Mapping[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Graph:
    """A validated graph: nodes in a topological order, the DAG, placement and layouts."""

    spec: GraphSpec
    file: str
    nodes: tuple[Node, ...]
    dag: nx.DiGraph  # node name -> node name, edge attribute "keys"
    pools: dict[str, PoolSpec]
    placement: dict[str, str]  # model name -> pool name
    layouts: dict[str, ParallelLayout]  # model name -> training layout with dp resolved
    ops: dict[str, Op]  # the records of the ops the nodes run (they travel with the graph)
    # model name -> the pool its rollout engine has to itself (``rollout.pool``); empty when
    # every rollout engine shares its model's pool (the hybrid engine)
    rollout_pools: dict[str, str] = field(default_factory=dict)
    plugin_dir: str = ""  # where the graph file's plugins are looked for first (its folder)

    def __reduce_ex__(self, protocol):
        """A graph with plugins unpickles (in a worker process) by importing them first, so
        that its nodes' and ops' classes, defined in the plugins, are found there."""
        if not self.spec.plugins:
            return super().__reduce_ex__(protocol)
        state = pickle.dumps({f.name: getattr(self, f.name) for f in fields(self)}, protocol)
        return _unpickle_with_plugins, (list(self.spec.plugins), self.plugin_dir, self.file, state)

    def with_absolute_sources(self) -> "Graph":
        """This graph with its models' relative local sources (``path``, ``gguf``, ``run``) made
        absolute from the current directory, where the user gave them. The graph's workers
        resolve a source where they run, which is this directory only when this process
        started their Ray (not with ``--address``, nor in a Ray started elsewhere)."""
        models = {}
        for name, model in self.spec.models.items():
            source = model.source
            local = {k: str(Path(v).absolute()) for k in ("path", "gguf", "run")
                     if (v := getattr(source, k)) is not None and not Path(v).is_absolute()}
            models[name] = model.model_copy(update={"source": source.model_copy(update=local)}) if local else model
        return replace(self, spec=self.spec.model_copy(update={"models": models}))

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def op(self, node: Node) -> Op:
        return self.ops[node.op]

    def dispatch_layout(self, node: Node) -> ParallelLayout:
        """The layout a node's batch is split over: the actor's generation layout for an op
        that generates (its generation TP peers share a chunk), else the model's training layout
        (one chunk per data-parallel rank, shared by its tensor/pipeline peers)."""
        if self.op(node).generates:
            gen = self.spec.models[node.model].rollout.layout
            return gen.resolve(self.pools[self.pool_of(node)].num_devices)
        return self.layouts[node.model]

    def pool_of(self, node: Node) -> str:
        """The pool whose workers run ``node``: its model's, or for a generating op of a model
        with a standalone rollout (``rollout.pool``) that pool."""
        if node.model in self.rollout_pools and self.op(node).generates:
            return self.rollout_pools[node.model]
        return self.placement[node.model]

    def used_pools(self) -> list[str]:
        """Every pool that runs something: the models' and the standalone rollouts', in order."""
        return list(dict.fromkeys([*self.placement.values(), *self.rollout_pools.values()]))

    def rollouts_on(self, pool: str) -> list[str]:
        """Models whose rollout engine alone (no train engine) lives on ``pool``."""
        return [m for m, p in self.rollout_pools.items() if p == pool]

    def producers(self, node: Node) -> dict[str, str]:
        """Input key -> producing node name (``SOURCE`` for the data source)."""
        out = {}
        for src, _, keys in self.dag.in_edges(node.name, data="keys"):
            for key in keys:
                out[key] = src
        return out

    def models_on(self, pool: str) -> list[str]:
        return [m for m, p in self.placement.items() if p == pool]

    @property
    def actor(self) -> str | None:
        """The actor; None in a graph that reads preference pairs (it trains scalar models)."""
        return next((name for name, m in self.spec.models.items() if m.role == "actor"), None)

    def rollout_sizes(self, model: str) -> tuple[int, int, int]:
        """What ``model``'s rollout engine is built for: ``(max_model_len, shared_prefix_len,
        max_num_seqs)``, the longest sequence, the longest prefix two requests share, and the
        sequences of one generate call (a whole iteration's, so one call fits the KV cache)."""
        data = self.spec.data
        judge = self.judge_node(model)
        if judge is not None:  # a verdict per actor sample; every filled template starts alike
            opts = judge.spec.options
            num_seqs = data.prompts_per_iteration * self.spec.models[self.actor].rollout.n
            return opts.max_prompt_length + opts.max_new_tokens, opts.max_prompt_length, num_seqs
        max_model_len = data.max_prompt_length + data.max_response_length
        # A prompt's samples share the prompt; a multi-turn episode's turns the context before them.
        multi_turn = any(n.model == model and self.op(n).multi_turn for n in self.nodes)
        shared = max_model_len if multi_turn else data.max_prompt_length
        return max_model_len, shared, data.prompts_per_iteration * self.spec.models[model].rollout.n

    def judge_node(self, model: str) -> Node | None:
        """The judge node that runs on ``model`` (its verdict lengths size the model's rollout
        engine), or None when ``model`` is no judge."""
        return next((n for n in self.nodes if n.model == model and self.op(n).judges), None)

    @property
    def reads_pairs(self) -> bool:
        """Whether the graph's data are preference pairs (``data.train_files`` of pair rows)."""
        return any(key == "pairs" for node in self.nodes for key in node.inputs)

    def reads_rollout_log_probs(self, model: str) -> bool:
        """Whether an update of ``model`` reads every sample's ``rollout_log_probs`` (rollout
        correction, ``old_log_probs: rollout``), or a distillation advantage of it takes them as
        the student's (``student_log_probs: rollout``), beyond the consistency check's sample."""
        def reads(opts) -> bool:
            if isinstance(opts, UpdateOptions):
                return opts.rollout_correction is not None or opts.old_log_probs == "rollout"
            return (isinstance(opts, AdvantageOptions) and opts.estimator == "distill"
                    and opts.student_log_probs == "rollout")
        return any(node.model == model and reads(node.spec.options) for node in self.nodes)

    def redundant_nodes(self) -> dict[str, str]:
        """Nodes whose outputs the graph could compute for free, with why: a ``log_prob`` node
        giving an update its ``old_log_probs`` when that update takes one optimizer step per
        rollout batch (one mini-batch, one epoch) and nothing else reads them (a KL-in-reward
        advantage does). Its weights are then the rollout's, and the
        update's own first forward (detached) gives the same log-probs up to float rounding;
        without the node the update uses exactly that. Leaving it out saves a forward pass."""
        found = {}
        for node in self.nodes:
            if not isinstance(node.spec.options, UpdateOptions) or "old_log_probs" not in node.inputs:
                continue
            options = node.spec.options
            if options.rollout_correction is not None:  # weighs by these log-probs up front
                continue
            if options.mini_batches * options.epochs != 1 and options.old_log_probs != "rollout":
                continue
            source = self.producers(node).get("old_log_probs")
            if source is None or source == SOURCE:
                continue
            producer = self.node(source)
            consumers = {dst for _, dst in self.dag.out_edges(producer.name)}
            if self.op(producer).forward and producer.model == node.model and consumers == {node.name}:
                if options.old_log_probs == "rollout":
                    found[producer.name] = (
                        f"{node.name} takes pi_old from the rollout (options.old_log_probs: "
                        "rollout); leave the node (and old_log_probs in its inputs) out"
                    )
                    continue
                found[producer.name] = (
                    f"{node.name} takes one optimizer step per batch (mini_batches 1, epochs 1), so "
                    "its own first forward gives these log-probs; leave the node (and "
                    "old_log_probs in its inputs) out to save a forward per iteration"
                )
        return found

    def base_of(self, model: str) -> str | None:
        """The LoRA actor whose module serves ``model`` with its adapters disabled, or None.

        A ``ref`` model is served that way when the actor has ``train.lora``, the two have the
        same source and sit on the same pool: its log-probs are then the base model's, and its
        workers build no weights of their own.
        """
        spec = self.spec.models[model]
        actor = self.actor
        if actor is None:
            return None
        actor_spec = self.spec.models[actor]
        if (
            spec.role == "ref"
            and actor_spec.train.adapters is not None
            and spec.source == actor_spec.source
            and self.placement[model] == self.placement[actor]
        ):
            return actor
        return None


def _unpickle_with_plugins(plugins: list[str], folder: str, file: str, state: bytes) -> "Graph":
    import_plugins(plugins, folder, file)
    return Graph(**pickle.loads(state))


def _resolve_nodes(spec: GraphSpec, file: str) -> list[Node]:
    nodes, seen = [], {}
    for i, node in enumerate(spec.nodes):
        where = f"nodes[{i}]"
        if node.name in seen:
            raise SpecError(file, f"{where}.name", f"duplicate node name {node.name!r}")
        seen[node.name] = i
        model: ModelSpec | None = spec.models.get(node.model)
        if model is None:
            raise SpecError(
                file, f"{where}.model", f"unknown model {node.model!r}; expected one of {sorted(spec.models)}"
            )
        nodes.append(resolve_node(node, model, file, where, fill_slots=False))
    return nodes


def resolve_node(
    node: NodeBase, model: ModelSpec, file: str = "<graph>", where: str = "node", fill_slots: bool = True
) -> Node:
    """``node`` (on ``model``) with its default keys filled in and (``fill_slots``) its op's
    slots filled; a role that cannot run the op, or keys that do not fill its slots, raise
    ``SpecError``."""
    op = OPS[node.op]
    if model.role not in op.roles:
        raise SpecError(
            file,
            f"{where}.op",
            f"a {model.role} cannot {node.op} (model {node.model!r}); "
            f"{node.op} runs on {sorted(op.roles)}",
        )
    if op.generates and model.rollout is None:
        raise SpecError(
            file, f"models.{node.model}.rollout", "an actor that generates needs rollout settings"
        )
    if op.judges and model.rollout is None:
        raise SpecError(
            file, f"models.{node.model}.rollout",
            f"judge node {node.name!r} generates its verdicts with the model's rollout engine: give "
            "rollout settings (e.g. {engine: hf})",
        )
    keys = {
        "inputs": tuple(node.inputs) if node.inputs is not None else op.default_inputs(model.role),
        "outputs": tuple(node.outputs) if node.outputs is not None else op.default_outputs(model.role),
    }
    resolved = Node(node.name, node.op, node.model, model.role, keys["inputs"], keys["outputs"], node)
    return _fill_slots(resolved, file, where) if fill_slots else resolved


def _fill_slots(node: Node, file: str, where: str) -> Node:
    """``node`` with ``slots`` filled from its keys (after the DAG is built, so that a key
    nobody produces is reported as such first)."""
    slots = {}
    for slot_name, slot in OPS[node.op].slots_for(node.role).items():
        keys = getattr(node, slot.side)
        found = [key for key in keys if key in slot.keys]
        if len(found) > 1 or (slot.required and not found):
            expected = "at most one" if len(found) > 1 else "one"
            raise SpecError(
                file,
                f"{where}.{slot.side}",
                f"{node.op} node {node.name!r} needs {expected} {slot.what} "
                f"({' or '.join(slot.keys)}) among its {slot.side} {list(keys)}",
            )
        slots[slot_name] = found[0] if found else None
    return replace(node, slots=slots)


def _build_dag(nodes: list[Node], file: str) -> nx.DiGraph:
    producer: dict[str, str] = {key: SOURCE for key in SOURCE_WRITES}
    for i, node in enumerate(nodes):
        for key in node.outputs:
            if key in producer:
                raise SpecError(
                    file,
                    f"nodes[{i}].outputs",
                    f"key {key!r} is already produced by {producer[key]!r}; each key needs one producer",
                )
            producer[key] = node.name
    dag = nx.DiGraph()
    dag.add_node(SOURCE)
    dag.add_nodes_from(n.name for n in nodes)
    for i, node in enumerate(nodes):
        for key in node.inputs:
            if key not in producer:
                raise SpecError(
                    file,
                    f"nodes[{i}].inputs",
                    f"key {key!r} is produced by no node; produced keys: {sorted(producer)}",
                )
            src = producer[key]
            if dag.has_edge(src, node.name):
                dag.edges[src, node.name]["keys"].append(key)
            else:
                dag.add_edge(src, node.name, keys=[key])
    try:
        cycle = nx.find_cycle(dag)
    except nx.NetworkXNoCycle:
        return dag
    path = " -> ".join([cycle[0][0]] + [edge[1] for edge in cycle])
    raise SpecError(file, "nodes", f"the graph has a cycle: {path}")


def _route_through_filters(nodes: list[Node], dag: nx.DiGraph, file: str) -> None:
    """Make every reader of a refilling node's input keys that runs after it read them from it.

    A refilling op (``filter``: dynamic sampling) drops prompt groups and has the nodes before
    it (its ancestors: prompts -> generate -> score) re-run on fresh prompts until the batch is
    full; the nodes after it must see the filtered batch only. So an edge that carries one of
    its input keys to a node that is not its ancestor is re-pointed to start at the filter (the
    DAG stays acyclic: the filter is upstream of none of its ancestors), and a later node may
    read nothing else that the re-run nodes (or the data source) produce.
    """
    refilling = [(i, n) for i, n in enumerate(nodes) if OPS[n.op].refills]
    if len(refilling) > 1:
        names = [n.name for _, n in refilling]
        raise SpecError(file, f"nodes[{refilling[1][0]}]", f"one filter node per graph, found {names}")
    for i, filt in refilling:
        # Its score slot makes it come after a generate node (and an update, writing no key,
        # can never come before it).
        before = nx.ancestors(dag, filt.name)
        index = {n.name: j for j, n in enumerate(nodes)}
        guarded = set(filt.inputs)
        for src, dst, keys in list(dag.edges(data="keys")):
            if src not in before or dst in before or dst == filt.name:
                continue
            stray = [key for key in keys if key not in guarded]
            if stray:
                raise SpecError(
                    file,
                    f"nodes[{index[dst]}].inputs",
                    f"node {dst!r} runs after filter {filt.name!r} but reads {stray} from "
                    f"{src!r}, which the filter re-runs; only the filter's inputs "
                    f"{sorted(guarded)} reach later nodes (filtered)",
                )
            dag.remove_edge(src, dst)
            if dag.has_edge(filt.name, dst):
                dag.edges[filt.name, dst]["keys"].extend(keys)
            else:
                dag.add_edge(filt.name, dst, keys=list(keys))


def generation_nodes(graph: "Graph") -> list[Node]:
    """The nodes that generate from the prompts alone: what ``trainer.async.mode``
    one_step_off and streaming run ahead of the iteration."""
    return [n for n in graph.nodes if OPS[n.op].generates and set(graph.producers(n).values()) <= {SOURCE}]


def refilled_nodes(graph: "Graph", filt: Node) -> list[Node]:
    """The nodes a refilling node re-runs each round (its ancestors), in execution order."""
    before = nx.ancestors(graph.dag, filt.name)
    return [n for n in graph.nodes if n.name in before]


def samples_per_prompt(spec: GraphSpec, node: Node, inputs: int) -> int:
    """Samples per prompt in ``node``'s outputs, given its inputs' (the same for all of them): a
    node that generates makes ``rollout.n`` (1 when greedy); every other op keeps its inputs'
    count."""
    if OPS[node.op].generates:
        return 1 if node.spec.options.greedy else spec.models[node.model].rollout.n
    return inputs


def _check_samples_per_prompt(spec: GraphSpec, nodes: list[Node], dag: nx.DiGraph, file: str) -> None:
    """Every node's inputs must come at one number of samples per prompt (a node reads row i of
    each input as the same sample): ReMax's greedy baseline (1 per prompt) cannot meet n > 1
    sampled responses, for instance."""
    index = {node.name: i for i, node in enumerate(nodes)}
    by_name = {node.name: node for node in nodes}
    per_prompt = {SOURCE: 1}
    for name in nx.topological_sort(dag):
        if name == SOURCE:
            continue
        node = by_name[name]
        sources = {src: per_prompt[src] for src in dag.predecessors(name)}
        if len(set(sources.values())) > 1:
            found = ", ".join(
                f"{key!r} from {src!r}: {sources[src]}"
                for src in sources for key in dag.edges[src, name]["keys"]
            )
            raise SpecError(
                file,
                f"nodes[{index[name]}].inputs",
                f"node {name!r} reads inputs at different samples per prompt ({found}); "
                "every input of a node must have the same (check models.<actor>.rollout.n and "
                "greedy generate nodes)",
            )
        inputs_per_prompt = max(sources.values(), default=1)
        _check_groups(spec, node, inputs_per_prompt, file, f"nodes[{index[name]}]")
        _check_distill(node, file, f"nodes[{index[name]}]")
        per_prompt[name] = samples_per_prompt(spec, node, inputs_per_prompt)


def _check_distill(node: Node, file: str, where: str) -> None:
    """A distillation advantage compares the teacher's log-probs with the student's: both are
    among its inputs, or the graph stops here instead of in a worker."""
    opts = node.spec.options
    if not (isinstance(opts, AdvantageOptions) and opts.estimator == "distill"):
        return
    needed = ("teacher_log_probs",) if opts.student_log_probs == "rollout" else ("teacher_log_probs", "old_log_probs")
    missing = [k for k in needed if k not in node.inputs]
    if missing:
        raise SpecError(
            file, f"{where}.inputs",
            f"estimator distill reads the teacher's and the student's log-probs; add {missing} "
            "(a log_prob node on a teacher model, and one on the actor unless "
            "options.student_log_probs is rollout)",
        )


def _check_groups(spec: GraphSpec, node: Node, per_prompt: int, file: str, where: str) -> None:
    """Refuse an advantage whose baseline is the other samples of a prompt when each prompt
    has one sample: every advantage would be 0 and the run would train on nothing."""
    opts = node.spec.options
    if per_prompt == 1 and isinstance(opts, AdvantageOptions) and zero_without_groups(opts.estimator, opts.scope):
        grpo = opts.estimator == "grpo"
        actor = next(name for name, model in spec.models.items() if model.role == "actor")
        raise SpecError(
            file,
            f"{where}.options.estimator",
            f"{opts.estimator}{' at scope group' if grpo else ''} compares each sample with the "
            f"other samples of its prompt, but node {node.name!r} gets 1 sample per prompt: every "
            f"advantage would be 0; set models.{actor}.rollout.n >= 2"
            + (" or options.scope: batch" if grpo else ""),
        )


def _resolve_placement(
    spec: GraphSpec, pools: dict[str, PoolSpec], file: str, pool_file: str
) -> tuple[dict[str, str], dict[str, ParallelLayout]]:
    if not pools:
        raise SpecError(pool_file, "pools", "no pool defined")
    if spec.placement == "auto":
        # Colocated on the first pool; build_graph's planner (the auto-mapper) may re-place it.
        first = next(iter(pools))
        placement = {name: first for name in spec.models}
    else:
        placement = dict(spec.placement)
        for name in spec.models:
            if name not in placement:
                raise SpecError(file, f"placement.{name}", "model has no pool; add it or use 'auto'")
        for name, pool in placement.items():
            if name not in spec.models:
                raise SpecError(file, f"placement.{name}", f"unknown model; expected one of {sorted(spec.models)}")
            if pool not in pools:
                raise SpecError(
                    file, f"placement.{name}", f"unknown pool {pool!r}; {pool_file} defines {sorted(pools)}"
                )
    layouts = {}
    for name, model in spec.models.items():
        pool = pools[placement[name]]
        try:
            layouts[name] = model.train.layout.resolve(pool.num_devices)
        except ValueError as exc:
            raise SpecError(file, f"models.{name}.train.layout", f"{exc} (pool {placement[name]!r})") from None
        if model.rollout is not None:
            gen = model.rollout.layout
            if layouts[name].tp % gen.tp or layouts[name].pp % gen.pp:
                raise SpecError(
                    file,
                    f"models.{name}.rollout.layout",
                    f"generation tp/pp ({gen.tp}/{gen.pp}) must divide training tp/pp "
                    f"({layouts[name].tp}/{layouts[name].pp})",
                )
            _check_generation_layout(model.rollout, layouts[name], file, f"models.{name}.rollout")
    return placement, layouts


def _resolve_rollout_pools(
    spec: GraphSpec, pools: dict[str, PoolSpec], placement: dict[str, str], file: str, pool_file: str
) -> dict[str, str]:
    """Model -> the pool of its standalone rollout engine (``rollout.pool``), checked: a known
    pool other than the model's, a train engine holding the full weights on every rank (they
    are what travels; a LoRA actor's with its adapters merged in), generation tp 1, and a batch
    that splits over the pool's ranks."""
    found = {}
    for name, model in spec.models.items():
        rollout = model.rollout
        if rollout is None or rollout.pool is None:
            continue
        field_ = f"models.{name}.rollout.pool"
        if rollout.pool not in pools:
            raise SpecError(file, field_, f"unknown pool {rollout.pool!r}; {pool_file} defines {sorted(pools)}")
        if rollout.pool == placement[name]:
            raise SpecError(
                file, field_,
                f"pool {rollout.pool!r} is the one {name!r} trains on; leave rollout.pool out to "
                "generate there (the hybrid engine), or name another pool",
            )
        if not caps_of(model.train).full_weights:
            raise SpecError(
                file, field_,
                "a standalone rollout takes the full weights of a train engine that holds them on "
                f"every rank (such as the torch train engine); {model.train.engine!r} actors that "
                "shard them generate on their own pool (leave rollout.pool out)",
            )
        if model.train.adapters is not None and getattr(rollout, "lora_sync", "merged") != "merged":
            raise SpecError(
                file, f"models.{name}.rollout.lora_sync",
                "a LoRA actor's weights reach a standalone rollout pool with the adapters merged in; "
                "set rollout.lora_sync: merged",
            )
        if rollout.layout.tp * rollout.layout.pp != 1:
            raise SpecError(file, field_, "a standalone rollout generates at tp = pp = 1 on every rank of its pool")
        ranks = pools[rollout.pool].num_devices
        if spec.data.prompts_per_iteration % ranks:
            raise SpecError(
                file, "data.prompts_per_iteration",
                f"{spec.data.prompts_per_iteration} prompts do not split evenly over the {ranks} "
                f"ranks of rollout pool {rollout.pool!r}; use a multiple of {ranks}",
            )
        found[name] = rollout.pool
    partial = spec.trainer.async_.partial_rollout
    if partial != "off":
        field_ = "trainer.async.partial_rollout"
        if spec.trainer.async_.synchronous:
            raise SpecError(file, field_, f"{partial} needs an off-policy mode (trainer.async.mode one_step_off or streaming): in sync mode no weights arrive during a generation")
        if not found:
            raise SpecError(file, field_, f"{partial} needs the actor's rollout on a pool of its own (models.<actor>.rollout.pool): on the training pool generation and update never overlap")
        for name in found:
            engine = spec.models[name].rollout.engine
            if not caps_of(spec.models[name].rollout).partial_rollouts:
                able = " or ".join(engines_with("rollout", "partial_rollouts")) or "that takes weights between decoding steps"
                raise SpecError(file, field_, f"{partial} needs models.{name}.rollout.engine {able} (an engine that takes weights between decoding steps; got {engine})")
    return found


def _check_generation_layout(rollout, train: ParallelLayout, file: str, field: str) -> None:
    """Generation TP > 1 runs on vLLM only, at generation pp = 1, over ranks vLLM's external
    launcher groups itself: ``tg`` consecutive ones. Training ranks are TP-fastest, and a
    generation TP group takes training TP ranks at stride t/tg (``hybrid_engine.groups``), so
    the groups are consecutive exactly when tg == t, whatever the training pp and dp: at
    t = 2 x p = 2 -> tg = 2 they are each stage's TP group, {0, 1} and {2, 3}, and the micro-DP
    groups ({0, 2}, {1, 3}) span the stages."""
    gen = rollout.layout
    if gen.tp * gen.pp == 1:
        return
    if gen.pp > 1:
        raise SpecError(file, f"{field}.layout.pp", f"generation pp {gen.pp} is not available: the rollout engines generate at pp = 1")
    if not caps_of(rollout).generation_tp:
        able = " or ".join(engines_with("rollout", "generation_tp")) or "with generation TP"
        raise SpecError(file, f"{field}.layout.tp", f"generation tp {gen.tp} needs rollout.engine {able} (got {rollout.engine})")
    if gen.tp != train.tp:
        raise SpecError(
            file,
            f"{field}.layout.tp",
            f"generation tp {gen.tp} must equal the training tp {train.tp}: vLLM's external launcher "
            "groups consecutive ranks, the 3D-HybridEngine's generation groups are strided otherwise",
        )


LORA_ROLES = ("actor", "reward", "cost")  # a reward or cost model trained on pairs may be LoRA


def derive_dag(spec: GraphSpec, file: str = "<python graph>") -> tuple[list[Node], nx.DiGraph]:
    """A spec's nodes (keys resolved, in a topological order) and its DAG, validated as far as
    they go without a pool file."""
    reads_pairs = spec_reads_pairs(spec)
    actors = [n for n, m in spec.models.items() if m.role == "actor"]
    if not actors and not reads_pairs:
        raise SpecError(file, "models", "a graph needs one model with role actor (or a node reading "
                        "preference pairs, which trains a reward or cost model)")
    if len(actors) > 1:
        raise SpecError(file, "models", f"one actor per graph, found {actors}")
    for name, model in spec.models.items():
        if model.train.adapters is not None and model.role not in LORA_ROLES:
            raise SpecError(file, f"models.{name}.train.lora",
                            f"LoRA is for the actor and reward or cost models (role is {model.role})")
        if model.train.adapters is not None and model.rollout is not None and not caps_of(model.rollout).lora:
            able = " or ".join(engines_with("rollout", "lora"))
            raise SpecError(file, f"models.{name}.rollout.engine",
                            f"{model.rollout.engine!r} takes no LoRA adapters (train.lora); use rollout.engine {able}")
    nodes = _resolve_nodes(spec, file)
    _check_rollout_correction(nodes, file)
    _check_learned_score_options(spec, nodes, file)
    _check_overlong_buffer(spec, nodes, file)
    _check_judges(spec, nodes, file)
    _check_record(spec, nodes, file)
    if not spec.trainer.async_.synchronous and any(OPS[n.op].refills for n in nodes):
        raise SpecError(
            file, "trainer.async.mode",
            f"{spec.trainer.async_.mode} runs generation ahead of the iteration; a filter node "
            "(dynamic sampling) re-runs it inside the iteration: use mode sync",
        )
    dag = _build_dag(nodes, file)
    readers = {key: [n.name for n in nodes if key in n.inputs] for key in ("prompts", "pairs")}
    if readers["prompts"] and readers["pairs"]:
        raise SpecError(file, "nodes", f"nodes {readers['prompts']} read prompts and {readers['pairs']} "
                        "preference pairs; a graph's data are one or the other")
    for i, node in enumerate(nodes):
        train = spec.models[node.model].train
        if "pairs" in node.inputs and (train.micro_batch_size % 2 or getattr(train, "micro_batch_tokens", None)):
            raise SpecError(file, f"models.{node.model}.train.micro_batch_size",
                            f"node {node.name!r} trains on pairs, two rows each (chosen, rejected): a micro-batch "
                            f"must hold whole pairs, expected an even micro_batch_size and no micro_batch_tokens")
    _route_through_filters(nodes, dag, file)
    nodes = [_fill_slots(node, file, f"nodes[{i}]") for i, node in enumerate(nodes)]
    _check_samples_per_prompt(spec, nodes, dag, file)
    by_name = {n.name: n for n in nodes}
    return [by_name[n] for n in nx.topological_sort(dag) if n != SOURCE], dag


def _check_record(spec: GraphSpec, nodes: list[Node], file: str) -> None:
    """``trainer.record`` names nodes of the graph, at iterations the run reaches; a generation
    on a standalone rollout pool is not recordable (its weights arrive published, not kept)."""
    record = spec.trainer.record
    if record is None:
        return
    by_name = {n.name: n for n in nodes}
    for i, name in enumerate(record.nodes):
        if name not in by_name:
            raise SpecError(file, f"trainer.record.nodes[{i}]", f"no node {name!r}; the graph's nodes are {list(by_name)}")
        rollout = spec.models[by_name[name].model].rollout
        if OPS[by_name[name].op].generates and rollout is not None and rollout.pool is not None:
            raise SpecError(file, f"trainer.record.nodes[{i}]", f"node {name!r} generates on the standalone rollout "
                            f"pool {rollout.pool!r}, whose published weights are not recorded")
    for i, iteration in enumerate(record.iterations):
        if iteration > spec.trainer.iterations:
            raise SpecError(file, f"trainer.record.iterations[{i}]",
                            f"iteration {iteration} is past the run's last (trainer.iterations = {spec.trainer.iterations})")


def _check_rollout_correction(nodes: list[Node], file: str) -> None:
    """An update with rollout correction weighs by pi_old / pi_rollout: it needs pi_old, the
    ``old_log_probs`` key, among its inputs (``responses`` brings the rollout's)."""
    for i, node in enumerate(nodes):
        if not isinstance(node.spec.options, UpdateOptions) or node.role != "actor":
            continue
        if node.spec.options.rollout_correction is not None and "old_log_probs" not in node.inputs:
            raise SpecError(
                file,
                f"nodes[{i}].options.rollout_correction",
                f"update {node.name!r} weighs tokens by pi_old / pi_rollout and needs "
                f"old_log_probs among its inputs {list(node.inputs)} (a log_prob node on the actor)",
            )


def _check_learned_score_options(spec: GraphSpec, nodes: list[Node], file: str) -> None:
    """``normalize`` keeps running moments of a learned model's scores; a rule, compute_score or
    remote scorer gives scores on its own fixed scale, and the option would do nothing there."""
    for i, node in enumerate(nodes):
        options = node.spec.options
        if OPS[node.op].scores and getattr(options, "normalize", False) and spec.models[node.model].source.is_scorer:
            raise SpecError(
                file, f"nodes[{i}].options.normalize",
                f"score node {node.name!r} scores with a rule or remote scorer (model "
                f"{node.model!r}), whose scores have a scale of their own; normalize is for a "
                "learned reward or cost model (remove it)",
            )


def _check_overlong_buffer(spec: GraphSpec, nodes: list[Node], file: str) -> None:
    """DAPO's overlong buffer is the last ``overlong_buffer`` tokens of ``data.max_response_length``:
    a longer one would fail at the first score, after the workers started."""
    for i, node in enumerate(nodes):
        buffer = getattr(node.spec.options, "overlong_buffer", None)
        if buffer is not None and buffer > spec.data.max_response_length:
            raise SpecError(
                file, f"nodes[{i}].options.overlong_buffer",
                f"{buffer} tokens is longer than the responses (data.max_response_length = "
                f"{spec.data.max_response_length}); the buffer is their last tokens",
            )


def _check_judges(spec: GraphSpec, nodes: list[Node], file: str) -> None:
    """A judge model is a causal LM with a rollout engine of its own: it has weights, runs
    judge nodes only (a score node would read a value head it has not), and generates where it
    sits; a reward or cost model with rollout settings is a judge."""
    judged = {n.model for n in nodes if OPS[n.op].judges}
    for i, node in enumerate(nodes):
        if node.model in judged and not OPS[node.op].judges:
            raise SpecError(file, f"nodes[{i}].op", f"model {node.model!r} is a judge (a judge node runs on it): "
                            f"it runs judge nodes only, not {node.op}")
    for name, model in spec.models.items():
        if model.role == "actor" or model.rollout is None:
            continue
        where = f"models.{name}.rollout"
        if name not in judged:
            raise SpecError(file, where, f"a {model.role} model has rollout settings only as a judge; "
                            "add a judge node on it or leave rollout out")
        if model.source.is_scorer:
            raise SpecError(file, f"models.{name}.source", "a judge generates: give it weights (config, path, gguf, "
                            "package or run), not a rule, compute_score or remote source")
        if model.rollout.pool is not None:
            raise SpecError(file, f"{where}.pool", "a judge generates on its own model's pool; place the model "
                            "on a pool of its own instead (placement)")
        if model.train.adapters is not None:
            raise SpecError(file, f"models.{name}.train.lora", "a judge is not trained: leave lora out")


# Resolves ``placement: auto`` for a graph validated with everything on the first pool: returns
# (model -> pool name, pool name -> PoolSpec). The auto-mapper (placement layer) is passed in by
# the layers above, so this module never imports it.
Planner = Callable[["Graph"], tuple[dict[str, str], dict[str, PoolSpec]]]


def build_graph(
    spec: GraphSpec,
    file: str | Path = "<python graph>",
    pools_file: str | Path | None = None,
    planner: Planner | None = None,
    check_batch: bool = True,
) -> Graph:
    """Validate ``spec`` and derive its DAG. Raises ``SpecError`` (one line) on any mistake.

    ``placement: auto`` is resolved by ``planner`` when given, else colocates every model on the
    first pool. ``check_batch=False`` leaves out the batch-size divisibility check (for the
    planner's own use: ``hybridflow plan`` scales the batch to the plan it finds).
    """
    file = str(file)
    nodes, dag = derive_dag(spec, file)
    pool_path = resolve_relative(str(pools_file or spec.resources), file if Path(file).is_file() else None)
    pools = dict(load_pools(pool_path).pools)
    placement, layouts = _resolve_placement(spec, pools, file, str(pool_path))
    planned = spec.placement == "auto" and planner is not None
    if check_batch and not planned:  # a planned placement is checked once it is known
        batch_plan(spec, layouts, file)  # batch sizes must divide over the layouts
    graph = Graph(
        spec=spec,
        file=file,
        nodes=tuple(nodes),
        dag=dag,
        pools=pools,
        placement=placement,
        layouts=layouts,
        ops={op: OPS[op] for op in dict.fromkeys(n.op for n in nodes)},
        rollout_pools=_resolve_rollout_pools(spec, pools, placement, file, str(pool_path)),
        plugin_dir=plugin_dir(file),
    )
    if planned:
        placement, pools = planner(graph)
        explicit = spec.model_copy(update={"placement": placement})
        placement, layouts = _resolve_placement(explicit, pools, file, str(pool_path))
        if check_batch:
            batch_plan(spec, layouts, file)
        rollout_pools = _resolve_rollout_pools(spec, pools, placement, file, str(pool_path))
        graph = replace(graph, pools=pools, placement=placement, layouts=layouts, rollout_pools=rollout_pools)
    if spec.trainer.elastic:
        _check_elastic(graph, str(pool_path))
    return graph


def _check_elastic(graph: Graph, pool_file: str) -> None:
    """``trainer.elastic`` restarts a pool on the nodes left after one is lost: a pool that
    node labels pin to one node has nowhere else to go."""
    for name in graph.used_pools():
        pool = graph.pools[name]
        if pool.node_labels and pool.nodes == 1:
            raise SpecError(
                pool_file, f"pools.{name}.node_labels",
                f"{pool.node_labels} pins the pool to one node; trainer.elastic cannot move or shrink "
                "it when that node is lost: leave node_labels out, or set trainer.elastic: false",
            )


def resize_pools(graph: Graph, pools: dict[str, PoolSpec]) -> Graph:
    """``graph`` on pools of other sizes (``trainer.elastic`` after a lost node): every model
    keeps its tp x pp and takes the data-parallel size its pool now holds (a ``dp`` the graph
    file fixed included); layouts and batch sizes are checked as ``build_graph`` checks them.
    Raises ``SpecError`` where they do not fit."""
    spec = graph.spec
    free_dp = {
        name: model.model_copy(update={"train": model.train.model_copy(
            update={"layout": model.train.layout.model_copy(update={"dp": None})})})
        for name, model in spec.models.items()
    }
    spec = spec.model_copy(update={"models": free_dp, "placement": dict(graph.placement)})
    pools = {**graph.pools, **pools}
    placement, layouts = _resolve_placement(spec, pools, graph.file, "the resized pools")
    batch_plan(spec, layouts, graph.file)
    rollout_pools = _resolve_rollout_pools(spec, pools, placement, graph.file, "the resized pools")
    return replace(graph, spec=spec, pools=pools, placement=placement, layouts=layouts, rollout_pools=rollout_pools)


def load_graph(
    path: str | Path,
    overrides: list[str] = (),
    pools_file: str | Path | None = None,
    planner: Planner | None = None,
) -> Graph:
    """Read, override and validate a graph file (its plugins imported first)."""
    return build_graph(load_graph_spec(path, overrides), path, pools_file, planner)
