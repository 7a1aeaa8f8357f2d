"""Regional ``torch.compile`` of a training model (``train.compile``).

The repeated decoder layer, the class a transformers model names in ``_no_split_modules``, is
compiled once and the compiled code serves every layer: torch.compile lifts a module's
parameters as graph inputs, so layers differ only in their inputs and the number of
compilations does not grow with depth (tested). Inductor fuses the work between the matrix
products (RMSNorm, SwiGLU, the rotary embedding, residual adds) in the forward and the backward.

The compiled forwards are switched on only inside ``active()``: a transformers rollout that
generates with the same module (``HFRolloutEngine``) changes its input shapes every decoding
step and passes a KV-cache object, which would recompile; it runs the plain layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["CompiledLayers", "decoder_layers"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose class a transformers model lists in ``_no_split_modules``
    (its decoder layers), in order."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [module for module in model.modules() if type(module).__name__ in names]


class CompiledLayers:
    """``torch.compile``'d forwards of ``model``'s decoder layers, used inside ``active()``.

    ``dynamic=None`` (torch's default): the first shapes compile static, and each input
    dimension seen changing for the first time recompiles once with it symbolic. With learned
    lengths that is a few recompilations over the first iterations; ``dynamic=True`` from the
    start compiled once but kept little of the speed-up (benchmarks/RESULTS.md).
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = decoder_layers(model)
        if not self.layers:
            raise ValueError(
                f"train.compile: {type(model).__name__} names no decoder layer class in "
                "_no_split_modules, so there is no repeated block to compile"
            )
        self._forwards = [torch.compile(layer.forward) for layer in self.layers]
        self._active = False

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside, the layers run compiled (re-entering keeps them so until the outer exit)."""
        if self._active:
            yield
            return
        for layer, forward in zip(self.layers, self._forwards):
            layer.forward = forward  # an instance attribute: shadows the class's forward
        self._active = True
        try:
            yield
        finally:
            self._active = False
            for layer in self.layers:
                del layer.forward
