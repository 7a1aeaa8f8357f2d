"""hybridflow against its limit: the same graph's ops called in a plain loop, in one process.

    .venv/bin/python benchmarks/limit.py [--graph graphs/grpo.yaml] [--set KEY=VALUE ...]
        [--iterations 30] [--warmup 5] [--json out.json]
    .venv/bin/python benchmarks/limit.py --peers [benchmarks/peers.py's workload flags]

Two paths run the same graph, iterations alternating so background load hits both alike:
- hybridflow: `hybridflow run`'s controller on the graph's own pools and layouts (Ray actors,
  sharded batches in the object store, dataflow scheduling, metric reduction, JSONL logging);
- limit: one process, no Ray, no controller: every model of the graph on one in-process worker
  of one rank, with as many torch threads as the graph's ranks have together, its nodes' op
  bodies called in graph order with their input batches merged by hand. Same engines, same
  settings (packing, micro-batches, advantage, loss), so the same work per iteration; what is
  left between the two is the framework's cost (and whatever the graph's data parallelism
  gains or loses against one rank of all the threads).

``--peers`` takes the workload of ``benchmarks/peers.py`` (the same flags: ``--engine vllm``,
``--model smollm2``, ``--prompts``, ``--samples``, ...; its defaults) instead of a graph file.

Prints, after ``--warmup`` iterations, the mean time of each stage (hybridflow: its nodes'
``timing/*`` metrics, which hold waits on inputs; limit: each op call) and of the whole
iteration on both paths, and hybridflow/limit; ``--json`` writes them with the load average
before and after. Ratios are meaningful only on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, for --peers


def total_threads(graph) -> int:
    """Torch threads of the graph's ranks together (the pools its models and rollouts use)."""
    return sum(graph.pools[name].num_devices * graph.pools[name].threads_per_device for name in graph.used_pools())


def one_rank(graph, threads: int):
    """``graph`` with every model (and standalone rollout) on one rank of ``threads`` threads."""
    from hybridflow.graph.dag import build_graph
    from hybridflow.spec.graph import GraphSpec

    raw = graph.spec.model_dump(mode="json", by_alias=True, exclude_unset=True)
    for model in raw.get("models", {}).values():
        for section in ("train", "rollout"):
            if isinstance(model.get(section), dict):
                model[section].pop("layout", None)
                model[section].pop("pool", None)
    pool = {"nodes": 1, "devices_per_node": 1, "device": "cpu", "cpus_per_device": threads,
            "threads_per_device": threads}
    pools_file = Path(tempfile.mkdtemp(prefix="limit-pool-")) / "one_rank.yaml"
    pools_file.write_text(json.dumps({"pools": {"default": pool}}))  # JSON is YAML
    raw["resources"] = str(pools_file)
    raw["placement"] = dict.fromkeys(raw["models"], "default")
    return build_graph(GraphSpec.model_validate(raw), graph.file, pools_file)


class LimitPath:
    """The graph's nodes called in order on one in-process worker: no Ray, no controller."""

    def __init__(self, graph, total_steps: int):
        from hybridflow.controller.preflight import run_tokenizer
        from hybridflow.data.datasets import PromptDataset, load_data
        from hybridflow.workers.model_worker import ModelWorker

        self.graph = graph
        spec = graph.spec
        tokenizer = run_tokenizer(graph)
        tokenizer_dir = tempfile.mkdtemp(prefix="limit-tok-")
        tokenizer.save_pretrained(tokenizer_dir)
        with socket.socket() as probe:  # a free port for the one-rank gloo group
            probe.bind(("127.0.0.1", 0))
            addr, port = probe.getsockname()
        pool = graph.pools["default"]
        self.worker = ModelWorker(
            0, 1, addr, port, pool.threads_per_device, graph=graph, models=list(spec.models),
            rollouts=graph.rollouts_on("default"), tokenizer_dir=tokenizer_dir, total_steps=total_steps,
        )
        train_rows, _ = load_data(spec.data, graph.file)
        self.dataset = PromptDataset(train_rows, tokenizer, spec.data.max_prompt_length,
                                     spec.data.prompts_per_iteration, spec.data.shuffle, spec.data.seed,
                                     system_prompt=spec.data.system_prompt)

    def step(self) -> tuple[dict[str, float], dict[str, float]]:
        """One iteration: (seconds per node, every node's metrics, as a run logs them)."""
        from hybridflow.controller.metrics import reduce_metas
        from hybridflow.graph.dag import SOURCE

        outputs = {SOURCE: self.dataset.next_batch()}
        times, metrics = {}, {}
        for node in self.graph.nodes:
            sources = list(dict.fromkeys(self.graph.producers(node).values()))
            batch = outputs[sources[0]].clone(False)
            for source in sources[1:]:
                batch.update(outputs[source])
            coords = self.graph.dispatch_layout(node).coords(0)
            start = time.perf_counter()
            out, meta = self.worker.run_op(batch, node=node.name, coords=coords)
            times[node.name] = time.perf_counter() - start
            outputs[node.name] = out
            metrics.update(reduce_metas([{**meta, "num_samples": 1}]))
        return times, metrics

    def shutdown(self, release_process_group: bool = False) -> None:
        """Stop the score processes. The process group stays unless ``release_process_group``
        (another ``LimitPath`` is to start in this process): then the worker goes, and vLLM's
        groups with torch's default group (vLLM's own cleanup, which destroys both)."""
        for sources in self.worker.rules.values():
            sources.close()
        if release_process_group:
            import gc

            import torch.distributed as dist

            del self.worker
            gc.collect()
            if "vllm" in sys.modules:
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            if dist.is_initialized():
                dist.destroy_process_group()


