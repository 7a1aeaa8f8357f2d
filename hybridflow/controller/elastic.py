"""``trainer.elastic``: a recovery that finds a Ray node gone restarts on the nodes left.

After a lost worker (``Recovery.workers_lost``) the trainer asks :meth:`Elastic.replan`:

1. Did a node the pools ran on die? Ray says so only once the node misses its health checks
   (with Ray's defaults within about 30 s), so replan waits, at most ``wait_s``, until Ray
   reports one of those nodes dead or every one of them runs a probe task (then no node was
   lost: a worker died alone, and the recovery restarts the pools as they were).
2. For each pool, the largest shape the alive nodes hold (``placement/elastic.py``) at which
   every model keeps its tp x pp and the batch divides over the smaller dp
   (``graph.dag.resize_pools``). Prompts per iteration stay as they are: each rank gets a
   larger share.
3. A ``shrink`` line in ``events.jsonl`` and a console warning; the trainer removes every
   placement group (one with a bundle pinned to a dead node would wait for it forever),
   creates the pools at their new sizes and restores the newest checkpoint, which is
   layout-free.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hybridflow.controller.recovery import Recovery, RunStopped
from hybridflow.graph.dag import Graph, resize_pools
from hybridflow.placement.elastic import NoRoomError, shrink_pools
from hybridflow.spec.loading import SpecError
from hybridflow.spec.pool import PoolSpec
from hybridflow.workers.pools import ResourcePool

log = logging.getLogger(__name__)

# Ray's defaults (health_check_period_ms 3000, health_check_timeout_ms 10000,
# health_check_failure_threshold 5) mark a dead node within about 30 s; twice that and more.
NODE_DEATH_WAIT_S = 90.0


@ray.remote(num_cpus=0)
def _probe() -> None:
    return None


def _alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


class Elastic:
    """The nodes a run's pools are on, and the graph to restart on when one is lost."""

    def __init__(self, recovery: Recovery, wait_s: float = NODE_DEATH_WAIT_S) -> None:
        self.recovery = recovery
        self.wait_s = wait_s
        self.nodes: set[str] = set()

    def watch(self, pools: list[ResourcePool]) -> None:
        """Note the nodes ``pools``' bundles were placed on (call once they are created)."""
        self.nodes = {pool.node_of(rank) for pool in pools for rank in range(pool.spec.num_devices)}

    def lost_nodes(self) -> set[str]:
        """The watched nodes Ray reports dead; waits (at most ``wait_s``) until it reports one
        or every watched node has run a probe."""
        probes = [
            _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for node in sorted(self.nodes)
        ]
        deadline = time.monotonic() + self.wait_s
        while True:
            dead = self.nodes - {node["NodeID"] for node in _alive_nodes()}
            if dead:
                return dead
            ready, _ = ray.wait(probes, num_returns=len(probes), timeout=0.5)
            if len(ready) == len(probes):
                return self.nodes - {node["NodeID"] for node in _alive_nodes()}
            if time.monotonic() > deadline:
                log.warning("trainer.elastic: no node reported dead within %.0f s; restarting the pools as they were",
                            self.wait_s)
                return set()

    def replan(self, graph: Graph, iteration: int) -> Graph | None:
        """The graph to restart on after a lost node (its pools at the largest sizes that fit),
        or None when every node is still there. ``RunStopped`` when a pool fits at no size."""
        lost = self.lost_nodes()
        if not lost:
            return None
        alive = _alive_nodes()
        used = {name: graph.pools[name] for name in graph.used_pools()}

        def accepts(sizes: dict[str, PoolSpec]) -> bool:
            try:
                resize_pools(graph, sizes)
            except SpecError:
                return False
            return True

        try:
            sizes = shrink_pools(used, [node["Resources"] for node in alive], accepts)
        except NoRoomError as exc:
            raise RunStopped(
                f"stopping at iteration {iteration}: node(s) {', '.join(sorted(lost))} lost and {exc} "
                "(trainer.elastic)"
            ) from None
        shrunk = resize_pools(graph, sizes)
        pools = {name: {"before": used[name].num_devices, "after": sizes[name].num_devices} for name in used}
        layouts = {
            model: {"before": graph.layouts[model].model_dump(include={"tp", "pp", "dp"}),
                    "after": shrunk.layouts[model].model_dump(include={"tp", "pp", "dp"})}
            for model in graph.layouts
        }
        self.recovery.record("shrink", iteration=iteration, lost_nodes=sorted(lost), alive_nodes=len(alive),
                             pools=pools, layouts=layouts)
        log.warning(
            "node(s) %s lost; trainer.elastic restarts on the %d node(s) left: %s",
            ", ".join(sorted(lost)), len(alive),
            "; ".join(
                [f"pool {name!r} {p['before']} -> {p['after']} devices" for name, p in pools.items()]
                + [f"{model} dp {l['before']['dp']} -> {l['after']['dp']}" for model, l in layouts.items()
                   if l["before"] != l["after"]]
            ),
        )
        return shrunk
