"""Build the transformers models the engines hold: a tiny Qwen2 from a config, or a local HF dir.

Config-built models are initialised under ``seed`` inside a forked RNG, so every rank builds
bitwise-identical weights and the caller's RNG stream is untouched. Attention is ``sdpa``:
deterministic on CPU, and its KV-cached decode matches the full forward to ~1e-7 in float32.
"""

from __future__ import annotations

import torch

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    GenerationConfig,
    PreTrainedModel,
    Qwen2Config,
)

from hybridflow.spec.graph import ModelSource

# Overridden key by key by ModelSource.config.
TINY_QWEN2: dict = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,  # head size 32: the smallest vLLM's CPU attention kernel takes
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    attention_dropout=0.0,
)

ATTN_IMPLEMENTATION = "sdpa"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "GenerationConfig",
    "TINY_QWEN2",
    "build_causal_lm",
    "build_value_model",
    "tiny_qwen2_config",
]


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def tiny_qwen2_config(
    overrides: dict, vocab_size: int, pad_id: int, eos_id: int, **extra
) -> Qwen2Config:
    """``TINY_QWEN2 | overrides`` with the tokenizer's vocabulary and special ids (these win)."""
    tokenizer_fields = dict(
        vocab_size=vocab_size, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None
    )
    return Qwen2Config(**(TINY_QWEN2 | overrides | tokenizer_fields | extra))


def _build(
    auto_cls,
    source: ModelSource,
    config_kwargs: dict,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
    seed: int,
    dtype: str | torch.dtype,
) -> PreTrainedModel:
    torch_dtype = _torch_dtype(dtype)
    with torch.random.fork_rng(devices=[]):
        # A path model's freshly added head (value models) is seeded too.
        torch.manual_seed(seed)
        if source.config is not None:
            config = tiny_qwen2_config(source.config, vocab_size, pad_id, eos_id, **config_kwargs)
            model = auto_cls.from_config(
                config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch_dtype
            )
        elif source.path is not None:
            config = AutoConfig.from_pretrained(source.path, local_files_only=True)
            for key, value in config_kwargs.items():
                setattr(config, key, value)
            model = auto_cls.from_pretrained(
                source.path,
                config=config,
                local_files_only=True,
                attn_implementation=ATTN_IMPLEMENTATION,
                dtype=torch_dtype,
            )
            if model.config.vocab_size < vocab_size:
                raise ValueError(
                    f"model at {source.path} has vocab_size {model.config.vocab_size}, "
                    f"smaller than the tokenizer's {vocab_size}"
                )
        else:
            raise ValueError("a rule source is not a neural model; it has nothing to build")
    return model.to(torch_dtype)


def build_causal_lm(
    source: ModelSource,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
    seed: int,
    dtype: str | torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A causal LM (policy / reference): a tiny Qwen2 from ``source.config`` or a local HF dir.

    For a path source ``vocab_size`` only checks the model is large enough; the model keeps its
    own config (pad/eos ids included).
    """
    return _build(AutoModelForCausalLM, source, {}, vocab_size, pad_id, eos_id, seed, dtype)


def build_value_model(
    source: ModelSource,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
    seed: int,
    dtype: str | torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A critic / reward model: the same backbone with a scalar head per token (num_labels=1).

    From a path, the head is new (seeded); from a config, everything is.
    """
    head = {"num_labels": 1, "classifier_dropout": 0.0}
    return _build(
        AutoModelForTokenClassification, source, head, vocab_size, pad_id, eos_id, seed, dtype
    )
