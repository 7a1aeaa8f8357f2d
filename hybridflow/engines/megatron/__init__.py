"""megatron-core train engine and HF <-> megatron weight conversion.

megatron-core (``pip install -e '.[megatron]'``) is imported when an engine or model is built,
not when this package is; the worker imports the package only for ``train.engine: megatron``.

- ``convert``: HF Qwen2/Llama <-> megatron ``GPTModel`` weights, and HF-named shards with their
  layout (the resharder's input);
- ``model``: ``TransformerConfig`` and ``GPTModel`` (local layer spec) from an HF config;
- ``engine``: ``MegatronTrainEngine``, the ``TrainEngine`` over megatron's schedules, DDP and
  optimizer;
- ``cpu_compat``: every CPU workaround, active only without CUDA.
"""

from hybridflow.engines.megatron.convert import Dims, HFShard, Rank, hf_shards, hf_to_megatron, merge_shards
from hybridflow.engines.megatron.engine import MegatronTrainEngine, init_parallel_state

__all__ = [
    "Dims",
    "HFShard",
    "MegatronTrainEngine",
    "Rank",
    "hf_shards",
    "hf_to_megatron",
    "init_parallel_state",
    "merge_shards",
]
