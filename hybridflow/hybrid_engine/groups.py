"""The 3D-HybridEngine's grouping, as pure functions of the layouts.

Training ranks are numbered by ``ParallelLayout.coords`` (megatron-core's default order: TP
fastest, then DP, then PP), so the shards a megatron engine holds line up with them.

Generation (pg-tg-dg-d, dg = p*t / (pg*tg)): write ``st = t/tg`` and ``sp = p/pg``. A training rank
(pp, tp, dp) becomes generation TP rank ``tp // st`` and PP stage ``pp // sp`` of the generation
replica ``(dp, micro_dp_rank)`` with ``micro_dp_rank = (pp % sp) * st + tp % st``. Hence

- generation TP groups take training TP ranks at stride ``st``, PP groups stages at stride ``sp``;
- micro-DP groups take ``st`` consecutive TP ranks (consecutive global ranks) times ``sp``
  consecutive stages, and together hold exactly one generation shard: training TP chunk ``tp``
  is sub-chunk ``tp % st`` of generation chunk ``tp // st``, and stage ``pp``'s layers are among
  generation stage ``pp // sp``'s. So every rank's training shard lies inside its generation
  shard and an all-gather inside the micro-DP group is the only communication.

A tg-way generation model needs process groups over ``generation_tp_groups`` (and
``generation_pp_groups``): they are not megatron's default TP groups. With p = 1 and d = 1 they are
megatron's ``initialize_model_parallel(tensor_model_parallel_size=tg, order="dp-tp-pp")`` (DP
fastest; ``tests/test_reshard_megatron.py``); in general a rollout engine builds them from these
lists. vLLM's external launcher (vLLM 0.32) does not take groups: it forms its TP groups from
*consecutive* torch ranks, which are these groups only at stride ``t/tg`` = 1, at any training
pp and dp (t = 2 x p = 2 -> tg = 2: {0, 1} and {2, 3}, with micro-DP groups {0, 2} and {1, 3}
across the stages; ``graphs/grpo_megatron_tg2.yaml``); the vLLM engine refuses any other group
(``engines.vllm.tp.check_tp_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.spec.layout import GenerationLayout, ParallelLayout, RankCoords


@dataclass(frozen=True)
class GenCoords:
    """Where a rank sits while generating."""

    pp: int  # generation pipeline stage, 0 .. pg-1
    tp: int  # generation TP rank, 0 .. tg-1
    dp: int  # training DP rank
    micro_dp_rank: int  # 0 .. dg-1; (dp, micro_dp_rank) names the generation replica


def _strides(gen: GenerationLayout) -> tuple[int, int]:
    return gen.train.pp // gen.pp, gen.train.tp // gen.tp


def gen_coords(gen: GenerationLayout, rank: int) -> GenCoords:
    c = gen.train.coords(rank)
    sp, st = _strides(gen)
    return GenCoords(
        pp=c.pp_rank // sp,
        tp=c.tp_rank // st,
        dp=c.dp_rank,
        micro_dp_rank=(c.pp_rank % sp) * st + c.tp_rank % st,
    )


def gen_replica(gen: GenerationLayout, rank: int) -> int:
    """Global generation DP rank, 0 .. dg*d - 1."""
    g = gen_coords(gen, rank)
    return g.dp * gen.micro_dp + g.micro_dp_rank


def _rank_of(gen: GenerationLayout, g: GenCoords) -> int:
    sp, st = _strides(gen)
    tp = g.tp * st + g.micro_dp_rank % st
    pp = g.pp * sp + g.micro_dp_rank // st
    return RankCoords(gen.train, tp_rank=tp, pp_rank=pp, dp_rank=g.dp).rank


def micro_dp_groups(gen: GenerationLayout) -> list[list[int]]:
    """Each micro-DP group's ranks, in micro-DP-rank order; one group per (dp, gen pp, gen tp)."""
    return [
        [_rank_of(gen, GenCoords(pp=gp, tp=gt, dp=dp, micro_dp_rank=m)) for m in range(gen.micro_dp)]
        for dp in range(gen.train.dp)
        for gp in range(gen.pp)
        for gt in range(gen.tp)
    ]


def generation_tp_groups(gen: GenerationLayout) -> list[list[int]]:
    """Each generation TP group's ranks, in generation-TP-rank order."""
    return [
        [_rank_of(gen, GenCoords(pp=gp, tp=gt, dp=dp, micro_dp_rank=m)) for gt in range(gen.tp)]
        for dp in range(gen.train.dp)
        for m in range(gen.micro_dp)
        for gp in range(gen.pp)
    ]


def generation_pp_groups(gen: GenerationLayout) -> list[list[int]]:
    """Each generation PP group's ranks, in stage order."""
    return [
        [_rank_of(gen, GenCoords(pp=gp, tp=gt, dp=dp, micro_dp_rank=m)) for gp in range(gen.pp)]
        for dp in range(gen.train.dp)
        for m in range(gen.micro_dp)
        for gt in range(gen.tp)
    ]


def model_parallel_groups(train: ParallelLayout) -> list[list[int]]:
    """Each training model-parallel group (one DP replica, p*t ranks), ordered (pp, tp)."""
    return [
        [RankCoords(train, tp_rank=tp, pp_rank=pp, dp_rank=dp).rank for pp in range(train.pp) for tp in range(train.tp)]
        for dp in range(train.dp)
    ]
