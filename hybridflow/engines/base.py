"""The two engine interfaces every backend implements, and the registry that builds them.

A *train engine* holds a model shard under a training layout: forward passes for log-probs,
entropy or values, loss backward + optimizer step, its state for checkpoints, offload of its
state while a colocated model runs, its data-parallel group, and its weights for the rollout
engine (full HF-named tensors, or a sharded training buffer the resharder moves). A *rollout
engine* generates. The 3D-HybridEngine (``hybridflow.hybrid_engine``) moves the actor's weights
from the first to the second every iteration. Batches are ``TensorDict``s using the keys in
``hybridflow.data.keys``.

Engines are registered records (``hybridflow.spec.engines``: builder, typed config,
capabilities), named by the graph file's ``train.engine`` / ``rollout.engine``;
``TRAIN_ENGINES`` / ``ROLLOUT_ENGINES`` give their classes. A record names its class as
``"module:Class"``, imported on first use, so megatron-core and vLLM load only in a process
whose graph asks for them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from hybridflow.engines.shards import ShardSpec, TrainShardBuffer
from hybridflow.spec.engines import EngineCaps, EngineRecord, engine_names, engine_record, register_engine
from hybridflow.spec.graph import RolloutSpec, TrainEngineSpec
from hybridflow.spec.layout import ParallelLayout

# loss_fn(micro_batch, forward_out) -> (loss summed over tokens / global normaliser, metrics)
# forward_out holds "log_probs" (B, R) and "entropy" (B, R) for a policy, "values" (B, R) for a
# critic (with grad, zero outside response_mask), plus the global normalisers as 0-dim float32
# tensors: "num_global_tokens" (response_mask summed over the whole mini-batch, all micro-batches
# and all DP ranks) and "num_global_seqs" (its samples with at least one response token:
# ``algos.count_sequences``, the fully-masked-row rule of ``algos.losses``). The engine sums the returned losses over
# micro-batches and DP ranks: a loss_fn that divides by "num_global_tokens" therefore yields the
# exact full-batch token mean. Metrics are python floats, averaged weighted by response tokens.
LossFn = Callable[[TensorDict, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one generate call."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    greedy: bool = False
    # EOS is not sampled before this many new tokens (vLLM's min_tokens, transformers'
    # min_new_tokens); max_new_tokens = every sample full length.
    min_new_tokens: int = 0
    # Samples whose log-probs are recorded (rollout_log_probs): the first ones, in whole prompt
    # groups; None = every sample. An engine may record more (all, when it costs nothing).
    log_prob_samples: int | None = None


ModelKind = Literal["policy", "value"]  # an LM head (log-probs, entropy) or a scalar head (values)


@dataclass(frozen=True)
class TrainShard:
    """A train engine's weights as one flat tensor per rank, split over its model-parallel
    ranks (megatron-core): what the resharder (``hybridflow.hybrid_engine.reshard``) gathers
    into generation shards.

    ``to_hf(shards, tp)``: the HF-named tensors of a generation shard (``shards``: name -> its
    TP pieces, as the resharder returns them for a ``tp``-way generation layout), one at a time:
    what a rollout engine's ``load_weights`` takes.
    """

    layout: ParallelLayout  # the training layout, resolved; ranks numbered by its coords
    buffer: TrainShardBuffer  # this rank's shard; the engine's parameters are views of it
    specs: list[ShardSpec]  # the resharding layout of the whole model (all stages)
    to_hf: Callable[[Mapping[str, tuple[torch.Tensor, ...]], int], Iterator[tuple[str, torch.Tensor]]]


class TrainEngine(abc.ABC):
    """A model shard under a training layout, with its optimizer."""

    @classmethod
    @abc.abstractmethod
    def build(
        cls, module: torch.nn.Module, spec: TrainEngineSpec, *, kind: ModelKind, total_steps: int, seed: int
    ) -> "TrainEngine":
        """The engine for ``module`` (the full HF model, the same weights on every rank) under
        ``spec`` (its layout resolved); ``total_steps``: optimizer steps of the run."""

    @abc.abstractmethod
    def forward(self, batch: TensorDict, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """No-grad forward in micro-batches.

        Policy models return ``{"log_probs": (B, R), "entropy": (B, R)}`` of the tokens in
        ``responses`` under logits / temperature; value models return ``{"values": (B, R)}``.
        """

    @abc.abstractmethod
    def train_step(
        self, batch: TensorDict, loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's part of one mini-batch).

        Splits into micro-batches, accumulates gradients, reduces them over data-parallel ranks,
        clips, steps the optimizer and the LR schedule. Returns averaged loss metrics plus
        ``grad_norm`` and ``lr``.
        """

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights with HF parameter names (gathered when sharded: a collective every
        rank calls). What an unsharded engine's rollout engine loads each iteration."""

    def rollout_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module a rollout engine beside this engine is built from (``module``: the one
        ``build`` took). An engine whose module stays whole on every rank hands it on (the
        transformers rollout then generates from it); a sharded one a full copy of its
        weights (collective: every rank calls it)."""
        return module

    def sync_metrics(self) -> dict[str, float]:
        """Metrics of the last ``named_weights`` pass (a sharded engine's gathers:
        ``reshard/peak_bytes`` ...); empty when nothing was gathered."""
        return {}

    def train_shard(self) -> TrainShard | None:
        """The sharded training buffer the resharder moves to the rollout engine; None for an
        engine holding full weights on every rank (``named_weights`` serves the sync)."""
        return None

    @abc.abstractmethod
    def save_hf(self, path: str) -> None:
        """Write the full model in HF format (called on every rank; rank 0 writes)."""

    def adapter_config(self) -> dict[str, Any] | None:
        """peft's ``adapter_config.json`` content when the engine trains LoRA adapters
        (``train.lora``), else None: the rollout engine then syncs full weights."""
        return None

    def adapter_weights(self) -> dict[str, torch.Tensor] | None:
        """The LoRA adapters in peft's saved form (names as in ``adapter_model.safetensors``),
        or None without adapters."""
        return None

    def merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights (HF names) with the LoRA adapters merged in (LoRA engines only)."""
        raise ValueError(f"{type(self).__name__} trains no LoRA adapters")

    def adapters_disabled(self):
        """A context in which forwards compute as the base model (LoRA engines only)."""
        raise ValueError(f"{type(self).__name__} trains no LoRA adapters")

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The model, optimizer and schedule state for ``torch.distributed.checkpoint``,
        layout-free: every tensor keyed by name only and given as this rank's piece of the full
        tensor (a plain tensor when whole, a DTensor with the full shape when sharded), so a
        checkpoint loads under another layout. The tensors are the engine's own: ``dcp.load``
        into the returned dict fills them in place (``hybridflow/workers/checkpointing.py``)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a state in ``state_dict``'s form after ``dcp.load`` filled its tensors (the
        non-tensor values: optimizer steps, schedule counters)."""

    @abc.abstractmethod
    def offload(self) -> int:
        """Move parameters, gradients and optimizer state to CPU memory while a colocated
        model runs (``hybridflow.workers.colocation``); returns the bytes moved (0 when they
        are there already, or the engine keeps its state where it is)."""

    @abc.abstractmethod
    def reload(self) -> int:
        """Bring back to the engine's device what ``offload`` moved; returns the bytes moved."""

    @property
    @abc.abstractmethod
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group (the ranks holding the same shard with different
        samples); None = the default group. Batch statistics reduce over it."""


@dataclass
class WeightUpdates:
    """New weights that may reach a rollout engine while it generates (partial rollouts,
    ``trainer.async.partial_rollout``): ``poll()`` returns ``(HF name, tensor)`` pairs to load
    now, or None; ``mode`` is ``"continue"`` or ``"abort"``. The engine counts the samples that
    were in flight at a load into ``continued`` / ``resumed``."""

    poll: Callable[[], Iterator[tuple[str, torch.Tensor]] | None]
    mode: str = "continue"
    continued: int = 0
    resumed: int = 0


class RolloutEngine(abc.ABC):
    """Generates responses from prompts."""

    @classmethod
    @abc.abstractmethod
    def build(
        cls,
        module: torch.nn.Module,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        temperature: float = 1.0,
        adapter_config: dict[str, Any] | None = None,
        shared_prefix_len: int | None = None,
        enforce_eager: bool = True,
        tp_ranks: list[int] | None = None,
    ) -> "RolloutEngine":
        """The rollout engine of an actor whose train engine holds ``module`` (the full HF
        model, in this process): it may generate from the module itself or take a copy.
        ``max_num_seqs`` sequences of ``max_model_len`` tokens may be in flight at once (an
        iteration's samples); ``seed`` differs per rank; ``temperature``: that of every
        non-greedy call (an engine whose recorded log-probs depend on it fixes it here).
        ``adapter_config``: the actor trains LoRA adapters of this peft config (``module``
        holds them); the engine then takes adapter updates through ``load_adapter``.
        ``shared_prefix_len``: the longest prefix two requests can have in common (an engine
        with a prefix cache may leave it off below what it can reuse). ``enforce_eager=False``:
        an engine that can compile its model (``rollout.enforce_eager``) does so.
        ``tp_ranks``: this rank's generation TP group (torch ranks in TP-rank order; every rank
        of it builds collectively, with the same ``seed``); None = generation tp 1. An engine
        without the ``generation_tp`` capability refuses a group of more than one rank."""

    @abc.abstractmethod
    def generate(
        self, prompts: TensorDict, params: SamplingParams, updates: "WeightUpdates | None" = None
    ) -> TensorDict:
        """Sample ``params.n`` responses per prompt.

        ``updates``: weights that may arrive while it generates (partial rollouts); an engine
        without the ``partial_rollouts`` capability refuses a value other than None
        (``refuse_updates``).

        Input: ``prompt_ids``/``prompt_mask`` (B, P) left-padded, plus ``uid`` and any other
        per-prompt fields. Output (B * n samples, the n samples of a prompt adjacent): the
        per-prompt fields repeated, and ``responses``, ``response_mask``, ``input_ids``,
        ``attention_mask``, ``position_ids``, ``truncated``, ``rollout_log_probs`` as documented
        in ``hybridflow.data.keys``.
        """

    def generate_turns(
        self, contexts: list[list[int]], max_new_tokens: list[int], params: SamplingParams, stop: list[str]
    ) -> list[tuple[list[int], list[float], bool]]:
        """One model turn of a multi-turn rollout (``hybridflow.envs.rollout``) for each token
        context (no padding; never re-tokenised): per context, the sampled tokens (through EOS
        or the first stop string, at most its ``max_new_tokens``), their log-probs at
        ``params.temperature``, and whether the turn ended by itself (EOS or a stop string)
        rather than at the token limit. ``params.n`` and ``params.max_new_tokens`` are unused."""
        raise NotImplementedError(f"{type(self).__name__} does not run multi-turn rollouts")

    @abc.abstractmethod
    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Take fresh weights (HF names) in memory, without a restart; returns the bytes copied
        (0 for tensors the engine already shares)."""

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> int:
        """Take fresh LoRA adapter weights (peft's saved names) of the ``adapter_config`` the
        engine was built with; returns the bytes taken."""
        raise NotImplementedError(f"{type(self).__name__} does not take LoRA adapters")

    def probe_log_probs(self, ids: list[int], num_scored: int) -> torch.Tensor:
        """The log-probs (num_scored,) at temperature 1 of the last ``num_scored`` of ``ids``,
        each given the tokens before it, as the engine generates now (its adapters applied):
        the fingerprint a weight sync is verified by (``hybridflow.hybrid_engine.verify``).
        Computed without sampling, so no RNG stream moves."""
        raise NotImplementedError(f"{type(self).__name__} scores no probe (rollout.verify_sync: off)")

    def readable_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights the engine generates with, by HF name, where they can be read back as
        loaded (None: they cannot; vLLM on CPU repacks its linear layers). A failed weight-sync
        verification names the first one that differs from what was sent."""
        return None

    def weight_bytes(self) -> int | None:
        """Bytes of the weights this engine holds as its own copy (None: unknown). A sharded
        train engine's resharder reports this apart from its own buffers."""
        return None

    def offload(self) -> None:
        """Free generation memory (weights, KV cache, ...) while a colocated op that does not
        generate runs (``hybridflow.workers.colocation``). No-op by default."""

    def reload(self) -> None:
        """Restore what ``offload`` freed, before the next generation. No-op by default."""

    def close(self) -> None:
        """Release what the engine keeps outside the process (files). No-op by default."""


