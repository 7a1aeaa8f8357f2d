"""HF Qwen2/Llama-style causal LM <-> megatron-core ``GPTModel`` (local layer spec) weights.

Weight-layout facts the conversion follows (megatron's fused, TP-sharded tensors):

- ``linear_qkv`` is grouped per query group: for each KV head ``g``, the ``q`` rows of the query
  heads that share it, then its ``k`` rows, then its ``v`` rows. TP rank ``r`` holds query groups
  ``r * G/t .. (r+1) * G/t - 1``, so its rows are a contiguous chunk of the grouped tensor and
  contain exactly HF's query heads ``r * Nq/t ..`` (the ``r``-th chunk of ``q_proj``).
- ``linear_fc1`` fuses gate and up *per rank*: rank ``r`` holds ``[gate_r; up_r]`` with
  ``gate_r`` the ``r``-th row chunk of ``gate_proj``; the concatenation over ranks is not
  ``[gate; up]``, which is why named shards are given unfused, with HF names.
- Row-parallel layers (``linear_proj`` = ``o_proj``, ``linear_fc2`` = ``down_proj``) split on the
  input dimension (dim 1); column-parallel ones and the vocabulary on dim 0.
- The vocabulary is padded to a multiple of ``t`` (zero rows; logits beyond the HF vocab are
  dropped by the engine). Norms are replicated on every TP rank.
- Layers are split evenly over pipeline stages; a stage numbers its layers from 0. With tied
  embeddings and ``p > 1`` the last stage holds its own copy of the embedding as
  ``output_layer.weight`` (megatron all-reduces its gradient with the first stage's).

The seam to the resharder is :func:`hf_shards`: this rank's weights under HF names, each a
contiguous chunk along ``tp_dim`` of the (vocab-padded) HF tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Dims:
    """The architecture numbers the conversion needs, read from an HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool = True

    @classmethod
    def from_hf(cls, hf_config) -> "Dims":
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        return cls(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            ffn_hidden_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            tied=bool(hf_config.tie_word_embeddings),
            qkv_bias=getattr(hf_config, "model_type", "qwen2") == "qwen2",
        )

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check(self, tp: int, pp: int) -> None:
        """Raise ValueError when the model cannot be split ``tp`` x ``pp`` ways."""
        for what, n in (
            ("num_key_value_heads", self.num_kv_heads),
            ("num_attention_heads", self.num_heads),
            ("intermediate_size", self.ffn_hidden_size),
        ):
            if n % tp:
                raise ValueError(f"tensor-parallel size {tp} does not divide {what} = {n}")
        if self.num_layers % pp:
            raise ValueError(
                f"pipeline-parallel size {pp} does not divide num_hidden_layers = {self.num_layers}"
            )


@dataclass(frozen=True)
class Rank:
    """Where a rank sits in the model-parallel grid."""

    tp_rank: int = 0
    tp: int = 1
    pp_rank: int = 0
    pp: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def layers(self, dims: Dims) -> range:
        """Global indices of this stage's layers."""
        per_stage = dims.num_layers // self.pp
        return range(self.pp_rank * per_stage, (self.pp_rank + 1) * per_stage)


@dataclass(frozen=True)
class HFShard:
    """One rank's piece of an HF tensor: ``tensor`` is chunk ``tp_rank`` of ``tp`` along
    ``tp_dim`` of the full tensor of shape ``full_shape`` (``tp_dim`` None: replicated).
    ``full_shape`` of vocabulary tensors is the padded one; ``vocab_size`` trims it."""

    name: str
    tensor: Tensor
    tp_dim: int | None
    full_shape: tuple[int, ...]
    pp_stage: int


def _chunk(tensor: Tensor, dim: int, rank: Rank) -> Tensor:
    return tensor.chunk(rank.tp, dim=dim)[rank.tp_rank]


def _pad_vocab(weight: Tensor, padded: int) -> Tensor:
    if weight.shape[0] == padded:
        return weight
    pad = weight.new_zeros((padded - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad])


def _group_qkv(q: Tensor, k: Tensor, v: Tensor, dims: Dims) -> Tensor:
    """HF q/k/v (weights (N*d, H) or biases (N*d,)) -> megatron grouped (G*(qpg+2)*d, ...)."""
    groups, d = dims.num_kv_heads, dims.head_dim
    tail = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(groups, dims.heads_per_group * d, *tail),
            k.reshape(groups, d, *tail),
            v.reshape(groups, d, *tail),
        ],
        dim=1,
    )
    return grouped.reshape(-1, *tail)


def _ungroup_qkv(qkv: Tensor, dims: Dims, tp: int) -> tuple[Tensor, Tensor, Tensor]:
    """One rank's grouped qkv -> its chunks of HF q, k, v."""
    groups, d = dims.num_kv_heads // tp, dims.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (dims.heads_per_group + 2) * d, *tail)
    q, k, v = grouped.split([dims.heads_per_group * d, d, d], dim=1)
    return (
        q.reshape(-1, *tail).clone(),
        k.reshape(-1, *tail).clone(),
        v.reshape(-1, *tail).clone(),
    )


