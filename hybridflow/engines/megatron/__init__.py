"""megatron-core train engine and HF <-> megatron weight conversion.

megatron-core (``pip install -e '.[megatron]'``) is imported when an engine or model is built,
not when this package is; the worker imports the package only for ``train.engine: megatron``.

- ``convert``: HF Qwen2/Llama <-> megatron ``GPTModel`` weights, and the resharding layout (the
  ``ShardSpec`` list whose flat training shard holds the engine's parameters);
- ``model``: ``TransformerConfig`` and ``GPTModel`` (local layer spec) from an HF config;
- ``engine``: ``MegatronTrainEngine``, the ``TrainEngine`` over megatron's schedules, DDP and
  optimizer;
- ``cpu_compat``: every CPU workaround, active only without CUDA.
"""

from hybridflow.engines.megatron.convert import Dims, hf_to_megatron, shard_specs, to_hf
from hybridflow.engines.megatron.engine import MegatronTrainEngine, init_parallel_state

__all__ = [
    "Dims",
    "MegatronTrainEngine",
    "hf_to_megatron",
    "init_parallel_state",
    "shard_specs",
    "to_hf",
]
