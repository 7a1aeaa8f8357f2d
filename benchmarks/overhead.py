"""Framework overhead: one GRPO iteration's compute in a plain process vs the full engine.

    .venv/bin/python benchmarks/overhead.py [--iterations 30] [--warmup 5]

Both sides run the default graph (graphs/grpo.yaml) on ONE rank with two torch threads:
- plain: the worker class instantiated in this process (a one-rank gloo group), its op methods
  called in graph order with the batches merged by hand: no controller, no Ray, no scheduling;
- engine: `hybridflow run`'s controller with a one-device pool (Ray actor, ShardedRefs, the
  executor's dataflow scheduling, metric reduction, JSONL logging).
Both are seeded alike, so they generate the same tokens (checked: the reward sequences must
match), and overhead = (engine - plain) / engine per iteration, medians after warm-up.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
POOLS = Path(__file__).resolve().parent / "one_rank_pool.yaml"


def load(iterations: int):
    from hybridflow.graph.dag import load_graph

    return load_graph(
        ROOT / "graphs" / "grpo.yaml",
        [f"trainer.iterations={iterations}", "trainer.val_interval=0", "trainer.progress=false",
         "trainer.save_final=false"],
        pools_file=POOLS,
    )


def plain_times(iterations: int) -> tuple[list[float], list[float]]:
    """The ops of one iteration, called directly on an in-process worker."""
    import torch
    from tensordict import TensorDict

    from hybridflow.controller.executor import _call_args
    from hybridflow.data.datasets import PromptDataset, load_prompt_rows
    from hybridflow.data.tasks import get_task
    from hybridflow.workers.model_worker import ModelWorker

    graph = load(iterations)
    spec = graph.spec
    tokenizer = get_task("copy").tokenizer()
    tok_dir = tempfile.mkdtemp(prefix="overhead-tok-")
    tokenizer.save_pretrained(tok_dir)
    pool = graph.pools["default"]
    with socket.socket() as probe:  # a free port for the one-rank gloo group
        probe.bind(("127.0.0.1", 0))
        addr, port = probe.getsockname()
    worker = ModelWorker(
        0, 1, addr, port, pool.threads_per_device, graph_spec=spec, models=list(spec.models),
        layouts=graph.layouts, tokenizer_dir=tok_dir, total_steps=iterations,
    )
    train_rows, _ = load_prompt_rows(spec.data.source, ".", spec.data.num_train, spec.data.num_val, spec.data.seed)
    dataset = PromptDataset(train_rows, tokenizer, spec.data.max_prompt_length, spec.data.prompts_per_iteration,
                            spec.data.shuffle, spec.data.seed)
    times, rewards = [], []
    for _ in range(iterations):
        start = time.perf_counter()
        outputs: dict[str, TensorDict] = {"<data>": dataset.next_batch()}
        for node in graph.nodes:
            method, kwargs = _call_args(graph, node)
            srcs = list(dict.fromkeys(graph.producers(node).values()))
            batch = outputs[srcs[0]].clone(False)
            for src in srcs[1:]:
                batch.update(outputs[src])
            out, meta = getattr(worker, method)(batch, **kwargs)
            outputs[node.name] = out
            if node.op == "score":
                rewards.append(meta["metrics"]["reward/mean"])
        times.append(time.perf_counter() - start)
    worker.shutdown()
    del torch
    return times, rewards


def engine_times(iterations: int) -> tuple[list[float], list[float]]:
    from hybridflow.controller.trainer import Trainer

    trainer = Trainer(load(iterations), run_dir=tempfile.mkdtemp(prefix="overhead-run-"))
    trainer._setup()
    times, rewards = [], []
    try:
        for iteration in range(1, iterations + 1):
            start = time.perf_counter()
            metrics = trainer.step(iteration)
            times.append(time.perf_counter() - start)
            rewards.append(metrics["reward/mean"])
    finally:
        trainer.shutdown()
    return times, rewards


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    engine, engine_rewards = engine_times(args.iterations)
    plain, plain_rewards = plain_times(args.iterations)
    same = all(abs(a - b) < 1e-6 for a, b in zip(engine_rewards, plain_rewards))
    w = args.warmup
    e, p = statistics.median(engine[w:]), statistics.median(plain[w:])
    print("| path | median iteration (s) |")
    print("| --- | --- |")
    print(f"| plain process (no controller, no Ray) | {p:.4f} |")
    print(f"| full engine (controller + Ray worker) | {e:.4f} |")
    print(f"\noverhead: {(e - p) / e:.1%} of the engine's iteration; same rewards on both paths: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
