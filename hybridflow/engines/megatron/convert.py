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
- The vocabulary is padded to a multiple of lcm(``t``, 64) (zero rows; logits beyond the HF
  vocab are dropped by the engine): vLLM's padding, so generation shards fit its partitions. Norms are replicated on every TP rank.
- Layers are split evenly over pipeline stages; a stage numbers its layers from 0. With tied
  embeddings and ``p > 1`` the last stage holds its own copy of the embedding as
  ``output_layer.weight`` (megatron all-reduces its gradient with the first stage's).

The seam to the resharder is the *resharding layout* (:func:`shard_specs`): one ``ShardSpec`` per
tensor under HF names, in which every TP rank's megatron parameter is a contiguous chunk (or two
adjacent ones) of a full tensor, so the engine keeps its parameters as views of one flat
training shard:

- ``model.layers.N.self_attn.qkv_proj.weight`` / ``.bias``: HF's q, k, v grouped per query group
  (megatron's order); chunk ``r`` of ``t`` along dim 0 is rank ``r``'s ``linear_qkv``, and chunk
  ``g`` of ``tg`` is what a ``tg``-way model needs. :func:`to_hf` splits it back into q, k, v.
- ``mlp.gate_proj.weight`` then ``mlp.up_proj.weight``: adjacent slots whose two chunks together
  are rank ``r``'s ``linear_fc1`` (``[gate_r; up_r]``).
- Vocabulary tensors padded (``Dims.padded_vocab``); everything else as in HF.
- With tied embeddings, HF's ``lm_head.weight`` is not listed, nor is the last stage's
  ``output_layer.weight`` copy at ``p > 1`` (the engine keeps that one outside the buffer).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridflow.engines.shards import ShardSpec, TrainShardBuffer
from hybridflow.spec.layout import ParallelLayout, RankCoords


VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (0.32)


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

    def layers_of(self, coords: RankCoords) -> range:
        """Global indices of the layers of ``coords``' pipeline stage (split evenly)."""
        per_stage = self.num_layers // coords.layout.pp
        return range(coords.pp_rank * per_stage, (coords.pp_rank + 1) * per_stage)

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded to a multiple of lcm(tp, 64): vLLM's own padding (64) when
        tp divides 64, so a generation shard's vocabulary rows are exactly a tg-way vLLM
        partition's (``engines/vllm/``; megatron's own default pads to 128 * tp)."""
        multiple = math.lcm(tp, VLLM_VOCAB_PADDING)
        return -(-self.vocab_size // multiple) * multiple

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


def _chunk(tensor: Tensor, dim: int, coords: RankCoords) -> Tensor:
    return tensor.chunk(coords.layout.tp, dim=dim)[coords.tp_rank]


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


def hf_to_megatron(hf_state: dict[str, Tensor], dims: Dims, coords: RankCoords) -> dict[str, Tensor]:
    """This rank's megatron ``GPTModel`` parameters (its stage's names) from a full HF state."""
    out: dict[str, Tensor] = {}
    padded = dims.padded_vocab(coords.layout.tp)
    embed = _pad_vocab(hf_state["model.embed_tokens.weight"], padded)
    if coords.is_first_stage:
        out["embedding.word_embeddings.weight"] = _chunk(embed, 0, coords)
    for local, layer in enumerate(dims.layers_of(coords)):
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
        out[mg + "self_attention.linear_qkv.weight"] = _chunk(qkv, 0, coords)
        if dims.qkv_bias:
            qkv_bias = _group_qkv(
                hf_state[attn + "q_proj.bias"],
                hf_state[attn + "k_proj.bias"],
                hf_state[attn + "v_proj.bias"],
                dims,
            )
            out[mg + "self_attention.linear_qkv.bias"] = _chunk(qkv_bias, 0, coords)
        out[mg + "self_attention.linear_proj.weight"] = _chunk(
            hf_state[attn + "o_proj.weight"], 1, coords
        )
        out[mg + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        gate = _chunk(hf_state[hf + "mlp.gate_proj.weight"], 0, coords)
        up = _chunk(hf_state[hf + "mlp.up_proj.weight"], 0, coords)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[mg + "mlp.linear_fc2.weight"] = _chunk(hf_state[hf + "mlp.down_proj.weight"], 1, coords)
    if coords.is_last_stage:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
        if not dims.tied:
            lm_head = _pad_vocab(hf_state["lm_head.weight"], padded)
            out["output_layer.weight"] = _chunk(lm_head, 0, coords)
        elif not coords.is_first_stage:
            out["output_layer.weight"] = _chunk(embed, 0, coords)
    return {name: tensor.contiguous() for name, tensor in out.items()}



# -- the resharding layout ---------------------------------------------------------------------

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
QKV = "self_attn.qkv_proj"


@dataclass(frozen=True)
class _Entry:
    """One tensor of the resharding layout and the megatron parameter it is (part of)."""

    spec: ShardSpec
    megatron: str
    part: int = 0  # which of ``parts`` equal dim-0 blocks of the megatron parameter
    parts: int = 1


def _stage_entries(dims: Dims, coords: RankCoords) -> list[_Entry]:
    """The tensors of ``coords``' stage, in buffer order (``coords.tp_rank`` does not matter)."""
    padded = dims.padded_vocab(coords.layout.tp)
    h, d, ffn = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    qkv_rows = dims.num_kv_heads * (dims.heads_per_group + 2) * d
    entries: list[_Entry] = []

    def add(name, megatron, tp_dim, shape, part=0, parts=1):
        entries.append(_Entry(ShardSpec(name, shape, tp_dim, coords.pp_rank), megatron, part, parts))

    if coords.is_first_stage:
        add("model.embed_tokens.weight", "embedding.word_embeddings.weight", 0, (padded, h))
    for local, layer in enumerate(dims.layers_of(coords)):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
        add(hf + "input_layernorm.weight", mg + "input_layernorm.weight", None, (h,))
        add(f"{hf}{QKV}.weight", mg + "self_attention.linear_qkv.weight", 0, (qkv_rows, h))
        if dims.qkv_bias:
            add(f"{hf}{QKV}.bias", mg + "self_attention.linear_qkv.bias", 0, (qkv_rows,))
        add(hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight", 1, (h, dims.num_heads * d))
        add(hf + "post_attention_layernorm.weight", mg + "pre_mlp_layernorm.weight", None, (h,))
        add(hf + "mlp.gate_proj.weight", mg + "mlp.linear_fc1.weight", 0, (ffn, h), 0, 2)
        add(hf + "mlp.up_proj.weight", mg + "mlp.linear_fc1.weight", 0, (ffn, h), 1, 2)
        add(hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight", 1, (h, ffn))
    if coords.is_last_stage:
        add("model.norm.weight", "decoder.final_layernorm.weight", None, (h,))
        if not dims.tied:
            add("lm_head.weight", "output_layer.weight", 0, (padded, h))
    return entries


def shard_specs(dims: Dims, tp: int, pp: int) -> list[ShardSpec]:
    """The resharding layout of the whole model under ``tp`` x ``pp``, stage after stage."""
    return [e.spec for stage in range(pp) for e in _stage_entries(dims, RankCoords(ParallelLayout(tp=tp, pp=pp), pp_rank=stage))]


def megatron_views(buffer: TrainShardBuffer, dims: Dims, coords: RankCoords) -> dict[str, Tensor]:
    """Megatron parameter name -> its view of ``buffer`` (this rank's flat training shard)."""
    by_param: dict[str, list[_Entry]] = {}
    for entry in _stage_entries(dims, coords):
        by_param.setdefault(entry.megatron, []).append(entry)
    views = {}
    for name, entries in by_param.items():
        shapes = [e.spec.shard_shape(coords.layout.tp) for e in entries]
        shape = (sum(s[0] for s in shapes), *shapes[0][1:])
        views[name] = buffer.span([e.spec.name for e in entries], shape)
    return views


def resharding_named(mg_state: Mapping[str, Tensor], dims: Dims, coords: RankCoords) -> dict[str, Tensor]:
    """This rank's megatron tensors (weights, or anything shaped like them, e.g. gradients) under
    the resharding layout's names: views, fused ``linear_fc1`` split into gate and up."""
    out = {}
    for e in _stage_entries(dims, coords):
        tensor = mg_state[e.megatron]
        rows = tensor.shape[0] // e.parts
        # narrow, not chunk: a view of a multi-output op may not be written in place later
        # (a checkpoint loads into these views)
        out[e.spec.name] = tensor.narrow(0, e.part * rows, rows)
    return out


def resharding_full(hf_state: Mapping[str, Tensor], dims: Dims, tp: int) -> dict[str, Tensor]:
    """Full HF weights in the resharding layout (qkv grouped, vocabulary padded to ``tp``): the
    tensors the layout's specs slice (the oracle of the resharding tests)."""
    out = {}
    for spec in shard_specs(dims, tp, 1):
        name = spec.name
        if name.endswith((f"{QKV}.weight", f"{QKV}.bias")):
            prefix, kind = name.rsplit(f"{QKV}.", 1)
            q, k, v = (hf_state[f"{prefix}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[name] = _group_qkv(q, k, v, dims)
        elif name in VOCAB_TENSORS:
            out[name] = _pad_vocab(hf_state[name], spec.full_shape[0])
        else:
            out[name] = hf_state[name]
    return out


def to_hf(named: Iterable[tuple[str, Tensor]], dims: Dims, tp: int, trim_vocab: bool) -> Iterator[tuple[str, Tensor]]:
    """Resharding-layout tensors, each chunk ``r`` of ``tp`` of its full tensor (``tp`` = 1: the
    full tensors), -> HF-named ones: qkv split into q, k, v (copies); with ``trim_vocab`` the
    vocabulary padding dropped (a view). Lazy, one tensor at a time."""
    for name, tensor in named:
        if name.endswith((f"{QKV}.weight", f"{QKV}.bias")):
            prefix, kind = name.rsplit(f"{QKV}.", 1)
            for p, part in zip("qkv", _ungroup_qkv(tensor, dims, tp)):
                yield f"{prefix}self_attn.{p}_proj.{kind}", part
        elif trim_vocab and name in VOCAB_TENSORS:
            yield name, tensor[: dims.vocab_size]
        else:
            yield name, tensor
