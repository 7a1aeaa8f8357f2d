"""A recorded node call (``workers.recording``) run again without Ray: ``hybridflow replay``.

Each rank of the recorded call is a plain process holding the worker host the run had
(``ModelWorker``, built from the recorded graph with the same models), on a local gloo group of
the recorded world size: one rank in this process, the others spawned. Every rank loads the
recorded engine state, algorithm state, weight versions and input batch, sets the recorded RNG
states and torch thread count, and calls the op's body as ``run_op`` did; its outputs are then
compared with the recorded ones (``recording.compare``). With ``debug`` the body of this
process's rank runs under pdb, stopping at its first line.
"""

from __future__ import annotations

import json
import pdb
import queue
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from hybridflow.workers import checkpointing
from hybridflow.workers.model_worker import ModelWorker
from hybridflow.workers.recording import (
    GRAPH, INFO, INPUT, OUTPUT, STATE, compare, rank_dir, set_rng_states, weight_digests,
)

LOCALHOST = "127.0.0.1"


class ReplayError(RuntimeError):
    """A rank's replay raised (its traceback in the message)."""


def read_info(path: str | Path) -> dict:
    return json.loads((Path(path) / INFO).read_text())


def replay_rank(path: str | Path, rank: int, port: int, tokenizer_dir: str, debug: bool = False) -> str | None:
    """Replay rank ``rank`` of the call recorded in ``path`` (a collective with the other ranks,
    on ``LOCALHOST:port``); returns the first difference from the record, or None."""
    path, info = Path(path), read_info(path)
    saved = torch.load(path / GRAPH, weights_only=False)  # the graph's plugins are imported first
    graph, node = saved["graph"], saved["node"]
    own = rank_dir(path, rank)
    state = torch.load(own / STATE, weights_only=False)
    worker = ModelWorker(
        rank, info["world_size"], LOCALHOST, port, state["threads"], graph=graph, models=info["models"],
        tokenizer_dir=tokenizer_dir, total_steps=info["total_steps"], rollouts=info["rollouts"],
    )
    try:
        ctx = worker.ctx
        checkpointing.load_engines(path, ctx.trained_engines())
        for name in worker.rollout_engines:  # a colocated rollout holds its train engine's weights
            if name in worker.train_engines:
                ctx.sync_rollout(name)
        checkpointing.load_rank_state(path, info["pool"], rank, ctx.extra_state, True, graph.spec.trainer.seed, 0)
        ctx.train_versions.update(state["train_versions"])
        ctx.rollout_versions.update(state["rollout_versions"])
        batch = torch.load(own / INPUT, weights_only=False)
        op = graph.op(node)
        worker.colocation.activate(node.model, generates=op.generates)
        body = op.load_body(node.role)
        torch.set_num_threads(state["threads"])
        set_rng_states(state["rng"])
        if debug:
            print(f"rank {rank}: stopped in {op.body} for node {node.name!r} (`c` runs it to the end)", flush=True)
            out, meta = pdb.Pdb().runcall(body, ctx, batch, node)
        else:
            out, meta = body(ctx, batch, node)
        replayed = {"out": out, "meta": meta, "weights": weight_digests(ctx, node)}
        return compare(torch.load(own / OUTPUT, weights_only=False), replayed)
    finally:
        worker.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCALHOST, 0))
        return sock.getsockname()[1]


def _replay_child(path: str, rank: int, port: int, tokenizer_dir: str, results) -> None:
    try:
        results.put((rank, replay_rank(path, rank, port, tokenizer_dir), None))
    except BaseException:  # reported by the parent, which stops
        results.put((rank, None, traceback.format_exc()))


def replay(path: str | Path, tokenizer_dir: str, rank: int = 0, debug: bool = False) -> dict[int, str | None]:
    """Replay every rank of the call recorded in ``path``: ``rank`` in this process (under pdb
    with ``debug``), the others in spawned processes. Returns each rank's first difference
    (None: equal). Raises ReplayError if a rank's replay raised."""
    world_size = read_info(path)["world_size"]
    port = _free_port()
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    others = [
        spawn.Process(target=_replay_child, args=(str(path), r, port, tokenizer_dir, results), name=f"replay-rank-{r}")
        for r in range(world_size) if r != rank
    ]
    for process in others:
        process.start()
    done = False
    try:
        differences = {rank: replay_rank(path, rank, port, tokenizer_dir, debug)}
        while len(differences) < world_size:
            ended = not any(p.is_alive() for p in others)  # before the get: a result may be on its way
            try:
                other, difference, error = results.get(timeout=5.0)
            except queue.Empty:
                if ended:
                    codes = {p.name: p.exitcode for p in others}
                    raise ReplayError(f"a replay process ended without a result (exit codes {codes})") from None
                continue
            if error is not None:
                raise ReplayError(f"rank {other}'s replay raised:\n{error}")
            differences[other] = difference
        done = True
        return dict(sorted(differences.items()))
    finally:
        for process in others:  # after a failure, peers may wait in a collective: stop them
            process.join(timeout=60.0 if done else 1.0)
            if process.is_alive():
                process.terminate()
                process.join()