def hf_to_megatron(hf_state: dict[str, Tensor], dims: Dims, rank: Rank) -> dict[str, Tensor]:
    """This rank's megatron ``GPTModel`` parameters (its stage's names) from a full HF state."""
    out: dict[str, Tensor] = {}
    padded = dims.padded_vocab(rank.tp)
    embed = _pad_vocab(hf_state["model.embed_tokens.weight"], padded)
    if rank.is_first_stage:
        out["embedding.word_embeddings.weight"] = _chunk(embed, 0, rank)
    for local, layer in enumerate(rank.layers(dims)):
        hf = f"model.layers.{layer}."
        mg = f"decoder.layers.{local}."
        attn = hf + "self_attn."
        out[mg + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
        qkv = _group_qkv(
            hf_state[attn + "q_proj.weight"],
            hf_state[attn + "k_proj.weight"],
            hf_state[attn + "v_proj.weight"],
            dims,
        )
        out[mg + "self_attention.linear_qkv.weight"] = _chunk(qkv, 0, rank)
        if dims.qkv_bias:
            qkv_bias = _group_qkv(
                hf_state[attn + "q_proj.bias"],
                hf_state[attn + "k_proj.bias"],
                hf_state[attn + "v_proj.bias"],
                dims,
            )
            out[mg + "self_attention.linear_qkv.bias"] = _chunk(qkv_bias, 0, rank)
        out[mg + "self_attention.linear_proj.weight"] = _chunk(
            hf_state[attn + "o_proj.weight"], 1, rank
        )
        out[mg + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        gate = _chunk(hf_state[hf + "mlp.gate_proj.weight"], 0, rank)
        up = _chunk(hf_state[hf + "mlp.up_proj.weight"], 0, rank)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[mg + "mlp.linear_fc2.weight"] = _chunk(hf_state[hf + "mlp.down_proj.weight"], 1, rank)
    if rank.is_last_stage:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
        if not dims.tied:
            lm_head = _pad_vocab(hf_state["lm_head.weight"], padded)
            out["output_layer.weight"] = _chunk(lm_head, 0, rank)
        elif not rank.is_first_stage:
            out["output_layer.weight"] = _chunk(embed, 0, rank)
    return {name: tensor.contiguous() for name, tensor in out.items()}


def hf_shards(mg_state: dict[str, Tensor], dims: Dims, rank: Rank) -> list[HFShard]:
    """This rank's megatron parameters as HF-named shards (each tensor owned once per TP rank).

    Fused tensors (qkv, fc1) are split into HF's q/k/v and gate/up (copies); the rest share
    storage with ``mg_state``. With tied embeddings the last stage's copy is not reported.
    """
    padded = dims.padded_vocab(rank.tp)
    h, d, ffn = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    shards: list[HFShard] = []

    def add(name: str, tensor: Tensor, tp_dim: int | None, full_shape: tuple[int, ...]) -> None:
        shards.append(HFShard(name, tensor, tp_dim, full_shape, rank.pp_rank))

    if rank.is_first_stage:
        add("model.embed_tokens.weight", mg_state["embedding.word_embeddings.weight"], 0, (padded, h))
    for local, layer in enumerate(rank.layers(dims)):
        hf = f"model.layers.{layer}."
        mg = f"decoder.layers.{local}."
        attn = hf + "self_attn."
        add(hf + "input_layernorm.weight", mg_state[mg + "input_layernorm.weight"], None, (h,))
        q, k, v = _ungroup_qkv(mg_state[mg + "self_attention.linear_qkv.weight"], dims, rank.tp)
        add(attn + "q_proj.weight", q, 0, (dims.num_heads * d, h))
        add(attn + "k_proj.weight", k, 0, (dims.num_kv_heads * d, h))
        add(attn + "v_proj.weight", v, 0, (dims.num_kv_heads * d, h))
        if dims.qkv_bias:
            qb, kb, vb = _ungroup_qkv(mg_state[mg + "self_attention.linear_qkv.bias"], dims, rank.tp)
            add(attn + "q_proj.bias", qb, 0, (dims.num_heads * d,))
            add(attn + "k_proj.bias", kb, 0, (dims.num_kv_heads * d,))
            add(attn + "v_proj.bias", vb, 0, (dims.num_kv_heads * d,))
        add(attn + "o_proj.weight", mg_state[mg + "self_attention.linear_proj.weight"], 1, (h, dims.num_heads * d))
        add(hf + "post_attention_layernorm.weight", mg_state[mg + "pre_mlp_layernorm.weight"], None, (h,))
        gate, up = mg_state[mg + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        add(hf + "mlp.gate_proj.weight", gate, 0, (ffn, h))
        add(hf + "mlp.up_proj.weight", up, 0, (ffn, h))
        add(hf + "mlp.down_proj.weight", mg_state[mg + "mlp.linear_fc2.weight"], 1, (h, ffn))
    if rank.is_last_stage:
        add("model.norm.weight", mg_state["decoder.final_layernorm.weight"], None, (h,))
        if not dims.tied:
            add("lm_head.weight", mg_state["output_layer.weight"], 0, (padded, h))
    return shards


def merge_shards(pieces: list[Tensor], tp_dim: int | None, name: str, dims: Dims) -> Tensor:
    """Full HF tensor from its TP pieces in rank order (vocab padding trimmed)."""
    full = pieces[0] if tp_dim is None else torch.cat(pieces, dim=tp_dim)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = full[: dims.vocab_size]
    return full.contiguous()
