"""A node's record for ``hybridflow replay`` (``trainer.record``): what one call of its body
read, the state it ran from, and what it returned, on every rank.

    RUN_DIR/record/iter_<N>/<NODE>/
        record.json                  the call: op, model, pool, world size, options, the
                                     worker's models (rank 0 writes it)
        graph.pt                     the resolved graph and node (pickled; rank 0)
        models/<model>/              the trained models' engine state (weights, optimizer state,
                                     LR schedule) as a run checkpoint holds it
        pool_<pool>/rank_<r>.pt      each rank's torch RNG and algorithm state (``extra_state``)
                                     (both written by ``workers.checkpointing.save``)
        rank_<r>/input.pt            the rank's input batch
        rank_<r>/state.pt            its python, numpy and torch RNG states, torch thread count,
                                     world size and weight versions, as the body began
        rank_<r>/output.pt           the body's output batch and meta, and a SHA-256 of every
                                     weight of the node's model after it (an update's effect)

Recording leaves the run as it was: the RNG states are put back after the state is written, so
a recorded run's numbers equal an unrecorded one's. :func:`compare` is replay's verdict: outputs
equal bit for bit, metrics that measure the machine (``timing/``, ``memory/``) left out.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from hybridflow.graph.dag import Node
from hybridflow.workers import checkpointing
from hybridflow.workers.context import WorkerContext

RECORD = "record"
INFO, GRAPH = "record.json", "graph.pt"
INPUT, STATE, OUTPUT = "input.pt", "state.pt", "output.pt"
# Metrics of the machine and the moment, not of the computation: never compared.
VOLATILE_METRICS = ("timing/", "memory/")


def record_dir(run_dir: str | Path, iteration: int, node: str) -> Path:
    return Path(run_dir) / RECORD / f"iter_{iteration}" / node


def rank_dir(path: str | Path, rank: int) -> Path:
    return Path(path) / f"rank_{rank}"


def rng_states() -> dict[str, Any]:
    """This process's python, numpy and torch RNG states (a recording's, the controller's
    checkpoint)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def weight_digests(ctx: WorkerContext, node: Node) -> dict[str, str]:
    """SHA-256 of each weight of the node's model, if an op trains it (a collective on a
    sharded engine: every rank calls it)."""
    if not ctx.graph.op(node).trains or node.model not in ctx.train_engines:
        return {}
    return {
        name: hashlib.sha256(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, param in ctx.train_engines[node.model].named_weights()
    }


def call(body, ctx: WorkerContext, node: Node, batch: TensorDict, record: str | None, worker_models: dict):
    """``body(ctx, batch, node)``; with ``record`` (a directory) its inputs, state and outputs
    recorded there (:func:`record_inputs`, :func:`record_outputs`)."""
    if record is None:
        return body(ctx, batch, node)
    record_inputs(record, ctx, node, batch, worker_models)
    out, meta = body(ctx, batch, node)
    record_outputs(record, ctx, node, out, meta)
    return out, meta


def record_inputs(path: str | Path, ctx: WorkerContext, node: Node, batch: TensorDict, worker_models: dict) -> None:
    """Before the body runs: this rank's input and the state it runs from (a collective over
    the pool: every rank runs the node). ``worker_models``: the host's ``models``,
    ``rollouts`` and ``total_steps``, to build the same engines again."""
    states = rng_states()
    path, graph = Path(path), ctx.graph
    pool = graph.pool_of(node)
    if ctx.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        info = {
            "node": node.name, "op": node.op, "model": node.model, "role": node.role, "pool": pool,
            "world_size": ctx.world_size, "layout": graph.dispatch_layout(node).model_dump(),
            "options": node.spec.options.model_dump(mode="json") if node.spec.options is not None else None,
            **worker_models,
        }
        (path / INFO).write_text(json.dumps(info, indent=1) + "\n")
        torch.save({"graph": graph, "node": node}, path / GRAPH)
    checkpointing.rank_file(path, pool, ctx.rank).parent.mkdir(parents=True, exist_ok=True)
    checkpointing.save(path, pool, ctx.rank, ctx.trained_engines(), ctx.extra_state)
    own = rank_dir(path, ctx.rank)
    own.mkdir(parents=True, exist_ok=True)
    (own / OUTPUT).unlink(missing_ok=True)  # an earlier call's (an iteration run again) is not this one's
    torch.save(batch, own / INPUT)
    torch.save(
        {"rng": states, "threads": torch.get_num_threads(), "world_size": ctx.world_size,
         "train_versions": dict(ctx.train_versions), "rollout_versions": dict(ctx.rollout_versions)},
        own / STATE,
    )
    set_rng_states(states)


def record_outputs(path: str | Path, ctx: WorkerContext, node: Node, out: TensorDict, meta: dict) -> None:
    """After the body: what it returned, and its model's weights' digests."""
    torch.save({"out": out, "meta": meta, "weights": weight_digests(ctx, node)}, rank_dir(path, ctx.rank) / OUTPUT)


def compare(recorded: dict, replayed: dict) -> str | None:
    """The first difference between two :func:`record_outputs` dicts, in words; None if equal."""
    rec, rep = recorded["out"], replayed["out"]
    rec_keys, rep_keys = (set(td.keys(include_nested=True, leaves_only=True)) for td in (rec, rep))
    if rec_keys != rep_keys:
        return f"output keys: recorded {sorted(map(str, rec_keys))}, replayed {sorted(map(str, rep_keys))}"
    for key in sorted(rec_keys, key=str):
        differs = _tensor_difference(rec.get(key), rep.get(key))
        if differs:
            return f"output {key}{differs}"
    rec_meta, rep_meta = (_comparable(m) for m in (recorded["meta"], replayed["meta"]))
    for key in sorted(set(rec_meta) | set(rep_meta)):
        a, b = rec_meta.get(key, "<missing>"), rep_meta.get(key, "<missing>")
        if not _same(a, b):
            return f"meta {key}: recorded {a!r}, replayed {b!r}"
    for name in sorted(set(recorded["weights"]) | set(replayed["weights"])):
        if recorded["weights"].get(name) != replayed["weights"].get(name):
            return f"weights after the body: {name} differs"
    return None


def _comparable(meta: dict) -> dict:
    """A meta dict flattened (``metrics/<name>``, ``sums/<name>``, ...), volatile metrics out."""
    flat = {}
    for key, value in meta.items():
        if isinstance(value, dict):
            flat.update({f"{key}/{k}": v for k, v in value.items() if not k.startswith(VOLATILE_METRICS)})
        else:
            flat[key] = value
    return flat


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _tensor_difference(a: Any, b: Any) -> str:
    """'' if equal (NaN equal to NaN), else where they first differ."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        a, b = getattr(a, "tolist", lambda: a)(), getattr(b, "tolist", lambda: b)()
        return "" if a == b else f": recorded {a!r}, replayed {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f": recorded {a.dtype} {tuple(a.shape)}, replayed {b.dtype} {tuple(b.shape)}"
    unequal = a != b
    if a.is_floating_point():
        unequal &= ~(a.isnan() & b.isnan())
    if not bool(unequal.any()):
        return ""
    index = tuple(unequal.nonzero()[0].tolist())
    return f"[{', '.join(map(str, index))}]: recorded {a[index].item()!r}, replayed {b[index].item()!r}"
