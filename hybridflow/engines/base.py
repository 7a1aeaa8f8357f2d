"""The two engine interfaces every backend implements.

A *train engine* holds a model shard under a training layout: forward passes for log-probs,
entropy or values, and loss backward + optimizer step. A *rollout engine* generates. The
3D-HybridEngine (``hybridflow.hybrid_engine``) moves the actor's weights from the first to the
second every iteration. Batches are ``TensorDict``s using the keys in ``hybridflow.data.keys``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tensordict import TensorDict

# loss_fn(micro_batch, forward_out) -> (loss summed over tokens / global normaliser, metrics)
# forward_out holds "log_probs" (B, R) and "entropy" (B, R) for a policy, "values" (B, R) for a
# critic (with grad, zero outside response_mask), plus the global normalisers as 0-dim float32
# tensors: "num_global_tokens" (response_mask summed over the whole mini-batch, all micro-batches
# and all DP ranks) and "num_global_seqs" (its samples). The engine sums the returned losses over
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


class TrainEngine(abc.ABC):
    """A model shard under a training layout, with its optimizer."""

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
        """This rank's weights with HF parameter names (full tensors when unsharded)."""

    @abc.abstractmethod
    def save_hf(self, path: str) -> None:
        """Write the full model in HF format (called on every rank; rank 0 writes)."""


class RolloutEngine(abc.ABC):
    """Generates responses from prompts."""

    @abc.abstractmethod
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        """Sample ``params.n`` responses per prompt.

        Input: ``prompt_ids``/``prompt_mask`` (B, P) left-padded, plus ``uid`` and any other
        per-prompt fields. Output (B * n samples, the n samples of a prompt adjacent): the
        per-prompt fields repeated, and ``responses``, ``response_mask``, ``input_ids``,
        ``attention_mask``, ``position_ids``, ``truncated``, ``rollout_log_probs`` as documented
        in ``hybridflow.data.keys``.
        """

    @abc.abstractmethod
    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Take fresh weights (HF names) in memory, without a restart."""

    def weight_bytes(self) -> int | None:
        """Bytes of the weights this engine holds as its own copy (None: unknown). A sharded
        train engine's resharder reports this apart from its own buffers."""
        return None

    def offload(self) -> None:
        """Free generation memory (KV cache, ...) while training runs. No-op by default."""

    def reload(self) -> None:
        """Restore what ``offload`` freed. No-op by default."""
