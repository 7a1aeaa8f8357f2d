"""Train -> generate resharding of the actor's weights (HybridFlow's 3D-HybridEngine).

The seam, used by the actor worker once per iteration (``hybridflow.hybrid_engine.sync``)::

    groups = build_groups(gen_layout)                  # once, collectively, every rank
    shard = engine.train_shard()                       # the engine's parameters are its views
    gen, stats = reshard_to_generation(shard.buffer, shard.specs, gen_layout, groups)
    rollout.load_weights(shard.to_hf(gen, gen_layout.tp))  # HF names, streamed
    ...generate...
    gen.release()                                      # before training resumes

``reshard_to_generation`` also takes name -> tensor (packed into a buffer first: one copy,
reported in ``stats.packed_bytes``).

Memory. A rank's training shard is one flat tensor (the :class:`TrainShardBuffer`; the engine's
parameters are views into it, as megatron's DDP keeps its parameters in contiguous buffers). Its
generation shard is the ``dg`` flat training shards of its micro-DP group: its own buffer (not
copied) plus ``dg - 1`` received ones, filled by one all-gather. The generation tensor of a
parameter is the tuple of its TP pieces (views into those buffers); ``GenerationShards.tensor``
concatenates them when a rollout engine needs one tensor per name, a copy it owns and reports as
``materialized_bytes``. So the resharder holds ``dg`` training shards = M/(tg*pg) at its peak,
training shard included, and ``release()`` drops the received ones, back to M/(t*p).

Naive path (for comparison and as a fallback): all-gather the training shards of the whole
model-parallel group (the full model, M, on every rank), then keep the pieces of this rank's
generation shard and drop the rest.

Accounting is measured, not derived: every collective goes through :class:`CommMeter`, which adds
up the bytes of the tensors each call actually sent and received on this rank; every weight
tensor the resharder holds (training shard included) is tracked by :class:`WeightMeter`, which
sums the storages still alive after each allocation and keeps the maximum.

Replicated parameters (norms): each TP rank holds a copy, so when ``t/tg > 1`` the micro-DP
all-gather brings copies a rank already has; those bytes are counted in
``redundant_bytes_received`` (zero for a model whose every parameter is TP-split, the setting of
the paper's Table 2).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.engines.shards import ShardSpec, TrainShardBuffer, slot_views, stage_layout
from hybridflow.hybrid_engine.groups import gen_coords, micro_dp_groups, model_parallel_groups
from hybridflow.spec.layout import GenerationLayout, ParallelLayout

Mode = Literal["zero_redundancy", "naive"]


# --------------------------------------------------------------------------- accounting


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class CommMeter:
    """Runs collectives and counts, on this rank, the tensor bytes each one sent and received."""

    def __init__(self) -> None:
        self.sent_bytes = 0
        self.received_bytes = 0
        self.num_collectives = 0

    def all_gather(self, outputs: list[Tensor], own: int, group: dist.ProcessGroup) -> None:
        """``outputs[own]`` is this rank's input (filled in place, never copied by us)."""
        dist.all_gather(outputs, outputs[own], group=group)
        self.num_collectives += 1
        self.sent_bytes += _nbytes(outputs[own]) * (len(outputs) - 1)
        self.received_bytes += sum(_nbytes(o) for i, o in enumerate(outputs) if i != own)

    def broadcast(self, tensor: Tensor, src: int, is_src: bool, group_size: int, group) -> None:
        dist.broadcast(tensor, src=src, group=group)
        self.num_collectives += 1
        if is_src:
            self.sent_bytes += _nbytes(tensor) * (group_size - 1)
        else:
            self.received_bytes += _nbytes(tensor)

    def all_gather_v(self, outputs: list[Tensor], own: int, ranks: Sequence[int], group) -> None:
        """All-gather of possibly unequal pieces: one all-gather when sizes agree, else one
        broadcast per member (gloo's all-gather needs equal sizes)."""
        if len(outputs) == 1:
            return
        if len({o.numel() for o in outputs}) == 1:
            self.all_gather(outputs, own, group)
            return
        for i, (out, src) in enumerate(zip(outputs, ranks)):
            self.broadcast(out, src, i == own, len(ranks), group)


