"""Object-store bytes moved per iteration, per node: what the workers fetch and what they put.

    python benchmarks/transfer_bytes.py [--graph graphs/grpo_megatron.yaml] [--iterations 3]

Runs the graph for a few iterations (validation off) with the per-iteration timeline written
(``trainer.trace_interval=1``). Every rank's ``run_op`` reports the tensor bytes of the shards it
fetched (a shard crosses whole, even when the rank reads a slice of it) and of the shard it put
(``hybridflow/workers/accounting.py``); the timeline carries them per node and rank, and the run's
``metrics.jsonl`` has their sums as ``transfer/fetched_bytes`` and ``transfer/put_bytes``. Prints
the per-node table of the last iteration (the shapes are fixed, so every iteration moves the same
bytes) as Markdown for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def node_bytes(trace_file: Path) -> dict[str, dict[str, int]]:
    """Node -> {"fetched": bytes, "put": bytes} summed over its ranks, from one Chrome trace."""
    out: dict[str, dict[str, int]] = {}
    for event in json.loads(trace_file.read_text())["traceEvents"]:
        if event["ph"] != "X":
            continue
        row = out.setdefault(event["name"], {"fetched": 0, "put": 0})
        row["fetched"] += event["args"]["fetched_bytes"]
        row["put"] += event["args"]["put_bytes"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default=str(ROOT / "graphs/grpo_megatron.yaml"))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from hybridflow.controller.trainer import Trainer
    from hybridflow.graph.dag import load_graph

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    overrides = [
        f"trainer.iterations={args.iterations}", "trainer.val_interval=0", "trainer.trace_interval=1",
        "trainer.save_final=false", "trainer.save_interval=0", "trainer.progress=false", *args.overrides,
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(load_graph(args.graph, overrides), run_dir=run_dir)
        trainer.fit()
        per_node = node_bytes(Path(run_dir) / "trace" / f"iteration_{args.iterations:05d}.json")
    last = trainer.history[-1]
    print(f"{Path(args.graph).name}, iteration {args.iterations}: tensor bytes through the object store")
    print("| node | fetched by its ranks | put by its ranks |")
    print("| --- | ---: | ---: |")
    for name, row in per_node.items():
        print(f"| {name} | {row['fetched']:,} | {row['put']:,} |")
    print(f"| **total** (`transfer/*` metrics) | **{int(last['transfer/fetched_bytes']):,}** | "
          f"**{int(last['transfer/put_bytes']):,}** |")


if __name__ == "__main__":
    main()
