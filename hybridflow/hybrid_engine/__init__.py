"""The 3D-HybridEngine: the actor's weights between its training and generation layouts.

``groups`` (rank numbering, micro-DP / generation TP / PP groups, pure), ``reshard``
(``reshard_to_generation``: zero-redundancy and naive paths with measured bytes and peak
memory), ``sync`` (train engine -> rollout engine each iteration: in place for a same-layout
engine, through the resharder for a sharded one). The train engine's side of the seam, its
``ShardSpec`` list and flat training shard, is ``hybridflow.engines.shards``.
"""
