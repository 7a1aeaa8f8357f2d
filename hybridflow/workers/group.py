"""A worker group: one Ray actor per device of a resource pool, called as if it were one object.

``group.call(name, ...)`` (or ``group.name(...)``) looks up the method's transfer protocol,
splits the call into one ``execute`` per rank and collects the returned refs:

- ``Dispatch.ONE_TO_ALL``: ``group.call("load", path)`` -> ``[ObjectRef per rank]``.
- ``Dispatch.ALL_TO_ALL``: ``group.call("load", [path_0, path_1])`` -> rank r gets ``path_r``.
- ``Dispatch.DP_SPLIT``: ``group.call("score", [sharded_a, sharded_b], group_size=4, **kw)`` ->
  ``PendingShards``; ``pending.result()`` -> ``(ShardedRef, [meta per rank])``, fetching only
  the metas. The ShardedRef feeds the next group's DP_SPLIT call directly.
- ``Dispatch.DP_3D``: as DP_SPLIT plus ``layout=`` (the model's resolved ``ParallelLayout``):
  one chunk per DP rank, the same to its TP/PP ranks (each gets ``coords=``); only TP rank 0 of
  the last PP stage is collected.

Methods named in ``side_methods`` run on a second thread of each actor, beside the call in
progress (a standalone rollout takes new weights while it generates); the rest run one at a
time, in order. The group knows nothing about models or engines; those live in the ``Worker``
subclass.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import ray

from hybridflow.workers.pools import ResourcePool
from hybridflow.workers.base import Worker
from hybridflow.workers.accounting import controller_get
from hybridflow.workers.protocols import Dispatch, dispatch_table, get_protocol, text_table
from hybridflow.workers.sharded import PendingShards

__all__ = ["PendingShards", "WorkerGroup"]


class WorkerGroup:
    """``pool.spec.num_devices`` actors of ``worker_cls``, one per bundle of ``pool``."""

    def __init__(
        self,
        worker_cls: type[Worker],
        pool: ResourcePool,
        init_kwargs: dict[str, Any] | None = None,
        name: str = "workers",
        *,
        ready_timeout_s: float = 300.0,  # importing torch + transformers on a busy box
        side_methods: tuple[str, ...] = (),
    ) -> None:
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"worker_cls must be a subclass of Worker, got {worker_cls!r}")
        self.name = name
        self.pool = pool
        self.worker_cls = worker_cls
        self._dispatch = dispatch_table(worker_cls)
        self._text = text_table(worker_cls)
        self._workers: list[ray.actor.ActorHandle] = []
        # Methods that run on a thread of their own, beside the call in progress (the others run
        # one at a time, in order, as always): each rank's actor then has a "side" concurrency
        # group of one thread.
        for method in side_methods:
            self.dispatch_of(method)
        self._side = frozenset(side_methods)

        pool.create()
        spec = pool.spec
        master_addr, master_port = pool.free_address(rank=0, timeout_s=ready_timeout_s)
        options: dict[str, Any] = {
            "num_cpus": spec.cpus_per_device,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(spec.threads_per_device)}},
        }
        if spec.device == "gpu":
            options["num_gpus"] = 1
        if side_methods:
            actor_cls = ray.remote(concurrency_groups={"side": 1})(_with_side_entry(worker_cls))
        else:
            actor_cls = ray.remote(worker_cls)
        world_size = spec.num_devices
        for rank in range(world_size):
            handle = actor_cls.options(
                scheduling_strategy=pool.scheduling_strategy(rank), **options
            ).remote(
                rank,
                world_size,
                master_addr,
                master_port,
                spec.threads_per_device,
                **(init_kwargs or {}),
            )
            self._workers.append(handle)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            # Ranks still in the rendezvous would queue a graceful shutdown behind __init__.
            self.shutdown(graceful=False)
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        # ray.wait, not ray.get on the list: a rank that failed in __init__ must surface at once,
        # while the others are still blocked in the rendezvous waiting for it.
        protocols = {str(d): get_protocol(d) for d in set(self._dispatch.values())}
        for worker in self._workers:  # queued before ready(): an actor runs calls in order
            worker.install_protocols.remote(protocols)
        pending = {w.ready.remote(): rank for rank, w in enumerate(self._workers)}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not done:
                missing = sorted(pending.values())
                raise TimeoutError(
                    f"worker group {self.name!r}: ranks {missing} not initialised after "
                    f"{timeout_s:g} s (actor start or gloo rendezvous)"
                )
            controller_get(done[0])  # raises the rank's __init__ error, if any
            del pending[done[0]]

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        """The actor handles in rank order (for direct, protocol-free calls)."""
        return list(self._workers)

    def dispatch_of(self, method_name: str) -> Dispatch | str:
        try:
            return self._dispatch[method_name]
        except KeyError:
            raise AttributeError(
                f"worker group {self.name!r}: {self.worker_cls.__name__}.{method_name} is not a "
                f"registered worker method; registered: {sorted(self._dispatch)}"
            ) from None

    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run a registered method on every rank under its transfer protocol; returns refs."""
        if not self._workers:
            raise RuntimeError(f"worker group {self.name!r} is shut down")
        protocol = get_protocol(self.dispatch_of(method_name))
        if not self._text[method_name]:
            kwargs = {"with_text": False, **kwargs}
        per_rank = protocol.split(self.world_size, args, kwargs)
        assert len(per_rank) == self.world_size, "protocol.split must give one payload per rank"
        returns = []
        for worker, (payload, rank_kwargs) in zip(self._workers, per_rank):
            execute = worker.execute_side if method_name in self._side else worker.execute
            if protocol.num_returns != 1:
                execute = execute.options(num_returns=protocol.num_returns)
            returns.append(execute.remote(method_name, payload, rank_kwargs))
        collected = protocol.collect([returns[rank] for rank in protocol.select(self.world_size, kwargs)])
        if isinstance(collected, PendingShards) and protocol.num_returns == 2:
            collected.all_meta_refs = [refs[1] for refs in returns]
        return collected

    def __getattr__(self, name: str) -> Any:
        # group.score(...) == group.call("score", ...), for registered methods only.
        dispatch = self.__dict__.get("_dispatch", {})
        if name in dispatch:
            return functools.partial(self.call, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def shutdown(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Destroy the ranks' process groups and kill the actors; the pool stays reserved."""
        workers, self._workers = self._workers, []
        if graceful and workers:
            done = [w.shutdown.remote() for w in workers]
            ray.wait(done, num_returns=len(done), timeout=timeout_s)
        for worker in workers:
            ray.kill(worker)

    def __repr__(self) -> str:
        return (
            f"WorkerGroup({self.name!r}, {self.worker_cls.__name__}, world_size={self.world_size}, "
            f"pool={self.pool.name!r})"
        )


def _with_side_entry(worker_cls: type[Worker]) -> type[Worker]:
    """``worker_cls`` with ``execute_side``: ``execute`` on the actor's "side" thread."""

    class Sided(worker_cls):
        @ray.method(concurrency_group="side")
        def execute_side(self, method_name: str, dispatch_payload: Any, kwargs: dict[str, Any]) -> Any:
            return self.execute(method_name, dispatch_payload, kwargs)

    Sided.__name__ = Sided.__qualname__ = worker_cls.__name__
    return Sided