class WeightMeter:
    """Live bytes of the actor-weight tensors the resharder holds, sampled at every change."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self.peak_bytes = 0

    def track(self, tensor: Tensor) -> Tensor:
        self._refs.append(weakref.ref(tensor))
        self.sample()
        return tensor

    def alive_bytes(self) -> int:
        storages: dict[int, int] = {}
        for ref in self._refs:
            t = ref()
            if t is not None:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    def sample(self) -> int:
        alive = self.alive_bytes()
        self.peak_bytes = max(self.peak_bytes, alive)
        return alive


@dataclass
class ReshardStats:
    """One rank's measurements of one train -> generate transition."""

    mode: str
    rank: int
    model_bytes: int  # M: the full model under these specs
    train_shard_bytes: int  # this rank's training shard
    sent_bytes: int = 0
    received_bytes: int = 0
    redundant_bytes_received: int = 0  # copies of replicated parameters this rank already had
    peak_bytes: int = 0  # max live actor-weight bytes during the transition (own shard included)
    packed_bytes: int = 0  # copy made because the shards were not in a TrainShardBuffer
    num_collectives: int = 0
    seconds: float = 0.0
    weight_bytes_after_release: int | None = None
    materialized_bytes: int = 0  # copies made to hand the rollout engine whole tensors

    def as_metrics(self, prefix: str = "reshard") -> dict[str, float]:
        return {
            f"{prefix}/{k}": float(v)
            for k, v in self.__dict__.items()
            if isinstance(v, (int, float)) and k != "rank"
        }


# --------------------------------------------------------------------------- training shard


def shard_full_weights(
    full: Mapping[str, Tensor], specs: Sequence[ShardSpec], train: ParallelLayout, rank: int
) -> TrainShardBuffer:
    """The training shard of ``rank`` sliced from full weights (for tests and benchmarks)."""
    c = train.coords(rank)
    named = {
        s.name: s.slice_full(full[s.name], train.tp, c.tp_rank) for s in specs if s.pp_stage == c.pp_rank
    }
    return TrainShardBuffer.pack(named, specs, c.pp_rank, train.tp, rank)


# --------------------------------------------------------------------------- groups


@dataclass
class HybridGroups:
    """This rank's process groups for resharding (from :func:`build_groups`)."""

    rank: int
    micro_dp_ranks: list[int]
    micro_dp_group: dist.ProcessGroup | None
    model_parallel_ranks: list[int]
    model_parallel_group: dist.ProcessGroup | None


_GROUPS: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def _group(ranks: tuple[int, ...], backend: str | None) -> dist.ProcessGroup | None:
    """The process group over ``ranks``, created once per rank set (and default group). Every
    rank of the world calls this for every group, in the same order."""
    if len(ranks) == 1:
        return None
    key = (id(dist.group.WORLD), ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), backend=backend)
    return _GROUPS[key]


def build_groups(gen: GenerationLayout, backend: str | None = None) -> HybridGroups:
    """This rank's micro-DP and model-parallel process groups.

    Collective over the whole world, which the training layout must span: every rank calls it
    with the same layout, and every group of the layout is created on every rank in one global
    order, as megatron's ``parallel_state`` does. (Creating only a rank's own groups, with local
    synchronisation, can hang: torch names such a group by its ranks *and* the number of groups
    the calling process already has, which differs between ranks once other layouts' groups
    exist.)
    """
    world = dist.get_world_size()
    if gen.train.world_size != world:
        raise ValueError(f"the training layout has {gen.train.world_size} ranks, the world {world}")
    rank = dist.get_rank()
    every = {tuple(g) for g in micro_dp_groups(gen)} | {tuple(g) for g in model_parallel_groups(gen.train)}
    groups = {ranks: _group(ranks, backend) for ranks in sorted(every)}
    (micro,) = [g for g in micro_dp_groups(gen) if rank in g]
    (mp,) = [g for g in model_parallel_groups(gen.train) if rank in g]
    return HybridGroups(rank, micro, groups[tuple(micro)], mp, groups[tuple(mp)])


