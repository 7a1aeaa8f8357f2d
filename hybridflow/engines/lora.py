"""LoRA on the actor (``train.lora``): peft adapters on the torch engine's module.

- :func:`add_lora` injects the adapters into the module in place; the base weights are frozen,
  so AdamW holds state for the adapters only.
- :class:`BaseModelEngine` serves a reference model of the actor's source from the actor's own
  module with its adapters disabled: the reference policy is the base model, and no second copy
  of its weights is held.
- :func:`base_named_weights` gives the frozen base under plain HF names (what a rollout engine
  with its own copy of the weights starts from); afterwards only the adapters move
  (``RolloutEngine.load_adapter``), or, with ``rollout.lora_sync: merged``, the weights with
  the adapters merged in (:func:`merged_named_weights`, through ``load_weights``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from hybridflow.engines.base import LossFn, TrainEngine
from hybridflow.spec.graph import LoraSpec

def _base_name(name: str) -> str | None:
    """The HF name of a parameter of a peft-wrapped module (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``), or None for an adapter's own tensor (``lora_A``, ``lora_B``, ...)."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


SCALAR_HEAD = "score"  # the head of a *ForTokenClassification value model


def add_lora(model: nn.Module, lora: LoraSpec, seed: int = 0):
    """Inject PEFT LoRA adapters into ``model`` (in place) and return the ``PeftModel``: only
    the adapters require grad afterwards. peft initialises B = 0, so the adapted model starts
    equal to the base, and A at random: drawn here from ``seed`` (the global RNG is left as it
    was), so that every rank and every run starts from the same adapters."""
    from peft import LoraConfig, get_peft_model

    target, task, extra = lora.target_modules, "CAUSAL_LM", {}
    if type(model).__name__.endswith("ForTokenClassification"):  # a reward/cost model's value head
        # The new head trains whole (modules_to_save); adapters go on the backbone only, which
        # "all-linear" would not ensure: peft leaves out a causal LM's output layer, not this one.
        head = SCALAR_HEAD
        task, extra = "TOKEN_CLS", {"modules_to_save": [head]}
        if target == "all-linear":
            target = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                             if isinstance(m, nn.Linear) and not name.startswith(head)})
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target,
        task_type=task,
        **extra,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def base_named_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s base weights under their HF names (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``), adapters left out; tied weights once. Works on a module without
    adapters too (the names are then its own)."""
    for name, param in module.named_parameters():
        if (base := _base_name(name)) is not None:
            yield base, param.detach()


def merged_named_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s weights with its LoRA adapters merged in, under plain HF names: each adapted
    layer's ``W + scaling * B @ A`` (peft's ``get_delta_weight``), computed one layer at a time
    and handed over as a fresh tensor; every other weight as it is (shared storage)."""
    from peft.tuners.lora import LoraLayer

    adapted = {
        f"{name}.base_layer.weight": layer
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer) and layer.active_adapters and not layer.merged
    }
    for name, param in module.named_parameters():
        if (base := _base_name(name)) is None:
            continue
        weight = param.detach()
        if (layer := adapted.get(name)) is not None:
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    weight = weight + layer.get_delta_weight(adapter)
        yield base, weight


class BaseModelEngine(TrainEngine):
    """A reference model served by a LoRA actor's engine with the adapters disabled.

    It trains nothing and holds nothing: forwards run the actor's module (its micro-batch size,
    dtype and packing) inside ``adapters_disabled()``; memory moves with the actor's engine.
    """

    def __init__(self, actor: TrainEngine) -> None:
        self.actor = actor

    @classmethod
    def build(cls, module, spec, *, kind, total_steps, seed):  # pragma: no cover - never built from a spec
        raise TypeError("a BaseModelEngine is made from the actor's engine, not built")

    def forward(self, batch: TensorDict, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        with self.actor.adapters_disabled():
            return self.actor.forward(batch, temperature)

    def train_step(self, batch: TensorDict, loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        raise TypeError("the reference served by the LoRA actor's base weights is not trained")

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return base_named_weights(self.actor.module)

    def save_hf(self, path: str) -> None:
        raise TypeError("the reference is the actor's base model: save the base's source instead")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def offload(self) -> int:
        return 0  # the actor's weights: they move when the actor's engine moves

    def reload(self) -> int:
        return self.actor.reload()  # activating the reference makes the actor's module resident

    @property
    def dp_group(self):
        return self.actor.dp_group
