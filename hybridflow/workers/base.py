"""The worker base class: one rank of a ``WorkerGroup``, in its own Ray actor process.

A subclass adds the ML methods and declares each one's transfer protocol::

    class ScoreWorker(Worker):
        def __init__(self, rank, world_size, master_addr, master_port, threads, *, scale):
            super().__init__(rank, world_size, master_addr, master_port, threads)
            self.scale = scale

        @register(Dispatch.DP_SPLIT)
        def score(self, batch: TensorDict) -> tuple[TensorDict, dict]:
            scores = batch[RESPONSE_MASK].sum(-1).float() * self.scale
            return TensorDict({SCORES: scores}, batch_size=batch.batch_size), {}

The group never calls ``score`` directly: it calls ``execute("score", payload, kwargs)``, which
unpacks the payload with the method's protocol and packs the result.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.workers.accounting import worker_transfers
from hybridflow.workers.protocols import (
    dispatch_table,
    get_protocol,
    protocol_names,
    register_protocol,
)


class Worker:
    """One rank: a gloo process group over the group's ranks, and registered methods."""

    # Applies to the rendezvous and to every collective on the group.
    process_group_timeout_s: float = 300.0

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        threads: int,
        **init_kwargs: Any,
    ) -> None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        self.rank = rank
        self.world_size = world_size
        self.init_kwargs = init_kwargs
        host = f"[{master_addr}]" if ":" in master_addr else master_addr  # IPv6
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://{host}:{master_port}",
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=self.process_group_timeout_s),
        )

    def ready(self) -> int:
        """Returns once ``__init__`` (and so the rendezvous) is done."""
        return self.rank

    def install_protocols(self, protocols: dict[str, Any]) -> None:
        """Register protocols the controller registered and this process has not imported
        (a custom protocol defined in a script or test module lives only where it ran)."""
        for name, protocol in protocols.items():
            if name not in protocol_names():
                register_protocol(name, protocol)

    def execute(self, method_name: str, dispatch_payload: Any, kwargs: dict[str, Any]) -> Any:
        """Run a registered method on this rank's part of a group call."""
        dispatch = dispatch_table(type(self)).get(method_name)
        if dispatch is None:
            raise AttributeError(
                f"{type(self).__name__}.{method_name} is not a registered worker method"
            )
        protocol = get_protocol(dispatch)
        started = time.time()  # wall clock: comparable across processes for the timeline
        transfers = worker_transfers()
        args = protocol.unpack(dispatch_payload)
        result = getattr(self, method_name)(*args, **kwargs)
        packed = protocol.pack(method_name, result, dispatch_payload)
        if protocol.num_returns == 2:
            moved = {key: value - transfers[key] for key, value in worker_transfers().items()}
            packed[1].update(moved, t_start=started, t_end=time.time(), rank=self.rank, pid=os.getpid())
        return packed

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

