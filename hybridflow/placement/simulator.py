"""Cost simulator: how long each op of a graph takes on a set of devices under a layout.

Every op time is a dot product of a *work vector* with the profile's *inverse rates*:

    time = train_flops / rate(train) + forward_flops / rate(forward)
         + decode_bytes / rate(decode) + comm_bytes / rate(comm)        (per link kind)
         + sum_k calls_k * overhead_k

so the same accounting serves prediction and calibration (``calibrate`` fits the rates and the
per-call overheads by least squares from measured single-node op times).

- training and prefill / log-prob / values forwards are compute-bound (FLOPs / effective FLOP/s),
  with a pipeline bubble (p - 1) / micro-batches;
- decoding is memory-bandwidth-bound: each step streams the weight shard and the KV cache, unless
  the batch is large enough to be compute-bound (roofline: the slower of the two);
- tensor-parallel all-reduces, data-parallel gradient reduce-scatter + all-gather, the
  3D-HybridEngine's train -> generate all-gather and inter-set data transfers move bytes over
  NVLink inside a node or the node's network link across nodes;
- memory per device, by the train engine's state sharding (``ModelInfo.state_sharding``):
  megatron-core's bf16 weights + grads sharded by tp*pp, fp32 Adam state (master, m, v)
  sharded by tp*pp*dp (distributed optimizer); DDP's all of it on every rank; FSDP2's all of it
  sharded by dp (ZeRO-3); activations with selective recompute
  (34 * s * b * h bytes per layer / tp, Korthikanti et al. 2022), KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from hybridflow.graph.ops import OPS
from hybridflow.placement.profiles import HardwareProfile, ModelArch
from hybridflow.spec.layout import GenerationLayout, ParallelLayout

USABLE_MEMORY = 0.9  # fraction of device memory a plan may fill (allocator slack, CUDA context)
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m + v
ACTIVATION_BYTES = 34  # per token and hidden unit per layer, selective recompute
TOKEN_BYTES = 8  # int64 token ids on the wire
VALUE_BYTES = 4  # fp32 per-token log-probs, values, advantages

RATE_KINDS = ("train", "forward", "decode", "comm_intra", "comm_inter")


@dataclass(frozen=True)
class Workload:
    """One iteration's batch: prompts x samples, lengths, and the update schedule."""

    num_prompts: int
    samples_per_prompt: int = 1
    prompt_len: int = 1024
    response_len: int = 1024
    epochs: int = 1
    updates_per_epoch: int = 1  # optimizer steps (mini-batches) per epoch
    micro_batch: int = 1

    @property
    def num_samples(self) -> int:
        return self.num_prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


@dataclass(frozen=True)
class ModelInfo:
    """What the planner needs to know of a model node."""

    name: str
    role: str
    arch: ModelArch | None  # None: a rule scorer (no weights)
    trainable: bool = False
    any_layout: bool = True  # False: data parallel only (the torch engine)
    flexible_generation: bool = True  # generation layout may differ from training (vLLM)
    micro_batch: int | None = None  # samples per forward/backward; None = the workload's
    # How a trained model's weights, gradients and optimizer state split over the ranks:
    # "model_parallel" (megatron-core: weights and gradients over tp x pp, the optimizer over
    # every rank), "replicated" (DDP: everything on every rank), "data_parallel" (FSDP2:
    # everything over every rank).
    state_sharding: str = "model_parallel"


@dataclass(frozen=True)
class OpNode:
    """A graph node as the simulator sees it."""

    name: str
    op: str  # generate, log_prob, values, score, advantage, update
    model: str
    inputs: tuple[str, ...] = ()  # producing node names (not the data source)
    stage: int = 0
    calls: int = 1  # e.g. ReMax generates twice (sampled and greedy)


@dataclass(frozen=True)
class PlanGraph:
    models: dict[str, ModelInfo]
    nodes: tuple[OpNode, ...]
    workload: Workload

    def nodes_of(self, model: str) -> list[OpNode]:
        return [n for n in self.nodes if n.model == model]

    @property
    def num_stages(self) -> int:
        return max(n.stage for n in self.nodes) + 1