def graph_from_args(args):
    """(hybridflow's graph, a label) from ``--graph``/``--set`` or ``--peers`` flags."""
    if args.peers is not None:
        import peers

        peer_args = peers.parse_args(args.peers)
        if args.iterations < peer_args.iterations:
            peer_args.iterations = args.iterations
        graph = peers.peers_graph(peer_args, peer_args.seeds[0])
        return graph, "peers.py " + " ".join(args.peers)
    from hybridflow.graph.dag import load_graph

    overrides = [*args.set, f"trainer.iterations={args.iterations}", "trainer.val_interval=0",
                 "trainer.progress=false", "trainer.save_final=false"]
    graph_path = Path(args.graph).resolve()
    label = str(graph_path.relative_to(ROOT)) if graph_path.is_relative_to(ROOT) else graph_path.name
    return load_graph(args.graph, overrides), " ".join([label, *args.set])


def compare(graph, iterations: int, warmup: int, run_dir: Path) -> dict:
    """Both paths, alternating, ``iterations`` each; means after ``warmup``."""
    import torch

    from hybridflow.controller.trainer import Trainer

    threads = total_threads(graph)
    torch.set_num_threads(threads)
    trainer = Trainer(graph, run_dir=str(run_dir))
    trainer._setup()
    limit = LimitPath(one_rank(graph, threads), trainer._total_optimizer_steps())
    rows = {"hybridflow": [], "limit": []}  # per iteration: seconds per stage
    rewards = {"hybridflow": [], "limit": []}
    node_names = {n.name for n in graph.nodes}
    try:
        for iteration in range(1, iterations + 1):
            start = time.perf_counter()
            metrics = trainer.step(iteration)
            total = time.perf_counter() - start
            stages = {k.removeprefix("timing/"): v for k, v in metrics.items()
                      if k.startswith("timing/") and k.removeprefix("timing/") in node_names}
            rows["hybridflow"].append({**stages, "iteration": total})
            rewards["hybridflow"].append(metrics.get("reward/mean"))
            start = time.perf_counter()
            times, scored = limit.step()
            total = time.perf_counter() - start
            rows["limit"].append({**times, "iteration": total})
            rewards["limit"].append(scored.get("reward/mean"))
            print(f"iter {iteration:3d}  hybridflow {rows['hybridflow'][-1]['iteration']:.3f}s  "
                  f"limit {total:.3f}s", flush=True)
    finally:
        trainer.shutdown()
        limit.shutdown()
    stages = [n.name for n in graph.nodes] + ["iteration"]
    means = {side: {s: mean(r.get(s, 0.0) for r in side_rows[warmup:]) for s in stages}
             for side, side_rows in rows.items()}
    return {"stages": stages, "mean_s": means, "threads": threads,
            "ratio_hybridflow_over_limit": means["hybridflow"]["iteration"] / means["limit"]["iteration"],
            "rewards": rewards, "same_rewards": rewards["hybridflow"] == rewards["limit"]}


def print_table(result: dict) -> None:
    hf, lim = result["mean_s"]["hybridflow"], result["mean_s"]["limit"]
    print(f"\n{result['workload']}; {result['threads']} threads on both paths; load average "
          f"{result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after\n")
    print("| stage | hybridflow (s) | limit (s) | hybridflow / limit |")
    print("| --- | --- | --- | --- |")
    for stage in result["stages"]:
        ratio = hf[stage] / lim[stage] if lim[stage] > 0 else float("nan")
        name = f"**{stage}**" if stage == "iteration" else stage
        print(f"| {name} | {hf[stage]:.4f} | {lim[stage]:.4f} | {ratio:.2f} |")
    print(f"\nhybridflow / limit iteration time: {result['ratio_hybridflow_over_limit']:.3f}; the same "
          f"rewards on both paths: {result['same_rewards']} (expected where the graph runs on one rank)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", type=Path, default=ROOT / "graphs" / "grpo.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a graph override, as on `hybridflow run`'s command line (repeatable)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out of the means")
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--peers", nargs=argparse.REMAINDER,
                        help="the rest of the command line: benchmarks/peers.py's workload flags")
    args = parser.parse_args(argv)
    if args.iterations <= args.warmup:
        parser.error("--iterations must be more than --warmup")
    graph, label = graph_from_args(args)
    load_before = os.getloadavg()
    result = compare(graph, args.iterations, args.warmup, Path(tempfile.mkdtemp(prefix="limit-run-")))
    result.update(workload=label, load_before=load_before, load_after=os.getloadavg())
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
