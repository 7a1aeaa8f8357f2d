"""Elastic shrink: the largest pools that the nodes left after a loss still hold.

Pure planning over pool specs and node resources (no Ray): ``trainer.elastic``'s recovery
(``controller/elastic.py``) asks Ray which nodes are alive and what each holds, and restarts
the pools at the sizes :func:`shrink_pools` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hybridflow.spec.pool import PoolSpec


class NoRoomError(ValueError):
    """A pool does not fit the nodes left even at one device (or at no size the graph accepts)."""


def candidates(pool: PoolSpec) -> list[PoolSpec]:
    """``pool`` and every smaller shape (fewer nodes, fewer devices per node), largest first;
    of two shapes with as many devices, the one with more devices per node first (fewer
    ranks talk across nodes)."""
    shapes = [(n, d) for n in range(1, pool.nodes + 1) for d in range(1, pool.devices_per_node + 1)]
    shapes.sort(key=lambda nd: (nd[0] * nd[1], nd[1]), reverse=True)
    return [pool.model_copy(update={"nodes": n, "devices_per_node": d}) for n, d in shapes]


def _per_node(pool: PoolSpec) -> dict[str, float]:
    """What one node of ``pool`` reserves (its bundles together)."""
    need = {"CPU": pool.devices_per_node * pool.cpus_per_device}
    if pool.device == "gpu":
        need["GPU"] = float(pool.devices_per_node)
    return need


def _take(pool: PoolSpec, free: list[dict[str, float]]) -> list[dict[str, float]] | None:
    """``free`` after ``pool``'s nodes are taken out of the roomiest nodes, or None when fewer
    than ``pool.nodes`` nodes have room for one node's share."""
    need = _per_node(pool)
    roomy = [i for i, node in enumerate(free) if all(node.get(k, 0.0) >= v for k, v in need.items())]
    if len(roomy) < pool.nodes:
        return None
    roomy.sort(key=lambda i: free[i].get("CPU", 0.0), reverse=True)
    left = [dict(node) for node in free]
    for i in roomy[: pool.nodes]:
        for key, amount in need.items():
            left[i][key] -= amount
    return left


def shrink_pools(
    pools: Mapping[str, PoolSpec],
    nodes: list[Mapping[str, float]],
    accepts: Callable[[dict[str, PoolSpec]], bool] = lambda pools: True,
) -> dict[str, PoolSpec]:
    """For each pool (in order), its largest shape that fits what ``nodes`` (the alive nodes'
    resources, e.g. ``{"CPU": 3.0}``) hold after the pools before it, and that ``accepts``
    takes: it is given the pools chosen so far with this shape (the graph's layouts and batch
    sizes must divide over them; pools not reached yet keep their size). A pool that fits as it is
    stays as it is. Raises ``NoRoomError`` naming the pool that fits at no size."""
    free = [dict(node) for node in nodes]
    chosen: dict[str, PoolSpec] = {}
    for name, pool in pools.items():
        for shape in candidates(pool):
            left = _take(shape, free)
            if left is not None and accepts({**chosen, name: shape}):
                chosen[name], free = shape, left
                break
        else:
            need = _per_node(pool.model_copy(update={"devices_per_node": 1}))
            raise NoRoomError(
                f"pool {name!r} ({pool.nodes} x {pool.devices_per_node} {pool.device}) fits the "
                f"{len(nodes)} node(s) left at no size its models' layouts and batch accept "
                f"(one device needs {need})"
            )
    return chosen
