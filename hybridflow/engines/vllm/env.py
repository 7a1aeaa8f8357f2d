"""vLLM's import and environment: in-process engine core, the CPU kernel's limits, log-prob modes.

vLLM is imported only when an engine is built (``import_vllm``): validating a graph never loads
it. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the import so the engine core lives in
this process, next to the train engine.
"""

from __future__ import annotations

import os
from typing import Any

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# vLLM's KV-cache block on CPU (vllm.platforms.cpu, 0.32): its prefix cache reuses whole blocks.
CPU_KV_BLOCK = 128

# In-process engine core, no CPU thread pinning of our process (defaults; the environment wins).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # Per-request INFO lines and a harmless start-up traceback (no chat template) otherwise.
    "VLLM_LOGGING_LEVEL": "ERROR",
}


def import_vllm():
    """``import vllm`` with the in-process settings; returns the module."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError(
            "VLLM_ENABLE_V1_MULTIPROCESSING must be 0: the vLLM rollout engine runs in-process"
        )
    import vllm

    return vllm


def check_head_size(model_dir: str, on_cpu: bool) -> None:
    """Raise a ValueError a user can act on when the CPU kernel cannot run this model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    head_size = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    if on_cpu and head_size not in CPU_HEAD_SIZES:
        raise ValueError(
            f"rollout.engine=vllm on CPU needs an attention head size in {list(CPU_HEAD_SIZES)}; "
            f"this model has {head_size} (hidden_size {config.hidden_size} / "
            f"num_attention_heads {config.num_attention_heads}): change the model's "
            "source.config (e.g. num_attention_heads) or use rollout.engine=hf"
        )


def kv_cache_bytes_for(config: Any, num_sequences: int, max_model_len: int, floor: int = 64 << 20) -> int:
    """KV-cache bytes (float32) that hold ``num_sequences`` sequences of ``max_model_len``
    tokens at once, so one generate call of that many samples runs as one batch; at least
    ``floor``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * 4
    return max(floor, num_sequences * max_model_len * per_token)


def vllm_logprobs_mode(temperature: float) -> str:
    """The vLLM ``logprobs_mode`` whose sampled-token log-prob is ``log_softmax(logits / T)``
    over the whole vocabulary (see the module docstring for the one case it cannot be)."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def sampled_log_probs(completion: Any) -> list[float]:
    """The log-prob of each sampled token of a vLLM ``CompletionOutput`` asked for ``logprobs=0``
    with ``flat_logprobs``: one entry per position, in a flat list (no dict per token)."""
    flat = completion.logprobs.logprobs
    if len(flat) != len(completion.token_ids):
        raise RuntimeError(f"vLLM gave {len(flat)} log-probs for {len(completion.token_ids)} sampled tokens")
    return flat


def recorded_prompts(log_prob_samples: int | None, n: int, num_prompts: int) -> int:
    """How many prompts, the first ones, get their samples' log-probs recorded: enough whole
    groups of ``n`` for ``log_prob_samples`` samples (``None``: every prompt)."""
    if log_prob_samples is None:
        return num_prompts
    return min(num_prompts, -(-log_prob_samples // n))

