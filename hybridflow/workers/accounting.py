"""Counting the tensor bytes that cross the object store, on both sides of it.

Controller: every fetch goes through ``controller_get``, which adds the tensor bytes it
materialises to ``fetched_tensor_bytes()``, so "the controller never sees a rollout tensor" is
a number a test can read (``controller/fetched_tensor_bytes`` per iteration).

Workers: a rank counts the tensor bytes of the shards it fetches (``count_fetched``, called by
``sharded.resolve``: a whole shard crosses even when a slice of it is used) and of the shard it
returns (``count_put``, called by the DP protocols' ``pack``). ``Worker.execute`` reports the
call's share as ``fetched_bytes`` / ``put_bytes`` in its meta; the executor sums them over all
ranks and nodes into ``transfer/fetched_bytes`` and ``transfer/put_bytes``.
"""

from __future__ import annotations

from typing import Any

import ray

from hybridflow.workers.wire import tensor_bytes

FETCHED_BYTES = "fetched_bytes"  # meta keys of a worker call's transfers
PUT_BYTES = "put_bytes"

_CONTROLLER = {"fetched": 0}
_WORKER = {FETCHED_BYTES: 0, PUT_BYTES: 0}


def controller_get(refs: Any, timeout_s: float | None = None) -> Any:
    """``ray.get`` for the controller: the one place it materialises results, counted.

    Adds the tensor bytes of what it fetched to ``fetched_tensor_bytes()``.
    """
    values = ray.get(refs, timeout=timeout_s)
    _CONTROLLER["fetched"] += tensor_bytes(values)
    return values


def fetched_tensor_bytes() -> int:
    """Tensor bytes ``controller_get`` has materialised in this process so far."""
    return _CONTROLLER["fetched"]


def count_fetched(value: Any) -> None:
    """A worker fetched ``value`` from the object store."""
    _WORKER[FETCHED_BYTES] += tensor_bytes(value)


def count_put(value: Any) -> None:
    """A worker returned ``value`` into the object store."""
    _WORKER[PUT_BYTES] += tensor_bytes(value)


def worker_transfers() -> dict[str, int]:
    """Tensor bytes this worker process has fetched and put so far (a copy)."""
    return dict(_WORKER)
