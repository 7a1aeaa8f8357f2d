"""One FSDP2 step on one device against the torch engine's step (a world of one rank).

``fully_shard`` over a group of one still runs FSDP2's all-gather and reduce-scatter paths and
its DTensor parameters, gradients and AdamW state; the torch engine beside it runs unwrapped.
The CUDA case (nccl, float32 with TF32 off) is what ``tests/gpu/device_check.sh`` runs; the CPU
case (gloo) checks the same function here. No Ray, no vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test_dp_equivalence

from test_dp_equivalence import EOS, PAD, _batch, _clip, _ppo_loss  # noqa: E402

VOCAB = 2048  # the chunked log-prob read-out, through a tied head


def step_pair(device: str, tmp_path: Path) -> tuple[dict, dict, float]:
    """(torch engine's metrics, FSDP2's, max abs weight difference) after one step each."""
    from hybridflow.engines.fsdp_engine import FSDP2TrainEngine
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.engines.torch_engine import TorchTrainEngine
    from hybridflow.spec.engines import FSDP2TrainSpec, TorchTrainSpec
    from hybridflow.spec.graph import ModelSource, OptimSpec

    def model():
        return build_causal_lm(ModelSource(config={"tie_word_embeddings": True}), VOCAB, PAD, EOS, 0).to(device)

    common = dict(micro_batch_size=3, optim=OptimSpec(lr=1e-3, grad_clip=_clip(VOCAB)))
    batch = _batch(VOCAB).to(device)
    # the torch engine first, before any process group: it runs unwrapped
    plain = TorchTrainEngine(model(), TorchTrainSpec(**common))
    plain_metrics = plain.train_step(batch, _ppo_loss, temperature=0.7)
    plain_weights = {k: v.clone() for k, v in plain.named_weights()}
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        fsdp = FSDP2TrainEngine(model(), FSDP2TrainSpec(engine="fsdp2", **common))
        assert all(type(p).__name__ == "DTensor" for p in fsdp.module.parameters())
        fsdp_metrics = fsdp.train_step(batch, _ppo_loss, temperature=0.7)
        fsdp_weights = dict(fsdp.named_weights())
        diff = max((plain_weights[k] - fsdp_weights[k]).abs().max().item() for k in plain_weights)
    finally:
        dist.destroy_process_group()
    return plain_metrics, fsdp_metrics, diff


def _check(device: str, tmp_path: Path, tolerance: float) -> None:
    plain, fsdp, diff = step_pair(device, tmp_path)
    for key in ("loss", "grad_norm", "clip_frac"):
        assert fsdp[key] == pytest.approx(plain[key], rel=tolerance, abs=tolerance), key
    assert diff < tolerance, f"FSDP2 vs torch engine on {device}: max abs weight diff {diff:.3g}"
    print(f"fsdp2 step on {device}: loss {fsdp['loss']:.6f} grad_norm {fsdp['grad_norm']:.6f} "
          f"max weight diff {diff:.2g}")


def test_fsdp2_step_equals_torch_step_on_cpu_gloo(tmp_path):
    _check("cpu", tmp_path, 1e-6)


@pytest.mark.gpu
def test_fsdp2_step_equals_torch_step_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _check("cuda", tmp_path, 1e-5)
