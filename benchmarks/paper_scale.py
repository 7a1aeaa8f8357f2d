"""Paper-scale study (simulated): the auto-mapper's placements for PPO, ReMax and Safe-RLHF with
Llama 7B/13B/34B/70B models on 16-128 A100-80GB GPUs.

    python benchmarks/paper_scale.py [--json benchmarks/results/paper_scale.json]

The HybridFlow paper's workload: every model the same Llama size, prompt and response length
1024, 1024 prompts per iteration (one response each), one PPO epoch of 8 updates; 8 GPUs per
node, 600 GB/s NVLink, 200 Gbps between nodes (the ``a100-80gb`` profile: datasheet numbers and
the documented efficiency factors, not tuned to any result). Reward and cost models are LLMs
(as in the paper), so the dataflows are ``rlhf_plan_graph``'s, not the CPU graph files (whose
rewards are rules).

For each point: the chosen plan, predicted seconds per iteration and throughput
(tokens/s = 1024 x 2048 / iteration time), and the same for colocate-all and for the paper's
standalone split (actor/critic/ref/reward = 1/2, 1/4, 1/8, 1/8 of the GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hybridflow.placement.automapper import AutoMapper, rlhf_plan_graph  # noqa: E402
from hybridflow.placement.profiles import A100_80GB, LLAMA  # noqa: E402
from hybridflow.placement.simulator import Workload  # noqa: E402

WORKLOAD = Workload(num_prompts=1024, samples_per_prompt=1, prompt_len=1024, response_len=1024,
                    epochs=1, updates_per_epoch=8, micro_batch=1)
TOKENS = WORKLOAD.num_samples * WORKLOAD.seq_len
GPUS = [16, 32, 64, 128]
SIZES = ["7b", "13b", "34b", "70b"]
ALGORITHMS = ["ppo", "remax", "safe_rlhf"]
DEVICES_PER_NODE = 8


def standalone_split(models: list[str], gpus: int) -> list[tuple[tuple[str, ...], int]] | None:
    """The paper's 13B/128-GPU standalone plan, scaled: actor 1/2, critic 1/4, the rest share 1/4."""
    if set(models) != {"actor", "critic", "ref", "reward"}:
        return None
    return [(("actor",), gpus // 2), (("critic",), gpus // 4), (("ref",), gpus // 8), (("reward",), gpus // 8)]


def study(algorithms=ALGORITHMS, sizes=SIZES, gpus_list=GPUS) -> list[dict]:
    rows = []
    for algorithm in algorithms:
        for size in sizes:
            graph = rlhf_plan_graph(algorithm, LLAMA[size], WORKLOAD)
            for gpus in gpus_list:
                started = time.perf_counter()
                mapper = AutoMapper(graph, A100_80GB, gpus, DEVICES_PER_NODE)
                plans = mapper.search(keep=3)
                seconds = time.perf_counter() - started
                colocate = mapper.evaluate([(tuple(graph.models), gpus)])
                split = standalone_split(list(graph.models), gpus)
                standalone = mapper.evaluate(split) if split else None
                row = {
                    "algorithm": algorithm, "size": size, "gpus": gpus,
                    "plan": plans[0].to_dict() if plans else None,
                    "runner_up": plans[1].to_dict() if len(plans) > 1 else None,
                    "colocate": colocate.to_dict() if colocate else None,
                    "standalone": standalone.to_dict() if standalone else None,
                    "plans_scored": mapper.num_evaluated,
                    "search_s": seconds,
                }
                rows.append(row)
                best = f"{plans[0].key()}  {plans[0].total:7.1f} s" if plans else "does not fit"
                print(f"{algorithm:<9} {size:>4} {gpus:>4} GPUs: {best}  ({seconds:.1f} s search)", flush=True)
    return rows


def _fmt(plan: dict | None) -> str:
    if plan is None:
        return "does not fit"
    return f"{plan['total_s']:.1f} s ({TOKENS / plan['total_s']:,.0f} tok/s)"


def _layouts(plan: dict) -> str:
    parts = []
    for s in plan["sets"]:
        inner = "; ".join(f"{m} {l}" for m, l in s["layouts"].items())
        parts.append(f"[{s['devices']}: {inner}]")
    return " ".join(parts)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| algorithm | model | GPUs | chosen placement (models:GPUs) | predicted | colocate-all | standalone 1/2,1/4,1/8,1/8 |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        chosen = r["plan"]["key"].replace(" | ", " / ") if r["plan"] else "-"
        lines.append(
            f"| {r['algorithm']} | {r['size']} | {r['gpus']} | {chosen} | {_fmt(r['plan'])} | "
            f"{_fmt(r['colocate'])} | {_fmt(r['standalone']) if r['standalone'] else '-'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "paper_scale.json"))
    parser.add_argument("--layouts", action="store_true", help="also print every chosen plan's layouts")
    args = parser.parse_args(argv)
    rows = study()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    print()
    print(markdown(rows))
    if args.layouts:
        for r in rows:
            if r["plan"]:
                print(f"{r['algorithm']} {r['size']} {r['gpus']}: {_layouts(r['plan'])}")
                print(f"    stages (s): {', '.join(f'{t:.1f}' for t in r['plan']['stage_s'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
