"""The megatron engine's CPU equivalence checks, rerun on nccl over CUDA devices.

Same checks as ``tests/test_megatron_engine.py`` (the check functions are shared), with CUDA
parameters, megatron's own CUDA paths (``cpu_compat`` inactive) and nccl process groups; the HF
reference stays on the CPU. Skipped cleanly without enough GPUs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_harness, test modules

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices")


@pytest.mark.parametrize(
    "tp,pp,tied", [(1, 1, True), (2, 1, True), (1, 2, True), (2, 2, False)], ids=["tp1", "tp2", "pp2", "tp2pp2"]
)
def test_hf_equivalence_nccl(tp, pp, tied):
    _need_gpus(tp * pp)
    from megatron_harness import spawn
    from test_megatron_engine import _check_equivalence

    spawn(_check_equivalence, tp * pp, tp, pp, tied, "nccl", start_method="spawn")


@pytest.mark.parametrize(
    "tp,pp,dp,grad_clip",
    [(1, 1, 1, 0.05), (2, 1, 1, 1.0), (2, 1, 2, 0.05), (2, 2, 1, 1.0)],
    ids=["tp1-clipped", "tp2", "tp2dp2-clipped", "tp2pp2"],
)
def test_train_step_nccl(tp, pp, dp, grad_clip):
    _need_gpus(tp * pp * dp)
    from megatron_harness import spawn
    from test_megatron_engine import _check_train_steps

    spawn(_check_train_steps, tp * pp * dp, tp, pp, dp, grad_clip, "nccl", start_method="spawn")


def test_checkpoint_across_layouts_nccl(tmp_path):
    """tp=2 -> tp=1 -> tp=2 -> pp=2 with CUDA tensors, nccl groups and megatron's GPU optimizer."""
    _need_gpus(2)
    from test_resume_layouts import checkpoints_across_layouts

    checkpoints_across_layouts(tmp_path, "nccl")