# --------------------------------------------------------------------------- generation shard


class GenerationShards(Mapping[str, tuple[Tensor, ...]]):
    """This rank's generation shard: name -> its TP pieces (views into the gathered buffers), in
    order along ``tp_dim``; one piece for replicated parameters and when t == tg."""

    def __init__(self, pieces: dict[str, tuple[Tensor, ...]], specs: dict[str, ShardSpec],
                 stats: ReshardStats, meter: WeightMeter, received: list[weakref.ref]) -> None:
        self._pieces = pieces
        self._received = received
        self._specs = specs
        self.stats = stats
        self._meter = meter

    def __getitem__(self, name: str) -> tuple[Tensor, ...]:
        return self._pieces[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    def tensor(self, name: str) -> Tensor:
        """The generation tensor of ``name``: the piece itself, or its pieces concatenated (copy)."""
        pieces = self._pieces[name]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces, dim=self._specs[name].tp_dim)

    def materialize(self) -> dict[str, Tensor]:
        """Every generation tensor, one per name (what a rollout engine's ``load_weights`` or a
        tg-way TP model takes). Concatenated tensors are copies, counted in
        ``stats.materialized_bytes``; single pieces are views."""
        out = {name: self.tensor(name) for name in self._pieces}
        self.stats.materialized_bytes = sum(
            _nbytes(t) for name, t in out.items() if len(self._pieces[name]) > 1
        )
        return out

    def release(self, timeout_s: float = 1.0) -> int:
        """Drop the received buffers (call before training resumes); returns the live actor-weight
        bytes afterwards (the training shard), also kept in ``stats``.

        Gloo's worker thread can hold a finished collective's tensors a moment longer, so this
        waits (up to ``timeout_s``) for the received buffers to be freed before measuring; a
        buffer the caller still references (a view from ``materialize``) stays counted.
        """
        self._pieces = {}
        deadline = time.monotonic() + timeout_s
        while any(r() is not None for r in self._received) and time.monotonic() < deadline:
            time.sleep(0.005)
        alive = self._meter.alive_bytes()
        self.stats.weight_bytes_after_release = alive
        return alive


