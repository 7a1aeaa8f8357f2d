"""Every weight sync verified: after a sync the rollout engine and the trainer each score a fixed
probe sequence, and the two fingerprints must agree (``rollout.verify_sync``).

The fingerprint is the log-probs of the probe's last ``PROBE_RESPONSE`` tokens given the tokens
before them: the one every engine can compute (vLLM on CPU repacks its linear weights, so its
weights cannot be read back and hashed). The trainer's side is taken from the weights it sends
*before* the sync: a rollout engine that shares the train engine's module, and so would
corrupt both by a bad copy, is caught too. The probe is scored without sampling: no RNG stream
of the run moves, and the run's metrics stay as they are without it.

Sync paths, as the stop line names them: ``full_weights``, ``resharded`` (megatron's training
shard through the resharder), ``lora_adapter``, ``merged`` (LoRA merged in), ``rollout_pool``
(a standalone rollout pool through the object store).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields
from hybridflow.engines.base import RolloutEngine, TrainEngine

PROBE_PROMPT = 4  # tokens the probe's response is conditioned on
PROBE_RESPONSE = 8  # tokens whose log-probs are the fingerprint

# Largest |diff| of the probe's log-probs between two engines holding the same weights, by the
# weights' dtype. Measured on CPU (benchmarks/RESULTS.md, "Weight sync verification"): float32
# transformers vs its own module 0, vs vLLM's CPU kernels below 2e-5; a corrupted tensor moves
# them by 0.1 or more.
PROBE_BOUNDS = {"float32": 1e-3, "bfloat16": 0.1}  # models.<m>.train.dtype -> bound


class WeightSyncError(RuntimeError):
    """A rollout engine's probe log-probs differ from the trainer's past the bound after a sync."""


def probe_ids(tokenizer) -> list[int]:
    """The probe: ``PROBE_PROMPT + PROBE_RESPONSE`` fixed ordinary token ids (no special token,
    so neither engine stops or pads at one), spread over the vocabulary."""
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    step = max(1, len(ordinary) // (PROBE_PROMPT + PROBE_RESPONSE + 1))
    return [ordinary[(k * step * 7 + 3) % len(ordinary)] for k in range(PROBE_PROMPT + PROBE_RESPONSE)]


def probe_batch(tokenizer) -> TensorDict:
    """The probe as a one-sample batch a train engine's ``forward`` scores."""
    ids = torch.tensor([probe_ids(tokenizer)], dtype=torch.int64)
    prompt, response = ids[:, :PROBE_PROMPT], ids[:, PROBE_PROMPT:]
    fields = build_rollout_fields(
        prompt, torch.ones_like(prompt), response, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    return TensorDict({K.PROMPT_IDS: prompt, K.PROMPT_MASK: torch.ones_like(prompt), **fields}, batch_size=[1])


def trainer_probe(engine: TrainEngine, tokenizer) -> torch.Tensor:
    """The trainer's fingerprint (PROBE_RESPONSE,) float64: its forward's log-probs of the
    probe (collective for a sharded engine: every rank calls it)."""
    return engine.forward(probe_batch(tokenizer), temperature=1.0)["log_probs"][0].double()


def rollout_probe(engine: RolloutEngine, tokenizer) -> torch.Tensor:
    """The rollout engine's fingerprint (PROBE_RESPONSE,) float64, as it generates now."""
    ids = probe_ids(tokenizer)
    return engine.probe_log_probs(ids, PROBE_RESPONSE).double()


def first_difference(rollout: RolloutEngine, sent: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """``"NAME (max |diff| X)"`` of the first of the ``sent`` weights that the rollout engine does
    not hold as sent, where its weights are readable (``readable_weights``); else None."""
    held = rollout.readable_weights()
    if held is None:
        return None
    for name, tensor in sent:
        param = held.get(name)
        if param is None:
            return f"{name} (not in the rollout model)"
        if not torch.equal(param.detach().to(tensor.device, tensor.dtype), tensor):
            gap = (param.detach().to(tensor.device).double() - tensor.double()).abs().max()
            return f"{name} (max |diff| {float(gap):.3g})"
    return None


def verify(
    expected: torch.Tensor, rollout: RolloutEngine, tokenizer, *, path: str, model: str, engine: str,
    version: int, dtype: str, sent: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
) -> dict[str, float]:
    """Score the probe on ``rollout`` and compare with the trainer's ``expected``; raise
    WeightSyncError (one line: the model, the sync path, the weight version, and with ``sent``,
    a local way to go over the weights sent again, the first parameter the rollout engine holds
    otherwise where it can be read) past the bound of ``dtype``. Returns
    ``weight_sync/verified``, ``weight_sync/probe_diff_max`` and ``timing/weight_verify`` (the
    rollout side's seconds)."""
    start = time.perf_counter()
    got = rollout_probe(rollout, tokenizer)
    diff = float((got - expected).abs().max())
    bound = PROBE_BOUNDS.get(dtype, 0.1)
    if not diff <= bound:  # NaN fails too
        differing = first_difference(rollout, sent()) if sent is not None else None
        raise WeightSyncError(
            f"weight sync not verified on model {model!r} (sync path {path}, rollout.engine={engine}, "
            f"weight version {version}): probe log-prob max |diff| {diff:.3g} > {bound:g}, the "
            f"bound for {dtype} weights; the rollout engine does not hold the weights the trainer "
            f"sent{f', first at {differing}' if differing else ''}, stopping"
        )
    return {
        "weight_sync/verified": 1.0,
        "weight_sync/probe_diff_max": diff,
        "timing/weight_verify": time.perf_counter() - start,
    }


def rollout_pool_check(model: str, spec, tokenizer):
    """The check of each load into a standalone rollout pool's engine (sync path
    ``rollout_pool``), as ``publish.receive`` calls it: ``check(engine, probe, version, sent)``.
    ``spec``: the model's ``ModelSpec``."""

    def check(engine: RolloutEngine, probe: torch.Tensor, version: int, sent=None) -> dict[str, float]:
        return verify(probe, engine, tokenizer, path="rollout_pool", model=model,
                      engine=spec.rollout.engine, version=version, dtype=spec.train.dtype, sent=sent)

    return check