def refuse_updates(engine: RolloutEngine, updates: WeightUpdates | None) -> None:
    """The part of the rollout contract an engine without partial rollouts keeps."""
    if updates is not None:
        raise ValueError(f"{type(engine).__name__} takes no weights while it generates (partial rollouts)")


def refuse_tp(engine: type, tp_ranks: list[int] | None) -> None:
    """The part of the rollout contract an engine without generation TP keeps."""
    if tp_ranks is not None and len(tp_ranks) > 1:
        raise ValueError(f"{engine.__name__} generates at tp 1 only (got the group {tp_ranks})")


E = TypeVar("E")


class EngineRegistry(Generic[E]):
    """The classes of the registered engines of one kind, imported on first use."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def register(self, name: str, target: "str | type[E]", config: type | None = None, caps: EngineCaps = EngineCaps()) -> None:
        """Add an engine: its class, or ``"module:Class"`` to import when first asked for;
        ``config``: its graph-file section's model (default: the kind's common options)."""
        base = TrainEngineSpec if self.kind == "train" else RolloutSpec
        register_engine(EngineRecord(name, self.kind, target, config or base, caps))

    def get(self, name: str) -> type[E]:
        return engine_record(self.kind, name).load()

    def names(self) -> list[str]:
        return engine_names(self.kind)


TRAIN_ENGINES: EngineRegistry[TrainEngine] = EngineRegistry("train")
ROLLOUT_ENGINES: EngineRegistry[RolloutEngine] = EngineRegistry("rollout")
