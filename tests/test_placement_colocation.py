"""Colocation on real Ray: one process holding actor + ref vs one process per role.

Resident memory is read from outside the worker processes (psutil on their pids). On CPU the
idle-role offload is a no-op move, but the same path runs on every op: the stats prove it.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import psutil
import pytest
import ray

from hybridflow.data.tasks import get_task
from hybridflow.workers.pools import ResourcePool
from hybridflow.spec.layout import ParallelLayout
from hybridflow.spec.pool import PoolSpec
from hybridflow.workers.group import WorkerGroup
from hybridflow.workers.model_worker import ModelWorker
from hybridflow.workers.sharded import ShardedRef

ROOT = Path(__file__).resolve().parent.parent
# A model big enough that its weights and optimizer state show next to the process's baseline.
BIGGER = [f"models.{m}.source.config.{k}={v}" for m in ("actor", "ref")
          for k, v in (("hidden_size", 256), ("num_hidden_layers", 4))]

def _group(graph, models: list[str], tokenizer_dir: Path, name: str) -> WorkerGroup:
    pool = ResourcePool(name, PoolSpec(devices_per_node=1, cpus_per_device=0.5))
    return WorkerGroup(
        ModelWorker,
        pool,
        init_kwargs={
            "graph": graph,
            "models": models,
            "tokenizer_dir": str(tokenizer_dir),
            "total_steps": 10,
        },
        name=name,
    )


def _rss(group: WorkerGroup) -> dict[str, int]:
    def usage(worker):
        gc.collect()
        info = psutil.Process().memory_full_info()
        return {"rss": info.rss, "uss": info.uss}

    return ray.get(group.workers[0].__ray_call__.remote(usage))


@pytest.mark.slow
def test_colocated_process_uses_less_memory_than_two_single_role_ones(ray_session, tmp_path):
    from graph_variants import with_old_log_prob

    # One-rank pools, as the groups below: the graph's layouts are dp = 1. An actor log_prob node
    # (grpo.yaml has none: one optimizer step per batch) gives the actor a forward like the ref's.
    graph = with_old_log_prob(
        ROOT / "graphs/grpo.yaml", BIGGER + ["data.prompts_per_iteration=2"], ROOT / "benchmarks/one_rank_pool.yaml"
    )
    task = get_task("copy")
    tokenizer = task.tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    from hybridflow.data.datasets import collate_prompts, load_prompt_rows

    rows, _ = load_prompt_rows("builtin:copy", ".", 4, 0, 0)
    prompts = ShardedRef.put(collate_prompts(rows[:2], tokenizer, 8))

    groups = {
        "both": _group(graph, ["actor", "ref"], tmp_path / "tok", "colo_both"),
        "actor": _group(graph, ["actor"], tmp_path / "tok", "colo_actor"),
        "ref": _group(graph, ["ref"], tmp_path / "tok", "colo_ref"),
    }
    try:
        # The same work in each: log-probs from every hosted model of the same responses
        # (and generation in the processes that host the actor).
        one_rank = ParallelLayout().resolve(1)
        for key in ("both", "actor"):
            call = groups[key].run_op([prompts], group_size=1, layout=one_rank, node="generate")
            responses, _ = call.result(timeout_s=300)
        log_prob = {"actor": "old_log_prob", "ref": "ref_log_prob"}
        for key, group in groups.items():
            for model in ["actor", "ref"] if key == "both" else [key]:
                group.run_op([responses], group_size=1, layout=one_rank, node=log_prob[model]).result(timeout_s=300)
        usage = {key: _rss(group) for key, group in groups.items()}
        stats = ray.get(groups["both"].workers[0].__ray_call__.remote(lambda w: w.colocation.stats()))
    finally:
        for group in groups.values():
            group.shutdown()
            group.pool.remove()

    print("colocation memory:", json.dumps(usage))
    for kind in ("rss", "uss"):
        assert usage["both"][kind] < usage["actor"][kind] + usage["ref"][kind], (kind, usage)
    # Offload ran on every switch between the two models (a no-op move on CPU).
    assert stats["models"] == ["actor", "ref"] and stats["active"] == "ref"
    assert stats["activations"] >= 2 and stats["offloads"] >= 2
    assert stats["bytes_offloaded"] == 0  # CPU pool: home is the CPU, nothing moves
