"""vLLM at generation TP 2 fed by the megatron resharder, on nccl over CUDA devices (issue 19).

The checks of ``tests/test_vllm_tp.py`` (the rank function is shared): megatron t = 2 (x p = 2 on
four devices) trains one model, vLLM at tg = 2 (external launcher over consecutive ranks) starts
from another and takes the first through ``ReshardedSync``; greedy tokens and log-probs equal
the HF model's (on the CPU), and the logged bytes are Table 2's plus the replicated norms.
Needs the CUDA ``vllm`` package and megatron-core; skipped cleanly without enough GPUs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_harness, test modules

pytest.importorskip("megatron.core")
pytest.importorskip("vllm")

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.mark.parametrize("pp", [1, 2], ids=["t2-tg2", "t2p2-tg2"])
def test_vllm_tp2_fed_by_megatron_resharder_nccl(pp):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 * pp:
        pytest.skip(f"needs {2 * pp} CUDA devices")
    from megatron_harness import spawn
    from test_vllm_tp import _megatron_rank

    spawn(_megatron_rank, 2 * pp, pp, "nccl", start_method="spawn")
