"""The vLLM rollout engine, by job: ``env`` (import and environment), ``weights`` (loading into a
running engine and its CPU workarounds), ``tp`` (generation TP through the external launcher),
``lora`` (adapter transport) and ``engine`` (the engine, with partial rollouts and sleep mode).
Importing this package does not import vLLM."""

from hybridflow.engines.vllm.engine import VLLMRolloutEngine, standalone
from hybridflow.engines.vllm.env import CPU_KV_BLOCK, import_vllm, vllm_logprobs_mode
from hybridflow.engines.vllm.tp import check_tp_group, load_vocab_rows
from hybridflow.engines.vllm.weights import save_for_vllm

__all__ = [
    "CPU_KV_BLOCK", "VLLMRolloutEngine", "check_tp_group", "import_vllm", "load_vocab_rows",
    "save_for_vllm", "standalone", "vllm_logprobs_mode",
]
