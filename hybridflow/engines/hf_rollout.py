"""Rollout engine over ``transformers`` ``generate`` (KV cache), the CPU default.

Rollout log-probs are ``log_softmax(raw logits / temperature)`` at the sampled tokens: the
distribution the train engine computes at the same temperature. Top-k / top-p only restrict
which tokens can be sampled; they do not renormalise the recorded log-probs, so rollout and
training log-probs agree (to float rounding) whatever the sampling filters.

Colocated on CPU, the engine can hold the train engine's own module
(``HFRolloutEngine(train_engine.module, ...)``): no weight is held twice and ``load_weights``
from that engine copies nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace

import torch
from tensordict import TensorDict
from torch import nn
from transformers import StoppingCriteria

from hybridflow.algos import log_probs_from_logits
from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields, repeat_interleave_td
from hybridflow.engines.base import RolloutEngine, SamplingParams, WeightUpdates, refuse_tp, refuse_updates
from hybridflow.engines.models import GenerationConfig


class _TurnEnd(StoppingCriteria):
    """A transformers stopping criterion that ends each row at EOS, at a stop string or at its
    own token budget, and records where (``ended_at``) and whether by itself (``natural``)."""

    def __init__(self, width: int, budgets: list[int], eos_id: int, stop: list[str], tokenizer) -> None:
        self.width, self.budgets, self.eos_id, self.stop, self.tokenizer = width, budgets, eos_id, stop, tokenizer
        self.ended_at: list[int | None] = [None] * len(budgets)
        self.natural = [False] * len(budgets)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        generated = input_ids[:, self.width:]
        num = generated.shape[1]
        for i, row in enumerate(generated.tolist()):
            if self.ended_at[i] is not None:
                continue
            natural = row[-1] == self.eos_id or (
                bool(self.stop) and any(s in self.tokenizer.decode(row) for s in self.stop)
            )
            if natural or num >= self.budgets[i]:
                self.ended_at[i], self.natural[i] = num, natural
        return torch.tensor([e is not None for e in self.ended_at], device=input_ids.device)


class HFRolloutEngine(RolloutEngine):
    """Generates with a transformers causal LM.

    Args:
        model: the causal LM; may be the train engine's unwrapped module (shared weights).
        eos_id: end-of-sequence token id; generation of a sample stops at it.
        pad_id: pad token id (prompts are left-padded with it, responses right-padded).
    """

    def __init__(self, model: nn.Module, *, eos_id: int, pad_id: int, tokenizer=None) -> None:
        self.model = model
        self.tokenizer = tokenizer  # decodes turns to find stop strings (multi-turn)
        self.eos_id = eos_id
        self.pad_id = pad_id
        # Counts of the last load_weights call: {"copied": n, "shared": n}.
        self.last_load: dict[str, int] = {"copied": 0, "shared": 0}

    @classmethod
    def build(
        cls,
        module: nn.Module,
        tokenizer,
        *,
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        temperature: float = 1.0,
        adapter_config=None,
        shared_prefix_len: int | None = None,
        enforce_eager: bool = True,
        tp_ranks: list[int] | None = None,
    ) -> "HFRolloutEngine":
        """Generates from the train engine's own ``module`` (same layout, no copy); records
        log-probs at each call's own temperature, so ``temperature`` is not needed here (nor
        ``shared_prefix_len``: transformers' generate keeps no cache across calls; nor
        ``enforce_eager``: the module runs as the train engine has it). A
        LoRA actor's module holds its adapters: they generate as they train."""
        refuse_tp(cls, tp_ranks)
        return cls(module, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, tokenizer=tokenizer)

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        """Library defaults plus ``params`` only: nothing from the model's own
        generation_config.json (repetition penalty, top-k, ...) alters the sampling distribution."""
        sampling = {} if params.greedy else dict(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k
        )
        if params.min_new_tokens:  # EOS masked out before it; the log-probs stay the raw logits'
            sampling["min_new_tokens"] = params.min_new_tokens
        return GenerationConfig(
            do_sample=not params.greedy,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
            **sampling,
        )

    @torch.no_grad()
    def generate(self, prompts: TensorDict, params: SamplingParams, updates: WeightUpdates | None = None) -> TensorDict:
        """``params.n`` samples per prompt, adjacent; responses padded to ``params.max_new_tokens``.

        Returns every field of ``prompts`` repeated, plus the rollout fields of
        ``hybridflow.data.keys``; ``rollout_log_probs`` is zero outside ``response_mask``.
        Greedy decoding still returns ``n`` (identical) samples per prompt and records
        log-probs at ``params.temperature``. Sampling draws from torch's global RNG.
        """
        refuse_updates(self, updates)
        batch = repeat_interleave_td(prompts, params.n)
        prompt_ids = batch[K.PROMPT_IDS]
        prompt_mask = batch[K.PROMPT_MASK]
        num_prompt_tokens = prompt_ids.shape[1]

        was_training = self.model.training
        own_config = self.model.generation_config
        self.model.eval()
        # The model's stored generation config fills whatever a call leaves unset; swap in a
        # neutral one for the call.
        self.model.generation_config = GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=self._generation_config(params),
            )
        finally:
            self.model.generation_config = own_config
            self.model.train(was_training)

        generated = out.sequences[:, num_prompt_tokens:]  # (B, L), L <= max_new_tokens
        num_generated = generated.shape[1]
        # Raw logits: before temperature and the top-k / top-p filters.
        logits = torch.stack(out.logits, dim=1) / params.temperature  # (B, L, V)
        log_probs = log_probs_from_logits(logits, generated)

        # Stopped early (every sample hit EOS): pad to the fixed width.
        missing = params.max_new_tokens - num_generated
        responses = nn.functional.pad(generated, (0, missing), value=self.pad_id)
        log_probs = nn.functional.pad(log_probs, (0, missing), value=0.0)

        fields = build_rollout_fields(prompt_ids, prompt_mask, responses, self.eos_id, self.pad_id)
        fields[K.ROLLOUT_LOG_PROBS] = log_probs * fields[K.RESPONSE_MASK]
        batch.update(fields)
        return batch

    @torch.no_grad()
    def generate_turns(
        self, contexts: list[list[int]], max_new_tokens: list[int], params: SamplingParams, stop: list[str]
    ) -> list[tuple[list[int], list[float], bool]]:
        """One model turn per context (``RolloutEngine.generate_turns``): the contexts are
        left-padded into one batch; rows stop at EOS, a stop string or their own budget."""
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros(len(contexts), width, dtype=torch.int64)
        for i, context in enumerate(contexts):
            ids[i, width - len(context):] = torch.tensor(context)
            mask[i, width - len(context):] = 1
        turn_end = _TurnEnd(width, max_new_tokens, self.eos_id, stop, self.tokenizer)
        config = self._generation_config(replace(params, max_new_tokens=max(max_new_tokens)))
        was_training, own_config = self.model.training, self.model.generation_config
        self.model.eval()
        self.model.generation_config = GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, stopping_criteria=[turn_end]
            )
        finally:
            self.model.generation_config = own_config
            self.model.train(was_training)
        generated = out.sequences[:, width:]
        log_probs = log_probs_from_logits(torch.stack(out.logits, dim=1) / params.temperature, generated)
        results = []
        for i in range(len(contexts)):
            end = turn_end.ended_at[i] or generated.shape[1]
            results.append((generated[i, :end].tolist(), log_probs[i, :end].tolist(), turn_end.natural[i]))
        return results

    @torch.no_grad()
    def probe_log_probs(self, ids: list[int], num_scored: int) -> torch.Tensor:
        """One forward of the module in eval mode (``RolloutEngine.probe_log_probs``)."""
        was_training = self.model.training
        self.model.eval()
        try:
            logits = self.model(input_ids=torch.tensor([ids], device=self.model.device)).logits
        finally:
            self.model.train(was_training)
        scored = torch.tensor([ids[-num_scored:]], device=logits.device)
        return log_probs_from_logits(logits[:, -num_scored - 1 : -1].float(), scored)[0].cpu()

    def readable_weights(self) -> dict[str, torch.Tensor]:
        """The module's parameters, by every name a tied one answers to."""
        return dict(self.model.named_parameters(remove_duplicate=False))

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (tied ones once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> int:
        """The adapters are the module's own (shared with the train engine): nothing moves."""
        return 0

    @torch.no_grad()
    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(HF name, tensor)`` pairs into the model's parameters in place.

        A tensor that already is the parameter's storage (shared module) is skipped. Tied
        parameters answer to every one of their names. Unknown names and shape mismatches raise.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))
        copied = shared = copied_bytes = 0
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"rollout model has no parameter named {name!r}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: rollout shape {tuple(param.shape)} != given {tuple(tensor.shape)}"
                )
            if (
                param.data_ptr() == tensor.data_ptr()
                and param.stride() == tensor.stride()
                and param.dtype == tensor.dtype
                and param.device == tensor.device
            ):
                shared += 1
                continue
            param.copy_(tensor)
            copied += 1
            copied_bytes += tensor.numel() * tensor.element_size()
        self.last_load = {"copied": copied, "shared": shared}
        return copied_bytes


def standalone(build_module, tokenizer, *, source_dir, max_model_len: int, seed: int, temperature: float):
    """``generate(prompts, params)`` on an engine in this process (``hybridflow eval``), in
    chunks of 32 prompts under a progress bar; ``build_module()`` gives the model."""
    torch.manual_seed(seed)
    rollout = HFRolloutEngine(build_module(), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)

    def generate(prompts: TensorDict, params: SamplingParams, chunk: int = 32) -> TensorDict:
        from tqdm import tqdm

        num = prompts.batch_size[0]
        parts = []
        # As `hybridflow run`'s: a bar only on a terminal, never redrawn into a pipe or a log file.
        shown = sys.stdout.isatty() and sys.stderr.isatty()
        desc = "greedy" if params.greedy else f"{params.n} samples"
        with tqdm(total=num, desc=desc, unit="prompt", disable=not shown) as bar:
            for i in range(0, num, chunk):
                parts.append(rollout.generate(prompts[i : i + chunk], params))
                bar.update(min(chunk, num - i))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    return generate
