"""Auto-mapper: which models share which devices, and under which layouts (HybridFlow's search).

    for each partition of the models into colocated sets          (Bell(#models) of them)
        for each allocation of the devices to the sets            (each set >= its memory minimum)
            each set: per-model layouts chosen by the simulator   (cached per set and size)
            cost = sum over stages of max over concurrent sets of the sum of the set's op times
    return the cheapest plan, with its predicted per-stage and per-node times

Set sizes are 1..devices_per_node (a set inside one node) or whole nodes beyond that. A
colocated set runs its models' ops one after another on all its devices and must hold every
model's static state (weights; grads and optimizer state if trained) at once plus the largest
op's transient memory. Inputs produced on another set pay a transfer; on CPU, devices beyond
the physical cores slow every busy device down (``Simulator.contention``).

Imports no Ray: ``hybridflow plan`` and graph validation stay light.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import networkx as nx

from hybridflow.graph.batching import smallest_even_batch
from hybridflow.graph.dag import SOURCE, derive_dag
from hybridflow.graph.library import ALGORITHMS
from hybridflow.graph.ops import OPS
from hybridflow.placement.profiles import HardwareProfile, ModelArch, arch_from_hf_config, get_profile, model_size
from hybridflow.spec.engines import caps_of
from hybridflow.spec.graph import PRETRAINED_KINDS, TINY_QWEN2
from hybridflow.spec.layout import GenerationLayout
from hybridflow.placement.simulator import (
    ModelInfo,
    OpNode,
    PlanGraph,
    Simulator,
    Workload,
    all_partitions,
)
from hybridflow.spec.loading import SpecError, resolve_relative


@dataclass(frozen=True)
class SetPlan:
    models: tuple[str, ...]
    devices: int
    layouts: dict[str, GenerationLayout]
    node_times: dict[str, float]  # node name -> seconds (op time only)
    memory_per_device: float


@dataclass
class Plan:
    sets: tuple[SetPlan, ...]
    stage_times: list[float]
    node_times: dict[str, float]  # including transfers into the node's set
    total: float

    @property
    def placement(self) -> dict[str, int]:
        """Model -> index of its set."""
        return {m: i for i, s in enumerate(self.sets) for m in s.models}

    def key(self) -> str:
        return " | ".join(f"{'+'.join(s.models)}:{s.devices}" for s in self.sets)

    def describe(self, graph: PlanGraph | None = None) -> str:
        lines = [f"plan: {self.key()}   predicted iteration {self.total:.4g} s"]
        for i, s in enumerate(self.sets):
            lines.append(f"  set {i}: {s.devices} device(s), {s.memory_per_device / 1e9:.3g} GB/device")
            for m in s.models:
                lines.append(f"    {m:<10} {s.layouts[m]}")
        lines.append("  stages: " + ", ".join(f"{t:.4g} s" for t in self.stage_times))
        for name, seconds in self.node_times.items():
            lines.append(f"    {name:<16} {seconds:.4g} s")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "key": self.key(),
            "total_s": self.total,
            "stage_s": self.stage_times,
            "node_s": self.node_times,
            "sets": [
                {"models": list(s.models), "devices": s.devices,
                 "layouts": {m: str(l) for m, l in s.layouts.items()}}
                for s in self.sets
            ],
        }


class AutoMapper:
    """Search placements of ``graph`` on ``total_devices`` devices of one profile."""

    def __init__(self, graph: PlanGraph, profile: HardwareProfile, total_devices: int, devices_per_node: int):
        self.graph = graph
        self.total_devices = total_devices
        self.sim = Simulator(profile, devices_per_node, graph.workload)
        dpn = devices_per_node
        self.sizes = [n for n in range(1, min(dpn, total_devices) + 1)]
        self.sizes += [k * dpn for k in range(2, total_devices // dpn + 1)]
        self._model_cache: dict[tuple[str, int], list[tuple[GenerationLayout, float, float, float]]] = {}
        self._set_cache: dict[tuple[tuple[str, ...], int], SetPlan | None] = {}
        self.num_evaluated = 0

    # -- per model ------------------------------------------------------------------------------

    def model_time(self, model: str, layout: GenerationLayout, free_memory: float) -> dict[str, float]:
        info = self.graph.models[model]
        return {n.name: self.sim.time(self.node_work(n, layout, free_memory)) for n in self.graph.nodes_of(model)}

    def node_work(self, node: OpNode, layout: GenerationLayout, free_memory: float) -> dict[str, float]:
        """A node's work: its op ``calls`` times, plus the controller's dispatch of it."""
        work = self.sim.op_work(self.graph.models[node.model], node.op, layout, free_memory)
        work = {k: v * node.calls for k, v in work.items()}
        work["overhead:dispatch"] = work.get("overhead:dispatch", 0.0) + 1
        return work

    def candidates(self, model: str, n: int) -> list[tuple[GenerationLayout, float, float, float]]:
        """(layout, static bytes, transient bytes, seconds alone) for every layout that fits
        alone, fastest first. Cached per (model, device count)."""
        key = (model, n)
        if key not in self._model_cache:
            info = self.graph.models[model]
            usable = self.sim.usable_memory()
            out = []
            for layout in self.sim.layouts(info, n):
                static = self.sim.static_memory(info, layout)
                transient = self.sim.transient_memory(info, layout)
                if static + transient > usable:
                    continue
                free = self._kv_free(info, layout, usable - static)
                out.append((layout, static, transient, sum(self.model_time(model, layout, free).values())))
            out.sort(key=lambda c: c[3])
            self._model_cache[key] = out
        return self._model_cache[key]

    def _kv_free(self, info: ModelInfo, layout: GenerationLayout, free_after_static: float) -> float:
        if info.role != "actor" or info.arch is None:
            return free_after_static
        return free_after_static - self.sim._generation_weight_extra(info, layout)

    # -- per colocated set ----------------------------------------------------------------------

    def set_plan(self, models: tuple[str, ...], n: int) -> SetPlan | None:
        """Layouts for ``models`` sharing ``n`` devices, or None when they cannot fit."""
        key = (tuple(sorted(models)), n)
        if key in self._set_cache:
            return self._set_cache[key]
        usable = self.sim.usable_memory()
        cands = {m: self.candidates(m, n) for m in models}
        plan = None
        if all(cands.values()):
            choice = {m: 0 for m in models}

            def memory() -> float:
                picked = [cands[m][choice[m]] for m in models]
                return sum(c[1] for c in picked) + max(c[2] for c in picked)

            # Greedy: while the set does not fit, move the model whose next smaller-memory
            # layout costs the least extra time per byte saved.
            while memory() > usable:
                best = None
                for m in models:
                    cur = cands[m][choice[m]]
                    for j in range(choice[m] + 1, len(cands[m])):
                        alt = cands[m][j]
                        saved = (cur[1] + cur[2]) - (alt[1] + alt[2])
                        if saved > 0:
                            ratio = (alt[3] - cur[3]) / saved
                            if best is None or ratio < best[0]:
                                best = (ratio, m, j)
                            break
                if best is None:
                    break
                choice[best[1]] = best[2]
            if memory() <= usable:
                layouts = {m: cands[m][choice[m]][0] for m in models}
                plan = self._finish_set(models, n, layouts, cands, choice, usable)
        self._set_cache[key] = plan
        return plan

    def _finish_set(self, models, n, layouts, cands, choice, usable) -> SetPlan:
        statics = {m: cands[m][choice[m]][1] for m in models}
        # The actor's layout (and generation layout) again, now that the KV cache competes with
        # its set mates' static memory.
        for m in models:
            info = self.graph.models[m]
            if info.role != "actor" or info.arch is None:
                continue
            others = sum(v for k, v in statics.items() if k != m)
            others_transient = max([cands[k][choice[k]][2] for k in models if k != m], default=0.0)
            best = None
            for layout, static, transient, _ in cands[m]:
                if others + static + max(transient, others_transient) > usable:
                    continue
                free = self._kv_free(info, layout, usable - others - static)
                seconds = sum(self.model_time(m, layout, free).values())
                if best is None or seconds < best[0]:
                    best = (seconds, layout, static, transient)
            if best is not None:
                layouts[m], statics[m] = best[1], best[2]
        return self._scored_set(tuple(models), n, layouts)

    def _scored_set(self, models: tuple[str, ...], n: int, layouts: dict[str, GenerationLayout]) -> SetPlan:
        """A colocated set with its layouts fixed: op times and memory per device."""
        usable = self.sim.usable_memory()
        infos = {m: self.graph.models[m] for m in models}
        static = sum(self.sim.static_memory(infos[m], layouts[m]) for m in models)
        node_times = {}
        for m in models:
            free = self._kv_free(infos[m], layouts[m], usable - static)
            node_times.update(self.model_time(m, layouts[m], free))
        transient = max(self.sim.transient_memory(infos[m], layouts[m]) for m in models)
        return SetPlan(models, n, dict(layouts), node_times, static + transient)

    def score(self, plan: Plan) -> Plan:
        """``plan``'s placement and layouts scored under this mapper's graph and workload (e.g.
        another batch size)."""
        return self._combine([self._scored_set(s.models, s.devices, s.layouts) for s in plan.sets])

    # -- plans ----------------------------------------------------------------------------------

    def evaluate(self, sets: list[tuple[tuple[str, ...], int]]) -> Plan | None:
        """The cost of one placement: colocated sets with their device counts."""
        set_plans = []
        for models, n in sets:
            sp = self.set_plan(tuple(models), n)
            if sp is None:
                return None
            set_plans.append(sp)
        self.num_evaluated += 1
        return self._combine(set_plans)

    def _combine(self, set_plans: list[SetPlan]) -> Plan:
        where = {m: i for i, sp in enumerate(set_plans) for m in sp.models}
        by_name = {node.name: node for node in self.graph.nodes}
        node_times = {}
        per_stage_set = [[0.0] * len(set_plans) for _ in range(self.graph.num_stages)]
        for node in self.graph.nodes:
            i = where[node.model]
            seconds = set_plans[i].node_times[node.name]
            for src in node.inputs:
                j = where[by_name[src].model]
                if j != i:
                    seconds += self.sim.time(
                        self.sim.transfer_work(by_name[src], set_plans[i].devices, set_plans[j].devices)
                    )
            node_times[node.name] = seconds
            per_stage_set[node.stage][i] += seconds
        stage_times = []
        for row in per_stage_set:
            busy = sum(sp.devices for sp, t in zip(set_plans, row) if t > 0)
            stage_times.append(max(row) * self.sim.contention(busy))
        return Plan(tuple(set_plans), stage_times, node_times, sum(stage_times))

    def min_devices(self, models: tuple[str, ...]) -> int | None:
        """The fewest devices on which ``models`` fit together (memory only)."""
        for n in self.sizes:
            if self.set_plan(models, n) is not None:
                return n
        return None

    def search(self, keep: int = 10) -> list[Plan]:
        """The ``keep`` cheapest plans, best first (an empty list when nothing fits)."""
        models = list(self.graph.models)
        best: list[Plan] = []
        feasible: dict[tuple[str, ...], list[int]] = {}
        for partition in all_partitions(models):
            sizes_per_set = []
            for s in partition:
                if s not in feasible:
                    low = self.min_devices(s)
                    feasible[s] = [] if low is None else [n for n in self.sizes if n >= low]
                sizes_per_set.append(feasible[s])
            if not all(sizes_per_set):
                continue
            for alloc in _allocations(self.total_devices, sizes_per_set):
                plan = self.evaluate(list(zip(partition, alloc)))
                if plan is None:
                    continue
                best.append(plan)
                if len(best) > 4 * keep:
                    best.sort(key=lambda p: p.total)
                    del best[keep:]
        best.sort(key=lambda p: p.total)
        return best[:keep]


def _allocations(total: int, sizes_per_set: list[list[int]]):
    if len(sizes_per_set) == 1:
        if total in sizes_per_set[0]:
            yield (total,)
        return
    rest_min = sum(s[0] for s in sizes_per_set[1:])
    for n in sizes_per_set[0]:
        if n + rest_min > total:
            break
        for rest in _allocations(total - n, sizes_per_set[1:]):
            yield (n,) + rest


# -- from a validated hybridflow Graph ------------------------------------------------------------

TINY_VOCAB = 64  # the built-in tasks' character tokenizers have a few dozen symbols


def _arch_of(name: str, graph, size: str | None) -> ModelArch | None:
    source = graph.spec.models[name].source
    if source.is_scorer:
        return None
    if size is not None:
        return model_size(size)
    if source.is_pretrained:
        where = Path(source.path or source.gguf or source.package or source.run).name
        return arch_from_hf_config(_pretrained_config(name, graph), name=where)
    return arch_from_hf_config({"vocab_size": TINY_VOCAB, **TINY_QWEN2, **(source.config or {})})


def _pretrained_config(name: str, graph) -> dict:
    """The HF config of a ``path``, ``gguf`` or ``package`` source, read without loading (nor
    converting) the weights; a missing or unreadable one is a SpecError naming the field."""
    from hybridflow.engines.models import ModelSourceError, gguf_file, run_model_dir

    source = graph.spec.models[name].source
    kind = next(k for k in PRETRAINED_KINDS if getattr(source, k) is not None)
    field = f"models.{name}.source.{kind}"
    try:
        if source.path is not None:
            config = resolve_relative(source.path, graph.file) / "config.json"
            return json.loads(config.read_text())
        if source.run is not None:
            return json.loads((run_model_dir(source.run, source.model) / "config.json").read_text())
        file = gguf_file(source)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True).to_dict()
    except ModelSourceError as exc:
        raise SpecError(graph.file, field, str(exc)) from None
    except (OSError, ValueError) as exc:  # no config.json, not JSON, not a GGUF transformers reads
        raise SpecError(graph.file, field, f"cannot read the model's config: {exc}") from None


def plan_graph(graph, model_size_name: str | None = None) -> PlanGraph:
    """The simulator's view of a validated ``hybridflow.graph.dag.Graph``.

    With ``model_size_name`` every weighted model becomes that Llama size and may use any
    tp x pp layout (as megatron-core would run it; the torch engine is data-parallel only).
    """
    spec = graph.spec
    updated = {n.model for n in graph.nodes if graph.op(n).trains}
    models = {}
    for name, m in spec.models.items():
        models[name] = ModelInfo(
            name=name,
            role=m.role,
            arch=_arch_of(name, graph, model_size_name),
            trainable=name in updated,
            micro_batch=None if model_size_name else m.train.micro_batch_size,
            any_layout=model_size_name is not None or caps_of(m.train).model_parallel,
            state_sharding=_state_sharding(caps_of(m.train), model_size_name),
            flexible_generation=m.rollout is not None and (caps_of(m.rollout).generation_tp or model_size_name is not None),
        )
    actor = spec.models[graph.actor] if graph.actor is not None else None
    updates = [n for n in graph.nodes if graph.op(n).trains]
    workload = Workload(
        num_prompts=spec.data.prompts_per_iteration,
        samples_per_prompt=actor.rollout.n if actor is not None and actor.rollout else 1,
        prompt_len=spec.data.max_prompt_length,
        response_len=spec.data.max_response_length,
        epochs=max((n.spec.options.epochs for n in updates), default=1),
        updates_per_epoch=max((n.spec.options.mini_batches for n in updates), default=1),
        micro_batch=1 if model_size_name or actor is None else actor.train.micro_batch_size,
    )
    return PlanGraph(models, _op_nodes(graph.nodes, graph.dag), workload)


def _state_sharding(caps, model_size_name: str | None) -> str:
    """``ModelInfo.state_sharding`` of a model under its train engine (``--model-size`` plans
    every model as megatron-core would run it)."""
    if model_size_name is not None or caps.model_parallel:
        return "model_parallel"
    return "data_parallel" if caps.sharded_data_parallel else "replicated"


def train_memory_lines(mapper: "AutoMapper", n: int) -> list[str]:
    """For each trained model: its static bytes per device on ``n`` devices alone, under its
    train engine, with the arithmetic (the layout with the least), and whether it fits."""
    usable = mapper.sim.usable_memory()
    lines = []
    for name, info in mapper.graph.models.items():
        if not info.trainable or info.arch is None:
            continue
        memory, terms = min(
            (mapper.sim.static_memory_terms(info, layout) for layout in mapper.sim.layouts(info, n)),
            key=lambda t: t[0],
        )
        verdict = "fits" if memory <= usable else "does not fit"
        lines.append(
            f"{name} train state per device on {n} devices: {terms} = {memory / 1e9:.4g} GB; "
            f"{verdict} in {usable / 1e9:.4g} GB usable"
        )
    return lines


def _op_nodes(nodes, dag: nx.DiGraph) -> tuple[OpNode, ...]:
    """The simulator's nodes: each graph node with the nodes it reads from and its stage (the
    longest chain of nodes before it)."""
    depth = {SOURCE: -1}
    for name in nx.topological_sort(dag):
        if name != SOURCE:
            depth[name] = max(depth[src] for src, _ in dag.in_edges(name)) + 1
    return tuple(
        OpNode(
            name=n.name,
            op=n.op,
            model=n.model,
            inputs=tuple(sorted({src for src, _ in dag.in_edges(n.name) if src != SOURCE})),
            stage=depth[n.name],
        )
        for n in nodes
    )


def mapper_for_pool(graph, pool, model_size_name: str | None = None, base_dir: str | Path = ".") -> AutoMapper:
    """An auto-mapper for ``graph`` over the devices of one ``PoolSpec`` (its profile's rates)."""
    profile = get_profile(pool.profile, pool.device, base_dir)
    return AutoMapper(plan_graph(graph, model_size_name), profile, pool.num_devices, pool.devices_per_node)


def plan_for_pool(graph, pool, model_size_name: str | None = None, base_dir: str | Path = ".") -> tuple[AutoMapper, list[Plan]]:
    """Search placements of ``graph`` over the devices of one ``PoolSpec``."""
    mapper = mapper_for_pool(graph, pool, model_size_name, base_dir)
    return mapper, mapper.search()


def plan_dp(plan: Plan) -> dict[str, int]:
    """Model -> its data-parallel size in ``plan``."""
    return {m: s.layouts[m].train.dp for s in plan.sets for m in s.models}


def with_prompts(graph, prompts: int):
    """``graph`` with ``data.prompts_per_iteration`` set to ``prompts`` (nothing else changes)."""
    spec = graph.spec
    data = spec.data.model_copy(update={"prompts_per_iteration": prompts})
    return replace(graph, spec=spec.model_copy(update={"data": data}))


def plan_even_batch(graph, pool, model_size_name: str | None = None, keep: int = 10,
                    base_dir: str | Path = ".") -> tuple[AutoMapper, list[Plan], int]:
    """Search as :meth:`AutoMapper.search`, then scale the batch to the best plan: the fewest
    prompts per iteration, no fewer than the graph's, that its data-parallel ranks split evenly.
    The best plan (same placement and layouts) is scored again at that batch; the runners-up
    keep their scores at the graph's batch.

    Returns the mapper of the search, the plans and the prompts per iteration of the best one.
    """
    mapper = mapper_for_pool(graph, pool, model_size_name, base_dir)
    plans = mapper.search(keep)
    prompts = graph.spec.data.prompts_per_iteration
    if not plans:
        return mapper, plans, prompts
    needed = smallest_even_batch(graph.spec, plan_dp(plans[0]))
    if needed != prompts:
        scaled = mapper_for_pool(with_prompts(graph, needed), pool, model_size_name, base_dir)
        plans[0] = scaled.score(plans[0])
    return mapper, plans, needed


def split_pool(pool_name: str, pool, plan: Plan) -> tuple[dict[str, str], dict]:
    """Pools for a plan's sets, carved out of ``pool``: (model -> pool name, pool name -> PoolSpec)."""
    if len(plan.sets) == 1:
        return {m: pool_name for m in plan.sets[0].models}, {pool_name: pool}
    placement, pools = {}, {}
    for i, s in enumerate(plan.sets):
        name = f"{pool_name}.{i}"
        if s.devices <= pool.devices_per_node:
            nodes, per_node = 1, s.devices
        else:
            nodes, per_node = s.devices // pool.devices_per_node, pool.devices_per_node
        pools[name] = pool.model_copy(update={"nodes": nodes, "devices_per_node": per_node})
        for m in s.models:
            placement[m] = name
    return placement, pools


def auto_placement(graph) -> tuple[dict[str, str], dict]:
    """``build_graph``'s planner for ``placement: auto``: search over the graph's first pool and
    carve that pool into one pool per colocated set of the best plan.

    The batch is the user's: when the best plan's data-parallel ranks do not split it evenly,
    this refuses (one line naming the batch that would fit, or a placement by hand) rather than
    train on another batch than the one asked for.
    """
    pool_name = next(iter(graph.pools))
    pool = graph.pools[pool_name]
    base_dir = Path(graph.file).parent if Path(graph.file).is_file() else Path(".")
    _, plans = plan_for_pool(graph, pool, base_dir=base_dir)
    if not plans:
        raise SpecError(graph.file, "placement", f"auto: the models do not fit on pool {pool_name!r}")
    prompts = graph.spec.data.prompts_per_iteration
    needed = smallest_even_batch(graph.spec, plan_dp(plans[0]))
    if needed != prompts:
        ranks = ", ".join(f"{m} dp={d}" for m, d in plan_dp(plans[0]).items())
        raise SpecError(
            graph.file, "placement",
            f"auto: the best plan on pool {pool_name!r} ({plans[0].key()}; {ranks}) does not split "
            f"{prompts} prompts per iteration evenly, and auto placement never changes the batch: "
            f"set data.prompts_per_iteration={needed}, or place the models yourself "
            "(placement: {model: pool})",
        )
    return split_pool(pool_name, pool, plans[0])


# -- the library's algorithms at paper scale (for studies without graph files) -------------------


def rlhf_plan_graph(algorithm: str, arch: ModelArch, workload: Workload) -> PlanGraph:
    """An algorithm of the library (``hybridflow.graph.library``: ppo, grpo, remax, rloo,
    safe_rlhf) as the HybridFlow paper plans it: its graph's models and nodes, every model an LLM
    of architecture ``arch`` (reward and cost models too, where the library's are rules), any
    layout allowed, and the batch of ``workload`` instead of the library's.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {sorted(ALGORITHMS)}")
    spec = ALGORITHMS[algorithm]().spec()
    nodes, dag = derive_dag(spec, f"<library graph {algorithm}>")
    updated = {n.model for n in nodes if OPS[n.op].trains}
    models = {
        name: ModelInfo(name, model.role, arch, trainable=name in updated)
        for name, model in spec.models.items()
    }
    return PlanGraph(models, _op_nodes(nodes, dag), workload)


__all__ = [
    "AutoMapper", "Plan", "SetPlan", "auto_placement", "mapper_for_pool", "plan_dp", "plan_for_pool", "plan_graph",
    "rlhf_plan_graph", "plan_even_batch", "split_pool",
]
