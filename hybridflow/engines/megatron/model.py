"""Build a megatron-core ``GPTModel`` (local layer spec) shaped like an HF Qwen2/Llama model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engines.megatron import cpu_compat
from hybridflow.engines.megatron.convert import Dims
from hybridflow.spec.layout import RankCoords


def rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config(hf_config, tp: int, pp: int, dtype: torch.dtype):
    """The ``TransformerConfig`` of ``hf_config`` (Qwen2/Llama: RMSNorm, SwiGLU, RoPE, GQA)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dims = Dims.from_hf(hf_config)
    return TransformerConfig(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu_compat.needed(),
        # True even though the HF weights overwrite it: on the CPU-initialisation path megatron
        # only marks TP-sharded params (tensor_model_parallel) while initialising them, and the
        # grad norm needs those marks.
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,  # the loss_fn already divides by the global token count
    )


def build_gpt_model(hf_config, coords: RankCoords, dtype: torch.dtype = torch.float32):
    """An uninitialised megatron ``GPTModel`` for this rank's pipeline stage.

    ``parallel_state`` must be initialised with ``coords.layout``'s tp x pp. The output layer
    keeps its vocabulary shard (``parallel_output=True``); the engine gathers logits itself.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    dims = Dims.from_hf(hf_config)
    dims.check(coords.layout.tp, coords.layout.pp)
    config = transformer_config(hf_config, coords.layout.tp, coords.layout.pp, dtype)
    with cpu_compat.building_model():
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=dims.padded_vocab(coords.layout.tp),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=coords.is_first_stage,
            post_process=coords.is_last_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=dims.tied,
            position_embedding_type="rope",
            rotary_base=rope_theta(hf_config),
        )
    if cpu_compat.needed():
        model = model.to("cpu")
    return model.to(dtype)


@torch.no_grad()
def load_megatron_state(model, state: dict[str, torch.Tensor]) -> None:
    """Copy converted weights into ``model``'s parameters; every parameter must be given."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    unknown = sorted(set(state) - set(params))
    if missing or unknown:
        raise KeyError(f"weight names do not match: missing {missing}, unexpected {unknown}")
    for name, param in params.items():
        if tuple(param.shape) != tuple(state[name].shape):
            raise ValueError(f"{name}: shape {tuple(state[name].shape)}, model has {tuple(param.shape)}")
        param.copy_(state[name])
