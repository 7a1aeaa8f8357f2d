"""Resource pools: a named set of devices reserved as one Ray placement group.

One bundle per device (rank): ``{"CPU": cpus_per_device}`` plus ``{"GPU": 1}`` on GPU pools.
Rank ``r`` of a worker group on the pool is scheduled into bundle ``r``.

- One node, no labels: a ``PACK`` group (Ray picks the node).
- One node with ``node_labels``: ``STRICT_PACK``, every bundle's label selector = the labels, so
  the pool lands on a node started with ``ray start --labels``.
- ``nodes`` > 1: the pool picks ``nodes`` distinct alive nodes that carry ``node_labels`` and
  have the resources for ``devices_per_node`` bundles, and pins bundle ``r`` to node
  ``r // devices_per_node`` through the built-in ``ray.io/node-id`` label. Ranks of one node are
  consecutive, so a TP group (consecutive ranks, see ``ParallelLayout.coords``) stays
  inside a node when ``tp <= devices_per_node``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.spec.pool import PoolSpec


def start_ray(address: str | None, pools: Iterable[PoolSpec], worker_log: Path | None = None) -> Path | None:
    """Join the Ray cluster at ``address``, or start a local one with CPUs for ``pools``; a no-op
    when Ray is already up (tests, a notebook). With ``worker_log`` the workers' stdout and
    stderr go to that file instead of the console (``hybridflow.workers.output``); returns it, or
    None where Ray was already up and its workers' output stays where that Ray put it."""
    if ray.is_initialized():
        return None
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    quiet = {}
    if worker_log is not None:
        from hybridflow.workers.output import LOG_ENV, SETUP_HOOK

        quiet = {"worker_process_setup_hook": SETUP_HOOK, "env_vars": {LOG_ENV: str(Path(worker_log).resolve())}}
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env=quiet or None)
        return worker_log
    # Ray starts workers at niceness 15; here the workers do all the heavy work while the
    # controller sleeps, and at 15 any other busy process on the box starves them (measured:
    # 1.55 s vs 0.25 s per iteration of the one-rank default graph beside a busy process).
    os.environ.setdefault("RAY_worker_niceness", "0")
    needed = sum(p.num_devices * p.cpus_per_device for p in pools)
    ray.init(
        num_cpus=max(int(needed + 0.999), os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={
            **quiet,
            "env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **quiet.get("env_vars", {})},
        },
    )
    return worker_log


class PoolUnavailableError(RuntimeError):
    """The cluster could not reserve a pool's bundles in time."""


class ResourcePool:
    """A named pool of ``spec.num_devices`` devices, reserved by ``create()``."""

    def __init__(self, name: str, spec: PoolSpec) -> None:
        self.name = name
        self.spec = spec
        self._placement_group: PlacementGroup | None = None

    @property
    def bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": float(self.spec.cpus_per_device)}
        if self.spec.device == "gpu":
            bundle["GPU"] = 1.0
        return [dict(bundle) for _ in range(self.spec.num_devices)]

    @property
    def placement_group(self) -> PlacementGroup:
        if self._placement_group is None:
            raise RuntimeError(f"resource pool {self.name!r} is not created; call create() first")
        return self._placement_group

    @property
    def created(self) -> bool:
        return self._placement_group is not None

    def create(self, timeout_s: float = 60.0) -> PlacementGroup:
        """Reserve the bundles and wait until every one is placed; idempotent.

        Raises ``PoolUnavailableError`` (and withdraws the request, so it cannot grab resources
        later) when the bundles are not placed within ``timeout_s``.
        """
        if self._placement_group is not None:
            return self._placement_group
        labels = dict(self.spec.node_labels)
        name = f"hybridflow:{self.name}"
        if self.spec.nodes > 1:
            selectors = [
                {**labels, NODE_ID_LABEL_KEY: node_id}
                for node_id in self._pick_nodes()
                for _ in range(self.spec.devices_per_node)
            ]
            pg = placement_group(self.bundles, "PACK", name, bundle_label_selector=selectors)
        elif labels:
            pg = placement_group(
                self.bundles, "STRICT_PACK", name, bundle_label_selector=[labels] * len(self.bundles)
            )
        else:
            pg = placement_group(self.bundles, strategy="PACK", name=name)
        # ray.wait, not pg.wait: pg.wait truncates its timeout to whole seconds.
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise PoolUnavailableError(self._shortage_message(timeout_s))
        self._placement_group = pg
        return pg

    def _pick_nodes(self) -> list[str]:
        """Ids of ``spec.nodes`` distinct alive nodes with the labels and room for one node's
        bundles (by total resources; a busy node makes ``create`` time out, with a message)."""
        per_node = {"CPU": self.spec.devices_per_node * self.spec.cpus_per_device}
        if self.spec.device == "gpu":
            per_node["GPU"] = float(self.spec.devices_per_node)
        labels = self.spec.node_labels
        fit = [
            node["NodeID"]
            for node in ray.nodes()
            if node["Alive"]
            and all(node.get("Labels", {}).get(k) == v for k, v in labels.items())
            and all(node["Resources"].get(k, 0.0) >= v for k, v in per_node.items())
        ]
        if len(fit) < self.spec.nodes:
            raise PoolUnavailableError(
                f"resource pool {self.name!r} spans {self.spec.nodes} nodes of "
                f"{self.spec.devices_per_node} x {self.spec.device} ({per_node}) with labels "
                f"{labels or '{}'}; the cluster has {len(fit)} such node(s)"
            )
        return sorted(fit)[: self.spec.nodes]

    def node_of(self, rank: int) -> str:
        """The id of the node rank ``rank``'s bundle was placed on."""
        table = ray.util.placement_group_table(self.placement_group)
        return table["bundles_to_node_id"][rank]

    def scheduling_strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Where rank ``rank`` runs: its own bundle of this pool's placement group."""
        if not 0 <= rank < self.spec.num_devices:
            raise IndexError(
                f"rank {rank} out of range for pool {self.name!r} "
                f"of {self.spec.num_devices} devices"
            )
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=rank,
        )

    def free_address(self, rank: int = 0, timeout_s: float = 60.0) -> tuple[str, int]:
        """The IP of rank ``rank``'s node and a TCP port free there now (for a rendezvous).

        On the driver's own node (every single-node run) the driver binds the port itself; on
        another node a zero-CPU task in the rank's bundle probes it. The port is released before
        it is returned, so another process could take it first; a failed rendezvous says so.
        """
        if self.node_of(rank) == ray.get_runtime_context().get_node_id():
            return _ip_and_free_port()
        probe = _node_ip_and_free_port.options(scheduling_strategy=self.scheduling_strategy(rank))
        try:
            return tuple(ray.get(probe.remote(), timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise PoolUnavailableError(
                f"resource pool {self.name!r}: the address probe on rank {rank}'s node "
                f"{self.node_of(rank)} did not run within {timeout_s:g} s (Ray could not start "
                f"a worker process there)"
            ) from None

    def remove(self) -> None:
        """Release the bundles; workers still placed on them are killed by Ray."""
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None

    def _shortage_message(self, timeout_s: float) -> str:
        num = self.spec.num_devices
        cpus_asked = num * self.spec.cpus_per_device
        total = ray.cluster_resources()
        free = ray.available_resources()
        parts = [
            f"resource pool {self.name!r} could not be placed within {timeout_s:g} s: it asks for "
            f"{num} bundle(s) of {self.spec.cpus_per_device:g} CPU = {cpus_asked:g} CPUs, the "
            f"cluster has {total.get('CPU', 0.0):g} CPUs ({free.get('CPU', 0.0):g} free)"
        ]
        if self.spec.device == "gpu":
            parts.append(
                f"; and {num} GPUs, the cluster has {total.get('GPU', 0.0):g} "
                f"({free.get('GPU', 0.0):g} free)"
            )
        parts.append(
            ". Lower devices_per_node or cpus_per_device in the pool file, or start Ray with "
            "more resources."
        )
        return "".join(parts)

    def __repr__(self) -> str:
        state = "created" if self.created else "not created"
        return f"ResourcePool({self.name!r}, {self.spec.num_devices} x {self.spec.device}, {state})"


def _ip_and_free_port() -> tuple[str, int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


# Lives here, not beside the workers, so the probe's process does not import torch.
_node_ip_and_free_port = ray.remote(num_cpus=0)(_ip_and_free_port)
