"""benchmarks/limit.py: its limit path runs the graph's own work, on one rank of all the threads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridflow.graph.dag import load_graph

ROOT = Path(__file__).resolve().parent.parent


def _limit():
    spec = importlib.util.spec_from_file_location("limit", ROOT / "benchmarks" / "limit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_limit_graph_is_one_rank_of_every_thread():
    limit = _limit()
    graph = load_graph(ROOT / "graphs" / "grpo_split_rollout.yaml")
    threads = limit.total_threads(graph)
    assert threads == sum(p.num_devices * p.threads_per_device for n, p in graph.pools.items() if n in graph.used_pools())
    assert len(graph.used_pools()) == 2 and graph.rollout_pools  # a split graph: two pools
    one = limit.one_rank(graph, threads)
    assert one.used_pools() == ["default"] and not one.rollout_pools
    pool = one.pools["default"]
    assert (pool.num_devices, pool.threads_per_device) == (1, threads)
    assert set(one.placement.values()) == {"default"} and one.placement.keys() == graph.placement.keys()
    assert [n.name for n in one.nodes] == [n.name for n in graph.nodes]
    assert one.spec.nodes == graph.spec.nodes and one.spec.data == graph.spec.data


@pytest.mark.slow
def test_limit_on_one_rank_generates_what_hybridflow_generates(tmp_path):
    """hybridflow on one rank of two threads beside the limit path: the same seeds, so the same
    rewards iteration by iteration (the limit path does the graph's own work), and each stage
    timed on both sides."""
    out = tmp_path / "limit.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "limit.py"), "--iterations", "3", "--warmup", "1",
         "--set", f"resources={ROOT / 'benchmarks' / 'one_rank_pool.yaml'}", "--json", str(out)],
        check=True, cwd=tmp_path, env=env, timeout=300, capture_output=True,
    )
    result = json.loads(out.read_text())
    assert len(result["rewards"]["limit"]) == 3 and result["same_rewards"]
    assert result["rewards"]["hybridflow"] == result["rewards"]["limit"]
    assert result["stages"] == ["generate", "ref_log_prob", "reward", "advantage", "update_actor", "iteration"]
    for side in ("hybridflow", "limit"):
        assert all(result["mean_s"][side][stage] > 0 for stage in result["stages"])
    assert result["threads"] == 2 and result["ratio_hybridflow_over_limit"] > 0


def test_the_workload_label_names_the_graph_without_this_machines_paths():
    """The label goes into the result JSON, which is committed: no absolute path in it."""
    limit = _limit()
    args = SimpleNamespace(peers=None, graph=ROOT / "graphs" / "grpo.yaml", set=["data.seed=1"], iterations=3)
    _, label = limit.graph_from_args(args)
    assert label == "graphs/grpo.yaml data.seed=1"
