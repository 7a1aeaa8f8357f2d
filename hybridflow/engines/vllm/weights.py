"""Weights into and out of a running vLLM engine, and the CPU workarounds that loading needs.

A plain ``model.load_weights`` after start does not work on CPU: start-up repacks linear
weights into kernel format and leaves the original parameters empty. A load therefore goes
through the worker's ``reload_weights`` (or, on CPU at tg = 1, ``load_in_place``), followed by
two steps that silently leave old weights when skipped: a tied ``lm_head`` is re-tied to the
fresh embedding and re-packed (``retie_and_repack``), and the prefix cache is reset. The
functions taking ``worker`` run inside vLLM's worker (``collective_rpc``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hybridflow.engines.lora import base_named_weights


def retie_and_repack(worker: Any) -> int:
    """Runs inside vLLM's worker: re-tie a tied lm_head to the embedding and re-pack it.

    Returns 1 when a tied head was re-packed, 0 otherwise.
    """
    model = worker.model_runner.get_model()
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return 0
    lm_head = model.lm_head
    lm_head.weight = model.model.embed_tokens.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return 1


def _in_place_targets(model: nn.Module, tied: bool) -> tuple[dict[str, list[str]], set[str]]:
    """What an in-place load fills: each vLLM parameter -> the HF names of the tensors that make
    it, in order. A linear layer vLLM packed at start (``cpu_linear``) takes its weight, and its
    bias if any, from its parts (``packed_modules_mapping``: q/k/v, gate/up); every other
    parameter the HF tensor of its own name; a ``tied`` ``lm_head`` none (``retie_and_repack``
    redoes it). Also returns the packed layers' weight names (they are re-packed, not copied)."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    targets: dict[str, list[str]] = {}
    linears: set[str] = set()
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear") or isinstance(module, _vocab_embedding_class()):
            continue
        linears.add(name)
        base, _, leaf = name.rpartition(".")
        parts = [f"{base}.{part}" if base else part for part in packed.get(leaf, [leaf])]
        targets[f"{name}.weight"] = [f"{part}.weight" for part in parts]
        if getattr(module, "bias", None) is not None:
            targets[f"{name}.bias"] = [f"{part}.bias" for part in parts]
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner not in linears and not (tied and owner == "lm_head"):
            targets[name] = [name]
    return targets, {f"{name}.weight" for name in linears}


def _vocab_embedding_class() -> type:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return VocabParallelEmbedding


def load_in_place(worker: Any, weights: Iterator[tuple[str, torch.Tensor]], names: set[str]) -> bool:
    """Runs inside vLLM's worker (CPU, tp 1, no LoRA): load ``weights`` (HF names) into the live
    model without vLLM's layer-wise reload. Each vLLM parameter is written once all its parts
    have arrived: a packed linear layer's weight is rebuilt and re-packed by vLLM's own CPU
    dispatch (what start-up did); every other parameter is copied in place (an embedding's
    first rows: vLLM pads the vocabulary), an untied ``lm_head`` then re-packed. Returns False,
    without touching ``weights``, when the model's parameters do not map onto ``names`` (the
    checkpoint's) one to one; the caller then reloads."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    targets, repacked = _in_place_targets(model, tied)
    part_of = {part: (target, i) for target, parts in targets.items() for i, part in enumerate(parts)}
    if set(part_of) != names or len(part_of) != sum(len(parts) for parts in targets.values()):
        return False
    modules = dict(model.named_modules())
    live = dict(model.named_parameters())
    # The logits' weights are packed like a linear layer's; the input embedding's packed copy
    # is never used. A tied head is re-tied and re-packed after the load (retie_and_repack).
    head = getattr(model, "lm_head", None)
    pending: dict[str, dict[int, torch.Tensor]] = {}  # vLLM parameter -> its parts so far
    with torch.no_grad():
        for name, tensor in weights:
            if name not in part_of:
                if tied and name.startswith("lm_head."):  # a tied head's copy: re-tied below
                    continue
                raise ValueError(f"vLLM in-place load: no target for {name!r}")
            target, index = part_of[name]
            pending.setdefault(target, {})[index] = tensor
            if len(pending[target]) < len(targets[target]):
                continue
            parts = pending.pop(target)
            owner = modules[target.rpartition(".")[0]]
            if target in repacked:
                # A new tensor (cat copies), in the dtype the emptied parameter start-up left keeps.
                weight = torch.cat([parts[i] for i in range(len(parts))]).to(owner.weight.dtype)
                owner.weight = nn.Parameter(weight, requires_grad=False)
                dispatch_cpu_unquantized_gemm(owner, remove_weight=True)
                continue
            value = torch.cat([parts[i] for i in range(len(parts))]) if len(parts) > 1 else parts[0]
            param = live[target]
            (param[: value.shape[0]] if param.shape != value.shape else param).copy_(value)
            if owner is head:  # an untied head's packed copy
                head.quant_method.process_weights_after_loading(head)
    if pending:
        raise ValueError(f"vLLM in-place load: parameters given in part: {sorted(pending)}")
    return True



def weight_bytes_of(worker: Any) -> int:
    """Runs inside vLLM's worker: bytes of its weights, from their shapes (on CPU the linear
    weights live in oneDNN buffers their parameters no longer show), a tied head once."""
    model = worker.model_runner.get_model()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    total = 0
    for name, layer in model.named_modules():
        if tied and name == "lm_head":
            continue
        meta, _ = _restore_metadata(layer)  # shapes before repacking; a live one where absent
        params = {**dict(layer.named_parameters(recurse=False)), **meta}
        total += sum(t.numel() * t.element_size() for t in params.values())
    return total


def _restore_metadata(layer: nn.Module):
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(layer).restore_metadata



def checkpoint_names(model_dir: str) -> set[str]:
    """The tensor names of the safetensors files an engine starts from (HF names)."""
    import glob

    from safetensors import safe_open

    names: set[str] = set()
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def save_for_vllm(module: nn.Module, tokenizer: Any, model_dir: str) -> str:
    """Write ``module`` (config + safetensors) and ``tokenizer`` to ``model_dir`` for the engine.

    Not ``module.save_pretrained``: under an initialised torch.distributed it writes on global
    rank 0 only, and every rank starts its own engine. Tied parameters are written once (the HF
    layout: ``lm_head.weight`` is absent when ``tie_word_embeddings``).
    """
    from safetensors.torch import save_file

    os.makedirs(model_dir, exist_ok=True)
    module.config.save_pretrained(model_dir)
    tensors = {  # a LoRA actor's base weights (its adapters come through load_adapter)
        name: param.to("cpu").contiguous().clone()
        for name, param in base_named_weights(module)  # remove_duplicate: tied weights once
    }
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
    return model_dir

