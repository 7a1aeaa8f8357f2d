"""One-step off-policy and streaming across two pools vs the synchronous split vs colocated dp = 2 (issue 20).

    python benchmarks/async_throughput.py [--seeds 0 1 2] [--iterations 150] [--modes ...] [--json FILE] [overrides...]

Four ways to run the same GRPO workload (``graphs/grpo_split_rollout.yaml``: the copy task,
tiny model, 16 prompts x 16 samples, token TIS at C = 2) on two CPU ranks:

- ``sync_split``: the actor trains on pool ``train`` and generates on pool ``rollout`` (one rank
  each), generate then train, each pool idle while the other works;
- ``one_step_off``: the same pools, generation k+1 on ``rollout`` during update k on ``train``
  (streaming with K = 1);
- ``streaming_k2``: the same, two generations queued ahead (staleness 2);
- ``streaming_k1_abort``, ``streaming_k2_abort``, ``streaming_k2_continue``: streaming with
  partial rollouts (``trainer.async.partial_rollout``): an update's weights reach the generation
  in flight between two decoding steps, which resumes (abort) or goes on (continue) with them.
  They need the vLLM rollout (``models.actor.rollout.engine=vllm`` among the overrides) and are
  left out of the default modes. (Streaming with K = 1 and no partial rollouts is one_step_off.)
- ``colocated_dp2``: no rollout pool; actor, ref and reward on one pool of two ranks (dp = 2),
  generation and training one after another on both ranks (the hybrid engine).

Runs alternate mode by mode within each seed, one Ray for all. Reported per run: the median
iteration time (the first ``--warmup`` iterations left out), iterations per second, G (median
generate time) and T (median of the training pool's nodes summed: log-probs, reward, advantage,
update, weight publish), and the mean reward of the last 10 iterations (the same samples in
every mode). The overlap's ceiling over the synchronous split is (G + T) / max(G, T).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPH = ROOT / "graphs" / "grpo_split_rollout.yaml"
MODES = {
    "sync_split": ["trainer.async.mode=sync"],
    "one_step_off": ["trainer.async.mode=one_step_off"],  # streaming with K = 1
    "streaming_k2": ["trainer.async.mode=streaming", "trainer.async.max_staleness=2"],
    "streaming_k1_abort": ["trainer.async.mode=streaming", "trainer.async.max_staleness=1", "trainer.async.partial_rollout=abort"],
    "streaming_k2_abort": ["trainer.async.mode=streaming", "trainer.async.max_staleness=2", "trainer.async.partial_rollout=abort"],
    "streaming_k2_continue": ["trainer.async.mode=streaming", "trainer.async.max_staleness=2", "trainer.async.partial_rollout=continue"],
    "colocated_dp2": [
        "trainer.async.mode=sync", "models.actor.rollout.pool=null",
        f"resources={ROOT / 'resource_pools' / 'local_cpu.yaml'}",
        "placement={actor: default, ref: default, reward: default}",
    ],
}
PARTIAL = ("streaming_k1_abort", "streaming_k2_abort", "streaming_k2_continue")  # vLLM only
TRAIN_NODES = ("old_log_prob", "ref_log_prob", "reward", "advantage", "update_actor", "weight_publish")


def run(mode: str, seed: int, args: argparse.Namespace) -> dict:
    from hybridflow.controller.trainer import Trainer
    from hybridflow.graph.dag import load_graph

    overrides = [
        f"trainer.iterations={args.iterations}", f"trainer.seed={seed}", "trainer.val_interval=0",
        "trainer.save_final=false", "trainer.progress=false", "trainer.save_interval=0",
        "trainer.sample_interval=0", *MODES[mode], *args.overrides,
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(load_graph(GRAPH, overrides), run_dir=run_dir)
        started = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - started
    rows = trainer.history
    timed = rows[args.warmup:]
    iteration = statistics.median(r["timing/iteration"] for r in timed)
    generate = statistics.median(r["timing/generate"] for r in timed)
    train = statistics.median(sum(r.get(f"timing/{n}", 0.0) for n in TRAIN_NODES) for r in timed)
    rewards = [r["reward/mean"] for r in rows]
    return {
        "mode": mode, "seed": seed, "iteration_s": iteration, "its_per_s": 1.0 / iteration,
        "G_s": generate, "T_s": train, "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]),
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in timed),
        "staleness_last_mean": statistics.mean(r.get("async/staleness_last_mean", 0.0) for r in timed),
        "partial_samples": statistics.mean(
            r.get("rollout/partial_resumed", 0.0) + r.get("rollout/partial_continued", 0.0) for r in timed
        ),
        "weight_sync_s": statistics.median(r.get("timing/weight_sync", 0.0) for r in timed),
        "weight_sync_bytes": rows[-1].get("weight_sync/bytes", 0.0), "wall_s": wall,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| mode | seed | s/iteration | it/s | x sync split | G s | T s | weight sync s | staleness first / last | reward, last 10 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {r["seed"]: r["its_per_s"] for r in results if r["mode"] == "sync_split"}
    for r in results:
        ratio = r["its_per_s"] / base[r["seed"]] if r["seed"] in base else float("nan")
        lines.append(
            f"| {r['mode']} | {r['seed']} | {r['iteration_s']:.3f} | {r['its_per_s']:.2f} | {ratio:.2f} | "
            f"{r['G_s']:.3f} | {r['T_s']:.3f} | {r['weight_sync_s']:.4f} | "
            f"{r['staleness_mean']:.2f} / {r.get('staleness_last_mean', r['staleness_mean']):.2f} | {r['reward_last10']:.3f} |"
        )
    lines += ["", "| mode | mean it/s | mean x sync split | mean reward, last 10 |", "| --- | --- | --- | --- |"]
    for mode in MODES:
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        ratios = [r["its_per_s"] / base[r["seed"]] for r in rows if r["seed"] in base]
        lines.append(
            f"| {mode} | {statistics.mean(r['its_per_s'] for r in rows):.2f} | "
            f"{statistics.mean(ratios):.2f} | {statistics.mean(r['reward_last10'] for r in rows):.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the timings")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=[m for m in MODES if m not in PARTIAL])
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="graph overrides for every mode (key=value)")
    args = parser.parse_args(argv)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    load_before = os.getloadavg()
    results = []
    try:
        for seed in args.seeds:
            for mode in args.modes:
                results.append(run(mode, seed, args))
                print(json.dumps(results[-1]), flush=True)
    finally:
        ray.shutdown()
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(table(results))
    if args.json:
        settings = {**vars(args), "json": Path(args.json).name}  # no path of this machine in the file
        Path(args.json).write_text(json.dumps({"args": settings, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
