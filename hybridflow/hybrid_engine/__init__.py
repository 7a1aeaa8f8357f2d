"""The 3D-HybridEngine: the actor's weights between its training and generation layouts.

``groups`` (rank numbering, micro-DP / generation TP / PP groups, pure), ``layout_meta``
(per-parameter sharding metadata, the train engine's side of the seam), ``reshard``
(``reshard_to_generation``: zero-redundancy and naive paths with measured bytes and peak
memory), ``sync`` (same-layout weight sync between a train and a rollout engine).
"""
