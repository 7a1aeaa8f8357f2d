"""A recorded node call (``workers.recording``) run again without Ray: ``hybridflow replay``.

Each rank of the recorded call is a spawned process holding the worker host the run had
(``ModelWorker``, built from the recorded graph with the same models), on a local gloo group of
the recorded world size. Every rank loads the recorded engine state, algorithm state, weight
versions and input batch, sets the recorded RNG states and torch thread count, and calls the
op's body as ``run_op`` did; its outputs are then compared with the recorded ones
(``recording.compare``). With ``debug`` the debugged rank runs in this process instead, its body
under pdb, stopping at its first line.
"""

from __future__ import annotations

import json
import os
import pdb
import queue
import socket
import sys
import threading
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
DEBUG_TIMEOUT_S = 24 * 3600.0  # the spawned ranks wait on a person at the debugger
# Replayed workers live until their process ends without tearing anything down (os._exit).
# Freeing one frees its DDP reducer, whose gloo process group joins its worker thread while
# this thread holds the GIL; that thread may still be freeing a finished collective's tensors,
# which needs the GIL: both wait for ever (seen as a replay that hangs after its last op).
_KEPT: list[ModelWorker] = []


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
        _KEPT.append(worker)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCALHOST, 0))
        return sock.getsockname()[1]


def _replay_child(path: str, rank: int, port: int, tokenizer_dir: str, timeout_s: float, results) -> None:
    ModelWorker.process_group_timeout_s = timeout_s  # this process's own class: a spawned child
    try:
        results.put((rank, replay_rank(path, rank, port, tokenizer_dir), None))
    except BaseException:  # reported by the parent, which stops
        results.put((rank, None, traceback.format_exc()))
    results.close()
    results.join_thread()  # the result is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of the kept worker (_KEPT)


class _Peers:
    """The spawned ranks of one replay and the queue their results come back on."""

    def __init__(self, path: Path, ranks: list[int], port: int, tokenizer_dir: str, timeout_s: float) -> None:
        spawn = mp.get_context("spawn")
        self.port = port
        self.results = spawn.Queue()
        self.processes = {
            r: spawn.Process(target=_replay_child, args=(str(path), r, port, tokenizer_dir, timeout_s, self.results),
                             name=f"replay-rank-{r}")
            for r in ranks
        }
        for process in self.processes.values():
            process.start()

    def collect(self, differences: dict, world_size: int) -> None:
        """Wait for every spawned rank's result into ``differences``; ReplayError as soon as one
        raised or ended without a result."""
        while len(differences) < world_size:
            ended = not any(p.is_alive() for p in self.processes.values())  # before the get: a result may be on its way
            try:
                rank, difference, error = self.results.get(timeout=1.0)
            except queue.Empty:
                if ended:
                    codes = {p.name: p.exitcode for p in self.processes.values()}
                    raise ReplayError(f"a replay process ended without a result (exit codes {codes})") from None
                continue
            if error is not None:
                raise ReplayError(f"rank {rank}'s replay raised:\n{error}")
            differences[rank] = difference

    def stop(self, wait_s: float) -> None:
        """Join every rank (``wait_s`` each), then terminate, then kill what is left: no wait here
        is unbounded, so a rank stuck in a collective or at exit never holds the replay."""
        for process in self.processes.values():
            process.join(timeout=wait_s)
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)


def _watch_peers(peers: _Peers, differences: dict, world_size: int) -> None:
    """Beside the rank debugged in this process: when a peer fails, that rank may be waiting in a
    collective no signal reaches, so say why on stderr and end the process."""
    try:
        peers.collect(differences, world_size)
    except ReplayError as err:
        print(f"\nhybridflow replay: {err}", file=sys.stderr, flush=True)
        peers.stop(0.0)
        os._exit(1)


def replay(
    path: str | Path, tokenizer_dir: str, rank: int = 0, debug: bool = False, timeout_s: float = 300.0,
) -> dict[int, str | None]:
    """Replay every rank of the call recorded in ``path``, each in a spawned process; with
    ``debug``, rank ``rank`` runs in this process under pdb instead. Returns each rank's first
    difference (None: equal). Raises ReplayError if a rank's replay raised or a process ended
    without a result. ``timeout_s`` bounds the rendezvous and each collective of the spawned
    ranks (a day with ``debug``, where they wait on a person at the debugger)."""
    path = Path(path)
    world_size = read_info(path)["world_size"]
    here = [rank] if debug else []
    peers = _Peers(path, [r for r in range(world_size) if r not in here], _free_port(), tokenizer_dir,
                   DEBUG_TIMEOUT_S if debug else timeout_s)
    differences: dict[int, str | None] = {}
    done = False
    try:
        if debug:
            watcher = threading.Thread(target=_watch_peers, args=(peers, differences, world_size - 1),
                                       name="replay-peers", daemon=True)
            watcher.start()
            difference = replay_rank(path, rank, peers.port, tokenizer_dir, debug=True)
            watcher.join()
            differences[rank] = difference
        else:
            peers.collect(differences, world_size)
        done = True
        return dict(sorted(differences.items()))
    finally:
        peers.stop(60.0 if done else 0.0)
