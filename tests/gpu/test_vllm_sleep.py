"""vLLM's sleep mode under colocation, on one CUDA GPU: an op that does not generate puts the
rollout engine to sleep (level 1: weights to CPU memory, KV cache freed), the next generation
wakes it, and it generates as before. Skipped without the CUDA ``vllm`` package."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test modules

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore")]


def test_colocation_puts_vllm_to_sleep_and_wakes_it():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("vllm")
    from tensordict import TensorDict

    from hybridflow.data import keys as K
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.engines.vllm import VLLMRolloutEngine, save_for_vllm
    from hybridflow.spec.graph import ModelSource
    from hybridflow.workers.colocation import Colocation

    module = build_causal_lm(ModelSource(config={"vocab_size": 256}), 256, pad_id=0, eos_id=1, seed=0)
    engine = VLLMRolloutEngine(
        save_for_vllm(module, None, tempfile.mkdtemp(prefix="vllm-sleep-")), eos_id=1, pad_id=0,
        max_model_len=64, seed=0, gpu_memory_utilization=0.2,
    )
    ids = torch.randint(2, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    prompts = TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: torch.ones_like(ids), K.UID: torch.arange(4)}, batch_size=[4])
    params = SamplingParams(max_new_tokens=8, greedy=True)
    before = engine.generate(prompts, params)[K.RESPONSES]

    colocation = Colocation({}, {"actor": engine})
    awake_free = torch.cuda.mem_get_info()[0]
    assert colocation.activate("actor", generates=False) == {"rollout_offloads": 1, "rollout_reloads": 0}
    assert engine.asleep
    freed = torch.cuda.mem_get_info()[0] - awake_free
    assert freed > 0, "sleep(level=1) freed no device memory"
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.generate(prompts, params)
    assert colocation.activate("actor", generates=True) == {"rollout_offloads": 0, "rollout_reloads": 1}
    assert not engine.asleep
    assert torch.equal(engine.generate(prompts, params)[K.RESPONSES], before)
    print(f"vLLM sleep level 1 freed {freed / 2**20:.0f} MiB")
