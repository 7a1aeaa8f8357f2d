"""LoRA adapters into vLLM: its accepted ranks, and the in-memory transport (no file)."""

from __future__ import annotations

from typing import Any


def add_adapter_from_tensors(worker: Any, version: int, tensors: dict, config: dict) -> None:
    """Inside the engine's worker: make adapter ``version`` from ``tensors`` (peft names) and
    ``config`` (peft's adapter_config) as vLLM's loader would from a directory, and add it to
    the worker's adapter manager, active."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        version, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    manager._adapter_manager.add_adapter(lora)
    manager._adapter_manager.activate_adapter(lora.id)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's ``max_lora_rank`` accepts that holds ``rank``."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM takes LoRA ranks up to 512, got {rank}")