def _generation_pieces(
    member_buffers: dict[int, Tensor], specs: Sequence[ShardSpec], gen: GenerationLayout, rank: int
) -> tuple[dict[str, tuple[Tensor, ...]], int]:
    """Pieces of this rank's generation shard out of the flat training shards of its micro-DP
    group (``member_buffers``: micro-DP rank -> flat buffer). Also returns the bytes of replicated
    parameters that arrived although this rank held them."""
    sp, st = gen.train.pp // gen.pp, gen.train.tp // gen.tp
    g = gen_coords(gen, rank)
    own_pp = gen.train.coords(rank).pp_rank
    views = {}
    for m, flat in member_buffers.items():
        slots, _ = stage_layout(specs, g.pp * sp + m // st, gen.train.tp)
        views[m] = slot_views(flat, slots)
    pieces: dict[str, tuple[Tensor, ...]] = {}
    redundant = 0
    for spec in specs:
        if spec.pp_stage // sp != g.pp:
            continue
        members = [(spec.pp_stage % sp) * st + j for j in range(st)]
        if spec.tp_dim is None:
            holder = g.micro_dp_rank if spec.pp_stage == own_pp else members[0]
            pieces[spec.name] = (views[holder][spec.name],)
            if spec.pp_stage == own_pp:
                redundant += sum(
                    _nbytes(views[m][spec.name]) for m in members if m != g.micro_dp_rank
                )
        else:
            pieces[spec.name] = tuple(views[m][spec.name] for m in members)
    return pieces, redundant


def reference_generation_shard(
    full: Mapping[str, Tensor], specs: Sequence[ShardSpec], gen: GenerationLayout, rank: int
) -> dict[str, Tensor]:
    """What ``rank`` must hold to generate: each parameter of its generation stage, chunk
    ``tg rank`` of ``tg`` along its TP dim, sliced from the full weights (the test oracle)."""
    sp = gen.train.pp // gen.pp
    g = gen_coords(gen, rank)
    return {s.name: s.slice_full(full[s.name], gen.tp, g.tp) for s in specs if s.pp_stage // sp == g.pp}


# --------------------------------------------------------------------------- the seam


def reshard_to_generation(
    named_shards: TrainShardBuffer | Mapping[str, Tensor],
    specs: Sequence[ShardSpec],
    gen_layout: GenerationLayout,
    groups: HybridGroups,
    mode: Mode = "zero_redundancy",
) -> tuple[GenerationShards, ReshardStats]:
    """Gather this rank's generation shard from the training shards. Collective over the
    micro-DP group (``zero_redundancy``) or the model-parallel group (``naive``).

    Args:
        named_shards: this rank's training shard: a :class:`TrainShardBuffer` (no copy), or
            name -> tensor for the names of this rank's stage (packed into one first: a copy,
            reported as ``stats.packed_bytes`` and counted in the peak).
        specs: the whole model's :class:`ShardSpec` list, the same on every rank.
        gen_layout: generation layout; ``gen_layout.train`` is the (resolved) training layout,
            ranks numbered as in ``groups.py`` (megatron's tp-dp-pp order).
        groups: from :func:`build_groups`.
        mode: ``"zero_redundancy"`` or ``"naive"``.

    Returns:
        ``(shards, stats)``: ``shards[name]`` is the tuple of TP pieces of the generation tensor
        (concatenate along ``tp_dim``, or call ``shards.materialize()``), bitwise equal to chunk
        ``tg_rank`` of ``tg`` of the full parameter; ``stats`` the measured bytes and peak.
        Call ``shards.release()`` before training resumes.
    """
    if mode not in ("zero_redundancy", "naive"):
        raise ValueError(f"mode must be 'zero_redundancy' or 'naive', got {mode!r}")
    start = time.perf_counter()
    rank = groups.rank
    train = gen_layout.train
    meter, comm = WeightMeter(), CommMeter()
    packed = 0
    if isinstance(named_shards, TrainShardBuffer):
        own = named_shards
    else:
        for t in named_shards.values():
            meter.track(t)
        own = TrainShardBuffer.pack(named_shards, specs, train.coords(rank).pp_rank, train.tp, rank)
        packed = _nbytes(own.flat)
    meter.track(own.flat)
    itemsize = own.flat.element_size()
    stats = ReshardStats(
        mode=mode,
        rank=rank,
        model_bytes=sum(math.prod(s.full_shape) for s in specs) * itemsize,
        train_shard_bytes=_nbytes(own.flat),
        packed_bytes=packed,
    )
    ranks = groups.micro_dp_ranks if mode == "zero_redundancy" else groups.model_parallel_ranks
    group = groups.micro_dp_group if mode == "zero_redundancy" else groups.model_parallel_group
    numels = [stage_layout(specs, train.coords(r).pp_rank, train.tp)[1] for r in ranks]
    me = ranks.index(rank)
    buffers = [
        own.flat if i == me else meter.track(own.flat.new_empty(n)) for i, n in enumerate(numels)
    ]
    comm.all_gather_v(buffers, me, ranks, group)
    received = [weakref.ref(b) for i, b in enumerate(buffers) if i != me]
    micro = set(groups.micro_dp_ranks)
    by_micro_rank = {
        gen_coords(gen_layout, r).micro_dp_rank: buf for r, buf in zip(ranks, buffers) if r in micro
    }
    del buffers  # naive: the pieces outside this rank's generation shard are freed here
    pieces, redundant = _generation_pieces(by_micro_rank, specs, gen_layout, rank)
    del by_micro_rank
    meter.sample()
    stats.sent_bytes, stats.received_bytes = comm.sent_bytes, comm.received_bytes
    stats.num_collectives = comm.num_collectives
    stats.redundant_bytes_received = redundant
    stats.peak_bytes = meter.peak_bytes
    stats.seconds = time.perf_counter() - start
    return GenerationShards(pieces, {s.name: s for s in specs}, stats, meter, received), stats
