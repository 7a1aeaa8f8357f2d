"""trainer.elastic's planning, without Ray: the largest pools that the nodes left hold, the graph
resized to them, and the refusal of a pool pinned to one node. The shrink of a real run on two
Ray nodes: ``tests/test_multinode.py::test_elastic_run_shrinks_when_a_node_dies``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.graph.dag import load_graph, resize_pools
from hybridflow.placement.elastic import NoRoomError, candidates, shrink_pools
from hybridflow.spec.loading import SpecError
from hybridflow.spec.pool import PoolSpec

ROOT = Path(__file__).resolve().parent.parent


def _pools_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    return path


def test_candidates_are_largest_first_and_keep_devices_per_node():
    shapes = [(p.nodes, p.devices_per_node) for p in candidates(PoolSpec(nodes=2, devices_per_node=2))]
    assert shapes == [(2, 2), (1, 2), (2, 1), (1, 1)]


def test_a_pool_over_two_nodes_shrinks_to_the_one_left():
    pools = {"default": PoolSpec(nodes=2, devices_per_node=2)}
    both = shrink_pools(pools, [{"CPU": 3.0}, {"CPU": 2.0}])
    assert both == pools  # it fits as it is: unchanged
    left = shrink_pools(pools, [{"CPU": 3.0}])
    assert (left["default"].nodes, left["default"].devices_per_node) == (1, 2)


def test_pools_share_what_is_left_in_order():
    pools = {"actor": PoolSpec(devices_per_node=2), "aux": PoolSpec(devices_per_node=2)}
    left = shrink_pools(pools, [{"CPU": 3.0}])
    assert {n: p.num_devices for n, p in left.items()} == {"actor": 2, "aux": 1}
    with pytest.raises(NoRoomError, match="pool 'aux'"):
        shrink_pools(pools, [{"CPU": 2.5}])


def test_accepts_rules_out_sizes_the_graph_cannot_take():
    # tp 2 on the pool: 3 devices are left but only an even number divides.
    pools = {"default": PoolSpec(nodes=1, devices_per_node=4)}
    left = shrink_pools(pools, [{"CPU": 3.0}], accepts=lambda sizes: sizes["default"].num_devices % 2 == 0)
    assert left["default"].num_devices == 2
    with pytest.raises(NoRoomError, match="at no size"):
        shrink_pools(pools, [{"CPU": 1.0}], accepts=lambda sizes: sizes["default"].num_devices % 2 == 0)


def test_gpu_pools_count_gpus():
    pools = {"default": PoolSpec(nodes=2, devices_per_node=2, device="gpu")}
    left = shrink_pools(pools, [{"CPU": 16.0, "GPU": 1.0}, {"CPU": 16.0, "GPU": 0.0}])
    assert (left["default"].nodes, left["default"].devices_per_node) == (1, 1)


def test_resize_pools_keeps_tp_pp_and_shrinks_dp_even_a_fixed_one(tmp_path):
    pools = _pools_file(tmp_path, "pools:\n  default: {nodes: 2, devices_per_node: 1}\n")
    graph = load_graph(ROOT / "graphs/grpo.yaml", ["trainer.elastic=true", "models.actor.train.layout.dp=2",
                                                   "data.prompts_per_iteration=4"], pools_file=pools)
    assert graph.layouts["actor"].dp == 2
    shrunk = resize_pools(graph, {"default": PoolSpec(nodes=1, devices_per_node=1)})
    assert {m: (l.tp, l.pp, l.dp) for m, l in shrunk.layouts.items()} == {m: (1, 1, 1) for m in graph.layouts}
    assert shrunk.spec.data.prompts_per_iteration == 4 and shrunk.nodes == graph.nodes
    # 3 prompts do not split over dp 2 either way; over dp 3 they do, but 3 does not divide 4
    with pytest.raises(SpecError, match="prompts_per_iteration"):
        resize_pools(graph, {"default": PoolSpec(nodes=1, devices_per_node=3)})


def test_elastic_refuses_a_pool_pinned_to_one_node(tmp_path):
    pools = ROOT / "resource_pools/two_node_cpu.yaml"
    overrides = ["placement.actor=actor", "placement.ref=aux", "placement.reward=aux"]
    load_graph(ROOT / "graphs/grpo.yaml", overrides, pools_file=pools)  # fine without elastic
    with pytest.raises(SpecError) as info:
        load_graph(ROOT / "graphs/grpo.yaml", [*overrides, "trainer.elastic=true"], pools_file=pools)
    line = str(info.value)
    assert "\n" not in line and "two_node_cpu.yaml" in line and "pools.actor.node_labels" in line
    assert "trainer.elastic" in line
    # labels that choose among several nodes leave room to shrink
    spread = _pools_file(tmp_path, "pools:\n  default: {nodes: 2, node_labels: {zone: a}}\n")
    load_graph(ROOT / "graphs/grpo.yaml", ["trainer.elastic=true", "data.prompts_per_iteration=4"],
               pools_file=spread)
