"""Generation TP (tg > 1) through vLLM's external launcher.

The engine joins the torch.distributed world its process already belongs to (every rank of a
generation TP group builds its engine with the same seed, collectively), and ``load_weights``
then takes *this rank's* generation shard under HF names, never the full tensors: q/k/v/gate/up
and the vocabulary as row chunk ``r`` of tg, o_proj and down_proj as column chunk ``r``, norms
whole (``TrainShard.to_hf(shards, tg)`` of the megatron engine yields exactly these). vLLM's own
loaders take full tensors and narrow them per rank, so at start every parameter is marked as
already sharded (``mark_sharded``, on the live parameters and on the meta copies vLLM
re-materialises them from at each reload) and the vocabulary loader copies the given rows and
zero-fills vLLM's padding. Limits, each refused in one line: vLLM's external launcher groups
*consecutive* torch ranks (``initialize_model_parallel`` in ``vllm/distributed/parallel_state.py``),
so the generation TP group must be ``tg`` consecutive ranks starting at a multiple of tg
(``check_tp_group``; true when training tp == tg); vLLM's vocabulary partition (padded to 64,
split evenly) must have as many rows as the given shard. On CPU vLLM's TP communicator uses
shared-memory files named the same for every run on a host and never removed: the engine removes
its group's before starting (``stale_cpu_shm``), so two tg > 1 runs must not start on one host at
the same moment.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def check_tp_group(ranks: list[int], tp: int) -> None:
    """Raise a ValueError unless ``ranks`` (this rank's generation TP group, in TP-rank order)
    are the ``tp`` consecutive torch ranks vLLM's external launcher would group."""
    start = ranks[0] - ranks[0] % tp if ranks else 0
    if len(ranks) != tp or ranks != list(range(start, start + tp)):
        raise ValueError(
            f"rollout.layout.tp={tp}: vLLM groups tp consecutive ranks, but this generation TP "
            f"group is ranks {ranks} (stride training tp / rollout tp > 1); use rollout.layout.tp "
            "equal to the training tp"
        )


def external_launcher_env() -> None:
    """vLLM's external launcher reads the torchrun variables; fill them from the initialised
    torch.distributed world (one node: the local rank is the global one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a vLLM engine with tensor_parallel_size > 1 needs torch.distributed initialised")
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])


def stale_cpu_shm(rank: int, tp: int) -> list[str]:
    """Shared-memory files of vLLM's CPU TP communicator for ``rank``'s group of ``tp``
    consecutive ranks that already exist. vLLM 0.32 names them from the init method, which is
    ``env://`` under the external launcher, so the name is the same for every run on the host,
    and never unlinks them: the next start would fail with ``errno: 17``."""
    import glob

    start = rank - rank % tp
    group = "-".join(str(r) for r in range(start, start + tp))
    return sorted(p for p in glob.glob("/dev/shm/*cpushm_*") if f"[{group}]" in p)


def remove_stale_cpu_shm(tp: int) -> None:
    """Collectively, before any rank creates its files: each rank removes the ``stale_cpu_shm``
    files of its group (vLLM never unlinks them, so every earlier run on this host left them, and
    a new segment is needed anyway; a live run keeps the segment it has mapped)."""
    import torch.distributed as dist

    for path in stale_cpu_shm(dist.get_rank(), tp):
        try:
            os.remove(path)
        except FileNotFoundError:  # another rank of the group was first
            pass
    dist.barrier()


def load_vocab_rows(param: torch.Tensor, rows: torch.Tensor) -> None:
    """vLLM vocabulary loader for a generation shard: exactly this rank's partition (vLLM's
    padding to 64 included), else its rows would not start where vLLM's partition does."""
    if rows.shape != param.shape:
        raise ValueError(
            f"vocabulary shard of shape {tuple(rows.shape)} is not vLLM's partition "
            f"{tuple(param.shape)} (vocab_size padded to a multiple of 64, split over "
            "rollout.layout.tp): use a source.config vocab_size that is a multiple of 64 * tp"
        )
    param.copy_(rows)


def mark_sharded(worker: Any) -> list[int]:
    """Runs inside vLLM's worker: make every loader take this rank's shard as is (no narrow).

    On the live parameters and on the meta copies a reload re-materialises them from (their
    ``__dict__`` is copied): ``is_sharded_weight`` (linear loaders skip their narrow), ``tp_rank``
    0 (the vLLMParameter loaders narrow by it), and the vocabulary loader above. Returns the rows
    of this rank's vocabulary partitions (embedding, head).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    rows = []
    for layer in worker.model_runner.get_model().modules():
        meta, _ = get_layerwise_info(layer).restore_metadata
        live = dict(layer.named_parameters(recurse=False))
        for tensor in [*meta.values(), *live.values()]:
            tensor.__dict__["is_sharded_weight"] = True
            if "tp_rank" in tensor.__dict__:
                tensor.__dict__["tp_rank"] = 0
            if isinstance(layer, VocabParallelEmbedding):
                tensor.__dict__["weight_loader"] = load_vocab_rows
        if isinstance(layer, VocabParallelEmbedding):
            rows.append(layer.num_embeddings_per_partition)
    return rows

