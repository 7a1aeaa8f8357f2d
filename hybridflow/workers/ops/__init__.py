"""The bodies of the built-in ops, one module per job; their records are in
``hybridflow.graph.ops``, where they are registered the way a user's op is.

Each is ``body(ctx, batch, node) -> (TensorDict, meta)``: ``ctx`` the worker's
``WorkerContext``, ``batch`` this rank's part of the node's inputs, ``meta`` with ``metrics``
(averaged over the ranks), ``sums`` (summed) and ``samples`` (decoded rows for samples.jsonl).
"""
