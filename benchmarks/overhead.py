"""Framework overhead: one GRPO iteration's compute in a plain process vs the full engine.

    .venv/bin/python benchmarks/overhead.py [--iterations 30] [--warmup 5] [--workload tiny|peers]

Both sides run the default graph (graphs/grpo.yaml) on ONE rank with two torch threads, with the
default tiny model (``tiny``: a ~0.2 s iteration, the worst case for a fixed per-call cost) or
with benchmarks/peers.py's model and sampling (``peers``: hidden 256, 4 layers, 8 samples of up
to 64 new tokens per prompt, for actor and reference alike):
- plain: the worker class instantiated in this process (a one-rank gloo group), its op methods
  called in graph order with the batches merged by hand: no controller, no Ray, no scheduling;
- engine: `hybridflow run`'s controller with a one-device pool (Ray actor, ShardedRefs, the
  executor's dataflow scheduling, metric reduction, JSONL logging).
Both are seeded alike, so they generate the same tokens (checked: the reward sequences must
match). The two paths alternate iteration by iteration, so background load hits both alike;
overhead = (engine - plain) / engine of the median iteration times after warm-up.
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


WORKLOADS = {
    "tiny": [],
    "peers": [
        *(f"models.{model}.source.config.{key}={value}"
          for model in ("actor", "ref")
          for key, value in dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                                 num_attention_heads=4, num_key_value_heads=2).items()),
        "models.actor.rollout.n=8", "data.max_response_length=64",
    ],
}


def load(iterations: int, workload: str):
    from hybridflow.graph.dag import load_graph

    return load_graph(
        ROOT / "graphs" / "grpo.yaml",
        [f"trainer.iterations={iterations}", "trainer.val_interval=0", "trainer.progress=false",
         "trainer.save_final=false", *WORKLOADS[workload]],
        pools_file=POOLS,
    )


class PlainPath:
    """The ops of one iteration, called directly on an in-process worker."""

    def __init__(self, iterations: int, workload: str):
        from hybridflow.data.datasets import PromptDataset, load_prompt_rows
        from hybridflow.data.tasks import get_task
        from hybridflow.workers.model_worker import ModelWorker

        self.graph = graph = load(iterations, workload)
        spec = graph.spec
        tokenizer = get_task("copy").tokenizer()
        tok_dir = tempfile.mkdtemp(prefix="overhead-tok-")
        tokenizer.save_pretrained(tok_dir)
        with socket.socket() as probe:  # a free port for the one-rank gloo group
            probe.bind(("127.0.0.1", 0))
            addr, port = probe.getsockname()
        self.worker = ModelWorker(
            0, 1, addr, port, graph.pools["default"].threads_per_device, graph_spec=spec,
            models=list(spec.models), layouts=graph.layouts, tokenizer_dir=tok_dir,
            total_steps=iterations,
        )
        rows, _ = load_prompt_rows(spec.data.source, ".", spec.data.num_train, spec.data.num_val, spec.data.seed)
        self.dataset = PromptDataset(rows, tokenizer, spec.data.max_prompt_length,
                                     spec.data.prompts_per_iteration, spec.data.shuffle, spec.data.seed)

    def step(self) -> float:
        """One iteration; returns the mean reward."""
        from hybridflow.controller.executor import _call_args

        outputs = {"<data>": self.dataset.next_batch()}
        reward = float("nan")
        for node in self.graph.nodes:
            method, kwargs = _call_args(self.graph, node)
            srcs = list(dict.fromkeys(self.graph.producers(node).values()))
            batch = outputs[srcs[0]].clone(False)
            for src in srcs[1:]:
                batch.update(outputs[src])
            out, meta = getattr(self.worker, method)(batch, **kwargs)
            outputs[node.name] = out
            if node.op == "score":
                reward = meta["metrics"]["reward/mean"]
        return reward


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    args = parser.parse_args(argv)
    import torch

    from hybridflow.controller.trainer import Trainer

    torch.set_num_threads(2)
    trainer = Trainer(load(args.iterations, args.workload), run_dir=tempfile.mkdtemp(prefix="overhead-run-"))
    trainer._setup()
    plain_path = PlainPath(args.iterations, args.workload)
    engine, plain, same = [], [], True
    try:
        for iteration in range(1, args.iterations + 1):
            start = time.perf_counter()
            engine_reward = trainer.step(iteration)["reward/mean"]
            engine.append(time.perf_counter() - start)
            start = time.perf_counter()
            plain_reward = plain_path.step()
            plain.append(time.perf_counter() - start)
            same = same and abs(engine_reward - plain_reward) < 1e-6
    finally:
        trainer.shutdown()
        plain_path.worker.shutdown()
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
