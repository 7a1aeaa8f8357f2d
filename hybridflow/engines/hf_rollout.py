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

from collections.abc import Iterator

import torch
from tensordict import TensorDict
from torch import nn

from hybridflow.algos import log_probs_from_logits
from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields, repeat_interleave_td
from hybridflow.engines.base import RolloutEngine, SamplingParams
from hybridflow.engines.models import GenerationConfig


class HFRolloutEngine(RolloutEngine):
    """Generates with a transformers causal LM.

    Args:
        model: the causal LM; may be the train engine's unwrapped module (shared weights).
        eos_id: end-of-sequence token id; generation of a sample stops at it.
        pad_id: pad token id (prompts are left-padded with it, responses right-padded).
    """

    def __init__(self, model: nn.Module, *, eos_id: int, pad_id: int) -> None:
        self.model = model
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
    ) -> "HFRolloutEngine":
        """Generates from the train engine's own ``module`` (same layout, no copy); records
        log-probs at each call's own temperature, so ``temperature`` is not needed here. A
        LoRA actor's module holds its adapters: they generate as they train."""
        return cls(module, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)

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
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        """``params.n`` samples per prompt, adjacent; responses padded to ``params.max_new_tokens``.

        Returns every field of ``prompts`` repeated, plus the rollout fields of
        ``hybridflow.data.keys``; ``rollout_log_probs`` is zero outside ``response_mask``.
        Greedy decoding still returns ``n`` (identical) samples per prompt and records
        log-probs at ``params.temperature``. Sampling draws from torch's global RNG.
        """
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
