"""Reading checkpoints in tests: a model's torch.distributed.checkpoint as full tensors.

Not a test module (imported by name by the checkpoint and resume tests).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def saved_state(checkpoint: Path, model: str = "actor") -> dict:
    """Every entry of ``checkpoint``'s state of ``model``, tensors whole (one process)."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(Path(checkpoint) / "models" / model, Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", weights_only=False)


def saved_weights(checkpoint: Path, model: str = "actor") -> dict[str, torch.Tensor]:
    """The weights of ``model`` in ``checkpoint`` (torch engine: HF names)."""
    return saved_state(checkpoint, model)["model"]
