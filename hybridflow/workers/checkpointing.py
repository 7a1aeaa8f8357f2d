"""A worker's part of a run checkpoint (the controller's side: ``controller/checkpoint.py``).

    CHECKPOINT/models/<model>/          torch.distributed.checkpoint of one trained model's
                                        engine state (weights, optimizer state, LR schedule),
                                        written by every rank of its pool together; layout-free:
                                        each tensor is stored as pieces of the full tensor, so it
                                        loads under another tp x pp x dp (engine ``state_dict``)
    CHECKPOINT/pool_<pool>/rank_<r>.pt  the rank's own state: its torch RNG and the algorithm
                                        state the worker keeps (``WorkerContext.extra_state``)

Resuming with the pool's number of ranks unchanged, every rank takes its own file back, so the
run continues bit for bit. With another number of ranks a per-rank RNG stream has no owner: every
rank then starts a fresh stream seeded from ``trainer.seed``, its rank and the iteration resumed
from (:func:`resume_seed`), and takes the algorithm state from rank 0's file (that state is the
same on every rank of a pool: it is stepped from reduced statistics). Weights, optimizer state,
LR schedule and the data position (the controller's) carry over exactly either way.

Outside a run (``hybridflow eval``), :func:`read_hf_weights` reads a trained model's weights from
a checkpoint as full HF-named tensors, in one process, whichever engine and layout wrote them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hybridflow.engines.base import TrainEngine
from hybridflow.workers.errors import NonFiniteWeightError

MODELS = "models"


def rank_file(path: str | Path, pool: str, rank: int) -> Path:
    return Path(path) / f"pool_{pool}" / f"rank_{rank:05d}.pt"


def resume_seed(seed: int, rank: int, iteration: int) -> int:
    """The torch seed of ``rank`` resuming after ``iteration`` under another number of ranks
    (a fresh run's rank starts from ``seed * 1000 + rank``)."""
    return seed * 1000 + rank + 1_000_000 * iteration


def refuse_nonfinite(engines: dict[str, TrainEngine], rank: int) -> None:
    """Raise NonFiniteWeightError if any weight of ``engines`` is not finite: such a model is
    not checkpointed (the previous checkpoint stays the newest)."""
    for name, engine in engines.items():
        for param_name, param in engine.named_weights():
            if not bool(torch.isfinite(param).all()):
                raise NonFiniteWeightError(
                    f"model {name!r} rank {rank}: weight {param_name} is not finite; not checkpointing it"
                )


def save(path: str | Path, pool: str, rank: int, engines: dict[str, TrainEngine], extra: dict[str, Any]) -> None:
    """Write this rank's part of checkpoint ``path``: a collective over the pool's ranks (every
    rank calls it with the same ``engines``)."""
    for name, engine in engines.items():
        dcp.save(engine.state_dict(), checkpoint_id=Path(path) / MODELS / name)
    state = {"torch_rng": torch.get_rng_state(), "extra": {k: v.state_dict() for k, v in extra.items()}}
    torch.save(state, rank_file(path, pool, rank))


def load_engines(path: str | Path, engines: dict[str, TrainEngine]) -> None:
    """Load the engines' state from checkpoint ``path`` (a collective, as :func:`save`), whatever
    the layout it was saved under."""
    for name, engine in engines.items():
        state = engine.state_dict()
        dcp.load(state, checkpoint_id=Path(path) / MODELS / name)
        engine.load_state_dict(state)


def load_rank_state(
    path: str | Path, pool: str, rank: int, extra: dict[str, Any], same_ranks: bool, seed: int, iteration: int
) -> None:
    """This rank's RNG and algorithm state from checkpoint ``path``. ``same_ranks``: the
    checkpoint's pool ``pool`` had as many ranks as this one, and this rank's own file is taken
    back; otherwise as the module docstring says."""
    if same_ranks:
        own = torch.load(rank_file(path, pool, rank), weights_only=False)
        saved_extra = own["extra"]
    else:
        saved_extra = {}
        for first in sorted(Path(path).glob("pool_*/rank_00000.pt")):
            saved_extra.update(torch.load(first, weights_only=False)["extra"])
    for name, value in saved_extra.items():
        if name in extra:
            extra[name].load_state_dict(value)
    if same_ranks:
        torch.set_rng_state(own["torch_rng"])
    else:
        torch.manual_seed(resume_seed(seed, rank, iteration))


def read_hf_weights(path: str | Path, model: str, hf_config) -> dict[str, torch.Tensor]:
    """The full HF-named weights of trained model ``model`` in checkpoint ``path``, read in one
    process (no process group): the torch engine's ``model`` entries as they are, or the megatron
    engine's ``weights`` (the resharding layout's full tensors) converted to HF with
    ``hf_config``'s dimensions. Raises FileNotFoundError if the checkpoint has no ``model``."""
    reader = dcp.FileSystemReader(Path(path) / MODELS / model)
    entries = reader.read_metadata().state_dict_metadata

    def read(prefix: str) -> dict[str, torch.Tensor]:
        tensors = {
            key.removeprefix(f"{prefix}."): torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in entries.items()
            if key.startswith(f"{prefix}.") and isinstance(meta, TensorStorageMetadata)
        }
        if tensors:
            dcp.load({prefix: tensors}, storage_reader=reader)
        return tensors

    weights = read("model")  # the torch engine
    if weights:
        return weights
    from hybridflow.engines.megatron.convert import Dims, to_hf

    dims = Dims.from_hf(hf_config)
    weights = dict(to_hf(read("weights").items(), dims, tp=1, trim_vocab=True))  # saved padded
    if dims.tied:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights
