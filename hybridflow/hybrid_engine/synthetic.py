"""A decoder-shaped parameter set with megatron's sharding, for resharding tests and benchmarks."""

from __future__ import annotations

import torch

from hybridflow.engines.shards import ShardSpec


def decoder_specs(
    num_layers: int,
    hidden: int,
    ffn: int,
    vocab: int,
    pp: int,
    norms: bool = False,
    embeddings: bool = True,
) -> list[ShardSpec]:
    """Embedding (vocab-parallel, stage 0), per layer fused qkv + bias and fc1 (column-parallel,
    dim 0), attention output and fc2 (row-parallel, dim 1), lm head (vocab-parallel, last stage).

    ``norms=False, embeddings=False`` is the setting of the paper's Table 2: every parameter
    TP-split and every stage the same size. ``norms=True`` adds per-layer and final norms
    (replicated); ``embeddings`` puts the embedding on stage 0 and the lm head on the last stage
    (for p > 2 the middle stages are then smaller).
    """
    if num_layers % pp:
        raise ValueError(f"pp = {pp} does not divide num_layers = {num_layers}")
    per_stage = num_layers // pp
    h, f = hidden, ffn
    specs = [ShardSpec("embed.weight", (vocab, h), 0, 0)] if embeddings else []
    for layer in range(num_layers):
        stage, p = layer // per_stage, f"layers.{layer}."
        if norms:
            specs.append(ShardSpec(p + "input_norm.weight", (h,), None, stage))
        specs += [
            ShardSpec(p + "qkv.weight", (3 * h, h), 0, stage),
            ShardSpec(p + "qkv.bias", (3 * h,), 0, stage),
            ShardSpec(p + "proj.weight", (h, h), 1, stage),
        ]
        if norms:
            specs.append(ShardSpec(p + "mlp_norm.weight", (h,), None, stage))
        specs += [
            ShardSpec(p + "fc1.weight", (2 * f, h), 0, stage),
            ShardSpec(p + "fc2.weight", (h, f), 1, stage),
        ]
    if norms:
        specs.append(ShardSpec("final_norm.weight", (h,), None, pp - 1))
    if embeddings:
        specs.append(ShardSpec("lm_head.weight", (vocab, h), 0, pp - 1))
    return specs


def full_weights(specs: list[ShardSpec], seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random full tensors for ``specs``, the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.full_shape, generator=gen).to(dtype) for s in specs}
