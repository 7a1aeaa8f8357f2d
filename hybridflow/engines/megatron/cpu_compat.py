"""Every CPU workaround megatron-core 0.16.1 needs, in one place; active only without CUDA.

megatron-core assumes CUDA in a handful of spots that a CPU/gloo run reaches (measured):

- RoPE moves ``inv_freq`` to ``torch.cuda.current_device()`` on first use;
- the default causal mask is built with ``device="cuda"`` (the engine also passes its own mask);
- the global memory buffer used by attention allocates on ``torch.cuda.current_device()``;
- with tied embeddings and pipeline stages, building the model moves the last stage's copy of the
  embedding with ``weight.data.cuda()`` (a tensor method, not reachable through a module name):
  :func:`building_model` makes ``Tensor.cuda`` the identity while the model is built;
- pipeline schedules (token counter, p2p shape exchange), megatron DDP (grad buffers) and the
  optimizer (``found_inf``, grad-norm scratch) allocate on ``"cuda"``, call
  ``torch.cuda.synchronize()``, or assert ``param.type() == "torch.cuda.FloatTensor"``.

Instead of patching megatron's functions one by one, :func:`enable` rebinds the module-level
name ``torch`` inside exactly those megatron modules to :data:`CPU_TORCH`, a read-through proxy
of ``torch`` whose tensor factories map a CUDA device to the CPU and whose ``torch.cuda`` answers
``current_device() -> cpu``, ``synchronize() -> no-op``. Nothing outside those modules (and
nothing at all when CUDA is present) sees a difference. The engine's equivalence tests against
the HF model and a torch AdamW step are what prove the workaround harmless.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Iterator

import torch

# megatron-core modules that hard-code CUDA on a path a CPU training step reaches.
PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
)

_FACTORIES = frozenset(
    {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "as_tensor"}
)


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True  # a bare index means a CUDA device in torch's factory signatures
    return device is not None and torch.device(device).type == "cuda"


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as megatron sees it on a CPU-only machine."""

    FloatTensor = torch.FloatTensor
    HalfTensor = torch.HalfTensor
    BFloat16Tensor = torch.BFloat16Tensor

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None

    @staticmethod
    def is_available() -> bool:
        return False

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """Read-through proxy of ``torch`` with CUDA allocations redirected to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


CPU_TORCH = _CpuTorch()
_enabled = False


def needed() -> bool:
    """True when the workarounds apply (no CUDA device)."""
    return not torch.cuda.is_available()


def enable() -> bool:
    """Install the workarounds if CUDA is absent (idempotent). Returns whether they are active."""
    global _enabled
    if _enabled or not needed():
        return _enabled
    for module_name in PATCHED_MODULES:
        module = importlib.import_module(module_name)
        assert getattr(module, "torch", None) is torch, f"{module_name} no longer imports torch"
        module.torch = CPU_TORCH
    _enabled = True
    return True


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's mask convention: (1, 1, S, S) bool, True where attention is *not* allowed."""
    return torch.triu(
        torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1
    )[None, None]


@contextlib.contextmanager
def building_model() -> Iterator[None]:
    """While building a megatron model without CUDA, ``Tensor.cuda()`` returns the tensor."""
    if not needed():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original