def plan_layout(t: int = 1, p: int = 1, d: int = 1, tg: int | None = None, pg: int | None = None) -> GenerationLayout:
    """A candidate layout: training t x p x d, generation tg x pg (default: as in training).

    The simulator scores every model under a ``GenerationLayout``; for a model that does not
    generate, its generation part equals the training one and costs nothing.
    """
    train = ParallelLayout(tp=t, pp=p, dp=d)
    return GenerationLayout(train=train, tp=t if tg is None else tg, pp=p if pg is None else pg)


Work = dict  # kind -> amount (FLOPs, bytes, or calls for "overhead:<kind>" / "latency")


def _add(work: Work, kind: str, amount: float) -> None:
    if amount:
        work[kind] = work.get(kind, 0.0) + amount


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class Simulator:
    """Op times and memory for one hardware profile and ``devices_per_node``."""

    def __init__(self, profile: HardwareProfile, devices_per_node: int, workload: Workload):
        self.profile = profile
        self.devices_per_node = devices_per_node
        self.workload = workload

    # -- rates ---------------------------------------------------------------------------------

    def inverse_rates(self) -> dict[str, float]:
        p = self.profile
        inv = {
            "train": 1 / p.rate("train"),
            "forward": 1 / p.rate("forward"),
            "decode": 1 / p.rate("decode"),
            "comm_intra": 1 / (p.intra_node_bandwidth * p.efficiency["comm"]),
            # per device: the node's link is shared by its devices
            "comm_inter": self.devices_per_node / (p.inter_node_bandwidth * p.efficiency["comm"]),
        }
        for kind, seconds in p.overhead_s.items():
            inv[f"overhead:{kind}"] = seconds
        inv["latency"] = p.overhead_s.get("latency", 0.0)
        return inv

    def time(self, work: Work) -> float:
        inv = self.inverse_rates()
        return sum(amount * inv.get(kind, 0.0) for kind, amount in work.items())

    # -- layouts and memory ----------------------------------------------------------------------

    def layouts(self, model: ModelInfo, n: int) -> list[GenerationLayout]:
        """Every valid layout of ``model`` on ``n`` devices (TP inside a node, divides heads)."""
        if model.arch is None or not model.any_layout:
            return [plan_layout(d=n)]
        arch = model.arch
        out = []
        for t in _divisors(n):
            if t > self.devices_per_node or arch.num_heads % t or (arch.num_kv_heads or arch.num_heads) % t:
                continue
            for p in _divisors(n // t):
                if arch.num_layers % p:
                    continue
                d = n // (t * p)
                gens = [(t, p)]
                if model.role == "actor" and model.flexible_generation:
                    gens = [(tg, pg) for tg in _divisors(t) for pg in _divisors(p)]
                out.extend(plan_layout(t, p, d, tg, pg) for tg, pg in gens)
        return out

    def static_memory(self, model: ModelInfo, layout: GenerationLayout) -> float:
        """Bytes per device held all iteration: weights (+ grads and optimizer if trained)."""
        if model.arch is None:
            return 0.0
        return self.static_memory_terms(model, layout)[0]

    def static_memory_terms(self, model: ModelInfo, layout: GenerationLayout) -> tuple[float, str]:
        """``static_memory`` and its arithmetic, as ``hybridflow plan`` prints it."""
        params = model.arch.num_params
        bpp = self.profile.bytes_per_param
        mp, world = layout.train.model_parallel_size, layout.train.world_size
        if not model.trainable:
            return params * bpp / mp, f"{bpp:g} B weights x {params:.3g} params / {mp} (tp x pp)"
        state = f"({bpp:g} B weights + {bpp:g} B grads + {OPTIMIZER_BYTES_PER_PARAM} B AdamW) x {params:.3g} params"
        if model.state_sharding == "replicated":
            return params * (2 * bpp + OPTIMIZER_BYTES_PER_PARAM), f"{state}, whole on every rank (DDP)"
        if model.state_sharding == "data_parallel":
            memory = params * (2 * bpp + OPTIMIZER_BYTES_PER_PARAM) / world
            return memory, f"{state} / {world} ranks (FSDP2: all of it sharded over dp)"
        memory = params * 2 * bpp / mp + params * OPTIMIZER_BYTES_PER_PARAM / world
        return memory, (
            f"({bpp:g} B weights + {bpp:g} B grads) x {params:.3g} params / {mp} (tp x pp) + "
            f"{OPTIMIZER_BYTES_PER_PARAM} B AdamW x {params:.3g} / {world} ranks (distributed optimizer)"
        )

    def transient_memory(self, model: ModelInfo, layout: GenerationLayout) -> float:
        """Bytes per device needed only while one op runs: activations, or generation's extra
        weight shard plus the KV cache of at least one sequence."""
        if model.arch is None:
            return 0.0
        arch, w = model.arch, self.workload
        tokens = w.micro_batch * w.seq_len
        act = ACTIVATION_BYTES * tokens * arch.hidden * arch.num_layers / layout.train.tp
        if not model.trainable:
            act = ACTIVATION_BYTES * tokens * arch.hidden * 2 / layout.train.tp  # a layer or two live
        gen = 0.0
        if model.role == "actor":
            gen = self._generation_weight_extra(model, layout) + self._kv_per_sequence(model, layout)
        return max(act, gen)

    def _generation_weight_extra(self, model: ModelInfo, layout: GenerationLayout) -> float:
        bpp = self.profile.bytes_per_param
        return model.arch.num_params * bpp * (1 / (layout.tp * layout.pp) - 1 / layout.train.model_parallel_size)

    def _kv_per_sequence(self, model: ModelInfo, layout: GenerationLayout) -> float:
        kv_bpv = 2 if self.profile.bytes_per_param <= 2 else 4
        return model.arch.kv_bytes_per_token(kv_bpv) * self.workload.seq_len / (layout.tp * layout.pp)

    def usable_memory(self) -> float:
        return self.profile.memory_bytes * USABLE_MEMORY

    # -- op work -----------------------------------------------------------------------------------

    def _allreduce(self, work: Work, nbytes: float, group: int, crosses_nodes: bool, count: float = 1) -> None:
        """``count`` ring all-reduces of ``nbytes`` each over ``group`` ranks."""
        if group <= 1:
            return
        _add(work, "comm_inter" if crosses_nodes else "comm_intra", 2 * (group - 1) / group * nbytes * count)
        _add(work, "latency", count)

    def _dense(self, work: Work, kind: str, model: ModelInfo, layout: GenerationLayout, flops_factor: float,
               seqs: float, seq_len: int, tp_collectives_per_layer: int) -> None:
        """A forward (kind=forward) or forward+backward (kind=train) over ``seqs`` sequences."""
        arch, w = model.arch, self.workload
        flops = arch.forward_flops(seqs, seq_len) * flops_factor
        per_replica_seqs = seqs / layout.train.dp
        micro_batches = max(1, math.ceil(per_replica_seqs / (model.micro_batch or w.micro_batch)))
        bubble = (layout.train.pp - 1) / micro_batches
        _add(work, kind, flops / layout.train.world_size * (1 + bubble))
        tokens = per_replica_seqs * seq_len
        act_bytes = tokens * arch.hidden * self.profile.bytes_per_param
        layers = arch.num_layers / layout.train.pp
        self._allreduce(work, act_bytes / micro_batches, layout.train.tp, False,
                        count=tp_collectives_per_layer * layers * micro_batches)
        if layout.train.pp > 1:  # activations cross each stage boundary
            crosses = layout.train.model_parallel_size > self.devices_per_node
            _add(work, "comm_inter" if crosses else "comm_intra",
                 act_bytes * flops_factor / 2 * (layout.train.pp - 1) / layout.train.pp)

    def op_work(self, model: ModelInfo, op: str, layout: GenerationLayout, free_memory: float) -> Work:
        """Work of one call of ``op`` on ``model`` placed on ``layout.train.world_size`` devices."""
        w = self.workload
        work: Work = {}
        record = OPS[op]
        if not (record.forward or record.trains or record.generates):  # tensor math on a batch
            _add(work, "overhead:advantage", 1)
            return work
        if model.arch is None:  # rule scorer: per call plus per sample, split over ranks
            _add(work, "overhead:score", 1)
            _add(work, "overhead:score_sample", w.num_samples / layout.train.dp)
            return work
        micro = model.micro_batch or w.micro_batch
        if record.forward:
            _add(work, "overhead:forward", math.ceil(w.num_samples / layout.train.dp / micro - 1e-9))
            self._dense(work, "forward", model, layout, 1.0, w.num_samples, w.seq_len, 2)
        elif record.trains:
            steps = w.epochs * w.updates_per_epoch
            _add(work, "overhead:train", steps)
            per_step = w.num_samples / w.updates_per_epoch / layout.train.dp
            _add(work, "overhead:train_micro", steps * math.ceil(per_step / micro - 1e-9))
            self._dense(work, "train", model, layout, 3.0, w.num_samples * w.epochs, w.seq_len, 4)
            grad_bytes = model.arch.num_params * self.profile.bytes_per_param / layout.train.model_parallel_size
            crosses = layout.train.world_size > self.devices_per_node and layout.train.dp > 1
            # reduce-scatter grads + all-gather params once per optimizer step
            self._allreduce(work, grad_bytes, layout.train.dp, crosses, count=w.epochs * w.updates_per_epoch)
        elif record.generates:  # a multi-turn rollout: its model tokens (environment time not modelled)
            self._generate(work, model, layout, free_memory)
        else:
            raise ValueError(f"no cost model for op {op!r}")
        return work

    def _generate(self, work: Work, model: ModelInfo, layout: GenerationLayout, free_memory: float) -> None:
        arch, w, prof = model.arch, self.workload, self.profile
        _add(work, "overhead:decode", 1)
        # 3D-HybridEngine: all-gather the training shard into the generation shard inside each
        # micro-DP group of t*p / (tg*pg) consecutive ranks.
        group = layout.micro_dp
        if group > 1:
            shard = arch.num_params * prof.bytes_per_param / (layout.tp * layout.pp)
            crosses = layout.train.model_parallel_size > self.devices_per_node
            _add(work, "comm_inter" if crosses else "comm_intra", (group - 1) / group * shard)
        gen_mp = layout.tp * layout.pp
        replicas = layout.train.world_size // gen_mp
        seqs = w.num_samples / replicas
        # prefill: compute-bound over the prompts
        prefill = arch.forward_flops(seqs, w.prompt_len) / gen_mp
        _add(work, "forward", prefill)
        # decode: waves of as many sequences as the KV cache holds
        kv_seq = self._kv_per_sequence(model, layout)
        concurrent = max(1.0, min(seqs, math.floor(max(free_memory, 0.0) / kv_seq)))
        waves = math.ceil(seqs / concurrent - 1e-9)
        weight_bytes = arch.num_params * prof.bytes_per_param / gen_mp
        kv_token = kv_seq / w.seq_len
        inv = self.inverse_rates()
        for wave in range(waves):
            batch = min(concurrent, seqs - wave * concurrent)
            avg_context = w.prompt_len + w.response_len / 2
            # pp stages hold 1/pg of the weights each but a token passes them one after another,
            # so a step costs pg stage-steps: pp saves memory, not decode time
            step_bytes = (weight_bytes + batch * avg_context * kv_token) * layout.pp
            step_flops = 2 * arch.num_params * batch / layout.tp
            # roofline: a step is bound by whichever is slower
            if step_bytes * inv["decode"] >= step_flops * inv["forward"]:
                _add(work, "decode", step_bytes * w.response_len)
            else:
                _add(work, "forward", step_flops * w.response_len)
            _add(work, "overhead:decode_step", w.response_len)
            tokens_bytes = batch * arch.hidden * prof.bytes_per_param
            self._allreduce(work, tokens_bytes, layout.tp, False,
                            count=2 * arch.num_layers * w.response_len)

    # -- sets ----------------------------------------------------------------------------------

    def transfer_work(self, producer: OpNode, consumer_devices: int, producer_devices: int) -> Work:
        """Bytes a node's outputs move from the producing set to a consuming set, spread over
        the links of the smaller side (each node's link is shared by its devices)."""
        w = self.workload
        if OPS[producer.op].generates:
            nbytes = w.num_samples * w.seq_len * (TOKEN_BYTES + 1)  # ids + mask
        elif OPS[producer.op].scores:
            nbytes = w.num_samples * VALUE_BYTES
        else:
            nbytes = w.num_samples * w.response_len * VALUE_BYTES
        work: Work = {}
        crosses = consumer_devices + producer_devices > self.devices_per_node
        if crosses:
            nodes = max(1, min(consumer_devices, producer_devices) // self.devices_per_node)
            _add(work, "comm_inter", nbytes / nodes / self.devices_per_node)
        else:
            _add(work, "comm_intra", nbytes)
        return work

    def contention(self, busy_devices: int) -> float:
        """Slow-down when more devices compute than the machine has physical cores (CPU only)."""
        cores = self.profile.physical_cores
        if cores is None or busy_devices <= cores:
            return 1.0
        return (busy_devices / cores) ** self.profile.oversubscription


# -- calibration ----------------------------------------------------------------------------------


@dataclass
class Measurement:
    """One measured op time on a single node, with the work the simulator assigns to it."""

    work: Work
    seconds: float
    label: str = ""


def fit_inverse_rates(measurements: list[Measurement], prior: dict[str, float]) -> dict[str, float]:
    """Non-negative least squares on relative error: each measured time ~ work . inverse rates.

    Kinds absent from every measurement keep their prior value.
    """
    kinds = sorted({k for m in measurements for k, v in m.work.items() if v})
    a = np.array([[m.work.get(k, 0.0) / m.seconds for k in kinds] for m in measurements])
    b = np.ones(len(measurements))
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # columns on comparable scales
    active = list(range(len(kinds)))
    x = np.zeros(len(kinds))
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active] / scale[active], b, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            break
        active = [k for k, s in zip(active, sol) if s >= 0] if (sol >= 0).any() else []
    fitted = dict(prior)
    fitted.update({k: float(v) for k, v in zip(kinds, x)})
    return fitted


def profile_from_inverse_rates(base: HardwareProfile, inv: dict[str, float], devices_per_node: int) -> HardwareProfile:
    """A copy of ``base`` whose efficiencies and overheads reproduce ``inv``."""
    eff = dict(base.efficiency)
    if inv.get("train"):
        eff["train"] = 1 / inv["train"] / base.peak_flops
    if inv.get("forward"):
        eff["forward"] = 1 / inv["forward"] / base.peak_flops
    if inv.get("decode"):
        eff["decode"] = 1 / inv["decode"] / base.memory_bandwidth
    if inv.get("comm_intra"):
        eff["comm"] = 1 / inv["comm_intra"] / base.intra_node_bandwidth
    overheads = dict(base.overhead_s)
    for kind, value in inv.items():
        if kind.startswith("overhead:"):
            overheads[kind.split(":", 1)[1]] = value
    if "latency" in inv:
        overheads["latency"] = inv["latency"]
    return replace(base, efficiency=eff, overhead_s=overheads, name=f"{base.name}-calibrated")


def fit_oversubscription(profile: HardwareProfile, busy_devices: int, measured_s: float, linear_s: float) -> HardwareProfile:
    """``profile`` with ``oversubscription`` fitted from one run of ``busy_devices`` > cores:
    ``measured = linear * (busy / cores) ** oversubscription``, where ``linear`` is the calibrated
    prediction of that run without contention. Kept within [1, 4]."""
    cores = profile.physical_cores
    if cores is None or busy_devices <= cores or linear_s <= 0:
        return profile
    exponent = math.log(measured_s / linear_s) / math.log(busy_devices / cores)
    return replace(profile, oversubscription=min(4.0, max(1.0, exponent)))


def calibrate(sim: Simulator, measurements: list[Measurement]) -> HardwareProfile:
    """``sim.profile`` with effective rates and per-call overheads fitted to single-node op
    measurements (each with the work vector the simulator assigns to it).

    The decode roofline branch of each measurement's work was chosen with the prior rates; on
    CPU the tiny models' decode is compute-bound under any plausible rates, so one fit suffices.
    """
    inv = fit_inverse_rates(measurements, sim.inverse_rates())
    return profile_from_inverse_rates(sim.profile, inv, sim.devices_per_node)


def all_partitions(items: list[str]):
    """Every partition of ``items`` into non-empty sets (Bell number many), as tuples of tuples."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for part in all_partitions(rest):
        yield ((first,),) + part
        for i in range(len(part)):
            yield part[:i] + ((first,) + part[i],) + part[i + 1:]


__all__ = [
    "Measurement", "ModelInfo", "OpNode", "PlanGraph", "Simulator", "Workload",
    "all_partitions", "calibrate", "fit_inverse_rates", "fit_oversubscription", "plan_layout",
]
