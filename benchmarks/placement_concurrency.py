"""Split placement, concurrent vs forced one-node-at-a-time: iteration time.

    python benchmarks/placement_concurrency.py [--graph graphs/grpo_split.yaml] [--iterations 6]

Runs the same graph twice on one local Ray (same seed, same data): once as the executor runs it
(every node whose inputs are ready is submitted, so nodes on disjoint pools overlap) and once
with ``trainer.serial=true``. Prints the median iteration time (first iteration dropped: it
includes warm-up) and the median time of each node, then a Markdown table for
benchmarks/RESULTS.md. On a machine with fewer cores than ranks the pools share cores, so the
gain is bounded by the idle time the overlap can fill; on separate devices it is larger.

graphs/grpo_split.yaml has no old_log_prob node any more (one optimizer step per batch: the
update's own first forward is pi_old), so nothing on its actor pool runs beside ref_log_prob and
reward and the two modes should take the same time; give ``--graph`` a split graph whose actor
has a log_prob node (an update of several optimizer steps) to measure an overlap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(graph_file: str, overrides: list[str], serial: bool) -> list[dict]:
    from hybridflow.controller.trainer import Trainer
    from hybridflow.graph.dag import load_graph

    graph = load_graph(graph_file, [*overrides, f"trainer.serial={str(serial).lower()}"])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(graph, run_dir=run_dir)
        trainer.fit()
    return trainer.history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default=str(ROOT / "graphs/grpo_split.yaml"))
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [
        f"trainer.iterations={args.iterations}", "trainer.val_interval=0",
        "trainer.save_final=false", "trainer.progress=false",
        f"models.actor.rollout.n={args.n}", f"data.prompts_per_iteration={args.prompts}",
        *args.overrides,
    ]
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        for mode in ("concurrent", "serial"):
            started = time.perf_counter()
            history = _run(args.graph, overrides, serial=(mode == "serial"))
            results[mode] = (history[1:] or history, time.perf_counter() - started)
    finally:
        ray.shutdown()

    nodes = sorted({k for rows, _ in results.values() for k in rows[0] if k.startswith("timing/")})
    print(f"graph {args.graph}, {args.iterations} iterations, {args.prompts} prompts x {args.n}, "
          f"{os.cpu_count()} cores; medians over iterations 2..{args.iterations}")
    print("| metric (s) | concurrent | serial | serial / concurrent |")
    print("| --- | --- | --- | --- |")
    for key in ["timing/iteration", *[k for k in nodes if k != "timing/iteration"]]:
        med = {mode: statistics.median(r[key] for r in rows) for mode, (rows, _) in results.items()}
        ratio = med["serial"] / med["concurrent"] if med["concurrent"] else float("nan")
        print(f"| {key} | {med['concurrent']:.3f} | {med['serial']:.3f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
